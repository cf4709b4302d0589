"""Benchmark: sharded model state (``autosp.fully_shard``) against unsharded autosp.

    python bench/bench_fsdp.py --nproc 4 --sp 2 --seq 512        # dp2 x sp2 on Gloo (CPU)
    torchrun --nproc-per-node 8 bench/bench_fsdp.py --sp 8 --seq 32768 --hidden 2048 \\
        --layers 8 --heads 16 --vocab 32000 --backend inductor --bf16   # one GPU node

The same reference Llama (same weights, same batch per dp group) is trained unsharded
(every rank holds the parameters, gradients and AdamW state; gradients averaged over dp by
all-reduce) and sharded with ``autosp.fully_shard`` (all of it split over dp x sp; each
parameter all-gathered where used, gradients reduce-scattered). Each iteration times
zero_grad + forward + backward + AdamW step of both, alternating; per iteration the max over
ranks, then the median over ``--iters``. Printed (rank 0), measured in this run:

- step time of each and the ratio sharded / unsharded;
- model-state bytes per rank (parameters, gradients, AdamW state: the local storages) of each
  and the ratio (about 1/world expected);
- on CUDA also the peak allocated memory per rank of each (``torch.cuda.max_memory_allocated``).

Nothing is asserted.
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
from launch import bench_main, timed  # noqa: E402
from autosp.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from autosp.remat_policy import BACKENDS  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="autosp.fully_shard vs unsharded autosp",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks to launch when not under torchrun")
    p.add_argument("--sp", type=int, default=2, help="SP degree (dp = world // sp)")
    p.add_argument("--seq", type=int, default=512, help="full sequence length S")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--backend", default="aot_eager", choices=BACKENDS)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 compute: MixedPrecisionPolicy(bf16, fp32) sharded, autocast unsharded")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    return p.parse_args(argv)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state: distinct storages (a
    gradient that is a view of a bucket counts the bucket once)."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        s = _local(t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                add(v)
    return sum(storages.values())


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = dist.get_world_size()
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = autosp.init_mesh(args.sp)
    dp_rank = mesh.get_local_rank("dp")
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 8 // 3, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=args.heads)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    runs = {}
    for mode in ("unsharded", "sharded"):
        model = LlamaForCausalLM(cfg)
        model.load_state_dict(base.state_dict())
        model.to(device)
        if mode == "sharded":
            policy = autosp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32) if args.bf16 else None
            autosp.fully_shard(model, mesh, mp_policy=policy)
        compiled = autosp.compile(model, mesh, backend=args.backend)
        runs[mode] = (model, compiled, torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(1 + dp_rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    labels = ids.clone()

    peaks: dict[str, int] = {}

    def step(mode: str) -> None:
        model, compiled, opt = runs[mode]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        autocast = args.bf16 and mode == "unsharded"
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = compiled(ids, labels)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
            peaks[mode] = max(peaks.get(mode, 0), torch.cuda.max_memory_allocated())

    times: dict[str, list[float]] = {"unsharded": [], "sharded": []}
    for i in range(args.warmup + args.iters):
        for mode in ("unsharded", "sharded") if i % 2 == 0 else ("sharded", "unsharded"):
            t = timed(lambda: step(mode))
            if i >= args.warmup:
                times[mode].append(t)
    nbytes = {mode: state_bytes(m, o) for mode, (m, _, o) in runs.items()}
    if dist.get_rank() == 0:
        med = {m: statistics.median(t) for m, t in times.items()}
        print(f"world {world} = dp {world // args.sp} x sp {args.sp}, S {args.seq}, batch "
              f"{args.batch}, hidden {args.hidden}, layers {args.layers}, backend {args.backend}, "
              f"{'bf16' if args.bf16 else 'fp32'}, {device.type}, {args.iters} iterations "
              "(median of the max over ranks)")
        print(f"step time, unsharded: {med['unsharded'] * 1e3:10.2f} ms")
        print(f"step time, sharded:   {med['sharded'] * 1e3:10.2f} ms")
        print(f"ratio sharded / unsharded step time:  {med['sharded'] / med['unsharded']:.3f}")
        print(f"model-state bytes per rank: unsharded {nbytes['unsharded']}, sharded "
              f"{nbytes['sharded']}, ratio {nbytes['sharded'] / nbytes['unsharded']:.3f} "
              f"(1/world = {1 / world:.3f})")
        if cuda:
            print(f"peak allocated per rank: unsharded {peaks['unsharded'] / 2**30:.2f} GiB, "
                  f"sharded {peaks['sharded'] / 2**30:.2f} GiB, ratio "
                  f"{peaks['sharded'] / peaks['unsharded']:.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(str(Path(__file__).resolve()), argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
