"""Breakers helper-79 and helper-80 (round 11): ``regions=True``. torch 2.13 CPU, Gloo, world 2,
aot_eager; loss and every parameter gradient against one device at every step. Model:
tests/decoder_layer.py (embedding, 3 decoder layers, head); B=2, S=32.

FOUND (silent, both):

1. helper-79: a plain value of ONE layer other than the first, changed after the first call,
   was not seen: the layer kept running the first layer's trace (Dynamo's reuse guards only the
   first layer's reads; plain ``nested_compile_region`` does the same). Each of: a bool flag
   (``layers[1].flag = True``: loss 4.4226909 against 4.5984650, worst gradient 0.74), a string
   mode (0.4226909 against 4.3926463, worst 1.64), LayerNorm's ``eps``, LeakyReLU's slope,
   ``layers[1].eval()`` (worst 2.46 where the layer reads ``self.training``), a submodule's
   ``__class__`` set in place. FIXED: the module compares the marked layers' plain state (each
   module's class and ``__dict__`` values) at every call (layer_alike.PlainWatch); a change
   the first layer of the class did not make too makes autosp trace every layer.
   ``model.eval()`` and a flag set on every layer keep the layers traced once: the first
   layer's guards fail and Dynamo traces again, comparing every layer.

2. helper-80: alike layers each handed a different int derived from the sequence length
   (``layer(x, S - 7 * i)``), at static sizes (the first length of the default, or
   ``dynamic=False``): autosp.outline put layers 1 and 2 in one subgraph, whose static trace
   took one call's int for both (loss 4.4316473 against 4.4324565, worst gradient 0.28 with
   Dynamo's reuse on; Inductor raised an internal error). FIXED: a region's integer operand is
   keyed by its expression in the symbolic sizes (outline._operand_kind), so such layers stay
   apart.

3. helper-80 (loud, not silent): a layer handed its hidden state with other strides (``x =
   x.transpose(0, 1).contiguous().transpose(0, 1)`` before layer 1) called the subgraph traced
   for a contiguous operand, and the compile failed inside it ("internal error: Cannot view a
   tensor with shape [2, 16, 32] and strides (32, 64, 1)"). FIXED: a tensor operand is keyed
   by its strides too; layers 1 and 2 (both strided) share a subgraph, layer 0 stays apart.

``regions=False`` was exact on all of them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import decoder_layer
from decoder_layer import VOCAB
from distributed import make_batch, run_ranks


class FlagLayer(decoder_layer.Layer):
    """Reads a flag, a string mode and its own training flag; its norm has an ``eps`` and its
    activation a slope, each a constant of the trace."""

    def __init__(self) -> None:
        super().__init__()
        self.flag, self.mode = False, "a"
        self.act = nn.LeakyReLU(0.1)

    def scale(self, u: torch.Tensor) -> torch.Tensor:
        if self.flag:
            u = u * 3.0
        if self.mode == "b":
            u = u * 0.5
        if not self.training:
            u = u * 0.25
        return self.act(u)


class Halved(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


#: Made on layer 1 alone before the step after the first; each unseen before the fix.
CHANGES = {
    "flag": lambda m: setattr(m.layers[1], "flag", True),
    "mode": lambda m: setattr(m.layers[1], "mode", "b"),
    "eps": lambda m: setattr(m.layers[1].n2, "eps", 0.5),
    "slope": lambda m: setattr(m.layers[1].act, "negative_slope", 0.7),
    "eval": lambda m: m.layers[1].eval(),
    "class": lambda m: setattr(m.layers[1].n2, "__class__", Halved),
}


def _change_worker(rank: int, world: int, regions: bool, cases: list[str]) -> dict[str, Any]:
    import autosp

    mesh = autosp.init_mesh(world)
    out: dict[str, Any] = {}
    for case in cases:
        torch._dynamo.reset()  # each case's compiles count towards the forward's recompile limit
        torch.manual_seed(0)
        model = decoder_layer.Model(FlagLayer)
        ref = copy.deepcopy(model)
        compiled = autosp.compile(model, mesh, backend="aot_eager", regions=regions)
        steps = [decoder_layer.step(compiled, model, ref, 1)]
        for m in (model, ref):
            CHANGES[case](m)
        steps.append(decoder_layer.step(compiled, model, ref, 2))
        out[case] = steps
    return out


# The default suite's cases; "mode" (a string) and "eps" (a float on a submodule) go through
# the same comparison of a layer's plain values as "flag" and "slope" (layer_alike.PlainWatch,
# whose own test below tells "mode" apart), and run with -m slow.
DEFAULT_CHANGES = ["flag", "slope", "eval", "class"]


# regions=True is opt-in (autosp.compile's and the trainer's default is "compile"): its
# rounds run with -m slow; the default suite keeps the fast guards of autosp.dynamo_regions.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*tracing every layer instead")
def test_a_plain_value_changed_on_one_layer_after_the_first_call_is_seen() -> None:
    decoder_layer.check_exact(run_ranks(2, _change_worker, True, DEFAULT_CHANGES))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*tracing every layer instead")
def test_more_plain_values_changed_on_one_layer_after_the_first_call_are_seen() -> None:
    decoder_layer.check_exact(run_ranks(2, _change_worker, True,
                                        [c for c in CHANGES if c not in DEFAULT_CHANGES]))


@pytest.mark.slow
def test_guard_plain_values_changed_on_one_layer_are_exact_without_regions() -> None:
    decoder_layer.check_exact(run_ranks(2, _change_worker, False, list(CHANGES)))


def test_plain_watch_tells_a_change_on_one_layer_from_one_on_every_layer() -> None:
    """layer_alike.PlainWatch: a change every layer made is left to Dynamo's guards
    (model.eval(), a flag on every layer); one on some layers only is named."""
    from autosp.layer_alike import PlainWatch

    model = decoder_layer.Model(FlagLayer)
    watch = PlainWatch([[(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]])
    assert watch.changed_alone() is None
    model.eval()
    model.train()
    for layer in model.layers:
        layer.flag = True
    assert watch.changed_alone() is None
    model.layers[0].n2.eps = 1e-5  # reassigned, equal: no change
    assert watch.changed_alone() is None
    # The first layer alone: named too, since Dynamo may have traced another layer (round 12)
    model.layers[0].mode = "b"
    assert watch.changed_alone() == (
        "layers.0.mode changed after the first call, and not on layers.1 alike (Dynamo's "
        "reuse guards only the values of the layer it traced)")
    model.layers[2].flag = False
    assert watch.changed_alone().startswith("layers.2.flag changed after the first call, and "
                                            "not on layers.0 alike")
    assert watch.changed_alone() is None  # the change is the baseline now
    model.layers[1].act.__class__ = nn.ReLU
    assert watch.changed_alone().startswith("layers.1.act.__class__ changed")
    model.layers[1].eval()
    assert watch.changed_alone().startswith("layers.1.")
    del model.layers[2].mode
    assert watch.changed_alone().startswith("layers.2.mode changed")


def _train_eval_worker(rank: int, world: int) -> dict[str, Any]:
    import autosp

    torch.manual_seed(0)
    model = decoder_layer.Model(FlagLayer)
    ref = copy.deepcopy(model)
    compiled = autosp.compile(model, autosp.init_mesh(world), backend="aot_eager", regions=True)
    steps = [decoder_layer.step(compiled, model, ref, 1)]
    for m in (model, ref):
        m.eval()
    with torch.no_grad():
        ids, labels = make_batch(VOCAB, 2, 32, seed=3)
        evals = (compiled(ids, labels).item(), ref(ids, labels).item())
    for m in (model, ref):
        m.train()
    steps.append(decoder_layer.step(compiled, model, ref, 2))
    return {"steps": steps, "eval": evals, "traced_once": list(compiled.traced_once)}


@pytest.mark.slow
@pytest.mark.filterwarnings("error:.*tracing every layer instead")
def test_model_eval_and_train_keep_the_layers_traced_once() -> None:
    """The whole model put in eval mode and back (a validation pass) changes every layer alike:
    the layers stay traced once, and both modes are exact."""
    for out in run_ranks(2, _train_eval_worker):
        decoder_layer.check_exact([{"train": out["steps"]}])
        assert abs(out["eval"][0] - out["eval"][1]) <= 1e-5 * abs(out["eval"][1]), out["eval"]
        assert out["traced_once"] == ["layers.0", "layers.1", "layers.2"]


V, H = 64, 32


class SizedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x))) * (n * 0.01)


class SizedModel(nn.Module):
    """Each layer handed its own int from the sequence length: S, S - 7, S - 14."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList(SizedLayer() for _ in range(3))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, ids.shape[1] - 7 * i)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _sized_worker(rank: int, world: int, reuse: bool) -> dict[str, Any]:
    import autosp
    import autosp.dynamo_regions

    if not reuse:  # autosp.outline alone: Dynamo traces every layer
        autosp.dynamo_regions.reuse_supported = lambda: False
    torch.manual_seed(0)
    model = SizedModel()
    ref = copy.deepcopy(model)
    compiled = autosp.compile(model, autosp.init_mesh(world), backend="aot_eager", regions=True,
                              dynamic=False)
    return {"steps": [decoder_layer.step(compiled, model, ref, 1)], "outlined": compiled.last_compile.outlined}


# The outline alone (reuse off: what regions="compile" runs) stays in the default suite.
@pytest.mark.parametrize("reuse", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["traced-once", "outline-only"])
def test_layers_handed_different_sizes_do_not_share_a_subgraph(reuse: bool) -> None:
    for out in run_ranks(2, _sized_worker, reuse):
        decoder_layer.check_exact([{"sized": out["steps"]}])
        assert not any("calls" in line for line in out["outlined"]), out["outlined"]


class StridedModel(SizedModel):
    """Layer 1 handed its hidden state transposed in memory (the same values, other strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(decoder_layer.Layer() for _ in range(3))
        self.embed, self.head = nn.Embedding(VOCAB, H), nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            if i == 1:
                x = x.transpose(0, 1).contiguous().transpose(0, 1)
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _strided_worker(rank: int, world: int, reuse: bool) -> dict[str, Any]:
    import autosp
    import autosp.dynamo_regions

    if not reuse:
        autosp.dynamo_regions.reuse_supported = lambda: False
    torch.manual_seed(0)
    model = StridedModel()
    ref = copy.deepcopy(model)
    compiled = autosp.compile(model, autosp.init_mesh(world), backend="aot_eager", regions=True)
    return {"steps": [decoder_layer.step(compiled, model, ref, 1)], "outlined": compiled.last_compile.outlined}


# The outline alone (reuse off: what regions="compile" runs) stays in the default suite.
@pytest.mark.parametrize("reuse", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["traced-once", "outline-only"])
def test_a_layer_handed_other_strides_does_not_share_the_subgraph(reuse: bool) -> None:
    for out in run_ranks(2, _strided_worker, reuse):
        decoder_layer.check_exact([{"strided": out["steps"]}])
        assert out["outlined"][0].startswith("layers.0: not outlined"), out["outlined"]
