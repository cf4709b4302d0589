"""The tiled loss (``autosp.compile(..., tile_loss=True)``, autosp.tiled_loss): cross-entropy
over lm_head computed a chunk of tokens at a time is exact, on one rank and on two.

Each model of tests/loss_heads.py (and the reference Llama) runs two steps with different
batches against the same model on one device: the loss within 1e-5 and every gradient
max|g - g_ref| / max|g_ref| <= 1e-4 (fp32); returned logits equal one device's. Chunks of 5
rows (``AUTOSP_LOSS_TILE_ROWS``) over 16 or 32 rows per rank, so that there are several
chunks and a ragged last one. ``loss_tiling`` must say which losses were tiled.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from typing import Any, Iterator
from unittest import mock

import pytest
import torch

import loss_heads
from distributed import assert_grads_close, grads_of, make_batch, run_ranks, tiny_config

SEQ = 16
TILE_ROWS = "5"


@contextlib.contextmanager
def _rank0_of_2(tile_rows: str | None) -> Iterator[Any]:
    """This process as rank 0 of 2 against a fake process group (collectives allocate, do not
    communicate: the memory is real), with AUTOSP_LOSS_TILE_ROWS set to ``tile_rows``; yields
    the mesh."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    if tile_rows:
        os.environ["AUTOSP_LOSS_TILE_ROWS"] = tile_rows
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield autosp.init_mesh(2)
    finally:
        os.environ.pop("AUTOSP_LOSS_TILE_ROWS", None)
        dist.destroy_process_group()


def _step(model: torch.nn.Module, fn: Any, ids: torch.Tensor, labels: torch.Tensor,
          scale: float = 1.0) -> tuple:
    """One step; the loss's gradient is ``scale`` (the tiled loss computes its gradients in the
    forward for a gradient of 1 and scales them in the backward: a step with another gradient
    checks that scaling)."""
    model.zero_grad(set_to_none=True)
    out = fn(ids, labels)
    logits, loss = out if isinstance(out, tuple) else (None, out)
    (loss * scale).backward() if scale != 1.0 else loss.backward()
    return loss.item(), grads_of(model), None if logits is None else logits.detach()


def _worker(rank: int, world: int, names: list[str], llama: bool) -> list[dict[str, Any]]:
    import autosp
    from autosp.models.llama import LlamaForCausalLM

    os.environ["AUTOSP_LOSS_TILE_ROWS"] = TILE_ROWS
    mesh = autosp.init_mesh(world)
    builds = [(m.name, m.build) for m in loss_heads.MODELS + loss_heads.REGRESSIONS
              if m.name in names]
    if llama:
        def build_llama() -> torch.nn.Module:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return LlamaForCausalLM(tiny_config(4, 2, vocab_size=loss_heads.VOCAB))
        builds.append(("llama", build_llama))
    out = []
    for name, build in builds:
        torch._dynamo.reset()
        model = build()
        ref = copy.deepcopy(model)
        compiled = autosp.compile(model, mesh=mesh, remat="none", backend="aot_eager",
                                  tile_loss=True)
        for seed, scale in ((1, 1.0), (2, 0.37)):
            ids, labels = make_batch(loss_heads.VOCAB, 2, SEQ, seed)
            loss, grads, logits = _step(model, compiled, ids, labels, scale)
            ref_loss, ref_grads, ref_logits = _step(ref, ref, ids, labels, scale)
            out.append({"model": name, "loss": loss, "ref_loss": ref_loss, "grads": grads,
                        "ref_grads": ref_grads, "logits": logits, "ref_logits": ref_logits,
                        "tiling": compiled.loss_tiling,
                        "graph": str(compiled.last_compile.graph_module.code)})
    return out


def _check(results: list[list[dict[str, Any]]], tiled: dict[str, bool | tuple[str, ...]]) -> None:
    """Every step exact; ``tiled[model]``: True (its one loss tiled), or per loss in order
    loss_heads.TILED or what its "not tiled" reason says."""
    for rank, per_rank in enumerate(results):
        assert {r["model"] for r in per_rank} == set(tiled)
        for r in per_rank:
            where = f"{r['model']} (rank {rank})"
            assert abs(r["loss"] - r["ref_loss"]) <= 1e-5, (where, r["loss"], r["ref_loss"])
            assert_grads_close(r["grads"], r["ref_grads"], rtol=1e-4, context=where)
            if r["ref_logits"] is not None:
                torch.testing.assert_close(r["logits"], r["ref_logits"], rtol=1e-5, atol=1e-5)
            lines = r["tiling"]
            expect = tiled[r["model"]]
            if isinstance(expect, tuple):
                assert len(lines) == len(expect), (where, lines)
                for line, e in zip(lines, expect):
                    ok = line.startswith(e) if e == loss_heads.TILED else (
                        line.startswith("not tiled: cross_entropy") and e in line)
                    assert ok, (where, e, line)
                continue
            assert len(lines) == 1, (where, lines)
            assert expect, where
            assert lines[0].startswith("tiled: cross_entropy"), (where, lines)
            assert "autosp.tiled_head_loss" in r["graph"], where


TILED = {m.name: m.tiled for m in loss_heads.MODELS}


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_tiled_loss_is_exact(world: int) -> None:
    # + 3-D class-probability targets, not tiled: an internal error at world 2 once.
    soft3d = {"soft-targets-3d": REGRESSIONS["soft-targets-3d"]}
    results = run_ranks(world, _worker, list(TILED) + list(soft3d), True)
    _check(results, {**TILED, **soft3d, "llama": True})


REGRESSIONS = {m.name: m.expect or m.tiled for m in loss_heads.REGRESSIONS}


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_forms_that_must_not_be_tiled_are_refused_and_exact(world: int) -> None:
    """A breaker's findings, each silently wrong (or a raw error) once: a write into the
    logits through a view, the projection under torch.no_grad or .detach(), under autocast,
    class-probability targets (whose untiled mean was also wrong; 3-D ones were an internal
    error at world 2), a scalar computed in the
    graph; and the deprecated reduce=False (planned as a mean once, untiled too), tiled."""
    # At world 2 the autocast model's lm_head gradient differs from one device's by bf16
    # rounding (2.7e-3, untiled too: each rank rounds its partial sum to bf16): checked at
    # world 1 only, where it is exact.
    cases = {k: v for k, v in REGRESSIONS.items() if world == 1 or k != "autocast-head"}
    results = run_ranks(world, _worker, list(cases), False)
    _check(results, cases)


def test_returned_logits_are_said_to_be_made_once_more() -> None:
    results = run_ranks(1, _worker, ["nanogpt-returns-logits"], False)
    assert "also read elsewhere" in results[0][0]["tiling"][0]


def _hf_worker(rank: int, world: int, vocab: int) -> list[dict[str, Any]]:
    import transformers

    import autosp

    os.environ["AUTOSP_LOSS_TILE_ROWS"] = TILE_ROWS
    mesh = autosp.init_mesh(world)
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config).train()
    ref = copy.deepcopy(model)
    compiled = autosp.compile(model, mesh=mesh, remat="none", backend="aot_eager", tile_loss=True,
                              outputs="local")
    out = []
    for seed in (1, 2):
        ids, labels = make_batch(vocab, 2, SEQ, seed)
        model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=labels).loss
        loss.backward()
        ref.zero_grad(set_to_none=True)
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        out.append({"model": "hf-qwen2", "loss": loss.item(), "ref_loss": ref_loss.item(),
                    "grads": grads_of(model), "ref_grads": grads_of(ref), "logits": None,
                    "ref_logits": None, "tiling": compiled.loss_tiling,
                    "graph": str(compiled.last_compile.graph_module.code)})
    return out


def test_hf_qwen2_with_a_32k_vocabulary() -> None:
    """Hugging Face's loss (logits.float(), view, cross_entropy) over a 32k vocabulary, the
    logits also returned (with outputs="local", this rank's chunk): tiled, exact at world 2."""
    results = run_ranks(2, _hf_worker, 32000)
    _check(results, {"hf-qwen2": True})
    assert "also read elsewhere" in results[0][0]["tiling"][0]


def test_tiling_removes_the_logits_from_the_measured_peak() -> None:
    """Rank 0 of 2 against a fake process group (collectives allocate, do not communicate),
    the reference Llama with an 8k vocabulary at S = 2048: a real training step's saved bytes
    and peak (autosp.measure), untiled and tiled. The untiled forward saves this rank's fp32
    logits' log-softmax ([1024, 8192]: 32 MiB) and its peak holds them about twice; tiled, the
    saved bytes drop by at least those 32 MiB and the peak by at least 1.5 times that."""
    import autosp
    from autosp import measure, tiled_loss_ops
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    seq, vocab = 2048, 8192
    logits_bytes = seq // 2 * vocab * 4
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=172, num_layers=1,
                      num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    measured = {}
    with _rank0_of_2("128") as mesh:
        for tile in (False, True):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
            compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", tile_loss=tile)
            with mock.patch.object(tiled_loss_ops, "_chunk_grads",
                                   side_effect=tiled_loss_ops._chunk_grads) as chunk_passes:
                measured[tile] = measure.train_step_memory(model, compiled, ids, ids)
            # Tiled: one pass over the chunks per step (the forward's, two steps); the
            # partitioner does not run it again in the backward.
            assert chunk_passes.call_count == (2 if tile else 0)
    print(f"untiled {measured[False]}, tiled {measured[True]}")
    # Tiled, the forward computes the gradients and saves them for the backward instead of h:
    # the weight's in fp32 ([vocab, 64]) and h's ([1024, 64]).
    grads_bytes = (vocab + seq // 2) * cfg.hidden_size * 4
    assert measured[False].saved_bytes - measured[True].saved_bytes >= logits_bytes - grads_bytes
    assert measured[False].peak_bytes - measured[True].peak_bytes >= 1.5 * logits_bytes


# Slow: the default suite checks the planner's prediction of a tiled-loss step in
# tests/test_tiled_mlp.py (the tiled MLP with sequence-aware remat and the tiled loss).
@pytest.mark.slow
@pytest.mark.parametrize("rows,recompute,chunks", [
    (None, False, (None, 4)), ("128", True, (None,))],
    ids=["default-and-4-chunks-grads-in-forward", "128-row-chunks-recomputing"])
def test_planner_predicts_the_tiled_peak(rows: str | None, recompute: bool,
                                         chunks: tuple) -> None:
    """``autosp plan``'s memory model on the tiled loss (its ops' workspace from
    autosp.tiled_loss.workspace) against a real step on rank 0 of 2 (fake process group):
    saved bytes exact, the peak within 10%, tiled and untiled: the default chunks (64) and 4
    chunks (``autosp.compile(loss_chunks=4)`` against ``MemoryOptions.loss_chunks``) with the
    gradients computed in the forward, and 128 rows per chunk with the recomputing backward
    (AUTOSP_LOSS_RECOMPUTE=1). Its recomputed FLOPs: none with the gradients in the forward,
    the logits' forward once more with the recomputing backward.

    The step runs in a fresh process: in the whole suite's process the same tiled step once
    measured a peak of 11.8 MB where a fresh process measures 13.9 MB (saved bytes equal);
    not explained yet (see the closing note of 2026-12-02)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = pool.submit(_predict_and_measure_tiled, rows, recompute, chunks).result(timeout=600)
    for tile, predicted_saved, measured_saved, predicted_peak, measured_peak, flops, logits_flops in results:
        print(f"tile_loss={tile}: predicted {predicted_peak}, measured {measured_peak}")
        assert predicted_saved == measured_saved
        assert abs(predicted_peak - measured_peak) <= 0.10 * measured_peak
        # The recomputing backward recomputes this rank's logits: 2 * rows * hidden * vocab.
        assert flops == pytest.approx(logits_flops if tile and recompute else 0, rel=1e-9)


def _predict_and_measure_tiled(rows: str | None, recompute: bool, chunks: tuple) -> list[tuple]:
    import autosp
    from autosp import _core, measure, planner
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM
    from autosp.plan_trace import trace_step

    seq, vocab = 1024, 4096
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=172, num_layers=1,
                      num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    out = []
    os.environ["AUTOSP_LOSS_RECOMPUTE"] = "1" if recompute else ""
    with _rank0_of_2(rows) as mesh:
        for tile, n in [(False, None)] + [(True, n) for n in chunks]:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
            compiled = autosp.compile(model, mesh=mesh, remat="sequence-aware",
                                      backend="aot_eager", tile_loss=tile, loss_chunks=n)
            measured = measure.train_step_memory(model, compiled, ids, ids)
            traced = trace_step(cfg, sp_size=2, dtype="fp32", batch_size=2, tile_loss=tile)
            predicted = _core.simulate_peak_memory(
                traced.graph, seq,
                planner.core_plan_options("sequence-aware", "fp32", traced.num_params, 1,
                                      loss_chunks=n or 0))
            none = _core.simulate_peak_memory(
                traced.graph, seq, planner.core_plan_options("none", "fp32", traced.num_params, 1))
            out.append((tile, predicted.saved_bytes, measured.saved_bytes, predicted.peak,
                        measured.peak_bytes, none.recompute_flops,
                        2 * (2 * seq // 2) * cfg.hidden_size * vocab))
    return out


def _chunks_worker(rank: int, world: int) -> list[dict[str, Any]]:
    """The reference Llama with ``loss_chunks=3`` and with the default chunks (no
    AUTOSP_LOSS_TILE_ROWS): two steps each against one device, and the chunks each pass ran."""
    import autosp
    from autosp import tiled_loss_ops
    from autosp.models.llama import LlamaForCausalLM

    mesh = autosp.init_mesh(world)
    out = []
    for chunks in (3, None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config(4, 2, vocab_size=loss_heads.VOCAB, hidden_size=32))
        ref = copy.deepcopy(model)
        compiled = autosp.compile(model, mesh=mesh, remat="none", backend="aot_eager",
                                  tile_loss=True, loss_chunks=chunks)
        ran: list[int] = []

        def counting(*args: Any) -> list[tuple[int, int]]:
            spans = tiled_loss._chunks(*args)
            ran.append(len(spans))
            return spans

        from autosp import tiled_loss

        with mock.patch.object(tiled_loss_ops, "_chunks", side_effect=counting):
            for seed, scale in ((1, 1.0), (2, 0.37)):
                ids, labels = make_batch(loss_heads.VOCAB, 2, SEQ, seed)
                loss, grads, _ = _step(model, compiled, ids, labels, scale)
                ref_loss, ref_grads, _ = _step(ref, ref, ids, labels, scale)
                out.append({"chunks": chunks, "loss": loss, "ref_loss": ref_loss, "grads": grads,
                            "ref_grads": ref_grads, "ran": list(ran)})
                ran.clear()
    return out


def test_loss_chunks_sets_the_chunks_and_stays_exact() -> None:
    """``autosp.compile(tile_loss=True, loss_chunks=3)`` at world 2: each step's one pass over
    this rank's 16 rows (batch 2 x 8 tokens) runs 3 chunks (6, 6 and 4 rows), and the default
    runs ceil(vocab / hidden) = ceil(97 / 32) = 4; both exact against one device (loss 1e-5,
    gradients 1e-4), with a loss gradient of 1 and of 0.37."""
    results = run_ranks(2, _chunks_worker)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            where = f"loss_chunks={r['chunks']} (rank {rank})"
            assert r["ran"] == [3 if r["chunks"] == 3 else 4], (where, r["ran"])
            assert abs(r["loss"] - r["ref_loss"]) <= 1e-5, (where, r["loss"], r["ref_loss"])
            assert_grads_close(r["grads"], r["ref_grads"], rtol=1e-4, context=where)


def test_bad_loss_chunks_are_clear_errors() -> None:
    import autosp

    mesh = mock.Mock()
    for chunks, tile, found in ((0, True, "found loss_chunks=0; expected a positive int"),
                                (2.5, True, "found loss_chunks=2.5; expected a positive int"),
                                (True, True, "found loss_chunks=True; expected a positive int"),
                                (2**31, True, "found loss_chunks=2147483648; expected a positive "
                                              "int up to 2147483647"),
                                (4, False, "found loss_chunks=4 with tile_loss=False; expected "
                                           "tile_loss=True")):
        with pytest.raises(autosp.AutospError, match=re.escape("[autosp:compile] " + found)):
            autosp.compile(torch.nn.Linear(2, 2), mesh=mesh, tile_loss=tile, loss_chunks=chunks)
        with pytest.raises(autosp.AutospError, match=re.escape("[autosp:compile] " + found)):
            autosp.backend(mesh, tile_loss=tile, loss_chunks=chunks)


def _errors_worker(rank: int, world: int) -> list[str]:
    import autosp

    mesh = autosp.init_mesh(world)
    found = []
    ids, labels = make_batch(loss_heads.VOCAB, 2, SEQ, 1)

    def sym_ignore(m: Any, h: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            m.lm_head(h).view(-1, loss_heads.VOCAB), lab.reshape(-1), ignore_index=-lab.size(1) - 1000)

    cases = [("abc", loss_heads.view_float, True), ("0", loss_heads.view_float, True),
             ("", sym_ignore, False)]
    for rows, loss, tile in cases:
        os.environ["AUTOSP_LOSS_TILE_ROWS"] = rows
        torch._dynamo.reset()
        model = loss_heads.LossModel("x", loss, tiled=True).build()
        compiled = autosp.compile(model, mesh=mesh, remat="none", backend="aot_eager",
                                  tile_loss=tile)
        try:
            compiled(ids, labels)
            found.append("no error")
        except autosp.AutospError as e:
            found.append(str(e))
    return found


def test_bad_chunk_setting_and_a_computed_ignore_index_are_clear_errors() -> None:
    found = run_ranks(1, _errors_worker)[0]
    assert "found AUTOSP_LOSS_TILE_ROWS='abc'; expected a positive integer" in found[0]
    assert "found AUTOSP_LOSS_TILE_ROWS='0'; expected a positive integer" in found[1]
    assert "[autosp:ulysses] op 'cross_entropy'" in found[2]
    assert "found an ignore_index computed in the graph" in found[2]


def _all_ignored_worker(rank: int, world: int) -> list[tuple[str, bool, float, float]]:
    import autosp

    os.environ["AUTOSP_LOSS_TILE_ROWS"] = TILE_ROWS
    mesh = autosp.init_mesh(world)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 16)
            self.fc = torch.nn.Linear(16, 16)
            self.lm_head = torch.nn.Linear(16, 50)

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits = self.lm_head(torch.tanh(self.fc(self.embed(ids))))
            return torch.nn.functional.cross_entropy(logits.view(-1, 50), labels.view(-1))

    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    compiled = autosp.compile(model, mesh=mesh, remat="none", backend="aot_eager", tile_loss=True)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    # A batch with targets, then one whose targets are all ignored, accumulated.
    for labels in (ids.roll(1, 1), torch.full_like(ids, -100)):
        compiled(ids, labels).backward()
        ref(ids, labels).backward()
    return [(n, bool(p.grad.isfinite().all()), float((p.grad - q.grad).abs().max()),
             float(q.grad.abs().max()))
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())]


def test_a_mean_over_no_valid_target_gives_the_eager_gradients() -> None:
    """A breaker's finding: a mean loss whose targets are all ignored is nan, and the untiled
    backward gives zero gradients (it never multiplies the ignored rows by the inf gradient of
    the mean). The gradients computed in the forward once were scaled by that inf: nan in every
    parameter, through the whole model, and into a gradient accumulated over micro-batches."""
    for name, finite, diff, scale in run_ranks(1, _all_ignored_worker)[0]:
        assert finite, name
        assert diff <= 1e-4 * max(scale, 1e-6), (name, diff, scale)
