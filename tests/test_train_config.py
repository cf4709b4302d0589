"""``autosp train``'s configuration, schedule, metrics and model loading, in one process
(the multi-rank runs are in test_cli.py)."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any
from pathlib import Path

import pytest
import torch

from autosp import cli
from autosp.train import config as C
from autosp.train.metrics import FIELDS, MetricsLog
from autosp.train.model import build_model
from autosp.train.schedule import lr_factor, warmup_cosine


def _parse(argv: list[str]) -> C.TrainConfig:
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    a = p.parse_args(argv)
    return C.load(a.config, C.overrides_of(a))


def test_file_then_flags_dotted_and_flat(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[training]\nseq_len = 1024\nlr = 1\nsteps = 7\n[parallel]\nsp = 4\nfsdp = true\n')
    cfg = _parse(["--config", str(f), "--training.seq_len", "131072", "--steps", "9",
                  "--fsdp", "false", "--check"])
    assert cfg.training.seq_len == 131072          # the flag overrides the file
    assert cfg.training.steps == 9                 # flat flag
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)  # TOML int for a float
    assert cfg.parallel.sp == 4                    # from the file
    assert cfg.parallel.fsdp is False and cfg.training.check is True
    assert cfg.model == C.ModelConfig()            # untouched: defaults
    assert cfg.training.offload is False           # default
    assert _parse(["--offload"]).training.offload is True
    assert _parse(["--offload-optimizer"]).training.offload_optimizer is True
    with pytest.raises(C.ConfigError, match=r"found training.offload_optimizer with parallel.fsdp"):
        _parse(["--offload-optimizer", "--fsdp"])


def test_regions_take_autosp_compiles_modes_by_name(tmp_path: Path) -> None:
    """training.regions names autosp.compile's regions modes; its default is autosp.compile's;
    TOML's booleans name False and True."""
    assert C.load(None).training.regions == "compile"
    assert C.REGION_MODES == {"false": False, "compile": "compile", "true": True}
    import inspect
    import autosp
    assert C.REGION_MODES[C.TrainConfig().training.regions] == \
        inspect.signature(autosp.compile).parameters["regions"].default
    f = tmp_path / "run.toml"
    for toml, name in (("true", "true"), ("false", "false"), ('"compile"', "compile")):
        f.write_text(f"[training]\nregions = {toml}\n")
        assert C.load(str(f)).training.regions == name
        assert C.load(C.save(C.load(str(f)), str(tmp_path / name))).training.regions == name
    assert _parse(["--regions", "false"]).training.regions == "false"
    assert _parse(["--training.regions", "true"]).training.regions == "true"
    # A boolean's spellings, as when the field was a bool; the flag alone is "true".
    for text, name in (("on", "true"), ("1", "true"), ("No", "false"), ("COMPILE", "compile")):
        assert _parse(["--regions", text]).training.regions == name, text
    assert _parse(["--regions"]).training.regions == "true"
    with pytest.raises(SystemExit):  # argparse names the choices
        _parse(["--regions", "flat"])


def test_saved_config_reloads_equal(tmp_path: Path) -> None:
    cfg = _parse(["--seq-len", "64", "--hf-config", 'a "quoted" \\ path', "--dtype", "bfloat16"])
    path = C.save(cfg, str(tmp_path / "out"))
    assert C.load(path) == cfg


@pytest.mark.parametrize("text, key, expected", [
    ("[trainig]\nsteps = 1\n", "[trainig]", "expected one of the tables"),
    ("[training]\nstep = 1\n", "training.step", "no such key"),
    ("[training]\nsteps = 1.5\n", "training.steps", "expected int"),
    ("[training]\nsteps = true\n", "training.steps", "expected int"),
    ("[training]\nremat = \"fast\"\n", "training.remat", "expected one of"),
    ("[training]\nregions = \"flat\"\n", "training.regions", "expected one of ['false', 'compile', 'true']"),
    ("[training]\nregions = 1\n", "training.regions", "expected str"),
    ("[training\n", "not valid TOML", ""),
])
def test_config_errors_name_the_key(tmp_path: Path, text: str, key: str, expected: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(C.ConfigError) as info:
        C.load(str(f))
    assert key in str(info.value) and expected in str(info.value), str(info.value)


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: a value of the wrong type for a flag
        cli.main(["train", "--training.seq_len", "long"])


def test_warmup_cosine() -> None:
    steps, warmup, floor = 10, 3, 0.1
    f = [lr_factor(t, steps, warmup, floor) for t in range(steps)]
    assert f[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert f[3] == pytest.approx(1.0) and f[-1] == pytest.approx(floor)
    assert all(a >= b for a, b in zip(f[3:], f[4:]))  # decreasing after warmup
    assert f[6] == pytest.approx(floor + (1 - floor) * 0.5)  # the midpoint of the cosine
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = warmup_cosine(opt, steps=steps, warmup_steps=warmup, min_lr_ratio=floor)
    seen = []
    for _ in range(steps):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * x for x in f])


def test_metrics_log_writes_every_field(tmp_path: Path) -> None:
    log = MetricsLog(str(tmp_path), tensorboard=True)
    rec = {k: 1.0 for k in FIELDS} | {"step": 0}
    log.write(rec)
    with pytest.raises(AssertionError, match="grad_norm"):
        log.write({k: v for k, v in rec.items() if k != "grad_norm"})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [rec]


def test_hf_config_model_is_seeded(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2).save_pretrained(tmp_path)
    cfg = C.ModelConfig(hf_config=str(tmp_path / "config.json"))
    a, vocab = build_model(cfg, seed=3)
    b, _ = build_model(cfg, seed=3)
    assert vocab == 96
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    ids = torch.randint(0, vocab, (2, 8))
    loss = a(ids, ids)
    assert loss.dim() == 0 and math.isfinite(loss.item())


def _gemma2_config(folder: Path) -> str:
    """A tiny Gemma 2: logit soft-capping, for which transformers refuses SDPA attention."""
    from transformers import AutoConfig

    AutoConfig.for_model("gemma2", vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, sliding_window=8).save_pretrained(folder)
    return str(folder / "config.json")


def test_a_model_that_refuses_sdpa_runs_its_eager_attention(tmp_path: Path) -> None:
    """Gemma 2 made transformers raise its own ValueError on every rank ("does not support an
    attention implementation through torch.nn.functional.scaled_dot_product_attention");
    autosp shards eager attention alike, so such a model now builds with it, and the run's
    header says so. A model with SDPA keeps it."""
    from autosp.train.model import attention_note

    model, _ = build_model(C.ModelConfig(hf_config=_gemma2_config(tmp_path)), seed=0)
    assert model.model.config._attn_implementation == "eager"
    assert "eager attention (Gemma2ForCausalLM refuses SDPA" in attention_note(model)
    ids = torch.randint(0, 96, (2, 8))
    assert math.isfinite(model(ids, ids).item())
    (tmp_path / "qwen2").mkdir()
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2).save_pretrained(tmp_path / "qwen2")
    model, _ = build_model(C.ModelConfig(hf_config=str(tmp_path / "qwen2")), seed=0)
    assert model.model.config._attn_implementation == "sdpa" and attention_note(model) == ""


def test_an_sdpa_refusal_the_class_flag_did_not_foresee_builds_eager_alike(tmp_path: Path, monkeypatch: Any) -> None:
    """build_model asks the class's ``_supports_sdpa`` flag up front. Where the flag allows
    SDPA but the load refuses it (a sub-model's class), the model builds with eager attention
    (the same weights as built so at once); where eager fails too, the SDPA load's error
    stands: no exception text is matched."""
    import transformers

    from autosp.train import model as train_model
    from autosp.train.model import attention_note

    folder = _gemma2_config(tmp_path)
    direct, _ = build_model(C.ModelConfig(hf_config=folder), seed=0)
    monkeypatch.setattr(train_model, "_supports_sdpa", lambda config: True)
    fallback, _ = build_model(C.ModelConfig(hf_config=folder), seed=0)
    assert fallback.model.config._attn_implementation == "eager"
    assert "eager attention (Gemma2ForCausalLM refuses SDPA" in attention_note(fallback)
    assert all(torch.equal(x, y) for x, y in zip(direct.parameters(), fallback.parameters()))

    def refuse(config: Any, **kwargs: Any) -> Any:
        raise ValueError(f"refused {config._attn_implementation}")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    with pytest.raises(ValueError, match="refused sdpa"):
        build_model(C.ModelConfig(hf_config=folder), seed=0)


def _hf(model_type: str, **kw: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from autosp.train.model import HFCausalLM

    torch.manual_seed(0)
    return HFCausalLM(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)))


def test_position_table_size_is_found_by_probing() -> None:
    """GPT-2's learned positions fail past n_positions, so packed documents restart there;
    rotary positions go on past max_position_embeddings (long documents keep theirs)."""
    from autosp.train.model import position_table_size

    gpt2 = _hf("gpt2", vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    qwen2 = _hf("qwen2", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    opt = _hf("opt", vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
              num_attention_heads=4, max_position_embeddings=16, word_embed_proj_dim=32)
    preset, _ = build_model(C.ModelConfig(), seed=0)
    assert position_table_size(gpt2) == 16
    assert position_table_size(opt) == 16  # its table holds 16 + 2 rows: OPT adds 2
    assert position_table_size(qwen2) is None
    assert position_table_size(preset) is None


def test_the_packed_document_probe_runs_the_model_in_eval_mode() -> None:
    """A model with dropout that keeps attention within documents is accepted: the probe's two
    losses differed by dropout alone (5.488328 against 5.473866 for GPT-NeoX with
    hidden_dropout 0.1: refused, found by breaker helper-88). Every module's mode comes back."""
    from autosp.train.model import check_attends_within_documents

    neox = _hf("gpt_neox", vocab_size=96, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.5)
    neox.train()
    neox.model.gpt_neox.layers[1].eval()  # a mixed model keeps its mix
    modes = [m.training for m in neox.modules()]
    check_attends_within_documents(neox, 96)
    assert [m.training for m in neox.modules()] == modes


def test_train_a_model_with_a_position_table(tmp_path: Path) -> None:
    """GPT-2 with 32 positions: on packed documents (each longer than 32 tokens) positions
    restart at 32 and the run passes --check at sp 2, where it stopped at its second step with
    a traceback on each rank. With synthetic data at S 64 (positions 0-63, no position_ids) the
    run stops at its first step with autosp's index check, its message alone on each rank
    (each printed PyTorch's RuntimeError and its traceback before)."""
    import subprocess

    from transformers import AutoConfig

    from test_train_faults import ENV, _autosp_command

    AutoConfig.for_model("gpt2", vocab_size=260, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                         ).save_pretrained(tmp_path / "gpt2")
    args = ["--nproc", "2", "--sp", "2", "--batch-size", "1", "--backend", "aot_eager",
            "--predict", "false", "--hf-config", str(tmp_path / "gpt2")]
    docs = subprocess.run([*_autosp_command(), "train", *args, "--seq-len", "32", "--steps", "3",
                           "--source", "sample", "--check", "--out-dir", str(tmp_path / "docs")],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert docs.returncode == 0, docs.stdout[-3000:] + docs.stderr[-3000:]
    assert re.search(r"^check: first-step loss .*: OK$", docs.stdout, re.M), docs.stdout
    steps = (tmp_path / "docs" / "metrics.jsonl").read_text().splitlines()
    assert sum('"step"' in x for x in steps) >= 3, steps
    synthetic = subprocess.run([*_autosp_command(), "train", *args, "--seq-len", "64", "--steps",
                                "1", "--out-dir", str(tmp_path / "synthetic")],
                               capture_output=True, text=True, timeout=600, env=ENV)
    assert synthetic.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"^autosp train: rank {rank}: \[autosp:inputs\] .*found an index outside "
                         r"\[0, 32\)", synthetic.stderr, re.M), synthetic.stderr[-3000:]
    # no rank's traceback (torchrun's own report of a failed rank, ChildFailedError, stays)
    assert "RuntimeError" not in synthetic.stderr and "loop.py" not in synthetic.stderr, \
        synthetic.stderr[-3000:]


def test_train_a_model_that_refuses_sdpa_exactly(tmp_path: Path) -> None:
    """``autosp train`` of the tiny Gemma 2 (soft-capped logits, sliding and global layers) at
    sp 2 passes --check: its first step's loss and gradient norm equal one device's."""
    import subprocess

    from test_train_faults import ENV, _autosp_command

    args = ["--nproc", "2", "--sp", "2", "--seq-len", "32", "--batch-size", "2", "--backend",
            "aot_eager", "--predict", "false"]
    proc = subprocess.run([*_autosp_command(), "train", *args, "--steps", "1", "--check",
                           "--hf-config", _gemma2_config(tmp_path), "--out-dir",
                           str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "eager attention (Gemma2ForCausalLM refuses SDPA" in proc.stdout, proc.stdout
    assert re.search(r"^check: first-step loss .*: OK$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^check: first-step gradient norm .*: OK$", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("kw, found", [
    (dict(hf_config="/nonexistent"), "found no config.json"),
    (dict(hf_config="/a", hf_checkpoint="/b"), "found both"),
])
def test_model_errors(kw: dict, found: str) -> None:
    import autosp

    with pytest.raises(autosp.AutospError, match=found):
        build_model(C.ModelConfig(**kw), seed=0)


def test_hf_checkpoint_loads_its_weights(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(7)
    saved = AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path)
    model, vocab = build_model(C.ModelConfig(hf_checkpoint=str(tmp_path)), seed=0)
    assert vocab == 96
    ours = dict(model.model.named_parameters())
    assert ours.keys() == dict(saved.named_parameters()).keys()
    assert all(torch.equal(ours[k], p) for k, p in saved.named_parameters())


def test_peak_tflops() -> None:
    from autosp.train.metrics import peak_tflops

    assert peak_tflops(torch.device("cpu"), 0.0) is None
    assert peak_tflops(torch.device("cpu"), 123.0) == 123.0


@pytest.mark.parametrize("override, found", [
    ((("training", "grad_accum"), 0), "training.grad_accum: found 0; expected a value >= 1"),
    ((("training", "min_lr_ratio"), -1.0), "between 0 and 1"),
    ((("training", "lr"), -1.0), "training.lr: found -1.0; expected a value > 0"),
    ((("parallel", "timeout_s"), 0.0), "parallel.timeout_s"),
    ((("metrics", "log_every"), 0), "metrics.log_every"),
    ((("training", "batch_size"), 0), "training.batch_size"),
    ((("model", "heads"), 3), "heads dividing hidden_size"),
])
def test_values_out_of_range_are_refused(override: tuple, found: str) -> None:
    with pytest.raises(C.ConfigError, match=found.replace("(", r"\(")):
        C.load(None, {override[0]: override[1]})


def test_config_errors_for_tables_and_unicode(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text("training = 3\n")
    with pytest.raises(C.ConfigError, match=r"found training = 3; expected a table \[training\]"):
        C.load(str(f))
    cfg = C.load(None, {("metrics", "out_dir"): "runs/\U0001f600 ünï"})
    assert C.load(C.save(cfg, str(tmp_path / "o"))) == cfg


def test_resumed_metrics_drop_the_steps_run_again(tmp_path: Path) -> None:
    rec = {k: 1.0 for k in FIELDS}
    log = MetricsLog(str(tmp_path), tensorboard=False)
    for step in range(5):
        log.write(rec | {"step": step})
    log.close()
    log = MetricsLog(str(tmp_path), tensorboard=False, start=3)  # resumed from step-3
    log.write(rec | {"step": 3})
    log.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


@pytest.mark.slow  # the cheapest fit and its errors: test_remat_auto.py (default), and
# TrainConfig's remat = "auto" path: test_remat_auto_gives_the_tiled_loss_the_fewest_chunks_that_fit
def test_remat_auto_picks_the_cheapest_combination_that_fits() -> None:
    """``training.remat = "auto"``: autosp plan's cheapest combination (least recomputation
    and host-link time) whose predicted peak fits ``memory_gib``. With room to spare nothing
    is recomputed; squeezed, it takes techniques that recompute (and fits); with too little
    room, and on a CPU without a budget, an AutospError says why."""
    from autosp.errors import AutospError
    from autosp.train.predict import choose_strategy

    def cfg_with(memory_gib: float) -> C.TrainConfig:
        cfg = C.TrainConfig()
        cfg.training.remat, cfg.training.memory_gib, cfg.training.seq_len = "auto", memory_gib, 65536
        cfg.training.batch_size = 1
        return cfg

    cpu = torch.device("cpu")
    roomy = cfg_with(64.0)
    line = choose_strategy(roomy, 2, 2, 256, cpu)
    assert line.startswith("autosp plan: remat auto chose ulysses + ") and "+0% predicted" in line
    assert not (roomy.training.tile_mlp or roomy.training.offload)
    def peak(line: str) -> float:  # GiB, as printed (to 0.01 of its unit)
        from autosp.plan_inputs import parse_bytes

        return parse_bytes(line.split("predicted peak ")[1].split(" of ")[0]) / (1 << 30)

    roomy_peak = peak(line)
    tight = cfg_with(0.6 * roomy_peak)
    line = choose_strategy(tight, 2, 2, 256, cpu)
    t = tight.training
    assert (t.remat, t.tile_mlp, t.offload) != (roomy.training.remat, roomy.training.tile_mlp,
                                                  roomy.training.offload), line
    assert peak(line) <= 0.6 * roomy_peak + 0.01, line  # both printed to 0.01
    with pytest.raises(AutospError, match=r"remat = 'auto': found no combination .* predicted to "
                                          r"fit [\d.]+ MiB per rank at S = 65536 with [\d.]+ GiB of host memory "
                                          r"per rank \(the lowest: "):
        choose_strategy(cfg_with(0.001), 2, 2, 256, cpu)
    with pytest.raises(AutospError, match=r"training.memory_gib = 0 on a CPU; expected the memory"):
        choose_strategy(cfg_with(0.0), 2, 2, 256, cpu)
    # The host bounds offload: with (almost) none, auto picks among strategies that offload
    # nothing, under the same device budget.
    offload_free = cfg_with(0.6 * roomy_peak)
    offload_free.training.host_memory_gib = 1e-6
    line = choose_strategy(offload_free, 2, 2, 256, cpu)
    assert not (offload_free.training.offload or offload_free.training.offload_all), line
    assert "0 B on the host of 1.05 KiB" in line, line  # 1e-6 GiB


def test_remat_auto_gives_the_tiled_loss_the_fewest_chunks_that_fit() -> None:
    """Fewer loss chunks read lm_head's weight fewer times, so with a memory budget the fastest
    tiled loss is the one with the fewest chunks that fit (``fewest_loss_chunks``, the core's
    bisection over ``MemoryOptions.loss_chunks``). Tiny Llama, vocabulary 32,000 (rule:
    ceil(32000 / 64) = 500 chunks), S = 65,536 over 2 ranks: with a budget halfway between
    the peaks at 1 chunk and at 500, the plan's fewest fit and one fewer does not; ``remat =
    "auto"`` picks a tiled loss there and trains with that many chunks. The fewest are those
    whose predicted peak stays under 90% of the budget (LOSS_CHUNKS_HEADROOM)."""
    import autosp
    from autosp.errors import AutospError
    from autosp.plan_result import LOSS_CHUNKS_HEADROOM
    from autosp.train.predict import choose_strategy, planner_model, predicted_peak

    cfg = C.TrainConfig()
    cfg.training.remat, cfg.training.seq_len, cfg.training.batch_size = "auto", 65536, 1
    vocab, gib = 32000, 1 << 30

    def plan(name: str, budget: int, chunks: int = 0) -> Any:
        return autosp.plan(planner_model(cfg, vocab), gpus=2, sp=2, dtype="fp32", batch_size=1,
                           optimizer_sharding="none", seq_len=65536, gpu_memory=budget,
                           strategies=[name], seq_multiple=65536, max_seq=65536,
                           curve_points=2, loss_chunks=chunks).strategies[0]

    name = "ulysses+sequence-aware+tiled-loss"
    roomy = plan(name, 1 << 40)
    assert (roomy.loss_chunks, roomy.fit_loss_chunks) == (500, 1)
    one, rule = plan(name, 1 << 40, 1).at_seq.peak, roomy.at_seq.peak
    assert one > rule + 100 * (1 << 20)  # one chunk holds [32768, 32000] fp32 logits and more
    budget = (one + rule) // 2
    fit = plan(name, budget).fit_loss_chunks
    assert 1 < fit < 500
    # The fewest chunks whose predicted peak keeps LOSS_CHUNKS_HEADROOM of the budget (the
    # predictions are within 10%): one fewer does not.
    edge = int(budget * LOSS_CHUNKS_HEADROOM)
    assert plan(name, budget, fit).at_seq.peak <= edge < plan(name, budget, fit - 1).at_seq.peak
    # Nothing fits under the headroom: 0.
    assert plan(name, int(rule / LOSS_CHUNKS_HEADROOM) - 1).fit_loss_chunks == 0

    cfg.training.memory_gib = budget / gib
    line = choose_strategy(cfg, 2, 2, vocab, torch.device("cpu"))
    t = cfg.training
    chosen = ("ulysses+" + t.remat + ("+tiled-loss" if t.tile_loss else "")
              + ("+tiled-mlp" if t.tile_mlp else "")
              + ("+offload-all" if t.offload_all else "+offload" if t.offload else ""))
    assert t.tile_loss, line  # below the peak of one chunk: an untiled loss does not fit
    expect = plan(chosen, int(t.memory_gib * gib)).fit_loss_chunks
    assert t.loss_chunks == expect > 0, (line, chosen)
    assert f"with {expect} loss chunks, the fewest predicted to fit" in line
    assert predicted_peak(cfg, 2, 2, vocab)[0] <= budget  # what trains is what was planned

    # Chunks the user set are planned with, also when auto turns the tiled loss on (a breaker
    # found auto planning with the default chunks and training with the user's 1).
    cfg = C.TrainConfig()
    t = cfg.training
    t.remat, t.seq_len, t.batch_size, t.memory_gib = "auto", 65536, 1, budget / gib
    t.tile_loss, t.loss_chunks = False, 1
    try:
        line = choose_strategy(cfg, 2, 2, vocab, torch.device("cpu"))
    except AutospError as e:
        assert "found no combination" in str(e)
    else:
        assert t.loss_chunks == 1
        assert predicted_peak(cfg, 2, 2, vocab)[0] <= budget, line


def test_loss_chunks_settings_are_checked() -> None:
    from autosp.errors import AutospError

    base = {("training", "tile_loss"): False, ("training", "loss_chunks"): 3}
    with pytest.raises(AutospError, match=r"training.loss_chunks = 3 with training.tile_loss = "
                                          r"false; expected tile_loss true"):
        C.load(None, base)
    assert C.load(None, {**base, ("training", "remat"): "auto"}).training.loss_chunks == 3
    with pytest.raises(AutospError, match=r"training.loss_chunks: found 2147483648; expected a "
                                          r"value between 0 and 2147483647"):
        C.load(None, {("training", "loss_chunks"): 2**31})
    import autosp

    with pytest.raises(AutospError, match=r"\[plan\] found loss_chunks=7 and no strategy with "
                                          r"the tiled loss"):
        autosp.plan("llama-3.2-1b", strategies=["ulysses+default"], loss_chunks=7)
    with pytest.raises(AutospError, match=r"\[plan\] found loss_chunks=2147483648; expected"):
        autosp.plan("llama-3.2-1b", loss_chunks=2**31)


def test_check_compares_the_first_steps_gradient_too(capsys: pytest.CaptureFixture[str]) -> None:
    """--check compares the norm of the first step's gradient with one device's (dp 2, two
    micro-batches each, weighted by their targets as the step weighs them): a step whose loss is
    right but whose gradient is 1% off fails. (With regions=True and Inductor's buffer reuse,
    the loss was exact and the gradient norm 0.4% off; only this catches it.)"""
    from autosp.train import loop
    from autosp.train.config import TrainConfig
    from autosp.train.data import Batches

    cfg = TrainConfig()
    cfg.data.source = "sample"
    cfg.training.seq_len, cfg.training.batch_size, cfg.training.grad_accum = 32, 2, 2
    batches = Batches(cfg.data, 32, 2, 2, 2, cfg.training.seed)
    assert loop._check_first_step(cfg, batches, 0.0, None, 2) == 1  # a wrong loss alone
    out = capsys.readouterr().out
    loss = float(re.search(r"single-device (\S+)", out).group(1))
    assert loop._check_first_step(cfg, batches, loss, 1.0, 2) == 1
    out = capsys.readouterr().out
    norm = float(re.search(r"gradient norm sp \S+ single-device (\S+)", out).group(1))
    assert "first-step loss" in out and ": OK" in out.splitlines()[0], out
    assert loop._check_first_step(cfg, batches, loss, norm, 2) == 0
    assert loop._check_first_step(cfg, batches, loss, norm * 1.01, 2) == 1
    assert "gradient norm" in capsys.readouterr().out


def test_regions_line_says_what_the_outline_did() -> None:
    """The trainer's line after its first step, from ``last_compile.outlined``: layers calling
    shared subgraphs, those inline with the first one's reason, a whole-graph reason as it
    is, nothing without regions."""
    from autosp.train.metrics import regions_line

    assert regions_line(None) is None and regions_line([]) is None
    assert regions_line(["no layer outlined: remat=Offload(...) offloads"]) == \
        "regions: no layer outlined: remat=Offload(...) offloads"
    lines = ["model.layers.0: calls autosp_region_0", "model.layers.1: calls autosp_region_0",
             "model.layers.2: calls autosp_region_1_r10 (sequence-aware admits 1 of its 2 "
             "matmuls, chosen over every layer)", "model.layers.3: calls autosp_region_1_r10",
             "model.layers.4: not outlined: it writes in place",
             "model.layers.5: not outlined: no other layer is alike"]
    assert regions_line(lines) == (
        "regions: 4 of 6 layers call 2 shared compiled subgraphs; 2 stay inline "
        "(first: model.layers.4: not outlined: it writes in place)")
