"""What PyTorch's CUDA kernels do that a trace on the CPU does not show: the one place the
planner's memory model reads it from (docs/plan.md, "On a GPU").

The planner traces a training step on fake CPU tensors. Two things differ on a GPU:

- **Which attention kernel runs.** ``F.scaled_dot_product_attention`` on a CPU runs a fused
  kernel whose memory is linear in S for every dtype. On CUDA, PyTorch 2.11 to 2.13 try cuDNN
  attention (Hopper and Blackwell only) and flash attention (both fp16/bf16 only), then
  memory-efficient attention (no grouped-query attention: ``enable_gqa`` with fewer KV heads
  than query heads is refused), then the math kernel, which keeps the [B, H, S, S] softmax for
  the backward
  (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``; memory-efficient attention learnt
  GQA in PyTorch after 2.13). So an fp32 model with GQA runs math attention on a GPU: measured
  on an H200 (torch 2.11, bench/bench_memory_gpu.py, Llama-3.2-1B shape, 4 layers, fp32) its
  peak was 68.2 GiB at S = 8192 where a fused kernel's prediction was 23.7 GiB.
- **Scratch tensors of a kernel.** CUDA's softmax backward first computes ``grad * output``
  into a new tensor of the output's size (``softmax_backward_cuda_out`` in
  ``aten/src/ATen/native/cuda/SoftMax.cu``); the CPU kernel does not. (Under Inductor the
  softmax backward is decomposed and fused, so there is none: the planner models the eager,
  ``aot_eager`` schedule, docs/plan.md.)
"""

from __future__ import annotations

from typing import Any

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
#: The GPU the planner predicts for when none is named: Hopper (H100, H200).
HOPPER = (9, 0)

#: Per ATen overload: how many temporaries of its output's size the CUDA kernel allocates
#: besides its output (alive while it runs).
OUTPUT_SIZED_SCRATCH: dict[str, int] = {"aten._softmax_backward_data.default": 1}


def sdpa_kernel(dtype: str, num_heads: int, num_kv_heads: int, head_dim: int, *,
                mask: bool = False, capability: tuple[int, int] = HOPPER) -> str:
    """The kernel ``F.scaled_dot_product_attention`` runs on a CUDA GPU of compute
    ``capability`` (8.0 or later) under PyTorch's default backend order: ``"cudnn"``,
    ``"flash"``, ``"efficient"`` or ``"math"``. ``dtype``: ``"bf16"``, ``"fp16"`` or
    ``"fp32"``; ``mask``: an explicit attention mask (``is_causal`` is none).

    On Hopper and Blackwell (9.x, 10.x) PyTorch tries cuDNN attention first when its cuDNN is
    newer than 9.15 (``check_prefer_cudnn_attention``; the wheels from 2.11 on ship one):
    half precision, head_dim a multiple of 8 up to 128, masks and grouped heads allowed. All
    but math keep memory linear in S; which fused kernel it is matters only to
    bench/gpu_sdpa_probe.py, which prints PyTorch's own choice beside this."""
    half = dtype in ("bf16", "fp16")
    if half and capability[0] in (9, 10) and head_dim <= 128 and head_dim % 8 == 0:
        return CUDNN
    if half and not mask and head_dim <= 256:
        return FLASH
    alignment = 8 if half else 4  # elements per 16 bytes
    if num_heads == num_kv_heads and head_dim % alignment == 0:
        return EFFICIENT
    return MATH


#: The fused attention ops a CPU trace holds, by name: (query, key) are args 0 and 1.
_CPU_FUSED_ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu.default",)
_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def math_attention_on_cuda(graph: Any) -> bool:
    """Whether a GPU would run one of the fused attention calls of ``graph`` (an FX graph
    traced on the CPU) in the math kernel: read from each call's own query and key (the heads
    a rank holds after the SP exchange, its dtype) and its mask."""
    for node in graph.nodes:
        if node.op != "call_function" or str(node.target) not in _CPU_FUSED_ATTENTION:
            continue
        q, k = (a.meta["val"] for a in node.args[:2])
        dtype = _DTYPE_NAMES.get(str(q.dtype), "fp32")
        kernel = sdpa_kernel(dtype, int(q.shape[1]), int(k.shape[1]), int(q.shape[-1]),
                             mask=node.kwargs.get("attn_mask") is not None)
        if kernel == MATH:
            return True
    return False
