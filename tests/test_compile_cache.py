"""PyTorch's compile caches take autosp's graphs (autosp.compile_cache, issue 12).

- In one process, against a fake process group: the graph each rank runs, for every
  hand-written style, passes AOTAutograd's own cacheability check. An SP function missing
  from the marked set, or an inserted node a method is called on without an example value,
  would make AOTAutograd bypass its cache silently (only a log line says so).
- At world 2 with Inductor: a second set of processes with the same model, length and cache
  directory takes the compiled graphs from AOTAutograd's cache (counted, not timed), is as
  exact as the first against one device (at another length; with the tiled loss, whose recipe the cached code
  looks up by key), and still gets the remat report (MFU reads it).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import styles
from autosp import _core
from autosp.apply import RankContext, apply_plan
from autosp.bridge import fx_to_core
from autosp.compile_cache import graph_functions, load_reports, marked_cacheable, report_key, save_reports, source_hash
from autosp.decompose import decompose_composites
from autosp.plan_trace import _fake_sp_group
from distributed import assert_step_exact, build_model, make_batch, run_ranks, step_against_reference, tiny_config


class _Done(Exception):
    """Raised by the test backend once the applied graph is checked: nothing compiles."""


def _rank0_of_2(gm: Any, example_inputs: list[Any]) -> Any:
    """The graph rank 0 of an SP group of 2 runs for Dynamo's ``gm`` (a fake group)."""
    bridge = fx_to_core(gm, list(example_inputs), 1)
    cfg = _core.SpConfig()
    cfg.sp_size = 2
    cfg.gather_unsupported = True
    plan = _core.plan_ulysses(bridge.graph, cfg)
    return apply_plan(gm, bridge, plan, RankContext(rank=0, world=2, group=_fake_sp_group(2)))


def _applied_graph_cacheable(style: styles.Style, seq_len: int = 16) -> None:
    from torch._functorch._aot_autograd.autograd_cache import check_cacheable
    from torch._inductor import config as inductor_config

    torch.manual_seed(0)
    model = style.build()
    args = style.inputs(0, seq_len)
    for t in args:
        if t.dim() >= 2 and t.shape[1] == seq_len:
            torch._dynamo.mark_dynamic(t, 1)

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        decompose_composites(gm)
        applied = _rank0_of_2(gm, example_inputs)
        with inductor_config.patch(unsafe_marked_cacheable_functions=marked_cacheable(), fx_graph_cache=True):
            check_cacheable(applied)  # raises BypassAOTAutogradCache with the reason
        raise _Done()

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failed:
        torch.compile(model, backend=backend, fullgraph=True)(*args)
    if not isinstance(getattr(failed.value, "inner_exception", None), _Done):
        raise failed.value


# Styles whose graphs hold what the apply stage inserts: slices, gradient syncs, all-to-alls,
# gathers, shifts, scans, halos, token-local routing, index checks, tiled masks, dropout.
CACHE_STYLES = ["nanogpt", "llama-scratch-complex-rope", "shift-inside", "bert-masked-mean-ce",
                "cumsum-mixer", "moe-index-add-aux", "flex-doc-mask", "nanogpt-attention-by-hand",
                "padded-causal-4d-mask", "mamba2-chunked-ssd-hybrid", "causal-conv1d-mixer",
                "nn-transformer-encoder", "packed-docs-llama"]


@pytest.mark.parametrize("name", CACHE_STYLES)
def test_applied_graph_passes_aot_autograds_cacheability_check(name: str) -> None:
    styles.allow_flex_backward_on_cpu()
    _applied_graph_cacheable(styles.ALL[name])


_SHIFTED_MODEL = """
import torch
import torch.nn.functional as F


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 32)

    def forward(self, ids, labels):
        h = self.emb(ids).relu()
        return F.cross_entropy(self.proj(h).flatten(0, 1), labels.flatten())
"""


def _applied(path: Any) -> Any:
    """The graph rank 0 of 2 runs for the model in ``path`` (its code and report key)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"shifted_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 32, (2, 16)), torch.randint(0, 32, (2, 16))
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(labels, 1)
    got = []

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        got.append(_rank0_of_2(gm, example_inputs))
        raise _Done()

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failed:
        torch.compile(module.Model(), backend=backend, fullgraph=True)(ids, labels)
    if not isinstance(getattr(failed.value, "inner_exception", None), _Done):
        raise failed.value
    return got[0]


def test_a_line_added_above_the_model_keeps_its_graph_and_report_key(tmp_path: Any) -> None:
    """Found by breaker helper-58: the index check's message held the user's line number, a
    constant of the graph, so a line added anywhere above the model (a comment, an import)
    made every compile miss AOTAutograd's cache, where plain torch.compile hits (measured
    with Inductor: `autograd_cache_miss` against `autograd_cache_hit`). The applied graph of
    two copies of a model, one with three lines more above it, must be the same code (its
    constants with it), and its report keyed alike."""
    graphs = []
    for name, padding in (("a", ""), ("b", "# one\n# two\n\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shifted_model.py").write_text(padding + _SHIFTED_MODEL)
        graphs.append(_applied(tmp_path / name / "shifted_model.py"))
    a, b = graphs
    assert a.code == b.code, "the applied graphs of the same model differ"
    assert "shifted_model.py, `h = self.emb(ids).relu()`" in a.code  # the check names the line
    assert report_key(a, "p") == report_key(b, "p")


def test_source_hash_is_taken_at_import_not_read_from_disk_at_the_first_compile() -> None:
    """Found by a breaker (silent): the hash was read from disk at the first compile, so a
    process that had loaded older code wrote its graphs under the newer code's key, and a later
    process with the newer code loaded them (gradients 3x off with a bug in the old code's
    backward). After ``import autosp`` the hash must not read any file."""
    import subprocess
    import sys

    code = ("import autosp\n"
            "from pathlib import Path\n"
            "def boom(self): raise AssertionError(f'read {self} after import')\n"
            "Path.read_bytes = boom\n"
            "from autosp.compile_cache import source_hash, marked_cacheable\n"
            "print(source_hash(), len(marked_cacheable()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == source_hash()


def test_marked_functions_are_the_collectives_keyed_by_the_source_hash() -> None:
    marked = marked_cacheable()
    names = {f"{fn.__module__}.{fn.__name__}" for fn in graph_functions()}
    assert {"autosp.chunks.local_chunk", "autosp.chunks.sharded_dropout", "autosp.collectives.all_to_all",
            "autosp.collectives.grad_sync", "autosp.collectives.check_index"} <= names
    assert all(marked[n] == source_hash() for n in names)
    assert not any(n.split(".")[-1].startswith("_") for n in names)


def test_report_round_trips_and_a_missing_one_is_none(tmp_path: Any, monkeypatch: Any) -> None:
    from autosp.remat_policy import GraphRematReport, LayerRemat, NodeRemat

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    g = GraphRematReport(policy="sequence-aware", saved_bytes=10, none_saved_bytes=20, budget_bytes=None,
                         recompute_flops=1.5, attention_flops=2.0, admitted_matmuls=1, solve_seconds=0.1,
                         flow_vertices=3, flow_edges=4, layers=(LayerRemat("layers.0", 1, 10, 2, 5, 1.5),),
                         nodes=(NodeRemat("mm", "aten.mm", "layers.0", "saved", 10, 1.0, ""),), model_flops=7.0)
    assert load_reports("k" * 64) is None
    save_reports("k" * 64, [g])
    assert load_reports("k" * 64) == [g]
    (tmp_path / "autosp_remat_reports" / f"{'k' * 64}.json").write_text("{not json")
    assert load_reports("k" * 64) is None  # a damaged file means: compile again
    (tmp_path / "autosp_remat_reports" / f"{'k' * 64}.json").write_text("[]")
    assert load_reports("k" * 64) is None  # a partition reports at least one graph
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert report_key(gm, "a") != report_key(gm, "b")


def test_report_key_tells_apart_the_static_lengths_a_graph_is_compiled_for() -> None:
    """Found by a breaker: a static compile hands AOTAutograd static inputs for a graph whose
    placeholders keep Dynamo's symbolic values; keyed by the placeholders, the report of S = 64
    was read back for S = 32 (a 2.4x wrong model_flops, so MFU) when the graph takes no integer
    input. A graph compiled for static sizes is keyed by the inputs AOTAutograd is handed."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    from autosp.compile_cache import STATIC_INPUTS

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dyn = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    traced = mode.from_tensor(torch.zeros(32, 2), symbolic_context=dyn)
    gm.graph.find_nodes(op="placeholder")[0].meta["example_value"] = traced
    short, long = [torch.zeros(32, 2)], [torch.zeros(64, 2)]
    # Compiled with the length dynamic: one key for every length (the traced, symbolic sizes).
    assert report_key(gm, "a", short) == report_key(gm, "a", long) == report_key(gm, "a")
    gm.meta[STATIC_INPUTS] = True  # a copy compiled for static sizes (autosp.specialize)
    assert report_key(gm, "a", short) != report_key(gm, "a", long)
    assert report_key(gm, "a", short) == report_key(gm, "a", [torch.ones(32, 2)])


def _report_step(training: bool) -> tuple[Any, float]:
    from autosp import remat
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_layers=1, num_heads=4, num_kv_heads=2))
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    torch._dynamo.mark_dynamic(ids, 1)
    report = remat.RematReport()
    compiled = torch.compile(model, backend=remat.backend(backend="inductor", report=report), fullgraph=True)
    with torch.set_grad_enabled(training):
        loss = compiled(ids, ids)
        if training:
            loss.backward()
    return report, loss.item()


@pytest.mark.slow  # 26 s; the second-process hit test stays in the default suite
def test_reports_on_hits_evaluation_and_a_missing_file(tmp_path: Any, monkeypatch: Any) -> None:
    """Found by a breaker: a hit whose saved report was gone, and a no_grad call, each compiled
    the graph a second time (an internal error); an evaluation process took a training
    report from the cache."""
    import warnings

    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    report, loss = _report_step(training=True)  # cold: partitioned, report saved
    assert len(report.graphs) == 1
    evaluation, eval_loss = _report_step(training=False)  # an inference graph: no partition
    assert evaluation.graphs == [] and eval_loss == loss
    counters.clear()
    warm, warm_loss = _report_step(training=True)  # a hit: the report read back
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert warm.graphs == report.graphs and warm_loss == loss
    for f in (tmp_path / "autosp_remat_reports").iterdir():
        f.unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gone, gone_loss = _report_step(training=True)  # a hit, its report removed
    assert gone.graphs == [] and gone_loss == loss
    assert any("remat report" in str(w.message) for w in caught)


def test_a_static_compile_marks_the_graph_it_compiles_for_its_report_key() -> None:
    """What keys a static compile's report by its sizes (test_report_key_tells_apart_...):
    autosp.specialize marks each copy it compiles, and not the graph it copies."""
    from autosp.compile_cache import STATIC_INPUTS
    from autosp.specialize import PerShapeCompiled

    template = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    seen = []

    def compile_fn(gm: Any, inputs: list) -> Any:
        seen.append((gm.meta.get(STATIC_INPUTS), [tuple(x.shape) for x in inputs],
                     report_key(gm, "a", inputs)))
        return gm

    compiled = PerShapeCompiled(template, compile_fn)
    compiled(torch.zeros(3, 2))
    compiled(torch.zeros(5, 2))
    assert [(m, shapes) for m, shapes, _ in seen] == [(True, [(3, 2)]), (True, [(5, 2)])]
    assert seen[0][2] != seen[1][2]
    assert not template.meta.get(STATIC_INPUTS)


def cached_step(rank: int, world: int, cache_dir: str, seq_len: int,
                dynamic: bool | None = None) -> dict[str, Any]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from torch._dynamo.utils import counters

    import autosp
    from autosp.remat import RematReport

    mesh = autosp.init_mesh(world)
    cfg = tiny_config(num_layers=1)
    model = build_model(cfg)
    ids, labels = make_batch(cfg.vocab_size, 2, seq_len)
    report = RematReport()
    compiled = autosp.compile(model, mesh=mesh, backend="inductor", remat_report=report, tile_loss=True,
                              tile_mlp=True, dynamic=dynamic)
    counters.clear()
    result = step_against_reference(model, compiled, ids, labels)
    result["aot"] = dict(counters["aot_autograd"])
    result["report"] = [(g.saved_bytes, g.model_flops) for g in report.graphs]
    result["tiling"] = list(compiled.loss_tiling) + list(compiled.mlp_tiling)
    result["waited"] = __import__("autosp.shared_compile").shared_compile.LAST_WAIT[0]
    return result


@pytest.mark.parametrize("dynamic,second_len", [
    (None, 48),
    # 28 s more; the dynamic graph's hit across lengths (a step of the trainer compiles static)
    pytest.param(True, 96, marks=pytest.mark.slow)])
def test_second_process_hits_aot_autograds_cache_and_stays_exact(
        tmp_path: Any, dynamic: bool | None, second_len: int) -> None:
    """The default (dynamic=None: a first length compiles with static sizes) in a second process
    with the same length hits AOTAutograd's cache, and reads the report of the compilation
    that made the entry. With dynamic=True the second process runs another length: the graph
    was compiled with the length symbolic, so it hits too. The tiled loss and MLP are on:
    their recipes' keys, arguments of the graph, must be the same in every process (a breaker
    found the MLP's held the address of F.silu once)."""
    cache = str(tmp_path / "inductor-cache")
    first = run_ranks(3, cached_step, cache, 48, dynamic, timeout=600)
    second = run_ranks(3, cached_step, cache, second_len, dynamic, timeout=600)
    # In the first process, with static sizes, ranks 0 and 1 run one graph (the rank is a
    # symbolic input): one compiles it and the other waits and loads it. Rank 2, the last of
    # the group, compiles its own at once (autosp.shared_compile). With dynamic=True each
    # rank's graph holds its rank: every rank compiles.
    counts = [(c["aot"].get("autograd_cache_miss", 0), c["aot"].get("autograd_cache_hit", 0))
              for c in first]
    if dynamic is None:
        assert sorted(counts[:2]) == [(0, 1), (1, 0)] and counts[2] == (1, 0), counts
        assert max(c["waited"] for c in first[:2]) > 1.0, [c["waited"] for c in first]
    else:
        assert counts == [(1, 0)] * 3, counts
    for rank in range(3):
        cold, warm = first[rank], second[rank]
        assert not cold["aot"].get("autograd_cache_bypass"), cold["aot"]
        assert warm["aot"].get("autograd_cache_hit", 0) == 1, warm["aot"]
        assert not warm["aot"].get("autograd_cache_miss") and not warm["aot"].get("autograd_cache_bypass")
        assert_step_exact(cold, f"rank {rank}, first process")
        assert_step_exact(warm, f"rank {rank}, second process (cache hit)")
        assert cold["report"] and warm["report"] == cold["report"], "the report is read back on a hit"
        assert len(warm["tiling"]) == 2 and all(t.startswith("tiled") for t in warm["tiling"]), warm["tiling"]


def _fx_cache_counts(monkeypatch: Any, source: str) -> dict[str, int]:
    """One training step through compile_joint with AOTAutograd's cache off, so that Inductor
    looks up the forward's and the backward's FX graphs; its FX graph cache counters."""
    from torch._dynamo.utils import counters

    from autosp import compile_cache

    from autosp import remat
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(compile_cache, "source_hash", lambda: source)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_layers=1, num_heads=4, num_kv_heads=2))
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    # Static sizes, as autosp compiles by default: AOTAutograd compiles the backward at the
    # first backward, outside compile_joint's call.
    compiled = torch.compile(model, backend=remat.backend(backend="inductor"), fullgraph=True,
                             dynamic=False)
    counters.clear()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled(ids, ids).backward()
    return {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}


@pytest.mark.slow  # about 40 s on 2 cores
def test_inductor_graph_cache_keys_change_with_autosps_code(tmp_path: Any,
                                                            monkeypatch: Any) -> None:
    """How autosp has Inductor compile a graph (buffer reuse, donation) is not in Inductor's FX
    graph cache key; autosp's source hash is put in (compile_fx's config_patches, which reach
    the backward's compile too), so code compiled by another autosp is never served. Found: the
    fix of a wrong gradient (regions and donated buffers) still failed against a cache filled
    before it, which served the old backward."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cold = _fx_cache_counts(monkeypatch, "a" * 64)
    same = _fx_cache_counts(monkeypatch, "a" * 64)
    other = _fx_cache_counts(monkeypatch, "b" * 64)
    assert cold.get("fxgraph_cache_miss", 0) >= 2 and not cold.get("fxgraph_cache_hit"), cold
    assert same.get("fxgraph_cache_hit", 0) == cold["fxgraph_cache_miss"], (cold, same)
    assert other.get("fxgraph_cache_miss", 0) == cold["fxgraph_cache_miss"], (cold, other)
    assert not other.get("fxgraph_cache_hit"), other
