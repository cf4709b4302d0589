"""Which attention kernel a GPU runs, and what CUDA's softmax backward allocates: the two facts
autosp.cuda_kernels states (from PyTorch's source) for the planner, checked on the device.

    python bench/gpu_sdpa_probe.py        # a CUDA GPU; about a minute

Prints (asserts nothing): for fp32 and bf16, with and without grouped-query attention
(32 query heads, 8 or 32 KV heads, head_dim 64, causal, S 4096), the kernel
``torch._fused_sdp_choice`` picks beside ``autosp.cuda_kernels.sdpa_kernel``'s answer; the
memory one ``aten._softmax_backward_data`` on [32, 8192, 8192] fp32 allocates beyond its
inputs (8 GiB is its output alone, 16 GiB output and one output-sized temporary, as
``OUTPUT_SIZED_SCRATCH`` says); and the peak of one fp32 SDPA forward and backward at S 8192
with ``enable_gqa=True`` against K and V repeated to 32 heads.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from autosp import cuda_kernels

GIB = float(1 << 30)
# torch's SDPBackend values, by name
KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def _extra_peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB


def _sdpa_step(repeat: bool) -> None:
    q = torch.randn(1, 32, 8192, 64, device="cuda", requires_grad=True)
    k = torch.randn(1, 8, 8192, 64, device="cuda", requires_grad=True)
    v = torch.randn(1, 8, 8192, 64, device="cuda", requires_grad=True)
    if repeat:
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                             v.repeat_interleave(4, 1), is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_sdpa_probe: no CUDA device")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for kv in (8, 32):
            q = torch.randn(1, 32, 4096, 64, device="cuda", dtype=dtype)
            k = torch.randn(1, kv, 4096, 64, device="cuda", dtype=dtype)
            chosen = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=kv != 32)
            print(f"{name} kv_heads {kv:>2}: PyTorch picks {KERNELS.get(chosen, chosen)}, "
                  f"autosp.cuda_kernels says {cuda_kernels.sdpa_kernel(name, 32, kv, 64)}",
                  flush=True)
    grad = torch.randn(32, 8192, 8192, device="cuda")
    out = torch.rand(32, 8192, 8192, device="cuda")
    extra = _extra_peak(lambda g=grad, o=out: torch.ops.aten._softmax_backward_data(
        g, o, -1, torch.float32))
    print(f"softmax backward on [32, 8192, 8192] fp32 allocates {extra:.2f} GiB "
          f"(8 GiB: its output; 16 GiB: and one temporary of that size)", flush=True)
    del grad, out
    for repeat in (False, True):
        print(f"fp32 SDPA forward+backward, S 8192, "
              f"{'K/V repeated' if repeat else 'enable_gqa'}: peak {_extra_peak(lambda: _sdpa_step(repeat)):.2f} GiB",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
