"""First-call time of autosp against torch.compile of the hand-written Ulysses model, on real
ranks, each model in a job of its own, cold and warm.

    .venv/bin/python bench/first_call_sp.py --nproc 4 --seq 2048 --backend inductor --remat default
    .venv/bin/python bench/first_call_sp.py --repeat 3 --layers 16      # the other options: bench_sp's
    .venv/bin/python bench/first_call_sp.py --modes false,compile,true  # one autosp job per regions mode

The first call is compile + forward + backward, the max over ranks (bench/bench_sp.py
``--first-call-only``). Each model runs alone in its own ``torchrun`` job, so neither pays for
the other's start-up (in bench_sp.py both share a process, and the one that compiles first also
pays for the process's first ``torch.compile``). "cold" is a job with a fresh
``TORCHINDUCTOR_CACHE_DIR``; "warm" a second job on the same directory (PyTorch's FX graph and
AOTAutograd caches on disk, as a restarted training job finds them). With ``--repeat`` the two
models alternate which goes first, so drift in the machine hits both alike.

Prints each job's seconds, then autosp / hand-written, cold and warm, per repeat and over the
medians. Nothing is asserted: this is a measurement.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_SP = Path(__file__).resolve().parent / "bench_sp.py"


def first_call(job: str, cache_dir: str, passthrough: list[str]) -> float:
    """One bench_sp job alone on ``cache_dir``: its first call, in seconds. ``job`` is
    ``handwritten``, or ``autosp`` with the regions mode after a colon (``autosp:compile``)."""
    model, _, mode = job.partition(":")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    cmd = [sys.executable, str(BENCH_SP), "--models", model, "--first-call-only",
           "--warmup", "1", *passthrough, *(["--regions", mode] if mode else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    found = re.search(rf"^first call s {model}: ([0-9.]+)$", proc.stdout, re.MULTILINE)
    if proc.returncode != 0 or not found:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"bench_sp.py --models {model} failed (exit {proc.returncode})")
    return float(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1, help="cold+warm pairs per model")
    ap.add_argument("--modes", default=None,
                    help="comma-separated regions modes (false, compile, true): one autosp job "
                         "per mode, each against the same hand-written jobs (default: bench_sp's "
                         "--regions, passed through)")
    args, passthrough = ap.parse_known_args()
    jobs = ["handwritten"] + ([f"autosp:{m}" for m in args.modes.split(",")] if args.modes
                              else ["autosp"])
    seconds: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeat):
        for job in jobs if r % 2 == 0 else jobs[::-1]:
            with tempfile.TemporaryDirectory(prefix="autosp-first-call-") as cache:
                for state in ("cold", "warm"):
                    s = first_call(job, cache, passthrough)
                    seconds.setdefault((job, state), []).append(s)
                    print(f"repeat {r}: {job:16} {state}: {s:7.2f} s", flush=True)
        for job in jobs[1:]:
            for state in ("cold", "warm"):
                ratio = seconds[job, state][-1] / seconds["handwritten", state][-1]
                print(f"repeat {r}: {job} / hand-written, {state}: {ratio:.2f}x", flush=True)
    print(f"\nfirst call, bench_sp.py {' '.join(passthrough)}; median of {args.repeat}:")
    for job in jobs[1:]:
        for state in ("cold", "warm"):
            a = statistics.median(seconds[job, state])
            h = statistics.median(seconds["handwritten", state])
            print(f"  {job} {state}: {a:.2f} s, hand-written {h:.2f} s, ratio {a / h:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
