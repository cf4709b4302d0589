"""``autosp train`` and ``autosp plan`` from the command line."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from autosp import cli


def _autosp_command() -> list[str]:
    # The installed console script when there is one (next to this interpreter),
    # else the same entry point through the module.
    script = Path(sys.executable).parent / "autosp"
    if script.exists():
        return [str(script)]
    found = shutil.which("autosp")
    return [found] if found else [sys.executable, "-m", "autosp.cli"]


@pytest.mark.parametrize("extra", [[], ["--fsdp"]], ids=["replicated", "fsdp"])
def test_train_two_ranks_runs_and_checks(extra: list[str]) -> None:
    cmd = [
        *_autosp_command(), "train",
        "--nproc", "2", "--sp", "2", "--steps", "3", "--backend", "aot_eager",
        "--seq-len", "32", "--batch-size", "2", "--vocab-size", "128",
        "--hidden-size", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--check", *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output}"
    losses = [float(m) for m in re.findall(r"^step\s+\d+\s+loss\s+(\S+)", proc.stdout, re.M)]
    assert len(losses) == 3, output
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"loss did not decrease over 3 AdamW steps: {losses}"
    assert re.search(r"^check: first-step loss .*: OK$", proc.stdout, re.M), output
    assert ("sharded over all ranks" in proc.stdout) == bool(extra), output


def test_relaunch_arguments_reach_the_ranks_intact() -> None:
    from torch.distributed.run import get_args_parser

    args_list = ["train", "--nproc", "4", "--sp", "2", "--seq-len", "64", "--steps", "2",
                 "--remat", "none", "--seed", "3", "--lr", "1e-3", "--layers", "1", "--check"]
    cmd = cli.torchrun_command(4, args_list)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    parsed = get_args_parser().parse_args(cmd[3:])
    assert parsed.nproc_per_node == "4"
    assert parsed.module and parsed.training_script == "autosp.cli"
    expected = [a for a in args_list if a not in ("--nproc", "4")]
    assert parsed.training_script_args == expected
    # What the ranks receive parses to the same training options.
    ours = cli._build_parser().parse_args(args_list)
    theirs = cli._build_parser().parse_args(parsed.training_script_args)
    assert {k: v for k, v in vars(theirs).items() if k != "nproc"} == {
        k: v for k, v in vars(ours).items() if k != "nproc"
    }


def test_plan_without_planner_reports_clearly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "autosp.planner", None)  # makes the import fail
    assert cli.main(["plan", "--seq-len", "1024"]) == 2
    err = capsys.readouterr().err
    assert "autosp plan" in err and "autosp.planner" in err


def test_plan_forwards_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("autosp.planner")
    fake.main = lambda argv: seen.append(list(argv)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "autosp.planner", fake)
    assert cli.main(["plan", "--seq-len", "1024", "--gpu", "h100"]) == 0
    assert seen == [["--seq-len", "1024", "--gpu", "h100"]]


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "train" in capsys.readouterr().err
