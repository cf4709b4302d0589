"""Measured peak memory of one training step per remat policy, beside autosp plan's prediction.

The reference Llama with ``--layers`` decoder layers on one CPU process (``aot_eager``: the
compiled graphs run op by op, so the allocator's statistics are the step's), compiled with
``autosp.remat.backend(policy)`` for ``none``, PyTorch's ``default`` partitioner and autosp's
``sequence-aware``. For each: the bytes saved for the backward and the peak of the second
step (``autosp.measure.train_step_memory``), and the memory model's prediction of both
(``autosp.planner.trace_step``, ``simulate_peak_memory``). Ratios are against ``default``,
measured in the same run.

    .venv/bin/python bench/bench_remat_peak.py --layers 4 --seq 4096

What it shows: the saved set alone does not make the peak. A cut that saves little but
recomputes every layer from a small input at the start of the backward keeps all of it live
until each layer's backward runs; sequence-aware remat keeps the hidden state between layers
so that each layer recomputes just before its backward.
"""

from __future__ import annotations

import argparse

import torch

from autosp import _core, measure, planner, remat
from autosp.models.llama import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                      num_layers=args.layers, num_heads=4, num_kv_heads=2)
    traced = planner.trace_step(cfg, sp_size=1, dtype="fp32", batch_size=args.batch)
    mib = float(1 << 20)
    rows = {}
    for policy in ("none", "default", "sequence-aware"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        labels = ids.clone()
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(labels, 1)
        compiled = torch.compile(model, backend=remat.backend(policy, backend="aot_eager"),
                                 fullgraph=True, dynamic=False)
        measured = measure.train_step_memory(model, compiled, ids, labels)
        predicted = _core.simulate_peak_memory(
            traced.graph, args.seq, planner.core_plan_options(policy, "fp32", traced.num_params, 1))
        rows[policy] = (measured, predicted)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, batch {args.batch}, S {args.seq}, fp32, "
          "one CPU process (aot_eager); MiB; ratios against 'default' in this run")
    print(f"{'policy':<16} {'saved':>9} {'peak':>9} {'peak / default':>15} {'predicted peak':>15} "
          f"{'prediction error':>17}")
    base = rows["default"][0].peak_bytes
    for policy, (m, p) in rows.items():
        print(f"{policy:<16} {m.saved_bytes / mib:>9.2f} {m.peak_bytes / mib:>9.2f} "
              f"{m.peak_bytes / base:>15.2f} {p.peak / mib:>15.2f} {p.peak / m.peak_bytes - 1:>+17.1%}")


if __name__ == "__main__":
    main()
