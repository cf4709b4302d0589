"""``autosp train``'s checkpoints and faults, through the command line on 2 Gloo ranks:
exact resume, SIGTERM (save and exit cleanly), a killed rank and a stopped one (every other
rank exits non-zero with a clear message, never a hang)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from autosp.train import checkpoint as ckpt
from distributed import run_ranks
from test_cli import _autosp_command

TINY = ["--nproc", "2", "--sp", "2", "--seq-len", "16", "--batch-size", "2", "--hidden-size", "32",
        "--intermediate-size", "64", "--layers", "1", "--heads", "4", "--backend", "aot_eager",
        "--warmup-steps", "2", "--predict", "false"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*_autosp_command(), "train", *TINY, "--out-dir", str(out), *extra],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # the 4-rank document run (test_documents.py) also resumes, at dp 2
def test_resume_continues_exactly(tmp_path: Path) -> None:
    """6 steps saving every 3; a second run resumes from step-3 (another folder): its steps 3
    to 5 equal the uninterrupted run's (loss to 1e-6 relative, fp32 on CPU), with the
    schedule's learning rates and the data position restored."""
    _train(tmp_path / "a", "--steps", "6", "--checkpoint-every", "3")
    assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["step-3", "step-6"]
    proc = _train(tmp_path / "b", "--steps", "6", "--resume", str(tmp_path / "a" / "checkpoints" / "step-3"))
    assert "resumed from" in proc.stdout and "3 steps done" in proc.stdout
    full, resumed = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for a, b in zip(full[3:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)
        assert b["lr"] == a["lr"]
    assert full[3]["loss"] != full[4]["loss"]  # the steps train on different batches


def test_resume_errors_clearly(tmp_path: Path) -> None:
    proc = subprocess.run([*_autosp_command(), "train", *TINY, "--steps", "1", "--out-dir",
                           str(tmp_path), "--resume", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 1
    assert "checkpoint.resume" in proc.stderr and "found no DCP checkpoint" in proc.stderr, proc.stderr
    # the launcher ends with one line naming the failed ranks, not torchrun's own traceback
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"autosp train: the run failed: rank 0 (exit code 1|killed by SIGTERM), "
                        r"rank 1 (exit code 1|killed by SIGTERM) \(once a rank fails, torchrun "
                        r"ends the others with SIGTERM, then SIGKILL\)\. Each rank's own message "
                        r"is above\.", last) and "exit code 1" in last, last


def _start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*_autosp_command(), "train", *TINY, "--steps", "100000", "--out-dir",
                             str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV, start_new_session=True)


def _rank_pids(launcher: subprocess.Popen, out: Path, steps: int = 3) -> list[int]:
    """The rank processes (torchrun's children), once ``steps`` steps are recorded."""
    deadline = time.time() + 300
    while len(_records(out)) < steps:
        assert launcher.poll() is None, launcher.communicate()[0]
        assert time.time() < deadline, "the run did not reach its third step"
        time.sleep(0.2)

    def children(pid: int) -> list[int]:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    ranks = [c for t in children(launcher.pid) for c in children(t)]
    assert len(ranks) == 2, ranks
    return ranks


@pytest.mark.parametrize("to", ["launcher", pytest.param("ranks", marks=pytest.mark.slow)])
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path: Path, to: str) -> None:
    """SIGTERM to the `autosp train` launcher (it passes it on to the ranks and waits), or to
    the ranks themselves (as a cluster scheduler does): every rank stops after its step, a
    checkpoint of every step done is saved, exit status 0, no process left behind; it is the
    checkpoint "--resume latest" picks. A resume into another model or data layout is refused
    clearly (resuming exactly is test_resume_continues_exactly's)."""
    out = tmp_path / "run"
    launcher = _start(out)
    ranks = _rank_pids(launcher, out)
    for pid in ([launcher.pid] if to == "launcher" else ranks):
        os.kill(pid, signal.SIGTERM)
    text, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, text
    assert "stopped by SIGTERM" in text, text
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), "ranks left running"
    done = len(_records(out))
    assert sorted(os.listdir(out / "checkpoints")) == [f"step-{done}"], text
    assert ckpt.latest(str(out / "checkpoints")) == str(out / "checkpoints" / f"step-{done}")
    assert ckpt.resolve("latest", str(out / "checkpoints")) == ckpt.latest(str(out / "checkpoints"))
    if to == "ranks":
        return
    for extra, found in ((["--grad-accum", "2"], "grad_accum 1 (now 2)"),
                         (["--hidden-size", "64"], "does not fit this run's model")):
        proc = subprocess.run([*_autosp_command(), "train", *TINY, "--steps", str(done + 2),
                               "--out-dir", str(out), "--resume", "latest", *extra],
                              capture_output=True, text=True, timeout=600, env=ENV)
        assert proc.returncode != 0 and found in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow  # 22 s of the default suite's 20 minutes
def test_the_loss_does_not_depend_on_how_the_batch_is_split(tmp_path: Path) -> None:
    """The step's loss is the mean over all its target tokens: two sequences of very
    different numbers of targets (one mostly empty documents) give the same loss and
    gradient norm as one micro-batch of 2 or as 2 accumulated micro-batches of 1."""
    import json as json_

    docs = tmp_path / "docs"
    docs.mkdir()
    rows = [{"text": ""}] * 12 + [{"text": "abcdefgh" * 6}]
    (docs / "d.jsonl").write_text("".join(json_.dumps(r) + "\n" for r in rows))
    got = []
    for b, accum in ((2, 1), (1, 2)):
        out = tmp_path / f"b{b}"
        _train(out, "--steps", "1", "--source", str(docs), "--nproc", "1", "--sp", "1",
               "--batch-size", str(b), "--grad-accum", str(accum), "--max-grad-norm", "0")
        got.append(_records(out)[0])
    assert got[0]["loss"] == pytest.approx(got[1]["loss"], rel=1e-6), got
    assert got[0]["grad_norm"] == pytest.approx(got[1]["grad_norm"], rel=1e-5), got


def test_latest_ignores_unfinished_checkpoints(tmp_path: Path) -> None:
    """A save cut off by a kill leaves step-N.tmp: the latest is the newest finished one;
    with none, "latest" is a fresh start."""
    assert ckpt.resolve("latest", str(tmp_path)) is None
    for name in ("step-2", "step-10", "step-12.tmp", "notes"):
        (tmp_path / name).mkdir()
    assert ckpt.latest(str(tmp_path)) == str(tmp_path / "step-10")


@pytest.mark.parametrize("how", [
    "kill",  # the dead rank's sockets close: the other rank fails at its next collective
    pytest.param("stop", marks=pytest.mark.slow),  # alive but silent: parallel.timeout_s
])
def test_a_lost_rank_ends_the_run(tmp_path: Path, how: str) -> None:
    out = tmp_path / "run"
    launcher = _start(out, "--timeout-s", "5")
    ranks = _rank_pids(launcher, out)
    t0 = time.time()
    os.kill(ranks[1], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        text, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:  # never leave a hung run behind
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0, text
    assert "autosp train: rank 0: a collective failed or timed out" in text, text
    if how == "kill":
        assert "rank 1 killed by SIGKILL" in text.strip().splitlines()[-1], text[-2000:]
        assert "ChildFailedError" not in text, text[-2000:]
    # the timeout is 5 s; torchrun then waits up to 30 s for the silent rank before killing it
    assert time.time() - t0 < (15 if how == "kill" else 60), time.time() - t0


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--fsdp"]],
                         ids=["pure-bf16", "mixed-fsdp"])
def test_bf16_runs_and_checks(tmp_path: Path, extra: list[str]) -> None:
    """bf16 weights (pure), or bf16 compute over fp32 sharded weights: trains, and --check
    compares with the model in bf16 on one device (1% relative)."""
    proc = _train(tmp_path, "--steps", "1", "--dtype", "bfloat16", "--check", *extra)
    assert "check: first-step loss" in proc.stdout and ": OK" in proc.stdout, proc.stdout[-2000:]


def _flops_worker(rank: int, world: int, with_report: list[bool]) -> float | None:
    from autosp.remat_policy import GraphRematReport, RematReport
    from autosp.train.loop import step_model_flops

    report = RematReport()
    if with_report[rank]:
        report.graphs.append(GraphRematReport(
            policy="none", saved_bytes=0, none_saved_bytes=0, budget_bytes=None,
            recompute_flops=0.0, attention_flops=0.0, admitted_matmuls=0, solve_seconds=0.0,
            flow_vertices=0, flow_edges=0, layers=(), nodes=(), model_flops=1000.0 * (rank + 1)))
    return step_model_flops(report, 2, torch.device("cpu"))


@pytest.mark.parametrize("with_report", [[True, True], [True, False], [False, False]])
def test_step_flops_are_reduced_on_every_rank_also_one_without_a_report(with_report) -> None:
    """Found by a breaker: a rank whose compiled graph came from PyTorch's cache without
    autosp's report skipped the FLOPs all-reduce the others entered, and the job hung after its
    first step (10 minutes, then a timeout). Every rank reduces; a missing report makes the
    FLOPs, and so the MFU, unknown (null), not 0."""
    got = run_ranks(2, _flops_worker, with_report, timeout=60)
    want = 2 * (1000.0 + 2000.0) if all(with_report) else None
    assert got == [want, want]


def _layout_worker(rank: int, world: int, folder: str) -> list[str]:
    from autosp.errors import AutospError

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    base = {"dp": 1, "batch_size": 2, "seq_len": 16}
    path = ckpt.save(folder, model, optimizer, scheduler, 3, {**base, "max_position": 4})
    errors = []
    for now in ({**base, "max_position": 8}, base):
        try:
            ckpt.load(path, model, optimizer, scheduler, now)
            errors.append("")
        except AutospError as e:
            errors.append(str(e))
    errors.append(str(ckpt.load(path, model, optimizer, scheduler, {**base, "max_position": 4})))
    path = ckpt.save(folder, model, optimizer, scheduler, 5, {**base, "max_position": None})
    try:  # a model without a table, then one with
        ckpt.load(path, model, optimizer, scheduler, {**base, "max_position": 4})
        errors.append("")
    except AutospError as e:
        errors.append(str(e))
    path = ckpt.save(folder, model, optimizer, scheduler, 6, base)  # as before the key existed
    errors.append(str(ckpt.load(path, model, optimizer, scheduler, {**base, "max_position": 4})))
    return errors


def test_resume_with_another_position_table_is_refused(tmp_path: Path) -> None:
    """Positions restart at the model's position table's size (autosp.train.documents): a
    resume whose table differs (a changed max_position_embeddings, or a model with none, or
    one with a table after none) would feed other positions than the uninterrupted run. Each
    is refused by name; the same size resumes."""
    [(other, none, same, added, older)] = run_ranks(1, _layout_worker, str(tmp_path))
    assert "max_position 4 (now 8)" in other, other
    assert "max_position 4 (now None)" in none, none
    assert same == "3"
    assert "max_position None (now 4)" in added, added
    assert older == "6"  # a checkpoint written before the layout held the table still resumes


def _missing_key_worker(rank: int, world: int, folder: str) -> str:
    from autosp.errors import AutospError

    def parts(model: torch.nn.Module) -> tuple:
        optimizer = torch.optim.AdamW(model.parameters())
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    path = ckpt.save(folder, *parts(torch.nn.Sequential(torch.nn.Linear(4, 4))), 1, {"dp": 1})
    try:
        ckpt.load(path, *parts(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))),
                  {"dp": 1})
    except AutospError as e:
        return str(e)
    return ""


def test_resume_into_a_deeper_model_names_the_missing_key(tmp_path: Path) -> None:
    """A checkpoint of one layer loaded into two: the refusal names the missing parameter,
    not the source line of PyTorch's that formats it ("{fqn}", found by breaker helper-90)."""
    [text] = run_ranks(1, _missing_key_worker, str(tmp_path))
    assert "does not fit this run's model" in text and "1.weight" in text, text
    assert "{fqn}" not in text, text
