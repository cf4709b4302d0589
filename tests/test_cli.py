"""``autosp train`` and ``autosp plan`` from the command line."""

from __future__ import annotations

import json
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


def _hf_toml(tmp_path: Path) -> list[str]:
    """A TOML config naming a tiny Hugging Face Qwen2 config.json (random weights)."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256).save_pretrained(tmp_path / "qwen2")
    f = tmp_path / "run.toml"
    f.write_text(f'[model]\nhf_config = "{tmp_path / "qwen2"}"\n[training]\nlr = 1e-3\n'
                 'grad_accum = 2\nwarmup_steps = 1\n[parallel]\nfsdp = true\n')
    return ["--config", str(f)]


# The README's flat flags on the built-in Llama and the built-in sample stories (packed
# documents); and a TOML file with a Hugging Face model on synthetic data, sharded
# (fully_shard), two micro-batches accumulated, a warmup and a remat memory budget of 0.3 MiB
# (between what recomputing all it may and saving everything save),
# overridden by flags.
@pytest.mark.parametrize("variant", ["flags", pytest.param("hf-toml-fsdp", marks=pytest.mark.slow)])
def test_train_two_ranks_runs_and_checks(variant: str, tmp_path: Path) -> None:
    extra = [*_hf_toml(tmp_path), "--predict", "false", "--remat-budget-gib", "0.0003"] \
        if variant == "hf-toml-fsdp" else [
        "--source", "sample", "--hidden-size", "64", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--intermediate-size", "172"]
    out = tmp_path / "run"
    cmd = [
        *_autosp_command(), "train", *extra,
        "--nproc", "2", "--sp", "2", "--steps", "3", "--backend", "aot_eager",
        "--seq-len", "32", "--batch-size", "2", "--check", "--out-dir", str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output}"
    losses = [float(m) for m in re.findall(r"^step\s+\d+/3\s+loss\s+(\S+)", proc.stdout, re.M)]
    assert len(losses) == 3, output
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"loss did not decrease over 3 AdamW steps: {losses}"
    assert re.search(r"^check: first-step loss .*: OK$", proc.stdout, re.M), output
    assert re.search(r"^check: first-step gradient norm .*: OK$", proc.stdout, re.M), output
    assert ("sharded over all ranks" in proc.stdout) == (variant == "hf-toml-fsdp"), output
    assert ("remat budget 0.0003 GiB" in proc.stdout) == (variant == "hf-toml-fsdp"), output
    # what training.regions (default "compile") did, after the first step: the two alike
    # layers share one subgraph; a budget keeps every layer inline, and says why
    said = re.findall(r"^regions: .*$", proc.stdout, re.M)
    assert said == (["regions: no layer outlined: remat=MemoryBudget(...) caps the saved bytes "
                     "of the whole graph; each region would be held to the whole budget alone, "
                     "and the calling graph to it for what every region saves"]
                    if variant == "hf-toml-fsdp" else
                    ["regions: 2 of 2 layers call 1 shared compiled subgraph"]), output
    # The metrics file: one record per step with every field, the printed losses.
    from autosp.train.config import load
    from autosp.train.metrics import FIELDS

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(set(FIELDS) <= set(r) for r in records), records[0]
    assert [round(r["loss"], 6) for r in records] == losses
    accum = 2 if variant == "hf-toml-fsdp" else 1
    assert all(r["tokens"] == 2 * 32 * accum for r in records)  # batch x seq x accum x dp 1
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 for r in records)
    if variant == "hf-toml-fsdp":  # warmup 1 step, then cosine to 0.1 x lr at the last step
        assert [r["lr"] for r in records] == pytest.approx([1e-3, 1e-3, 1e-4])
    else:
        # The step's model FLOPs, counted on the compiled graphs of both ranks, against the
        # formula for this Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 172, the
        # sample stories' 257-token vocabulary): 3 x the forward matmuls (forward + backward)
        # plus attention (q k^T and p v over the full S x S per layer). The count includes
        # nothing else that is large; it may differ by attention's backward formula.
        h, i, v, B, S, L = 64, 172, 257, 2, 32, 2
        matmul_params = L * (h * h + 2 * h * (h // 2) + h * h + 3 * h * i) + v * h
        expected = 6 * B * S * matmul_params + 3 * L * 4 * B * S * S * h
        assert all(r["model_flops"] == pytest.approx(expected, rel=0.1) for r in records), \
            (records[0]["model_flops"], expected)
        assert all(r["mfu"] is None for r in records)  # CPU: no peak to compare with
        assert re.search(r"^autosp plan: predicted peak [\d.]+ (?:[KMG]iB|B) per rank at S = 32", proc.stdout, re.M), output
        assert re.search(r"^peak memory: measured .* autosp plan predicted", proc.stdout, re.M), output
    # The effective config, saved beside the metrics, is what ran: the flags included.
    saved = load(str(out / "config.toml"))
    assert saved.training.steps == 3 and saved.parallel.sp == 2 and saved.training.check


def test_relaunch_arguments_reach_the_ranks_intact() -> None:
    from torch.distributed.run import get_args_parser

    args_list = ["train", "--nproc", "4", "--sp", "2", "--seq-len", "64", "--steps", "2",
                 "--remat", "none", "--seed", "3", "--lr", "1e-3", "--layers", "1", "--check"]
    cmd = cli.torchrun_command(4, args_list)
    assert cmd[:3] == [sys.executable, "-m", "autosp.torchrun"]  # torchrun's own arguments
    parsed = get_args_parser().parse_args(cmd[3:])
    assert parsed.nproc_per_node == "4"
    assert parsed.module and parsed.training_script == "autosp.cli"
    expected = [a for a in args_list if a not in ("--nproc", "4")]
    assert parsed.training_script_args == expected
    # What the ranks receive parses to the same training options.
    ours = cli._build_parser().parse_args(args_list)
    theirs = cli._build_parser().parse_args(parsed.training_script_args)
    nproc = "override:parallel.nproc"
    assert {k: v for k, v in vars(theirs).items() if k != nproc} == {
        k: v for k, v in vars(ours).items() if k != nproc
    }
    assert vars(ours)[nproc] == 4 and nproc not in vars(theirs)


def test_the_ranks_record_the_nproc_torchrun_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by breaker helper-59: the ranks never see the launcher's ``--nproc``, so a run
    with ``--nproc 4`` saved ``nproc = 2`` (the default) in its config.toml, and whoever rebuilt
    the run from it got the wrong data-parallel size. A rank records torchrun's
    LOCAL_WORLD_SIZE."""
    args_list = ["train", "--nproc", "4", "--sp", "2"]
    theirs = cli._build_parser().parse_args(cli.rank_arguments(args_list))
    cfg = cli.train_config.load(theirs.config, cli.train_config.overrides_of(theirs))
    assert cfg.parallel.nproc == 2  # what the ranks parse: the default
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    ran = cli.ranks_config(cfg)
    assert ran.parallel.nproc == 4 and ran.parallel.sp == 2 and cfg.parallel.nproc == 2
    assert "nproc = 4" in cli.train_config.to_toml(ran)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cli.ranks_config(cfg) is cfg  # not under torchrun: as given


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
