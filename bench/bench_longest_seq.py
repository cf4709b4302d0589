"""Benchmark: the longest sequence a fixed per-rank memory budget trains, on CPU, for no SP,
Ulysses, and Ulysses with sequence-aware remat, the tiled loss, the tiled MLP and offload;
each as a ratio to Ulysses with PyTorch's default remat, with its step time beside it, all
measured in one run.

The model is Llama-3.2-1B's layer narrowed so it runs on a CPU (hidden 2048 -> ``--hidden``,
the MLP 4x wide, 8 query heads per KV head as far as the width allows, ``--layers``), with the
vocabulary kept at 128,256. Each strategy runs on rank 0 of an SP group of ``--sp`` (no SP: of
1) against a fake process group: collectives allocate their outputs and do not communicate,
so the memory is real and the step time is one rank's compute. Peak bytes are
autosp.measure.train_step_memory's (torch.profiler's CPU allocations of a whole training
step, AdamW included), at two lengths; the peak is linear in S here (SDPA's CPU kernel is
flash attention), so the longest S under ``--budget`` is read off the line through them and
then checked by a real step at that S (stepping down until it fits). The step time is the
median of ``--steps`` steps at the second probe length, against Ulysses + default at the same
length.

Offload moves the saved hidden states to host memory; on a CPU host and device are the same
memory (PyTorch's pass copies nothing), so its row shows the measured peak unchanged and
``autosp plan``'s prediction for a GPU beside it.

    .venv/bin/python bench/bench_longest_seq.py                     # ~15 minutes on 2 cores
    .venv/bin/python bench/bench_longest_seq.py --budget 1GiB --hidden 128 --probe 1024 2048
    .venv/bin/python bench/bench_longest_seq.py --time-only --steps 3    # step-time ratios only
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Strategy:
    name: str
    sp: bool
    remat: str
    tile_loss: bool = False
    tile_mlp: bool = False
    offload: bool = False
    loss_recompute: bool = False  # the tiled loss's recomputing form (AUTOSP_LOSS_RECOMPUTE=1)


STRATEGIES = (
    Strategy("no-sp + default", False, "default"),
    Strategy("ulysses + default", True, "default"),
    Strategy("ulysses + sequence-aware", True, "sequence-aware"),
    Strategy("ulysses + sequence-aware + tiled loss", True, "sequence-aware", tile_loss=True),
    Strategy("ulysses + sequence-aware + tiled loss (recomputing)", True, "sequence-aware",
             tile_loss=True, loss_recompute=True),
    Strategy("ulysses + sequence-aware + tiled loss + tiled mlp", True, "sequence-aware",
             tile_loss=True, tile_mlp=True),
    Strategy("ulysses + sequence-aware + tiled loss + tiled mlp + offload", True, "sequence-aware",
             tile_loss=True, tile_mlp=True, offload=True),
)


def _config(args: argparse.Namespace) -> Any:
    from autosp.models.llama import LlamaConfig

    heads = max(args.sp, args.hidden // 64)
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=4 * args.hidden, num_layers=args.layers,
                       num_heads=heads, num_kv_heads=max(1, heads // 8))


LOSS_ROWS_HIDDEN = 2048


def _step_memory(s: Strategy, cfg: Any, p: int, seq: int, steps: int = 0) -> tuple[int, float]:
    """(peak bytes, median step seconds over `steps` steps or 0) of a training step at `seq`
    on rank 0 of `p` (fake process group)."""
    import autosp
    from autosp import measure
    from autosp.models.llama import LlamaForCausalLM
    from autosp.remat import Offload
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ["AUTOSP_LOSS_TILE_ROWS"] = str(-(-seq // p * LOSS_ROWS_HIDDEN // cfg.vocab_size))
    os.environ["AUTOSP_LOSS_RECOMPUTE"] = "1" if s.loss_recompute else ""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
    try:
        mesh = autosp.init_mesh(p)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        remat = Offload(s.remat) if s.offload else s.remat
        compiled = autosp.compile(model, mesh=mesh, remat=remat, backend="aot_eager",
                                  tile_loss=s.tile_loss, tile_mlp=s.tile_mlp)
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
        peak = measure.train_step_memory(model, compiled, ids, ids).peak_bytes
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            compiled(ids, ids).backward()
            times.append(time.perf_counter() - start)
        return peak, statistics.median(times) if times else 0.0
    finally:
        dist.destroy_process_group()


def _predicted_peak(s: Strategy, cfg: Any, p: int, seq: int) -> int:
    """``autosp plan``'s peak for the strategy at `seq`, with the loss chunks the step had."""
    import autosp

    os.environ["AUTOSP_LOSS_TILE_ROWS"] = str(-(-seq // p * LOSS_ROWS_HIDDEN // cfg.vocab_size))
    os.environ["AUTOSP_LOSS_RECOMPUTE"] = "1" if s.loss_recompute else ""
    name = ("ulysses+" if s.sp else "no-sp+") + s.remat + ("+tiled-loss" if s.tile_loss else "") \
        + ("+tiled-mlp" if s.tile_mlp else "") + ("+offload" if s.offload else "")
    result = autosp.plan(cfg, gpus=p, sp=p, dtype="fp32", gpu_memory=1 << 40, strategies=[name],
                         optimizer_sharding="none", seq_multiple=p, seq_len=seq, max_seq=seq,
                         curve_points=2, device="cpu")  # what this bench measures
    return result.strategies[0].at_seq.peak


def _time_only(chosen: list[Strategy], cfg: Any, args: argparse.Namespace) -> None:
    """Median step seconds of each strategy at the second probe length, with ulysses + default
    first as the baseline."""
    base_s = next(s for s in STRATEGIES if s.name == "ulysses + default")
    times = {}
    for s in [base_s] + [s for s in chosen if s is not base_s]:
        p = args.sp if s.sp else 1
        seq = args.probe[1] * p
        times[s.name] = _step_memory(s, cfg, p, seq, steps=args.steps)[1]
        print(f"  {s.name}: step {times[s.name]:.2f} s at S {seq} "
              f"({times[s.name] / times[base_s.name]:.2f}x ulysses + default)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default="2GiB", help="peak memory per rank")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--probe", type=int, nargs=2, default=(2048, 4096),
                    help="tokens per rank of the two probe steps")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--search-steps", type=int, default=5,
                    help="measured steps of the search for the longest S, per strategy")
    ap.add_argument("--loss-rows-hidden", type=int, default=2048,
                    help="the tiled loss's chunks as a model of this hidden size makes them "
                         "(Llama-3.2-1B's 2048: ceil(tokens * 2048 / vocab) rows); the default "
                         "rule with the narrowed hidden would make chunks 8x smaller")
    ap.add_argument("--only", default="", help="comma-separated strategy names (default: all)")
    ap.add_argument("--time-only", action="store_true",
                    help="only the step times at the second probe length, as ratios to "
                         "ulysses + default (no search for the longest S)")
    args = ap.parse_args()

    from autosp.plan_inputs import parse_bytes

    global LOSS_ROWS_HIDDEN
    LOSS_ROWS_HIDDEN = args.loss_rows_hidden
    budget = parse_bytes(args.budget)
    cfg = _config(args)
    gib = float(1 << 30)
    print(f"Llama-3.2-1B-shaped layers narrowed to hidden {cfg.hidden_size} (MLP "
          f"{cfg.intermediate_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV), "
          f"{cfg.num_layers} layers, vocabulary {cfg.vocab_size}; budget {budget / gib:.2f} GiB "
          f"per rank; fp32; rank 0 of sp {args.sp} on a fake process group, CPU")
    rows = []
    chosen = [s for s in STRATEGIES if not args.only or s.name in args.only.split(",")]
    if args.time_only:
        _time_only(chosen, cfg, args)
        return
    for s in chosen:
        p = args.sp if s.sp else 1
        multiple = 256 * p
        s1, s2 = (t * p for t in args.probe)
        m1, _ = _step_memory(s, cfg, p, s1)
        m2, step_s = _step_memory(s, cfg, p, s2, steps=args.steps)
        # A first guess from the line through the probes, then measured steps: double while
        # a step fits, and bisect between the last fit and the first that did not.
        slope = (m2 - m1) / (s2 - s1)
        guess = int((budget - m2) / slope + s2) if slope > 0 else 2 * s2
        fits, over = (s2, None) if m2 <= budget else (0, s2)
        probe = max(multiple, guess // multiple * multiple)
        peaks = {s1: m1, s2: m2}
        for _ in range(args.search_steps):
            if over is not None and over - fits <= multiple:
                break
            if probe in peaks or probe <= fits or (over is not None and probe >= over):
                probe = (2 * fits if over is None else (fits + over) // 2) // multiple * multiple
                probe = max(probe, fits + multiple)
            peaks[probe] = _step_memory(s, cfg, p, probe)[0]
            if peaks[probe] <= budget:
                fits = probe
            else:
                over = probe
            probe = (2 * fits if over is None else (fits + over) // 2) // multiple * multiple
        longest, checked = fits, peaks.get(fits, 0)
        predicted = _predicted_peak(s, cfg, p, longest) if longest else 0
        rows.append((s, longest, checked, step_s, predicted, m2))
        print(f"  {s.name}: peaks {m1 / gib:.3f} / {m2 / gib:.3f} GiB at S {s1} / {s2}; "
              f"longest S {longest} (peak there {checked / gib:.3f} GiB, predicted "
              f"{predicted / gib:.3f}); step {step_s:.2f} s at S {s2}", flush=True)
    base = next((r for r in rows if r[0].name == "ulysses + default"), rows[0])
    print(f"\n{'strategy':<62} {'longest S':>10} {'x ulysses+default':>18} "
          f"{'step s':>7} {'time ratio':>11} {'peak GiB':>9} {'predicted':>10}")
    for s, longest, checked, step_s, predicted, _ in rows:
        same_s = s.sp == base[0].sp
        ratio = f"{step_s / base[3]:.2f}x" if same_s and base[3] else "-"
        print(f"{s.name:<62} {longest:>10} {longest / max(1, base[1]):>17.2f}x "
              f"{step_s:>7.2f} {ratio:>11} {checked / gib:>9.3f} {predicted / gib:>10.3f}")
    print("Step times at the second probe length, against ulysses + default at the same length. "
          "Offload: measured on a CPU, where the host is the device (PyTorch's pass copies "
          "nothing); its predicted peak is what a GPU holds at that S.")


if __name__ == "__main__":
    main()
