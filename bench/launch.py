"""Shared by the benchmarks: launch one process per rank under torchrun, and time a step as
the slowest rank sees it."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def relaunch(script: str, argv: list[str], nproc: int) -> int:
    """Runs ``script`` with ``argv`` in ``nproc`` ranks (torchrun, Gloo over loopback),
    without the launcher's ``--nproc`` (``autosp.cli.rank_arguments``)."""
    from autosp.cli import rank_arguments

    rank_args = rank_arguments(argv)
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", script, *rank_args]
    return subprocess.run(cmd, env=env, check=False).returncode


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on the slowest rank, the ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return max_over_ranks(time.perf_counter() - start)


def bench_main(script: str, argv: Sequence[str] | None, parse_args: Callable[[list[str]], Any],
               run: Callable[[Any], None]) -> int:
    """Outside torchrun: relaunch ``script`` under it; inside: one Gloo group, ``run(args)``."""
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv_list)
    if "RANK" not in os.environ:
        return relaunch(script, argv_list, args.nproc)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    try:
        run(args)
    finally:
        dist.destroy_process_group()
    return 0
