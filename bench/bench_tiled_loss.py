"""Benchmark: the tiled loss (``autosp.compile(tile_loss=True)``) against the untiled loss,
measured in the same run: peak memory and saved bytes per rank of a real training step, and
its time.

The reference Llama narrowed so it runs on a CPU (``--hidden``, ``--layers``) with a large
vocabulary (``--vocab``), compiled with sequence-aware remat and ``aot_eager``, on rank 0 of
an SP group of ``--sp`` against a fake process group (collectives allocate their outputs and
do not communicate: the memory is real, the step time is the rank's compute). Memory is
autosp.measure.train_step_memory (torch.profiler's CPU allocations; the saved storages); the
step time is the median of ``--steps`` steps after a warm-up. ``autosp plan``'s prediction
for each is printed beside the measurement.

    .venv/bin/python bench/bench_tiled_loss.py                      # S 16384, vocab 32768, sp 2
    .venv/bin/python bench/bench_tiled_loss.py --seq 8192 --vocab 131072 --sp 4
    .venv/bin/python bench/bench_tiled_loss.py --vocab 128256 --sp 4 --budget-gib 2

With ``--budget-gib``, a third row: the tiled loss with the fewest chunks ``autosp plan``
predicts to fit that budget (``StrategyPlan.fit_loss_chunks``, what ``autosp train --remat
auto`` trains with) beside the default ``ceil(vocab / hidden)`` chunks.

CPU only: on a GPU the planner's strategies ``+ tiled loss`` (``autosp plan``) and
bench/gpu_longest_seq.py are what to run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=0.0,
                    help="also run the fewest loss chunks predicted to fit this many GiB")
    args = ap.parse_args()

    import autosp
    from autosp import _core, measure, planner
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM
    from autosp.plan_trace import trace_step

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.sp)
    mesh = autosp.init_mesh(args.sp)
    heads = max(4, args.hidden // 64)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 8 // 3, num_layers=args.layers,
                      num_heads=heads, num_kv_heads=heads)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, S {args.seq}, "
          f"rank 0 of sp {args.sp} (fake process group), CPU; this rank's fp32 logits: "
          f"{args.seq // args.sp * args.vocab * 4 / 2**30:.2f} GiB")
    runs: list[tuple[str, bool, int | None]] = [
        ("untiled", False, None),
        (f"tiled, {_core.tiled_loss_chunks(args.vocab, args.hidden, 0)} chunks", True, None)]
    if args.budget_gib:
        fit = autosp.plan(cfg, gpus=args.sp, sp=args.sp, dtype="fp32", batch_size=1,
                          optimizer_sharding="none", seq_len=args.seq,
                          gpu_memory=int(args.budget_gib * (1 << 30)),
                          strategies=["ulysses+sequence-aware+tiled-loss"], seq_multiple=args.seq,
                          max_seq=args.seq, curve_points=2).strategies[0].fit_loss_chunks
        print(f"fewest loss chunks predicted to fit {args.budget_gib} GiB: {fit or 'none fits'}")
        if fit:
            runs.append((f"tiled, {fit} chunks", True, fit))
    rows = {}
    for label, tile, chunks in runs:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        compiled = autosp.compile(model, mesh=mesh, remat="sequence-aware", backend="aot_eager",
                                  tile_loss=tile, loss_chunks=chunks)
        mem = measure.train_step_memory(model, compiled, ids, ids)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            compiled(ids, ids).backward()
            times.append(time.perf_counter() - start)
        traced = trace_step(cfg, sp_size=args.sp, dtype="fp32", batch_size=1, tile_loss=tile)
        predicted = _core.simulate_peak_memory(
            traced.graph, args.seq,
            planner.core_plan_options("sequence-aware", "fp32", traced.num_params, 1,
                                  loss_chunks=chunks or 0))
        rows[label] = (mem, statistics.median(times), predicted.peak)
    gib = float(1 << 30)
    base_mem, base_t, _ = rows["untiled"]
    print(f"{'loss':<20} {'saved GiB':>10} {'peak GiB':>9} {'predicted':>10} {'peak ratio':>11} "
          f"{'step s':>7} {'time ratio':>11}")
    for label, (mem, t, pred) in rows.items():
        print(f"{label:<20} {mem.saved_bytes / gib:>10.3f} "
              f"{mem.peak_bytes / gib:>9.3f} {pred / gib:>10.3f} "
              f"{mem.peak_bytes / base_mem.peak_bytes:>10.2f}x {t:>7.2f} {t / base_t:>10.2f}x")


if __name__ == "__main__":
    main()
