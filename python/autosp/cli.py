"""The ``autosp`` command.

    autosp train --nproc 4 --sp 4 --seq-len 256 --steps 20 --check
    autosp plan ...            # implemented by autosp.planner

``autosp train`` runs real sequence-parallel training (autosp.train): the reference causal
LM or a Hugging Face model, configured by a TOML file (``--config``) and options that
override it (autosp.train.config). Run outside torchrun (no ``RANK`` in the environment) it
re-launches itself under torchrun (``python -m autosp.torchrun --standalone --nproc-per-node N
-m autosp.cli train ...``: torchrun, ending a failed run with one line rather than its own
traceback); under torchrun every rank runs autosp.train.loop. With ``--check``
rank 0 finally recomputes the first step's loss with the plain model on one device and
compares.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from autosp.train import config as train_config


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
        try:
            cfg = train_config.load(args.config, train_config.overrides_of(args))
        except train_config.ConfigError as e:
            print(str(e), file=sys.stderr)
            return 2
        if "RANK" not in os.environ:
            return _relaunch_under_torchrun(cfg, args_list)
        from autosp.train.loop import run

        return run(ranks_config(cfg))
    raise AssertionError(f"unhandled command {args.command!r}")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autosp",
        description="Compiler-based sequence parallelism for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train a model with sequence parallelism (the reference Llama or a Hugging Face model)",
        description=(
            "Train with autosp.compile. Options come from --config (TOML) and the flags below, "
            "which override it. Outside torchrun this re-launches itself with "
            "torch.distributed.run on --nproc local processes."
        ),
    )
    train_config.add_arguments(train)

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


_NPROC = ("--nproc", "--parallel.nproc")


def rank_arguments(args_list: Sequence[str]) -> list[str]:
    """``args_list`` without ``--nproc N`` / ``--nproc=N``: that option is the launcher's
    alone, and torchrun's own parser would reject it as an ambiguous prefix of
    ``--nproc-per-node``."""
    rank_args: list[str] = []
    skip_next = False
    for arg in args_list:
        if skip_next:
            skip_next = False
        elif arg in _NPROC:
            skip_next = True
        elif not arg.startswith(tuple(f"{a}=" for a in _NPROC)):
            rank_args.append(arg)
    return rank_args


def ranks_config(cfg: train_config.TrainConfig) -> train_config.TrainConfig:
    """The config a rank runs and records (``config.toml``): ``parallel.nproc`` as torchrun
    launched it, its ``LOCAL_WORLD_SIZE``. The launcher keeps ``--nproc`` to itself
    (``rank_arguments``), so the ranks parsed the default (found by breaker helper-59: a run
    with ``--nproc 4`` saved ``nproc = 2``)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, nproc=int(local)))


def torchrun_command(nproc: int, args_list: Sequence[str]) -> list[str]:
    """The command that re-launches ``autosp <args_list>`` on ``nproc`` local ranks (without
    the launcher's ``--nproc``, see ``rank_arguments``)."""
    rank_args = rank_arguments(args_list)
    return [
        sys.executable, "-m", "autosp.torchrun",
        "--standalone", f"--nproc-per-node={nproc}",
        "-m", "autosp.cli", *rank_args,
    ]


def _relaunch_under_torchrun(cfg: train_config.TrainConfig, args_list: list[str]) -> int:
    from autosp.train.loop import use_cuda

    if cfg.parallel.nproc < 1:
        raise SystemExit(f"autosp train: parallel.nproc must be >= 1, got {cfg.parallel.nproc}")
    env = dict(os.environ)
    if not use_cuda(cfg.parallel.device):
        # A single-node Gloo group talks over loopback; hostname lookup may not work.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.parallel.nproc)))
    cmd = torchrun_command(cfg.parallel.nproc, args_list)
    # torchrun runs in its own session, so a Ctrl-C in the terminal reaches this launcher
    # only; SIGTERM or SIGINT here is passed to the ranks as SIGTERM (they finish the step,
    # save and exit 0, and so does torchrun), and the launcher waits for them.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum: int, frame: object) -> None:
        ranks = _children(proc.pid)
        for pid in ranks or [proc.pid]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux /proc; [] elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(main())
