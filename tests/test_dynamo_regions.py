"""``regions=True`` has Dynamo trace each class of repeated layers once (autosp.dynamo_regions):
the layers are marked as nested compile regions, Dynamo stamps out the later calls, and the
backend inlines them back with each layer's own module paths. No SP here: Dynamo and the
inlining alone, on one process."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from autosp import dynamo_regions
from autosp.remat_facts import _layer_of

pytestmark = pytest.mark.skipif(not dynamo_regions.reuse_supported(),
                                reason="this PyTorch's Dynamo does not reuse a traced region")


def _model(layers: int = 4) -> torch.nn.Module:
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                        num_layers=layers, num_heads=4, num_kv_heads=2))


def _capture(model: torch.nn.Module, ids: torch.Tensor,
             inside: Any = None) -> tuple[torch.fx.GraphModule, Any]:
    """Dynamo's graph of ``model(ids, ids)``, its example inputs and output; ``inside(gm)`` runs
    in the backend (where the placeholders still carry Dynamo's sources)."""
    got: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        got["gm"], got["inputs"] = gm, example_inputs
        if inside is not None:
            inside(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(ids, ids)
    return got["gm"], (got["inputs"], out)


def _calls(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)


def test_layers_are_traced_once_and_inlined_with_their_own_paths() -> None:
    """4 layers: Dynamo's graph calls one subgraph 4 times, with each layer's own weights as
    operands; inlined, it has no call left, each layer's nodes carry that layer's module path
    (as many per layer), and it computes what the model computes."""
    model = _model(4)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = model(ids, ids)
    assert dynamo_regions.mark_layers(model) == [f"layers.{i}" for i in range(4)]
    calls: list[int] = []
    gm, (inputs, out) = _capture(model, ids, lambda gm: calls.append(_calls(gm)))
    assert calls == [4]
    assert [name for name, _ in gm.named_children()] == ["subgraph_0"]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    assert dynamo_regions.inline_regions(gm) == 4
    assert _calls(gm) == 0 and not list(gm.named_children())
    per_layer: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            layer = _layer_of(n)
            per_layer[layer] = per_layer.get(layer, 0) + 1
    counts = [per_layer.get(f"layers.{i}", 0) for i in range(4)]
    assert counts[0] > 10 and counts == [counts[0]] * 4, per_layer
    torch.testing.assert_close(gm(*inputs)[0], expected, rtol=0, atol=0)

    dynamo_regions.unmark_layers(model)
    assert all(type(layer).forward is type(layer).__mro__[0].forward for layer in model.layers)
    assert all(dynamo_regions._MARK not in vars(type(layer)) for layer in model.layers)


def test_a_marked_model_pickles_and_copies_as_the_users_classes() -> None:
    import copy
    import io

    from autosp.models.llama import DecoderLayer

    model = _model(2)
    dynamo_regions.mark_layers(model)
    assert type(model.layers[0]) is not DecoderLayer and isinstance(model.layers[0], DecoderLayer)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (loaded, copy.deepcopy(model)):
        assert [type(layer) for layer in other.layers] == [DecoderLayer, DecoderLayer]
        torch.testing.assert_close(other.layers[1].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight)
    assert type(model.layers[0]) is not DecoderLayer  # still marked
    dynamo_regions.unmark_layers(model)
    assert type(model.layers[0]) is DecoderLayer


def test_a_layer_with_a_forward_of_its_own_is_not_marked() -> None:
    model = _model(3)
    model.layers[1].forward = types.MethodType(type(model.layers[1]).forward, model.layers[1])
    assert dynamo_regions.mark_layers(model) == ["layers.0", "layers.2"]
    dynamo_regions.unmark_layers(model)


def test_a_call_reading_another_layers_weights_is_refused() -> None:
    """A forward marked as an instance attribute (not autosp's way): torch 2.13's Dynamo then
    stamps out every layer with the first layer's weights, silently. The inlining refuses such
    a graph (autosp.sp_module then traces every layer instead)."""
    model = _model(3)
    region = torch.compiler.nested_compile_region(
        lambda mod, *a, **k: type(mod).forward(mod, *a, **k))
    for layer in model.layers:
        layer.forward = types.MethodType(region, layer)
    got: dict[str, Any] = {}

    def inside(gm: torch.fx.GraphModule) -> None:
        got["reads"] = {p.name for p in gm.graph.nodes if p.op == "placeholder"}
        try:
            dynamo_regions.inline_regions(gm)
        except dynamo_regions.RegionReuseError as e:
            got["error"] = e

    _capture(model, torch.randint(0, 64, (2, 16)), inside)
    if any("layers_modules_1" in r for r in got["reads"]):
        pytest.skip("this PyTorch stamps out each layer with its own weights")
    assert "error" in got, "the inlining took a call of layer 1 reading layer 0's weights"
    assert "layer layers.1 reading layers.0." in str(got["error"]), got["error"]


def test_layers_that_differ_where_dynamos_guards_do_not_look_are_not_marked_together() -> None:
    """Found by breaker helper-33 (torch 2.13): with an activation submodule chosen per layer, or
    a hook on one layer's submodule, Dynamo stamped out the layer as first traced (layer 2 ran
    layer 1's ReLU; the hook was dropped), silently. Only the largest group of layers alike in
    what the guards miss is marked; the others are traced as usual."""
    model = _model(4)
    model.layers[2].mlp.act = torch.nn.ReLU()  # an attribute the forward does not read
    assert dynamo_regions.mark_layers(model) == ["layers.0", "layers.1", "layers.3"]
    dynamo_regions.unmark_layers(model)

    model = _model(4)
    model.layers[1].mlp.up_proj.register_forward_hook(lambda mod, args, out: out * 2)
    assert dynamo_regions.mark_layers(model) == ["layers.0", "layers.2", "layers.3"]
    dynamo_regions.unmark_layers(model)

    model = _model(4)
    for i, layer in enumerate(model.layers):  # alternating: two groups of two, one is marked
        layer.mlp.act = torch.nn.ReLU() if i % 2 else torch.nn.SiLU()
    assert dynamo_regions.mark_layers(model) == ["layers.0", "layers.2"]
    dynamo_regions.unmark_layers(model)

    model = _model(3)
    for i, layer in enumerate(model.layers):  # a number per layer: Dynamo guards it
        layer.self_attn.layer_idx = i
    assert dynamo_regions.mark_layers(model) == ["layers.0", "layers.1", "layers.2"]
    dynamo_regions.unmark_layers(model)


@pytest.mark.parametrize("reference, marked", [
    ("none", True),
    ("shared_registered", True),  # one module registered in every layer: same object each
    ("shared_plain_embed", True),  # one plain list, in every layer, of a module outside them
    ("plain_embed", True),  # a plain reference to a module outside the layers, not a holder
    # A list of its own per layer holding a number: not a back reference, but data each layer
    # holds alone (a change to it after the compile would go unseen by Dynamo's reuse): not
    # marked either (dynamo_regions.held_alone).
    ("plain_numbers", False),
    ("plain_root", False),  # self._root = [model]
    ("plain_first", False),  # self._first = [layers[0]]
    ("plain_part_of_first", False),  # self._peer = {"mlp": layers[0].mlp}
    ("registered_root", False),  # the model registered as a submodule (a cycle)
    ("object_holding_list", False),  # a plain object holding the layers' list
])
def test_a_layer_reaching_another_layers_state_is_not_marked(reference: str,
                                                             marked: bool) -> None:
    """Dynamo stamps a layer's trace out by putting the new layer's source in place of the
    first layer's wherever it occurs, so a layer reading layer 0's buffer through a reference
    to the model or to layer 0 read its own (breaker helper-51, all gradients off): such
    layers are left unmarked (dynamo_regions.back_reference) and Dynamo traces each."""
    model = _model(3)
    layers = list(model.model.layers) if hasattr(model, "model") else list(model.layers)
    shared = torch.nn.Linear(2, 2)
    shared_list = [model.lm_head]
    for layer in layers:
        if reference == "shared_registered":
            layer.extra = shared
        elif reference == "plain_embed":
            layer._embed = [model.lm_head]
        elif reference == "shared_plain_embed":
            layer._embed = shared_list
        elif reference == "plain_numbers":
            layer._window = [4, 4]
        elif reference == "plain_root":
            layer._root = [model]
        elif reference == "plain_first":
            layer._first = [layers[0]]
        elif reference == "plain_part_of_first":
            layer._peer = {"mlp": layers[0].mlp} if layer is not layers[0] else {}
        elif reference == "registered_root":
            layer.parent = model
        elif reference == "object_holding_list":
            layer._ctx = types.SimpleNamespace(all=[layers])
    paths = dynamo_regions.mark_layers(model)
    try:
        assert bool(paths) is marked, (reference, paths)
        if not marked and reference == "plain_numbers":
            assert dynamo_regions.held_alone(layers) == ["_window"] * 3
        elif not marked:
            where = dynamo_regions.back_reference(model, "layers.1", layers[1],
                                                  dynamo_regions.numbered_layers(model))
            assert where is not None and where.startswith("layers.1"), where
    finally:
        dynamo_regions.unmark_layers(model)
