"""Benchmark: ``autosp train`` throughput over dp x sp layouts of the same ranks.

    python bench/bench_train.py                          # 4 Gloo ranks on CPU: 1x4, 2x2, 4x1
    python bench/bench_train.py --nproc 8 --seq-len 32768 --hidden-size 2048 --layers 8 \\
        --heads 16 --backend inductor --device cuda      # one GPU node

Each layout trains the same model (the reference Llama) on the built-in sample stories,
packed as documents, with the same batch per SP group and the same S, for ``--steps`` steps
through the command line as a user runs it, each in a fresh process group. Its tokens/s is the
median over the steps after the first two (compilation, warm-up), read from the run's
metrics.jsonl (a step's time is read after a CUDA synchronize). Printed, measured in this run:
tokens/s (total and per device) and step time per layout, and each layout's tokens/s as a
ratio to dp = nproc x sp = 1 (pure data parallelism, which moves no activations). A dp x sp
layout trains dp x batch sequences per step, so tokens/s compares the layouts' throughput on
the same ranks. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_layout(args: argparse.Namespace, sp: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "autosp.cli", "train", "--nproc", str(args.nproc), "--sp", str(sp),
           "--source", "sample", "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--steps", str(args.steps), "--hidden-size", str(args.hidden_size), "--layers",
           str(args.layers), "--heads", str(args.heads), "--intermediate-size",
           str(args.hidden_size * 8 // 3), "--backend", args.backend, "--device", args.device,
           "--remat", args.remat, "--predict", "false", "--out-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"layout sp={sp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][2:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
            "per_device": statistics.median(r["tokens_per_s_per_device"] for r in recs),
            "step_ms": statistics.median(r["step_ms"] for r in recs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    from autosp.remat_policy import BACKENDS  # the backends' names, defined once

    p.add_argument("--backend", default="aot_eager", choices=BACKENDS)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--remat", default="sequence-aware")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    layouts = [sp for sp in (args.nproc, 2, 1) if args.nproc % sp == 0]
    layouts = sorted(set(layouts), reverse=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sp in layouts:
            results[sp] = run_layout(args, sp, Path(tmp) / f"sp{sp}")
    base = results[1]["tokens_per_s"]
    print(f"autosp train throughput, {args.nproc} ranks ({args.device}, {args.backend}), "
          f"S = {args.seq_len}, batch {args.batch_size} per SP group, hidden {args.hidden_size}, "
          f"{args.layers} layers, remat {args.remat}; median of steps 2..{args.steps - 1}")
    print(f"{'dp x sp':>8} {'tokens/s':>10} {'per device':>11} {'step ms':>9} {'vs dp only':>11}")
    for sp in layouts:
        r = results[sp]
        print(f"{args.nproc // sp:>3} x {sp:<3} {r['tokens_per_s']:>10.0f} {r['per_device']:>11.0f} "
              f"{r['step_ms']:>9.1f} {r['tokens_per_s'] / base:>10.2f}x")


if __name__ == "__main__":
    main()
