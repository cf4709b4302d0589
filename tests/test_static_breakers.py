"""Breakers (helper-34) for ``autosp.compile(..., dynamic=False)`` baking its integer inputs
(autosp.specialize ``_copy``/``_bake``/``_bake_regions``) and for the alias/random rule of
``regions=True`` (autosp.ops ``may_alias``/``is_random`` used by autosp.outline).

Found at 7faa15d: layers ending in 11 kinds of alias were outlined (``x.mT``, ``x.real``,
``x.data``, ``+x``, ``atleast_2d``, F.dropout with p=0 or not training, ``sum_to_size``, a
one-operand ``einsum``, ATen overloads ``aten.t.default``/``aten.alias.default``): outline
asked for the wrong name (``getattr``, ``t.default``) or the schema does not say. Exact
end to end nonetheless; now they stay inline. The baking was exact in every case tried."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import (assert_step_exact, build_model, make_batch, run_ranks,
                         step_against_reference, tiny_config)
from test_outline import _Record, _tag

VOCAB = 64


# --------------------------------------------------------------------------------------
# Models.

class _Block(nn.Module):
    """A GPT block; ``mode`` picks an extra use of an integer the parent hands in."""

    def __init__(self, hidden: int, mode: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.proj = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
        self.mode = mode

    def forward(self, x: torch.Tensor, n: Any = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, 4, C // 4).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.o(y)
        m = self.proj(F.gelu(self.fc(self.ln2(x))))
        if n is not None:
            m = m / n
        out = x + m
        if self.mode == "end_dropout0":  # F.dropout with p=0 returns its input itself
            return F.dropout(out, 0.0, self.training)
        if self.mode == "end_pos":  # +x returns x itself
            return +out
        if self.mode == "end_atleast_3d":  # x itself when it has 3 dims
            return torch.atleast_3d(out)
        if self.mode == "end_mT":  # a view (Dynamo's getattr(x, "mT")); mT twice is x again
            return out.mT.mT
        return out


class _LM(nn.Module):
    """``mode``: what integer each block gets.
    "none": nothing; "half": S // 2 computed once in the parent; "seq": S itself;
    "per_layer": S + i for layer i (different ints)."""

    def __init__(self, mode: str, layers: int = 2, hidden: int = 32) -> None:
        super().__init__()
        self.mode = mode
        self.wte = nn.Embedding(VOCAB, hidden)
        self.h = nn.ModuleList([_Block(hidden, mode) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        S = ids.shape[1]
        for i, b in enumerate(self.h):
            if self.mode == "none" or self.mode.startswith("end_"):
                x = b(x)
            elif self.mode == "half":
                x = b(x, S // 2)
            elif self.mode == "seq":
                x = b(x, S)
            elif self.mode == "per_layer":
                x = b(x, S + i)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), labels.flatten())


def _lm_worker(rank: int, world: int, mode: str, seqs: list[int], regions: bool,
               tile_loss: bool, backend: str = "aot_eager") -> dict[str, Any]:
    import autosp

    mesh = autosp.init_mesh(world)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _LM(mode)
    compiled = autosp.compile(model, mesh, remat="none", backend=backend, regions=regions,
                              dynamic=False, tile_loss=tile_loss)
    results = []
    for i, seq in enumerate(seqs):
        ids, labels = make_batch(VOCAB, 2, seq, seed=i + 1)
        results.append((seq, step_against_reference(model, compiled, ids, labels)))
    return {"results": results, "outlined": compiled.last_compile.outlined}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["half", "seq", "per_layer"])
@pytest.mark.parametrize("regions", [False, True])
def test_layers_taking_an_int_from_the_sequence_length(mode: str, regions: bool) -> None:
    """Each block gets an integer derived from S (S // 2, S, S + i) from the parent: with
    regions the integer is an operand of the layer's subgraph, a Node (S // 2, S + i) or the
    baked placeholder (S); several lengths in turn."""
    for rank, out in enumerate(run_ranks(2, _lm_worker, mode, [16, 32, 16, 48], regions, False)):
        for seq, r in out["results"]:
            assert_step_exact(r, f"mode {mode}, regions {regions}, S {seq}, rank {rank}, "
                                 f"{out['outlined']}")


# --------------------------------------------------------------------------------------
# autosp.outline: a layer handing on a value that shares storage with what it reads must stay
# inline; a random draw between a layer's nodes must not move. FX level, no ranks.

def _ending(kind: str, g: torch.fx.Graph, h: torch.fx.Node) -> torch.fx.Node:
    """The last node of a layer: a value sharing the storage of ``h`` (checked below)."""
    import operator

    if kind == "mT":  # x.mT: Dynamo records getattr(x, "mT")
        return g.call_function(getattr, (h, "mT"))
    if kind == "real":  # x.real of a real tensor is x itself
        return g.call_function(getattr, (h, "real"))
    if kind == "data":  # x.data: Dynamo records torch._C._autograd._get_data_attr(x)
        return g.call_function(torch._C._autograd._get_data_attr, (h,))
    if kind == "pos":  # +x: operator.pos, which returns x itself
        return g.call_function(operator.pos, (h,))
    if kind == "atleast_2d":  # returns x itself when it has 2 dims
        return g.call_function(torch.atleast_2d, (h,))
    if kind == "dropout_p0":  # F.dropout(x, 0.0) returns x itself (ATen's _dropout_impl)
        return g.call_function(F.dropout, (h, 0.0, True))
    if kind == "dropout_eval":  # F.dropout(x, p, training=False) returns x itself
        return g.call_function(F.dropout, (h, 0.1, False))
    if kind == "sum_to_size":  # x.sum_to_size(x.shape) returns x itself
        return g.call_method("sum_to_size", (h, 4, 8))
    if kind == "einsum":  # a one-operand einsum without a sum is a permuted view
        return g.call_function(torch.einsum, ("ij->ji", h))
    if kind == "aten_t":  # an ATen overload (a decomposed composite, or the user's own call)
        return g.call_function(torch.ops.aten.t.default, (h,))
    if kind == "aten_alias":
        return g.call_function(torch.ops.aten.alias.default, (h,))
    if kind == "neg":  # a fresh value: the control
        return g.call_function(torch.neg, (h,))
    raise ValueError(kind)


_ALIAS_KINDS = ["mT", "real", "data", "pos", "atleast_2d", "dropout_p0", "dropout_eval",
                "sum_to_size", "einsum", "aten_t", "aten_alias"]


def _aliasing_layers(kind: str) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """Three alike layers h = ending(relu(h * w_i + 1)) (square [8, 8] so that a transpose
    keeps the shapes)."""
    g = torch.fx.Graph()
    x, *w = (g.placeholder(name) for name in ("x", "w0", "w1", "w2"))
    h = x
    for i in range(3):
        a = _tag(g.call_function(torch.mul, (h, w[i])), f"layers.{i}.mlp")
        b = _tag(g.call_function(torch.add, (a, 1.0)), f"layers.{i}.mlp")
        r = _tag(g.call_function(torch.relu, (b,)), f"layers.{i}")
        h = _tag(_ending(kind, g, r), f"layers.{i}")
    g.output((h,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(4, 8)] + [torch.randn(4, 8) for _ in range(3)]
    if kind in ("mT", "einsum", "aten_t"):
        args = [torch.randn(8, 8) for _ in range(4)]
    _Record(gm).run(*args)
    return gm, args


@pytest.mark.parametrize("kind", _ALIAS_KINDS)
def test_layer_ending_in_an_alias_stays_inline(kind: str) -> None:
    """Each ending returns a tensor sharing its operand's storage (checked on real tensors),
    so, like swapaxes (tests/test_outline.py), the layers may not be outlined."""
    from autosp.outline import outline_layers

    gm, args = _aliasing_layers(kind)
    env: dict[torch.fx.Node, Any] = {}
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for n, v in zip(nodes, [n.meta["val"] for n in nodes]):
        env[n] = v
    last = [n for n in nodes if n.op != "placeholder"][-1]
    src = last.args[1] if last.op == "call_function" and last.target is torch.einsum else last.args[0]
    assert env[last].untyped_storage().data_ptr() == env[src].untyped_storage().data_ptr(), kind
    lines = outline_layers(gm)
    assert all("not outlined" in line and "alias" in line for line in lines), (kind, lines)


def _random_interloper(kind: str) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """Three alike layers h = relu(h * w_i + c); in layer 0 a random draw of no layer sits
    between the layer's nodes and the layer does not read it (gathering would move it)."""
    g = torch.fx.Graph()
    x, t, *w = (g.placeholder(name) for name in ("x", "t", "w0", "w1", "w2"))
    h = x
    outs = []
    for i in range(3):
        a = _tag(g.call_function(torch.mul, (h, w[i])), f"layers.{i}.mlp")
        if i == 0:
            if kind == "aten_bernoulli":
                p = g.call_function(torch.sigmoid, (t,))
                outs.append(g.call_function(torch.ops.aten.bernoulli.default, (p,)))
            elif kind == "aten_rand_like":
                outs.append(g.call_function(torch.ops.aten.rand_like.default, (t,)))
            elif kind == "aten_native_dropout":
                outs.append(g.call_function(operator_getitem(),
                                            (g.call_function(torch.ops.aten.native_dropout.default,
                                                             (t, 0.5, True)), 0)))
            elif kind == "multinomial":
                p = g.call_function(torch.sigmoid, (t,))
                outs.append(g.call_function(torch.multinomial, (p, 2)))
            elif kind == "randint_like":
                outs.append(g.call_function(torch.randint_like, (t, 10)))
        b = _tag(g.call_function(torch.add, (a, 1.0)), f"layers.{i}.mlp")
        h = _tag(g.call_function(torch.relu, (b,)), f"layers.{i}")
        if i == 0:  # a second draw after layer 0: the order of the two draws is the meaning
            outs.append(g.call_function(torch.rand_like, (t,)))
    g.output((h, *outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(4, 8) for _ in range(5)]
    torch.manual_seed(0)
    _Record(gm).run(*args)
    return gm, args


def operator_getitem() -> Any:
    import operator

    return operator.getitem


@pytest.mark.parametrize("kind", ["aten_bernoulli", "aten_rand_like", "aten_native_dropout",
                                  "multinomial", "randint_like"])
def test_random_draw_between_a_layers_nodes_is_not_moved(kind: str) -> None:
    """The draws of the graph come in the same order (same values under one seed) after
    outlining as before: a random node between layer 0's nodes must not be moved."""
    from autosp.outline import outline_layers

    gm, args = _random_interloper(kind)
    torch.manual_seed(0)
    expected = gm(*args)
    lines = outline_layers(gm)
    torch.manual_seed(0)
    got = gm(*args)
    for e, r in zip(expected, got):
        torch.testing.assert_close(r, e, rtol=0, atol=0, msg=lambda m: f"{kind}: {lines}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["end_dropout0", "end_mT"])
def test_blocks_ending_in_an_alias_stay_inline_and_exact(mode: str, backend: str) -> None:
    """Each block ends in an op that returns its input (F.dropout with p=0) or a view of it
    (Dynamo's getattr(x, "mT")): the blocks hand on an alias, so they stay inline (like a block
    ending in swapaxes), and the steps are exact."""
    for rank, out in enumerate(run_ranks(2, _lm_worker, mode, [16, 32], True, False, backend)):
        for seq, r in out["results"]:
            assert_step_exact(r, f"mode {mode}, S {seq}, rank {rank}, {out['outlined']}")
        assert all("not outlined" in line for line in out["outlined"]), out["outlined"]


def _llama_worker(rank: int, world: int, steps: list[tuple[int, int]], regions: bool) -> dict[str, Any]:
    import autosp

    mesh = autosp.init_mesh(world)
    torch._dynamo.reset()
    model = build_model(tiny_config(4, 2, hidden_size=32, intermediate_size=64, vocab_size=VOCAB))
    compiled = autosp.compile(model, mesh, backend="aot_eager", dynamic=False, tile_loss=True,
                              regions=regions)
    results = []
    for i, (batch, seq) in enumerate(steps):
        ids, labels = make_batch(VOCAB, batch, seq, seed=i + 1)
        results.append(((batch, seq), step_against_reference(model, compiled, ids, labels)))
    return {"results": results, "outlined": compiled.last_compile.outlined}


@pytest.mark.slow
@pytest.mark.parametrize("regions", [False, True])
def test_static_llama_lengths_and_batch_sizes_in_turn(regions: bool) -> None:
    """Tiled loss, lengths 16, 32, 16, 48 and a batch size change: every step exact."""
    steps = [(2, 16), (2, 32), (2, 16), (2, 48), (1, 32), (2, 32)]
    for rank, out in enumerate(run_ranks(2, _llama_worker, steps, regions)):
        for (batch, seq), r in out["results"]:
            assert_step_exact(r, f"B {batch}, S {seq}, regions {regions}, rank {rank}")
