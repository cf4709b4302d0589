"""Benchmark: the cost of comparing the inputs across the SP group (``check_inputs``).

    python bench/bench_guard.py --nproc 2 --seq 512       # launches torchrun itself
    torchrun --nproc-per-node 2 bench/bench_guard.py --seq 512

Two copies of the reference Llama (same weights, same batch on every rank) are compiled
with ``check_inputs="always"`` (inputs compared on every call: two small all-gathers and a
checksum of every input tensor) and ``check_inputs="never"``. Each iteration times
zero_grad + forward + backward of both, alternating; per iteration the max over ranks, then
the median over ``--iters``. Printed (rank 0), measured in this run: both medians, the ratio
always / never, and the time of the check alone. ``"on_change"`` (the default) pays the
check only on the first call and when the input shapes change. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autosp  # noqa: E402
from autosp import guard  # noqa: E402
from launch import bench_main, timed  # noqa: E402
from autosp.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from autosp.remat_policy import BACKENDS  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="cost of check_inputs='always' vs 'never'",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch when not under torchrun")
    p.add_argument("--seq", type=int, default=512, help="full sequence length S")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--backend", default="aot_eager", choices=BACKENDS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    return p.parse_args(argv)






def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = dist.get_world_size()
    mesh = autosp.init_mesh(world)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                      num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.heads)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    models = {}
    for mode in ("always", "never"):
        plain = LlamaForCausalLM(cfg)
        plain.load_state_dict(base.state_dict())
        models[mode] = autosp.compile(plain, mesh, backend=args.backend, check_inputs=mode)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = ids.clone()

    def step(mode: str) -> None:
        m = models[mode]
        m.zero_grad(set_to_none=True)
        m(ids, labels).backward()

    times: dict[str, list[float]] = {"always": [], "never": []}
    for i in range(args.warmup + args.iters):
        for mode in ("always", "never") if i % 2 == 0 else ("never", "always"):
            t = timed(lambda: step(mode))
            if i >= args.warmup:
                times[mode].append(t)
    check = models["always"].input_guard
    leaves = guard.flatten_inputs((ids, labels), {}, check.names)
    check_times = [timed(lambda: check.check(leaves)) for _ in range(args.iters)]
    if dist.get_rank() == 0:
        always, never = statistics.median(times["always"]), statistics.median(times["never"])
        print(f"world {world}, S {args.seq}, batch {args.batch}, hidden {args.hidden}, layers {args.layers}, "
              f"backend {args.backend}, {args.iters} iterations (median of the max over ranks)")
        print(f"step time, check_inputs='never':  {never * 1e3:9.2f} ms")
        print(f"step time, check_inputs='always': {always * 1e3:9.2f} ms")
        print(f"ratio always / never:              {always / never:9.3f}")
        print(f"the check alone:                   {statistics.median(check_times) * 1e3:9.2f} ms")





def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(str(Path(__file__).resolve()), argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
