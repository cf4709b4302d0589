"""Benchmark: autosp-compiled Llama vs the hand-written Ulysses Llama, same ranks and S.

    torchrun --nproc-per-node 4 bench/bench_sp.py --seq 2048
    python bench/bench_sp.py --nproc 4 --seq 2048      # launches torchrun itself

Both models start from the same weights and get the same full-length batch on
every rank. Reported (rank 0), each measured in this run:

- iteration time: zero_grad + forward + backward (+ the hand-written version's
  gradient all-reduce; autosp's gradients are complete after backward), after
  ``--warmup`` iterations, the two models alternating; per iteration the max over
  ranks, then the median over ``--iters``.
- activation bytes saved for backward, per rank: the storages of every tensor
  autograd saves during one forward, collected with
  ``torch.autograd.graph.saved_tensors_hooks`` (which also sees the tensors a
  compiled graph saves through its autograd.Function), deduplicated by storage and
  excluding parameter storages; max over ranks. SP=1 is the plain model on the
  full sequence in one process, eager and under ``torch.compile`` with the same
  backend (the partitioner changes what is saved, so compiled SP is compared with
  compiled SP=1).

Ratios printed: autosp / hand-written time, and saved bytes per rank SP=P / SP=1.
No absolute number is asserted: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch import bench_main, max_over_ranks, timed  # noqa: E402
from ulysses_handwritten import UlyssesLlamaForCausalLM, sync_sp_grads  # noqa: E402

from autosp.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from autosp.remat_policy import BACKENDS, POLICIES  # noqa: E402
from autosp.train.config import REGION_MODES  # noqa: E402

MIB = 1024 * 1024


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="autosp vs hand-written Ulysses: iteration time and saved activation bytes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--nproc", type=int, default=4,
                        help="ranks to launch when not already under torchrun")
    parser.add_argument("--seq", type=int, default=2048, help="full sequence length S")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--intermediate", type=int, default=688, help="MLP width")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    parser.add_argument("--backend", choices=BACKENDS, default="aot_eager",
                        help="compiler backend, for autosp and for torch.compile of the "
                             "hand-written model")
    parser.add_argument("--remat", default="sequence-aware",
                        choices=POLICIES, help="autosp remat policy")
    parser.add_argument("--eager-handwritten", action="store_true",
                        help="run the hand-written model eagerly instead of torch.compile")
    parser.add_argument("--handwritten-decoder-frame", action="store_true",
                        help="loop over the hand-written model's layers in a method of their own "
                             "(ulysses_handwritten decoder_frame=True): torch.compile then compiles "
                             "its embedding, lm_head and loss, which it otherwise runs eagerly")
    parser.add_argument("--regions", nargs="?", const="true", default="compile",
                        choices=tuple(REGION_MODES),
                        help="autosp.compile(regions=...): 'compile' compiles each class of alike "
                             "decoder layers once, 'true' (the flag alone) "
                             "also has Dynamo trace it once")
    parser.add_argument("--models", default="autosp,handwritten",
                        help="comma-separated subset of autosp,handwritten to run")
    parser.add_argument("--dynamic", choices=["auto", "true", "false"], default="auto",
                        help="autosp.compile(dynamic=...): auto (None, the default; at the one "
                             "length of this bench, a static compile) compiles the first length "
                             "with S static, as torch.compile does the hand-written model here; "
                             "true compiles one graph with S symbolic")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per model")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per model")
    parser.add_argument("--seed", type=int, default=0, help="weights and batch seed")
    parser.add_argument("--first-call-only", action="store_true",
                        help="time the first call only (compile + forward + backward) and print "
                             "it as 'first call s <model>: <seconds>' (bench/first_call_sp.py)")
    parser.add_argument("--compile-times", action="store_true",
                        help="after the first call, each rank prints its own first-call seconds "
                             "and PyTorch's per-stage compile times "
                             "(torch._dynamo.utils.compile_times) to stderr")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(args.models) - {"autosp", "handwritten"}
    if unknown or not args.models:
        parser.error(f"--models: unknown {sorted(unknown)}; choose from autosp,handwritten")
    return args




def make_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = input_ids.clone()
    labels[:, : args.seq // 16] = -100  # some ignored targets, as in real data
    return input_ids, labels


def saved_activation_bytes(model: nn.Module, step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during ``step()``'s
    forward; runs the backward too (so the graph is freed)."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_storages and ptr != 0:
            saved[ptr] = max(saved.get(ptr, 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())








def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.heads if args.kv_heads is None else args.kv_heads,
    )
    torch.manual_seed(args.seed)
    reference = LlamaForCausalLM(cfg)
    input_ids, labels = make_inputs(args)

    steps: dict[str, Callable[[], torch.Tensor]] = {}
    models: dict[str, nn.Module] = {}
    extra: dict[str, Callable[[], None]] = {}
    compile_s: dict[str, float] = {}
    first_loss: dict[str, float] = {}

    if "handwritten" in args.models:
        hand = UlyssesLlamaForCausalLM.from_model(reference,
                                                  decoder_frame=args.handwritten_decoder_frame)
        hand_fn = hand if args.eager_handwritten else torch.compile(hand, backend=args.backend)
        models["handwritten"] = hand
        steps["handwritten"] = lambda: hand_fn(input_ids, labels)
        extra["handwritten"] = lambda: sync_sp_grads(hand)
    if "autosp" in args.models:
        import autosp

        sp_model = LlamaForCausalLM(cfg)
        sp_model.load_state_dict(reference.state_dict())
        mesh = autosp.init_mesh(world)
        compiled = autosp.compile(
            sp_model, mesh=mesh, seq_dim=1, remat=args.remat, backend=args.backend,
            dynamic={"auto": None, "true": True, "false": False}[args.dynamic],
            regions=REGION_MODES[args.regions],
        )
        models["autosp"] = sp_model
        steps["autosp"] = lambda: compiled(input_ids, labels)
        extra["autosp"] = lambda: None

    def iteration(name: str) -> torch.Tensor:
        models[name].zero_grad(set_to_none=True)
        loss = steps[name]()
        loss.backward()
        extra[name]()
        return loss

    # Warmup (the first call compiles).
    for name in steps:
        for i in range(args.warmup):
            start = time.perf_counter()
            loss = iteration(name)
            if i == 0:
                mine = time.perf_counter() - start
                if args.compile_times:
                    from torch._dynamo.utils import compile_times

                    sys.stderr.write(f"rank {rank} {name}: first call {mine:.2f} s\n"
                                     f"{compile_times(repr='str', aggregate=True)}\n")
                compile_s[name] = max_over_ranks(mine)
                first_loss[name] = loss.item()

    if args.first_call_only:
        if rank == 0:
            for name in steps:
                print(f"first call s {name}: {compile_s[name]:.3f}")
        return

    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.iters):
        for name in steps:  # alternate, so drift in the machine hits both alike
            times[name].append(timed(lambda: iteration(name)))

    saved = {name: max_over_ranks(saved_activation_bytes(models[name], steps[name]))
             for name in steps}

    single_eager = single_compiled = None
    if rank == 0:
        single = LlamaForCausalLM(cfg)
        single.load_state_dict(reference.state_dict())
        single_eager = saved_activation_bytes(single, lambda: single(input_ids, labels))
        single_c = torch.compile(single, backend=args.backend)
        single_c(input_ids, labels).backward()  # compile outside the measurement
        single.zero_grad(set_to_none=True)
        single_compiled = saved_activation_bytes(single, lambda: single_c(input_ids, labels))
    dist.barrier()
    if rank != 0:
        return

    median = {name: statistics.median(ts) for name, ts in times.items()}
    hand_mode = "eager" if args.eager_handwritten else f"torch.compile({args.backend})"
    hand_mode += ", decoder frame" if args.handwritten_decoder_frame else ""
    print(
        f"\nautosp bench: P={world} S={args.seq} B={args.batch} hidden={args.hidden} "
        f"layers={args.layers} heads={cfg.num_heads}/{cfg.num_kv_heads} vocab={args.vocab} "
        f"backend={args.backend} remat={args.remat} dynamic={args.dynamic} regions={args.regions} "
        f"handwritten={hand_mode} "
        f"threads/rank={torch.get_num_threads()} warmup={args.warmup} iters={args.iters}"
    )
    print(f"{'':24}{'iter ms (median)':>18}{'first call s':>14}{'saved MiB/rank':>16}"
          f"{'/ SP=1':>9}{'first loss':>14}")
    assert single_eager is not None and single_compiled is not None
    print(f"{'SP=1 eager':24}{'':>18}{'':>14}{single_eager / MIB:>16.2f}{1.0:>9.3f}")
    print(f"{'SP=1 compiled':24}{'':>18}{'':>14}{single_compiled / MIB:>16.2f}"
          f"{single_compiled / single_eager:>9.3f}")
    for name in steps:
        base = single_eager if name == "handwritten" and args.eager_handwritten else single_compiled
        print(f"{name:24}{median[name] * 1e3:>18.1f}{compile_s[name]:>14.1f}"
              f"{saved[name] / MIB:>16.2f}{saved[name] / base:>9.3f}{first_loss[name]:>14.6f}")
    if "autosp" in steps and "handwritten" in steps:
        print(f"time autosp / handwritten: {median['autosp'] / median['handwritten']:.3f}")
        print(f"first call autosp (dynamic={args.dynamic}) / handwritten (torch.compile's "
              f"default: S static): {compile_s['autosp'] / compile_s['handwritten']:.2f}x")
        print(f"saved bytes per rank autosp / handwritten: "
              f"{saved['autosp'] / saved['handwritten']:.3f}")
        print(f"first-step loss |autosp - handwritten|: "
              f"{abs(first_loss['autosp'] - first_loss['handwritten']):.2e}")
    print("saved bytes: storages saved for backward (saved_tensors_hooks), deduplicated, "
          "parameters excluded; '/ SP=1' is against SP=1 compiled with the same backend "
          "(eager when the hand-written model runs eagerly). Ideal SP=P ratio ~ 1/P.")



def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(str(Path(__file__).resolve()), argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
