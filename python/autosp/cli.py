"""The ``autosp`` command.

    autosp train --nproc 4 --sp 4 --seq-len 256 --steps 20 --check
    autosp plan ...            # implemented by autosp.planner

``autosp train`` runs real sequence-parallel training of the reference causal LM
(``autosp.models.llama``) on synthetic data. Run outside torchrun (no ``RANK`` in
the environment) it re-launches itself with ``python -m torch.distributed.run
--standalone --nproc-per-node N -m autosp.cli train ...``; under torchrun every
rank builds the same model from ``--seed``, compiles it with ``autosp.compile``
and trains it with AdamW on Gloo (CPU) or NCCL (CUDA). Rank 0 prints the loss of
every step. With ``--check`` rank 0 finally recomputes the first step's loss with
the plain model on one device and compares.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily so that `autosp --help` is instant
    import torch

    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

LOSS_CHECK_ATOL = 1e-4


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autosp`` console script; returns the exit status."""
    parser = _build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["plan"]:
        # The planner owns its arguments (and its --help).
        return _plan(args_list[1:])
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "train":
        if "RANK" not in os.environ:
            return _relaunch_under_torchrun(args, args_list)
        return _train(args)
    raise AssertionError(f"unhandled command {args.command!r}")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autosp",
        description="Compiler-based sequence parallelism for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train the reference Llama on synthetic data with sequence parallelism",
        description=(
            "Train autosp.models.llama.LlamaForCausalLM on synthetic token data with "
            "autosp.compile. Outside torchrun this re-launches itself with "
            "torch.distributed.run on --nproc local processes."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    launch = train.add_argument_group("launch")
    launch.add_argument("--nproc", type=int, default=2,
                        help="processes to launch when not already under torchrun")
    launch.add_argument("--sp", type=int, default=None,
                        help="SP degree P (default: all processes); the rest is data parallel")
    launch.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cuda uses NCCL, cpu uses Gloo; auto picks cuda when available")
    launch.add_argument("--timeout-s", type=float, default=600.0,
                        help="process-group timeout in seconds")

    model = train.add_argument_group("model")
    model.add_argument("--vocab-size", type=int, default=256, help="vocabulary size")
    model.add_argument("--hidden-size", type=int, default=64, help="model width")
    model.add_argument("--intermediate-size", type=int, default=172, help="MLP width")
    model.add_argument("--layers", type=int, default=2, help="decoder layers")
    model.add_argument("--heads", type=int, default=4, help="query heads")
    model.add_argument("--kv-heads", type=int, default=None,
                       help="key/value heads (default: --heads, i.e. MHA)")

    run = train.add_argument_group("training")
    run.add_argument("--seq-len", type=int, default=256, help="sequence length S (full, per rank)")
    run.add_argument("--batch-size", type=int, default=2, help="sequences per SP group per step")
    run.add_argument("--steps", type=int, default=20, help="optimizer steps")
    run.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    run.add_argument("--seed", type=int, default=0, help="model and data seed")
    run.add_argument("--backend", choices=["inductor", "aot_eager"], default="inductor",
                     help="compiler backend for the SP graph")
    run.add_argument("--remat", choices=["sequence-aware", "default", "none"],
                     default="sequence-aware", help="activation rematerialisation policy")
    run.add_argument("--fsdp", action="store_true",
                     help="shard parameters, gradients and AdamW state over all ranks "
                          "(autosp.fully_shard, ZeRO-3)")
    run.add_argument("--check", action="store_true",
                     help="at the end, compare the first step's loss with the plain model "
                          "on one device (exit 1 on mismatch)")
    run.add_argument("--check-atol", type=float, default=LOSS_CHECK_ATOL,
                     help="tolerance of --check on |loss_sp - loss_single_device|")

    # Listed for `autosp --help`; main() hands everything after `plan` to the planner.
    sub.add_parser(
        "plan",
        help="predict per-rank memory and the longest trainable sequence "
             "(arguments go to autosp.planner; see `autosp plan --help`)",
        add_help=False,
    )
    return parser


# --------------------------------------------------------------------------------------
# plan


def _plan(plan_args: list[str]) -> int:
    try:
        # import_module reads sys.modules, whatever the package attribute says.
        planner = importlib.import_module("autosp.planner")
    except ModuleNotFoundError as exc:
        if exc.name not in ("autosp.planner", "autosp"):
            raise
        print(
            "autosp plan: the planner is not available in this build "
            f"(module autosp.planner not found: {exc}).",
            file=sys.stderr,
        )
        return 2
    entry = getattr(planner, "main", None)
    if entry is None:
        print("autosp plan: autosp.planner has no main(argv) entry point.", file=sys.stderr)
        return 2
    status = entry(plan_args)
    return 0 if status is None else int(status)


# --------------------------------------------------------------------------------------
# train


def _use_cuda(device: str) -> bool:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("autosp train: --device cuda but CUDA is not available")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def rank_arguments(args_list: Sequence[str]) -> list[str]:
    """``args_list`` without ``--nproc N`` / ``--nproc=N``: that option is the launcher's
    alone, and torchrun's own parser would reject it as an ambiguous prefix of
    ``--nproc-per-node``."""
    rank_args: list[str] = []
    skip_next = False
    for arg in args_list:
        if skip_next:
            skip_next = False
        elif arg == "--nproc":
            skip_next = True
        elif not arg.startswith("--nproc="):
            rank_args.append(arg)
    return rank_args


def torchrun_command(nproc: int, args_list: Sequence[str]) -> list[str]:
    """The command that re-launches ``autosp <args_list>`` on ``nproc`` local ranks (without
    the launcher's ``--nproc``, see ``rank_arguments``)."""
    rank_args = rank_arguments(args_list)
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}",
        "-m", "autosp.cli", *rank_args,
    ]


def _relaunch_under_torchrun(args: argparse.Namespace, args_list: list[str]) -> int:
    if args.nproc < 1:
        raise SystemExit(f"autosp train: --nproc must be >= 1, got {args.nproc}")
    env = dict(os.environ)
    if not _use_cuda(args.device):
        # A single-node Gloo group talks over loopback; hostname lookup may not work.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    cmd = torchrun_command(args.nproc, args_list)
    return subprocess.run(cmd, env=env, check=False).returncode


def synthetic_batch(
    vocab_size: int, batch_size: int, seq_len: int, seed: int, step: int, dp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` for one step of one data-parallel group.

    Tokens follow a fixed random successor map (drawn from ``seed``) 90% of the
    time and are uniform otherwise, so the loss can fall well below log(vocab).
    The same arguments give the same batch on every rank of an SP group.
    """
    import torch

    successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 1_009 + dp_rank) & 0x7FFFFFFF)
    tokens = torch.empty(batch_size, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=gen)
    noise = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    follow = torch.rand(batch_size, seq_len, generator=gen) < 0.9
    for i in range(1, seq_len):
        tokens[:, i] = torch.where(follow[:, i], successor[tokens[:, i - 1]], noise[:, i])
    return tokens, tokens.clone()


def _train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    sp_size = world_size if args.sp is None else args.sp
    if sp_size < 1 or world_size % sp_size != 0:
        raise SystemExit(
            f"autosp train: --sp {sp_size} must divide the number of processes {world_size}"
        )
    use_cuda = _use_cuda(args.device)
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    try:
        return _train_loop(args, rank, world_size, sp_size, device)
    finally:
        dist.destroy_process_group()


def _model_config(args: argparse.Namespace) -> LlamaConfig:
    from autosp.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.heads if args.kv_heads is None else args.kv_heads,
    )


def _build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    import torch

    from autosp.models.llama import LlamaForCausalLM

    torch.manual_seed(args.seed)
    return LlamaForCausalLM(_model_config(args))


def _train_loop(
    args: argparse.Namespace, rank: int, world_size: int, sp_size: int, device: torch.device
) -> int:
    import torch
    import torch.distributed as dist

    import autosp

    dp_size = world_size // sp_size
    mesh = autosp.init_mesh(sp_size, dp_size=dp_size)
    dp_rank = mesh.get_local_rank("dp")
    model = _build_model(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.fsdp:
        autosp.fully_shard(model, mesh)
    compiled = autosp.compile(
        model, mesh=mesh, seq_dim=1, remat=args.remat, backend=args.backend
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(
            f"autosp train: world {world_size} = dp {dp_size} x sp {sp_size}, "
            f"{n_params / 1e6:.2f}M parameters{' sharded over all ranks' if args.fsdp else ''}, "
            f"seq_len {args.seq_len}, batch {args.batch_size}, backend {args.backend}, "
            f"remat {args.remat}, device {device.type}",
            flush=True,
        )

    first_loss: float | None = None
    for step in range(args.steps):
        input_ids, labels = synthetic_batch(
            args.vocab_size, args.batch_size, args.seq_len, args.seed, step, dp_rank
        )
        input_ids, labels = input_ids.to(device), labels.to(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(input_ids, labels)
        loss.backward()
        optimizer.step()
        local_loss = loss.detach().float()
        if first_loss is None:
            first_loss = local_loss.item()
        # Every rank of an SP group holds the same loss; the mean over all ranks is
        # the mean over the data-parallel groups.
        mean_loss = local_loss.clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        elapsed = time.perf_counter() - start
        if rank == 0:
            note = "  (includes compilation)" if step == 0 else ""
            print(f"step {step:4d}  loss {mean_loss.item():.6f}  time {elapsed * 1e3:.1f} ms{note}",
                  flush=True)
        if not math.isfinite(mean_loss.item()):
            if rank == 0:
                print(f"autosp train: loss is not finite at step {step}", file=sys.stderr)
            return 1

    status = 0
    if args.check and rank == 0 and first_loss is not None:
        status = _check_first_step(args, first_loss, dp_rank)
    if args.check:
        # Rank 0 may fail the check; make every rank exit with its status.
        flag = torch.tensor([status], device=device)
        dist.broadcast(flag, src=0)
        status = int(flag.item())
    return status


def _check_first_step(args: argparse.Namespace, sp_loss: float, dp_rank: int) -> int:
    """This rank's first-step loss against the plain model on one device (CPU, fp32)."""
    import torch

    model = _build_model(args)
    input_ids, labels = synthetic_batch(
        args.vocab_size, args.batch_size, args.seq_len, args.seed, 0, dp_rank
    )
    with torch.no_grad():
        ref_loss = model(input_ids, labels).item()
    diff = abs(sp_loss - ref_loss)
    ok = diff <= args.check_atol
    print(
        f"check: first-step loss sp {sp_loss:.8f} single-device {ref_loss:.8f} "
        f"|diff| {diff:.3e} {'<=' if ok else '>'} {args.check_atol:.0e}: "
        f"{'OK' if ok else 'MISMATCH'}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
