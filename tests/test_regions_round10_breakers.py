"""Breaker helper-78 (round 10): ``regions=True`` with state changed on one layer after the
first compiled call. torch 2.13 CPU, Gloo, world 2, aot_eager and Inductor; loss and every
parameter gradient against one device at each of two steps, the change made on the compiled
model and the reference alike between them. Model: embedding, 3 decoder layers (attention and
a GELU MLP, hidden 32), head; B=2, S=32.

FOUND (silent, all three): a change on a layer other than the first that leaves the layer's
own module attributes alone was not seen. The layer kept running the trace made before it,
because Dynamo's reuse keeps no guard on what the stamped-out layers read (plain
``nested_compile_region`` does the same; the first layer's reads are guarded):

- ``layers[1].up.weight.bits = 4`` (an attribute on a parameter, read with ``getattr``):
  loss 4.4226909 against 4.5014057, worst gradient 0.58 (aot_eager); Inductor the same kind;
- ``layers[1].cfg.scale = 2.0`` (a field of a per-layer plain object): the same numbers;
- ``layers[1].fl[0] = 2.0`` (an item of a per-layer list): loss 4.2553439 against 4.2786589,
  worst 0.61.

``regions=False`` was exact on all three. FIXED: at every call the module compares the
attributes set on the marked layers' parameters and buffers (90 us at 32 layers) and, where
they changed, asks dynamo_regions.marked_apart, whose layer signature holds them; a layer that
holds a mutable object (a list, dict or plain object) no other layer holds is not marked, and
one set after autosp.compile makes the first compile trace every layer
(dynamo_regions.held_alone). Each case then runs exact.

HELD (exact, regions=True): dropout then eval then train; S 32, 64, 32; two micro-batches per
optimizer step; a no_grad call then training; requires_grad of layer 1 toggled after the first
call; a parameter replaced by a subclass after the first call, or its __class__ set; set before
compile: an attribute on one layer's weight, a tensor-subclass buffer or plain attribute;
per-layer tensors or floats in a plain object, list or dict; default-argument lambdas,
functools.partial and bound methods per layer; a module attribute (``layers[1].mult``) or a
new lambda changed after the first call.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch

import decoder_layer
from distributed import run_ranks

CASES = ("bits", "cfg", "list")


class ChangingLayer(decoder_layer.Layer):
    def scale(self, u: torch.Tensor) -> torch.Tensor:
        if getattr(self.up.weight, "bits", 8) == 4:
            u = u * 2.0
        if hasattr(self, "cfg"):
            u = u * self.cfg.scale
        if hasattr(self, "fl"):
            u = u * self.fl[0]
        return u


def Model() -> decoder_layer.Model:  # noqa: N802 - a model class of the test's own
    return decoder_layer.Model(ChangingLayer)


def _change(case: str, model: decoder_layer.Model, step: int) -> None:
    layers = model.layers
    if case == "cfg" and step == 0:  # after autosp.compile, before the first call
        for layer in layers:
            layer.cfg = types.SimpleNamespace(scale=1.0)
    if case == "list" and step == 0:
        for layer in layers:
            layer.fl = [1.0]
    if step == 1:
        if case == "bits":
            layers[1].up.weight.bits = 4
        elif case == "cfg":
            layers[1].cfg.scale = 2.0
        elif case == "list":
            layers[1].fl[0] = 2.0


def _worker(rank: int, world: int, regions: bool) -> dict[str, Any]:
    import autosp

    mesh = autosp.init_mesh(world)
    out: dict[str, Any] = {}
    for case in CASES:
        torch.manual_seed(0)
        model = Model()
        ref = copy.deepcopy(model)
        compiled = autosp.compile(model, mesh, backend="aot_eager", regions=regions)
        steps = []
        for step in range(2):
            _change(case, model, step)
            _change(case, ref, step)
            steps.append(decoder_layer.step(compiled, model, ref, step + 1))
        out[case] = steps
    return out


# regions=True is opt-in (autosp.compile's and the trainer's default is "compile"): its
# rounds run with -m slow; the default suite keeps the fast guards of autosp.dynamo_regions.
@pytest.mark.filterwarnings("ignore:.*tracing every layer instead")
@pytest.mark.slow
def test_state_changed_on_one_layer_after_the_first_call_is_seen_with_regions() -> None:
    decoder_layer.check_exact(run_ranks(2, _worker, True))


@pytest.mark.slow
def test_guard_state_changed_on_one_layer_is_exact_without_regions() -> None:
    decoder_layer.check_exact(run_ranks(2, _worker, False))


def test_a_mutable_object_one_layer_holds_alone_keeps_the_layers_unmarked() -> None:
    """Per-layer lists or plain objects: no layer is marked (held_alone names them); one list
    every layer holds: all are; set after marking: marked_apart says which and why."""
    from autosp import dynamo_regions

    model = Model()
    for layer in model.layers:
        layer.fl = [1.0]
    assert dynamo_regions.mark_layers(model) == []
    assert dynamo_regions.held_alone(list(model.layers)) == ["fl"] * 3
    shared = [1.0]
    for layer in model.layers:
        layer.fl = shared
    assert dynamo_regions.mark_layers(model) == ["layers.0", "layers.1", "layers.2"]
    assert dynamo_regions.marked_apart(model) is None
    model.layers[2].cfg = types.SimpleNamespace(scale=1.0)
    why = dynamo_regions.marked_apart(model)
    assert why is not None and why.startswith("layers.2.cfg is a mutable object"), why
    del model.layers[2].cfg
    model.layers[1].up.weight.bits = 4
    why = dynamo_regions.marked_apart(model)
    assert why is not None and "layers.1 is no longer alike layers.0" in why, why
    dynamo_regions.unmark_layers(model)
