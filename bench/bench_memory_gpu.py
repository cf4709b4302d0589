"""Predicted vs measured peak memory on one GPU, for a 1B-class Llama at a few sequence lengths.

    python bench/bench_memory_gpu.py                      # Llama-3.2-1B shape, 4 layers
    python bench/bench_memory_gpu.py --layers 16 --seq 4096,8192,16384
    python bench/bench_memory_gpu.py --cpu-only           # only the prediction (no GPU needed)

For every (remat policy, S): the planner's prediction (``autosp.planner.trace_step`` on fake
tensors, evaluated at S by the C++ model) and, on CUDA, one real training step of the same
model compiled the same way (``autosp.remat.backend(policy, backend=...)``, bf16 weights,
``AdamW(foreach=True)``), measured with ``torch.cuda.max_memory_allocated`` over the second
step (the first creates the optimizer state). It prints predicted / measured per row; no row
asserts anything. Single GPU, no SP (P = 1): the SP side is checked on CPU by
tests/test_planner.py.

The prediction models PyTorch's caching allocator as exact (no fragmentation, no rounding of
block sizes to 512 bytes) and leaves out the CUDA context, cuBLAS workspaces and the attention
kernel's scratch; see docs/plan.md. The bf16 policy of the planner adds fp32 master weights and
a gradient accumulator to the optimizer state (16 B/param); a plain bf16 ``AdamW`` keeps its
moments in bf16 (4 B/param), so the measured run uses ``--dtype fp32`` by default, where the
two agree (8 B/param of AdamW state plus a foreach temporary of 4 B/param).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch


def predict(config, dtype: str, batch: int, policies: list[str], seqs: list[int]) -> dict:
    from autosp import _core, planner

    # For a GPU: the attention kernel and the kernels' scratch a GPU has (autosp.cuda_kernels).
    traced = planner.trace_step(config, sp_size=1, dtype=dtype, batch_size=batch, device="cuda")
    out = {}
    for policy in policies:
        options = planner.core_plan_options(policy, dtype, traced.num_params, 1)
        for s in seqs:
            out[policy, s] = _core.simulate_peak_memory(traced.graph, s, options)
    return out, traced


def measure(config, dtype: str, batch: int, policy: str, seq: int, backend: str) -> int:
    from autosp import remat
    from autosp.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    device = torch.device("cuda")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        model = LlamaForCausalLM(config).to(device)
    finally:
        torch.set_default_dtype(previous)
    if dtype == "bf16":
        from autosp.plan_trace import _RotaryInDtype

        model.rotary = _RotaryInDtype(model.rotary, torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    labels = ids.clone()
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(labels, 1)
    compiled = torch.compile(model, backend=remat.backend(policy, backend=backend),
                             fullgraph=True, dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        compiled(ids, labels).backward()
        optimizer.step()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del compiled, optimizer, model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return peak


def main(argv: list[str] | None = None) -> int:
    from autosp import planner

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the 1B shape")
    p.add_argument("--seq", default="2048,4096,8192", help="comma-separated sequence lengths")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="KV heads (default the 1B's 8: grouped-query attention; 32 for none)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--policies", default="none,default,sequence-aware")
    from autosp.remat_policy import BACKENDS  # the backends' names, defined once

    p.add_argument("--backend", choices=BACKENDS, default="aot_eager",
                   help="aot_eager runs the schedule the model simulates; inductor reuses "
                        "buffers and fuses, so it allocates less than predicted")
    p.add_argument("--cpu-only", action="store_true", help="print the prediction only")
    args = p.parse_args(argv)

    config = replace(planner.PRESETS["llama-3.2-1b"], num_layers=args.layers)
    if args.kv_heads:
        config = replace(config, num_kv_heads=args.kv_heads)
    seqs = [int(s) for s in args.seq.split(",")]
    policies = args.policies.split(",")
    start = time.perf_counter()
    predicted, traced = predict(config, args.dtype, args.batch, policies, seqs)
    print(f"# Llama-3.2-1B shape, {args.layers} layers, {config.num_kv_heads} KV heads, "
          f"{traced.num_params / 1e6:.0f}M params, "
          f"dtype {args.dtype}, batch {args.batch}; traced in {traced.seconds:.1f} s, "
          f"predicted all in {time.perf_counter() - start:.1f} s")
    on_gpu = torch.cuda.is_available() and not args.cpu_only
    if not on_gpu:
        print("# no CUDA device (or --cpu-only): prediction only")
    gib = float(1 << 30)
    print(f"{'policy':<16} {'S':>7} {'predicted GiB':>14} {'measured GiB':>13} {'pred/meas':>10}")
    for policy in policies:
        for s in seqs:
            pred = predicted[policy, s].peak
            if on_gpu:
                meas = measure(config, args.dtype, args.batch, policy, s, args.backend)
                print(f"{policy:<16} {s:>7} {pred / gib:>14.3f} {meas / gib:>13.3f} "
                      f"{pred / meas:>10.3f}", flush=True)
            else:
                print(f"{policy:<16} {s:>7} {pred / gib:>14.3f} {'-':>13} {'-':>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
