"""Breaker helper-81 (round 12): ``regions=True`` after round 11's fixes. torch 2.13 CPU, Gloo,
world 2, aot_eager; loss and every parameter gradient against one device at three steps (the
change made between steps 0 and 1, on the compiled model and the reference alike). Model:
tests/decoder_layer.py (embedding, 3 decoder layers, head); B=2, S=32.

FOUND (silent, all; ``regions=False`` exact on every one):

1. A change on some layers that include the first (``layers[0].flag = layers[2].flag = True``)
   was left to Dynamo's guards, but Dynamo had traced layer 1 (layer 0 took another branch) and
   stamped it out for layer 2: nothing guarded layer 2's flag (loss 4.3506064 against
   4.4650564, worst gradient 0.89). FIXED: only a change every marked layer of the class made
   is left to Dynamo (layer_alike.PlainWatch).
2. A module held outside the registry (``self._aux = [nn.LeakyReLU(0.1)]``, in a dict or a
   plain object), its slope changed on layer 1 (worst 0.54). FIXED: PlainWatch watches such
   modules too.
3. A per-layer ``functools.partial`` whose keywords changed in place, and a per-layer lambda
   whose ``__defaults__`` were replaced (worst 0.63-0.73). FIXED: PlainWatch compares the
   arguments, keywords, defaults and closure of the functions the layers' modules hold.
4. A per-layer ``__slots__`` object or ``collections.deque`` holding a number, changed on layer
   1 (worst 0.73): not found as per-layer mutable state. FIXED: layer_alike._mutables lists
   them (and counts an object it cannot list as holding data), so such layers are traced on
   their own.
5. Constant arguments equal by ``==`` but not alike: ``layer(x, True)`` then ``layer(x, 1)``
   (worst 0.90; the other order 4.54), ``0.0`` then ``-0.0`` (2.14), wrong at the first call:
   Dynamo's reuse compares constants with ``!=``. FIXED: the marked forward hands the region the
   type and sign of each number argument (dynamo_regions._marked_forward).
"""

from __future__ import annotations

import collections
import copy
import functools
import math
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import decoder_layer
from distributed import run_ranks


class GatedLayer(decoder_layer.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.flag = False, False

    def scale(self, u: torch.Tensor) -> torch.Tensor:
        return u * 3.0 if not self.first and self.flag else u


class HeldModuleLayer(decoder_layer.Layer):
    def __init__(self) -> None:
        super().__init__()
        self._aux = [nn.LeakyReLU(0.1)]  # not registered: the [module] idiom

    def scale(self, u: torch.Tensor) -> torch.Tensor:
        return self._aux[0](u)


class PartialLayer(decoder_layer.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.act = functools.partial(F.leaky_relu, negative_slope=0.1)

    def scale(self, u: torch.Tensor) -> torch.Tensor:
        return self.act(u)


def _scaler() -> Callable:
    return lambda u, k=1.0: u * k


class DefaultsLayer(decoder_layer.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.f = _scaler()

    def scale(self, u: torch.Tensor) -> torch.Tensor:
        return self.f(u)


class Slot:
    __slots__ = ("scale",)

    def __init__(self, scale: float) -> None:
        self.scale = scale


class SlotsLayer(decoder_layer.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = Slot(1.0)

    def scale(self, u: torch.Tensor) -> torch.Tensor:
        return u * self.cfg.scale


class DequeLayer(decoder_layer.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = collections.deque([1.0])

    def scale(self, u: torch.Tensor) -> torch.Tensor:
        return u * self.cfg[0]


def _gated() -> nn.Module:
    model = decoder_layer.Model(GatedLayer)
    model.layers[0].first = True
    return model


def _gated_change(m: nn.Module) -> None:
    m.layers[0].flag = m.layers[2].flag = True


def _set_slope(m: nn.Module) -> None:
    m.layers[1]._aux[0].negative_slope = 0.7


def _set_keyword(m: nn.Module) -> None:
    m.layers[1].act.keywords["negative_slope"] = 0.7


def _set_defaults(m: nn.Module) -> None:
    m.layers[1].f.__defaults__ = (2.0,)


def _set_slot(m: nn.Module) -> None:
    m.layers[1].cfg.scale = 2.0


def _set_deque(m: nn.Module) -> None:
    m.layers[1].cfg[0] = 2.0


#: (the model, the change made on it after the first step)
CHANGES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], None]]] = {
    "first-unread": (_gated, _gated_change),
    "held-module": (lambda: decoder_layer.Model(HeldModuleLayer), _set_slope),
    "partial": (lambda: decoder_layer.Model(PartialLayer), _set_keyword),
    "defaults": (lambda: decoder_layer.Model(DefaultsLayer), _set_defaults),
    "slots": (lambda: decoder_layer.Model(SlotsLayer), _set_slot),
    "deque": (lambda: decoder_layer.Model(DequeLayer), _set_deque),
}


class ArgLayer(decoder_layer.Layer):
    def forward(self, x: torch.Tensor, z: Any) -> torch.Tensor:  # type: ignore[override]
        y = super().forward(x)
        if isinstance(z, bool):
            return y
        return y * 2.0 * math.copysign(1.0, z)


class ArgModel(decoder_layer.Model):
    """Layer 0 called with ``args[0]``, the later layers with ``args[1]``."""

    def __init__(self, args: tuple) -> None:
        super().__init__(ArgLayer)
        self.args = args

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, self.args[min(i, 1)])
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


ARGS = {"true-then-1": (True, 1), "1-then-true": (1, True), "zero-then-minus-zero": (0.0, -0.0)}


def _worker(rank: int, world: int, regions: bool) -> dict[str, Any]:
    import autosp

    mesh = autosp.init_mesh(world)
    out: dict[str, Any] = {}
    cases = [(name, make, change) for name, (make, change) in CHANGES.items()]
    cases += [(name, functools.partial(ArgModel, args), None) for name, args in ARGS.items()]
    for name, make, change in cases:
        torch._dynamo.reset()  # each case's compiles count towards the forward's recompile limit
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        compiled = autosp.compile(model, mesh, backend="aot_eager", regions=regions)
        steps = []
        for step in range(3 if change else 1):
            if step == 1:
                change(model)
                change(ref)
            steps.append(decoder_layer.step(compiled, model, ref, step + 1))
        out[name] = steps
    return out


# regions=True is opt-in (autosp.compile's and the trainer's default is "compile"): its
# rounds run with -m slow; the default suite keeps the fast guards of autosp.dynamo_regions.
@pytest.mark.filterwarnings("ignore:.*tracing every layer instead")
@pytest.mark.slow
def test_round_12_changes_and_arguments_are_exact_with_regions() -> None:
    decoder_layer.check_exact(run_ranks(2, _worker, True))


@pytest.mark.slow
def test_guard_round_12_cases_are_exact_without_regions() -> None:
    decoder_layer.check_exact(run_ranks(2, _worker, False))


def test_hugging_face_layers_holding_a_partial_stay_marked() -> None:
    """Gemma 2's GELU holds a functools.partial per layer (``act_fn.act``): watched by
    PlainWatch, not a reason to trace each layer on its own."""
    import transformers as tf

    from autosp import dynamo_regions
    from autosp.layer_alike import PlainWatch

    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, head_dim=16))
    assert len(dynamo_regions.mark_layers(model)) == 3
    watch = PlainWatch(dynamo_regions.marked_groups(model))
    assert watch.changed_alone() is None
    model.model.layers[1].mlp.act_fn.act.keywords["approximate"] = "none"
    assert watch.changed_alone().startswith("model.layers.1.mlp.act_fn.act changed")


def test_a_function_replaced_on_every_layer_is_watched_from_then_on() -> None:
    """A per-layer function replaced on every layer after the first call (left to Dynamo, which
    traces again), then changed in place on layer 1 alone: PlainWatch listed the layers'
    functions once, so it kept watching the replaced ones and missed the change."""
    from autosp import dynamo_regions
    from autosp.layer_alike import PlainWatch

    model = decoder_layer.Model(DefaultsLayer)
    assert len(dynamo_regions.mark_layers(model)) == 3
    try:
        watch = PlainWatch(dynamo_regions.marked_groups(model))
        for layer in model.layers:
            layer.f = _scaler()
        assert watch.changed_alone() is None  # every layer changed alike
        model.layers[1].f.__defaults__ = (2.0,)
        assert (watch.changed_alone() or "").startswith("layers.1.f changed"), watch.changed_alone()
    finally:
        dynamo_regions.unmark_layers(model)
