"""GPU benchmark: the longest trainable sequence for a Llama-3.2-1B- or Llama-3.1-8B-shaped
model, per strategy, with MFU and the planner's prediction beside each measurement.

    python bench/gpu_longest_seq.py --nproc 8            # one node of 8 GPUs
    python bench/gpu_longest_seq.py --nproc 1            # one GPU (Ulysses is then P = 1)
    python bench/gpu_longest_seq.py --nproc 1 --model llama-3.1-8b --offload-optimizer
                                                         # ALST: 500K on one H100
    python bench/gpu_longest_seq.py --dry-run            # print the runs, start none (no GPU)

What it measures (printed as a table, nothing asserted), through ``autosp train`` exactly as a
user runs it (bf16 weights, AdamW, synthetic tokens over the full 128256-token vocabulary,
batch 1 per SP group, Inductor, ``--device cuda``), each run a fresh process group of
``--nproc`` ranks for 3 steps:

- for each strategy, the longest S that trains: S doubles from ``--start`` until a run fails
  (CUDA out of memory), then is bisected down to ``--granularity`` tokens between the last
  success and the first failure. Strategies: ``no-sp`` (sp 1: every rank holds the whole
  sequence; data parallel over the ranks; default remat) and ``ulysses`` (sp = nproc) with
  remat ``none``, ``default``, ``sequence-aware``, each with the tiled loss (autosp train's
  default) and ``default`` / ``sequence-aware`` without it, and ``sequence-aware`` with the
  tiled MLP (``--tile-mlp true``), activation offload (``--offload true``: the layers' hidden
  states in host memory between forward and backward), and both; and the tiled MLP with
  everything the layers save offloaded (``--offload-all true``), with ``sequence-aware`` and
  with ``default`` remat (``autosp plan`` predicts default + offload all the longest when the
  host has room); with ``--offload-optimizer``, every run keeps AdamW in host memory
  (``autosp.OffloadOptimizer``: the only way Llama-3.1-8B fits one 80 GB GPU);
- for every run that trains: the measured peak allocated memory per rank (the largest rank,
  ``torch.cuda.max_memory_allocated``) beside ``autosp plan``'s prediction for that run
  (printed by ``autosp train`` at start), and its ratio;
- MFU at S = 32768 and 131072 where they train (the median of steps 1 and 2; the step's
  model FLOPs are counted on the compiled graphs, the peak is the GPU's dense bf16 peak).

It has not been run yet in this project (no GPU lent); it is the script to run the day one is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "llama-3.2-1b": ["--hidden-size", "2048", "--intermediate-size", "8192", "--layers", "16",
                     "--heads", "32", "--kv-heads", "8", "--vocab-size", "128256"],
    "llama-3.1-8b": ["--hidden-size", "4096", "--intermediate-size", "14336", "--layers", "32",
                     "--heads", "32", "--kv-heads", "8", "--vocab-size", "128256"],
}
# (mode, sp (0: --nproc), remat, extras): the tiled loss is autosp train's default, so
# "untiled" turns it off; "tiled-mlp", "offload" and "offload-all" add those.
STRATEGIES = [("no-sp", 1, "default", ()), ("ulysses", 0, "none", ()),
              ("ulysses", 0, "default", ()), ("ulysses", 0, "default", ("untiled",)),
              ("ulysses", 0, "sequence-aware", ("untiled",)), ("ulysses", 0, "sequence-aware", ()),
              ("ulysses", 0, "sequence-aware", ("tiled-mlp",)),
              ("ulysses", 0, "sequence-aware", ("offload",)),
              ("ulysses", 0, "sequence-aware", ("tiled-mlp", "offload")),
              ("ulysses", 0, "sequence-aware", ("tiled-mlp", "offload-all")),
              ("ulysses", 0, "default", ("tiled-mlp", "offload-all"))]
MFU_AT = (32768, 131072)


def run(args: argparse.Namespace, sp: int, remat: str, seq: int, out: Path) -> dict | None:
    """One 3-step training run; its measurements, or None when it did not train (OOM).
    `remat`: the policy, then "+"-joined extras (untiled, tiled-mlp, offload, offload-all)."""
    policy, *extras = remat.split("+")
    cmd = [sys.executable, "-m", "autosp.cli", "train", "--nproc", str(args.nproc), "--sp", str(sp),
           *SHAPES[args.model], "--dtype", "bfloat16", "--seq-len", str(seq), "--batch-size", "1",
           "--steps", "3", "--remat", policy, "--backend", "inductor", "--device", "cuda",
           "--out-dir", str(out), "--timeout-s", "900"]
    if "offload" in extras:
        cmd += ["--offload", "true"]
    if "offload-all" in extras:
        cmd += ["--offload-all", "true"]
    if "tiled-mlp" in extras:
        cmd += ["--tile-mlp", "true"]
    if "untiled" in extras:
        cmd += ["--tile-loss", "false"]
    if args.offload_optimizer:
        cmd += ["--offload-optimizer", "true"]
    if args.dry_run:
        print(" ".join(cmd))
        return None
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    metrics = out / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        oom = "out of memory" in (proc.stdout + proc.stderr).lower()
        if not oom:
            print(f"  S={seq} sp={sp} {remat}: failed, not by OOM:\n{proc.stderr[-1500:]}", file=sys.stderr)
        return None
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    pred = re.search(r"predicted peak ([\d.]+) GiB", proc.stdout)
    later = sorted(recs[1:], key=lambda r: r["step_ms"])
    return {"peak": max(r["peak_mem_bytes"] for r in recs),
            "predicted": float(pred.group(1)) * (1 << 30) if pred else None,
            "mfu": later[len(later) // 2]["mfu"] if later else None}


def longest(args: argparse.Namespace, sp: int, remat: str, tmp: Path) -> tuple[int, dict]:
    """(longest S that trains, {S: measurements}) by doubling then bisection."""
    seen: dict[int, dict | None] = {}

    def ok(seq: int) -> bool:
        if seq not in seen:
            seen[seq] = run(args, sp, remat, seq, tmp / f"sp{sp}-{remat}-{seq}")
        return seen[seq] is not None

    good, seq = 0, args.start
    while seq <= args.max_seq and ok(seq):
        good, seq = seq, seq * 2
    bad = seq
    while bad - good > args.granularity and good and bad <= args.max_seq:
        mid = (good + bad) // 2 // args.granularity * args.granularity
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    for s in MFU_AT:
        if s <= good and s not in seen:
            ok(s)
    return good, {s: m for s, m in seen.items() if m is not None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--model", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--start", type=int, default=8192)
    p.add_argument("--max-seq", type=int, default=1 << 21)
    p.add_argument("--granularity", type=int, default=4096)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--dry-run", action="store_true", help="print the first run of each strategy")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="AdamW's state in host memory in every run (autosp.OffloadOptimizer)")
    args = p.parse_args()
    gib = float(1 << 30)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, sp, policy, extras in STRATEGIES:
            sp = sp or args.nproc
            remat = "+".join([policy, *extras])
            if args.dry_run:
                run(args, sp, remat, args.start, Path(tmp) / "dry")
                continue
            best, measured = longest(args, sp, remat, Path(tmp))
            rows.append((f"{mode} sp={sp} + {remat}", best, measured))
    if args.dry_run:
        return
    print(f"{args.model} shape, bf16, {args.nproc} GPU(s), batch 1 per SP group")
    print(f"{'strategy':<32} {'longest S':>10} {'S':>8} {'measured GiB':>13} {'predicted GiB':>14} "
          f"{'pred/meas':>9} {'MFU':>6}")
    for name, best, measured in rows:
        for s in sorted(measured):
            m = measured[s]
            pred = f"{m['predicted'] / gib:14.2f}" if m["predicted"] else f"{'-':>14}"
            ratio = f"{m['predicted'] / m['peak']:9.2f}" if m["predicted"] else f"{'-':>9}"
            mfu = f"{100 * m['mfu']:5.1f}%" if m["mfu"] is not None else f"{'-':>6}"
            print(f"{name:<32} {best:>10} {s:>8} {m['peak'] / gib:13.2f} {pred} {ratio} {mfu}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    main()
