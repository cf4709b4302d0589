"""``autosp.compile(..., dynamic=False)`` (autosp.specialize): planned once on the symbolic
trace, compiled per input shape with static sizes; ``dynamic=None`` (the default): static for the
first length, one symbolic graph from the second on.

Checked by counting, not timing: AOTAutograd gets each call's real tensors (concrete sizes, no
SymInt anywhere) once per distinct shape, a repeated shape compiles nothing, Dynamo captures
once, and every step is exact against one device (loss 1e-5, gradients 1e-4) at world 2.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from distributed import (assert_step_exact, build_model, make_batch, run_ranks,
                         step_against_reference, tiny_config)

VOCAB = 128


def _symbolic(x: Any) -> bool:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(x, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride()))
    return False


def _worker(rank: int, world: int, backend: str, dynamic: bool | None,
            regions: bool = False) -> dict[str, Any]:
    import sys

    import autosp
    from autosp.apply import RANK_INPUT

    sp_backend = sys.modules["autosp.backend"]  # the module (autosp.backend is also a function)

    mesh = autosp.init_mesh(world)
    torch._dynamo.reset()
    model = build_model(tiny_config(4, 2, vocab_size=VOCAB))
    # With regions, remat "default": under sequence-aware these two layers' admissions differ,
    # so each stays inline (autosp.remat_regions; tests/test_outline_remat.py).
    compiled = autosp.compile(model, mesh=mesh, backend=backend, dynamic=dynamic, tile_loss=True,
                              regions=regions, remat="default" if regions else "sequence-aware")
    compiles: list[bool] = []  # per compile of AOTAutograd: whether anything was symbolic
    real = sp_backend.compile_graph

    def counting(gm: Any, inputs: list[Any], **kw: Any) -> Any:
        out = real(gm, inputs, **kw)
        # AOTAutograd makes an integer input a symbol of the shape env: a static compile
        # must leave none there (autosp.specialize bakes the integers into the graph).
        # The one symbol a static compile keeps is the rank, its last input
        # (autosp.shared_compile), which must stay symbolic.
        shape_env = torch._guards.TracingContext.get().fake_mode.shape_env
        takes_rank = [n.name for n in gm.graph.nodes if n.op == "placeholder"][-1] == RANK_INPUT
        assert takes_rank == (dynamic is False) or dynamic is None, (dynamic, takes_rank)
        if takes_rank:
            rank = inputs[-1]
            assert isinstance(rank, torch.SymInt) and not rank.node.is_constant(), inputs
            inputs = inputs[:-1]
        others = set(shape_env.var_to_val) - ({rank.node.expr} if takes_rank else set())
        compiles.append(any(_symbolic(x) for x in inputs) or bool(others))
        return out

    results = []
    with mock.patch.object(sp_backend, "compile_graph", side_effect=counting):
        for seq, seed in ((16, 1), (32, 2), (16, 3), (32, 4)):
            ids, labels = make_batch(VOCAB, 2, seq, seed)
            results.append((seq, step_against_reference(model, compiled, ids, labels),
                            list(compiles)))
    per_shape = compiled.last_compile.per_shape
    return {"results": results, "dynamo_graphs": len(compiled.sp_backend.records),
            "shapes": None if per_shape is None else len(per_shape.shapes),
            "outlined": compiled.last_compile.outlined}


# Flat (regions=False) with -m slow: the automatic test below compiles the same static first
# length flat and checks it exact.
@pytest.mark.parametrize("backend,regions", [
    pytest.param("aot_eager", False, marks=pytest.mark.slow), ("aot_eager", True),
    pytest.param("inductor", False, marks=pytest.mark.slow),
    pytest.param("inductor", True, marks=pytest.mark.slow)])
def test_static_per_shape_is_exact_and_compiles_once_per_length(backend: str,
                                                                 regions: bool) -> None:
    for rank, out in enumerate(run_ranks(2, _worker, backend, False, regions)):
        if regions:  # both layers call one subgraph, compiled with every size static
            assert sum("calls autosp_layer_0" in line for line in out["outlined"]) == 2, out

        for seq, result, compiles in out["results"]:
            assert_step_exact(result, f"dynamic=False, S {seq}, rank {rank}")
        # One Dynamo capture (the length symbolic); AOTAutograd twice, each static: at the
        # first call with S 16 and with S 32; the repeats compile nothing.
        assert out["dynamo_graphs"] == 1, out
        assert [c for _, _, c in out["results"]] == [[False], [False, False], [False, False],
                                                       [False, False]]
        assert out["shapes"] == 2


@pytest.mark.slow  # the automatic test below compiles the same symbolic graph from its second length
def test_dynamic_compiles_one_symbolic_graph_for_every_length() -> None:
    """dynamic=True, for contrast: AOTAutograd compiles once, at Dynamo's compile, with
    symbolic sizes, and that graph runs both lengths exactly."""
    for rank, out in enumerate(run_ranks(2, _worker, "aot_eager", True)):
        for seq, result, compiles in out["results"]:
            assert_step_exact(result, f"dynamic=True, S {seq}, rank {rank}")
            assert compiles == [True], (seq, compiles)
        assert out["shapes"] is None


def test_automatic_compiles_the_first_length_static_then_one_graph_for_every_length() -> None:
    """autosp.compile's default, dynamic=None, as torch.compile's: the first length (16) with
    static sizes; the first call with a second length (32) has Dynamo capture again and
    AOTAutograd compile once with symbolic sizes; the later calls (16, 32) compile nothing.
    Every step exact."""
    for rank, out in enumerate(run_ranks(2, _worker, "aot_eager", None)):
        for seq, result, _ in out["results"]:
            assert_step_exact(result, f"dynamic=None, S {seq}, rank {rank}")
        assert [c for _, _, c in out["results"]] == [[False], [False, True], [False, True],
                                                       [False, True]], out["results"]
        assert out["dynamo_graphs"] == 2 and out["shapes"] is None, out


class _BranchOnLength(torch.nn.Module):
    """A Python branch on S (tests/test_breakers.py "size-python-branch"): a graph traced at
    S > 20 guards on it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h * 2 if ids.shape[1] > 20 else h * 3
        logits = self.head(h.cumsum(1))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 labels[:, 1:].reshape(-1))


_TAPS = [0]  # calls of the op below (in the rank's process)
_HELPER = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)


@torch.library.custom_op("autosp_tests::tap", mutates_args=())
def _tap(x: torch.Tensor) -> torch.Tensor:
    """The identity, through a torch.compile'd function of the user's."""
    _TAPS[0] += 1
    return (_HELPER(x) - 1) / 2


_tap.register_fake(lambda x: torch.empty_like(x))
_tap.register_autograd(lambda ctx, grad: grad)


class _Tapped(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tap(self.inner(x))


class _ReadsMode(torch.nn.Module):
    """A model whose forward reads an int attribute (Dynamo guards on its value)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.mode = 0

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.inner(ids, labels) * (1.0 + 0.1 * self.mode)


def _freeze(*names: str) -> Any:
    return lambda m: [p.requires_grad_(False) for n, p in m.named_parameters()
                      if n.startswith(names)]


def _automatic_worker(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """Dynamo graphs after each call of the runs ``names`` with dynamic=None (breaker
    helper-61 and later), each after a reset of Dynamo."""
    import autosp

    mesh = autosp.init_mesh(world)
    out: dict[str, Any] = {}

    def run(name: str, model: torch.nn.Module, calls: list[tuple[int, int]],
            before: dict[int, Any] | None = None) -> None:
        compiled = autosp.compile(model, mesh=mesh, backend="aot_eager")
        graphs, results = [], []
        for i, (batch, seq) in enumerate(calls):
            if before and i in before:
                before[i](model)
            if seq >= 8:
                ids, labels = make_batch(VOCAB, batch, seq, i)
            else:  # (make_batch puts ignored labels in longer batches)
                ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(i))
                labels = ids.clone()
            results.append(step_against_reference(model, compiled, ids, labels))
            graphs.append(len(compiled.sp_backend.records))
        out[name] = (graphs, results)

    def limit() -> None:
        # Three batch sizes at two lengths under a recompile limit of 4: the static graphs of
        # the first length stay in Dynamo's cache, and the limit is raised by as many. A fourth
        # batch size, first at the first length, then at the second: one graph (the symbolic
        # one's), not one for each (breaker helper-62).
        with torch._dynamo.config.patch(recompile_limit=4):
            # (one layer: what is counted is Dynamo's graphs, not the layers')
            run("limit", build_model(tiny_config(4, 2, vocab_size=VOCAB, num_layers=1)),
                [(b, s) for s in (16, 32) for b in (1, 2, 3)] + [(4, 16), (4, 32)])

    def branch() -> None:
        # Back to the first length after the switch: its static graph serves it, as
        # torch.compile's does (the symbolic graph traced at 32 guards S > 20).
        torch.manual_seed(0)
        run("branch", _BranchOnLength(), [(2, 16), (2, 32), (2, 48), (2, 16)])

    def one_token() -> None:
        # A second length of one token per rank compiles static: a symbolic graph traced there
        # would be specialised on a chunk of size 1. The switch then comes at a new length
        # (32), not back at the first (helper-62).
        run("one token", build_model(tiny_config(4, 2, vocab_size=VOCAB)),
            [(2, 16), (2, world), (2, 16), (2, 32), (2, 16)])

    def frozen() -> None:
        # Parameters frozen after the switch (gradual unfreezing, in reverse): Dynamo guards on
        # requires_grad. A call from before the switch with other parameters frozen takes the
        # symbolic graph, which the next new length reuses: one graph per change, as with
        # dynamic=True, not one in each torch.compile (breaker helper-63: the recompile limit
        # reached at the fourth change).
        run("frozen", build_model(tiny_config(4, 2, vocab_size=VOCAB)),
            [(2, 16), (2, 32), (2, 16), (2, 48), (2, 16), (2, 64), (2, 32)],
            before={2: _freeze("lm_head"), 4: _freeze("norm")})

    def full() -> None:
        # Parameters frozen after the switch, compiled at a new length, then a call at the
        # first length, under a recompile limit that the graphs of both compiles fill: the
        # symbolic graph serves it, as with dynamic=True (breaker helper-67: the static compile
        # hit the limit before its backend could refuse, and the call raised
        # [autosp:recompile] for good).
        with torch._dynamo.config.patch(recompile_limit=2):
            run("full", build_model(tiny_config(4, 2, vocab_size=VOCAB)),
                [(2, 16), (2, 32), (2, 32), (2, 16), (2, 16)], before={2: _freeze("lm_head")})

    def mode() -> None:
        # A value the model reads changing after the switch (a step counter): Dynamo guards on
        # it, the call's record does not hold it. The static compile refuses the call and it
        # takes the symbolic graph, so the recompile limit (3, raised by the one static graph)
        # stops it at the same change as dynamic=True's (breaker helper-66: graphs in the
        # static compile raised the limit in turn, without end).
        flagged = _ReadsMode(build_model(tiny_config(4, 2, vocab_size=VOCAB)))
        compiled = autosp.compile(flagged, mesh=mesh, backend="aot_eager")
        graphs: list[Any] = []
        results = []
        with torch._dynamo.config.patch(recompile_limit=3):
            for step, seq in enumerate([16, 32, 16, 16, 16, 16]):
                flagged.mode = max(0, step - 1)
                ids, labels = make_batch(VOCAB, 2, seq, step)
                try:
                    results.append(step_against_reference(flagged, compiled, ids, labels))
                except autosp.AutospError as e:
                    graphs.append(str(e)[:18])
                    break
                graphs.append(len(compiled.sp_backend.records))
        out["mode"] = (graphs, results)

    def tapped() -> None:
        # A torch.compile'd function of the user's inside an opaque op, run by the static graph
        # after the switch: it compiles as it would anywhere, and every call runs the op once
        # (breaker helper-65: a stance set around the static graph refused its compile, and the
        # step ran again through the other graph).
        model = build_model(tiny_config(4, 2, vocab_size=VOCAB))
        model.norm = _Tapped(model.norm)
        taps = []

        def count(m: Any) -> None:
            taps.append(_TAPS[0])
            _TAPS[0] = 0

        _TAPS[0] = 0
        run("tapped", model, [(2, 16), (2, 32), (2, 16), (2, 16)],
            before={1: count, 2: count, 3: count})
        count(model)
        out["taps"] = taps

    scenarios = {"limit": limit, "branch": branch, "one token": one_token, "frozen": frozen,
                 "full": full, "mode": mode, "tapped": tapped}
    for name in names:
        torch._dynamo.reset()
        scenarios[name]()
    return out


# What each run's Dynamo graph count is after each call (the last run also counts its taps).
_AUTOMATIC = {
    "limit": [1, 2, 3, 4, 5, 6, 7, 7],
    "branch": [1, 2, 2, 2],
    "one token": [1, 1, 1, 2, 2],
    "frozen": [1, 2, 3, 3, 4, 4, 4],
    "full": [1, 2, 3, 3, 3],
    "mode": [1, 2, 3, 4, "[autosp:recompile]"],  # the reference model's step and the compiled one
    "tapped": [1, 2, 2, 2],
}


@pytest.mark.parametrize("names", [
    ["limit", "branch"],
    pytest.param(["mode", "one token", "frozen", "full", "tapped"], marks=pytest.mark.slow),
], ids=["limit-branch", "more"])
def test_automatic_keeps_the_static_graphs_and_the_recompile_limit(names: list[str]) -> None:
    for rank, out in enumerate(run_ranks(2, _automatic_worker, names)):
        taps = out.pop("taps", None)
        assert sorted(out) == sorted(names), sorted(out)
        for name, (graphs, results) in out.items():
            for i, result in enumerate(results):
                assert_step_exact(result, f"{name}, call {i}, rank {rank}")
            assert graphs == _AUTOMATIC[name], (name, graphs)
        if "tapped" in names:
            assert taps == [2, 2, 2, 2], taps


def test_a_bad_dynamic_is_refused() -> None:
    import autosp

    with pytest.raises(autosp.AutospError,
                       match=r"found dynamic='auto'; expected True, False or None \(automatic\)"):
        autosp.compile(torch.nn.Linear(2, 2), mesh=None, dynamic="auto")  # type: ignore[arg-type]


def _cold_then_warm() -> list[dict[str, int]]:
    """Rank 0 of 2 against a fake process group, Inductor: the same model compiled with
    dynamic=False twice with one fresh cache directory, Dynamo reset in between (what a
    second process finds); AOTAutograd's cache counters of each."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autosp-static-cache-")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = autosp.init_mesh(2)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        autosp.compile(model, mesh=mesh, check_inputs="never", dynamic=False)(ids, ids).backward()
        out.append(dict(counters["aot_autograd"]))
    dist.destroy_process_group()
    return out


@pytest.mark.slow  # 29 s (an Inductor compile, cold then warm); the default suite has the
# dynamic compile's cache test (tests/test_compile_cache.py)
def test_static_compiles_hit_aot_autograds_cache() -> None:
    """The static compile runs in a fake mode with a shape env, as Dynamo's does: without one
    AOTAutograd bypasses its cache ("No shape env"). Cold: a miss, saved; warm: a hit."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        cold, warm = pool.submit(_cold_then_warm).result(timeout=600)
    assert cold.get("autograd_cache_miss") == 1 and cold.get("autograd_cache_saved") == 1, cold
    assert warm.get("autograd_cache_hit") == 1 and not warm.get("autograd_cache_bypass"), warm


def _two_calls(first: int, second: int) -> tuple[torch.fx.GraphModule, torch.nn.Module]:
    import torch.fx as fx

    sub = fx.symbolic_trace(lambda x, n: (x * n,))
    root = torch.nn.Module()
    root.autosp_layer_0 = sub
    g = fx.Graph()
    x = g.placeholder("x")
    attr = g.get_attr("autosp_layer_0")
    calls = [g.call_function(torch.ops.higher_order.invoke_subgraph,
                             (attr, "autosp_layer_0", x, n)) for n in (first, second)]
    g.output(tuple(calls))
    return fx.GraphModule(root, g), sub


def test_bake_regions_bakes_one_literal_per_subgraph_and_refuses_two() -> None:
    """A region subgraph called with one integer at a position by every call gets a copy with
    the value in place of its placeholder; calls passing different integers leave it alone
    (the static compile then keeps the integer inputs symbolic)."""
    from autosp.specialize import _bake_regions

    gm, sub = _two_calls(3, 3)
    assert _bake_regions(gm)
    baked = gm.autosp_layer_0
    assert baked is not sub and len([n for n in sub.graph.nodes if n.op == "placeholder"]) == 2
    assert [n.name for n in baked.graph.nodes if n.op == "placeholder"] == ["x"]
    assert torch.equal(baked(torch.ones(2))[0], torch.full((2,), 3.0))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all(len(c.args) == 3 for c in calls)

    gm, sub = _two_calls(3, 4)
    assert not _bake_regions(gm)
    assert gm.autosp_layer_0 is sub

