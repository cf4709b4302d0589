"""autosp.dynamo_reuse: Dynamo's reuse of a traced layer is refused while the calling code has
written outer state (a module attribute, a global, a dict), and left alone otherwise. One
process, no SP: Dynamo and the marked layers only (the SP runs are in
tests/test_regions_round5_breakers.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from autosp import dynamo_regions, dynamo_reuse

pytestmark = pytest.mark.skipif(not dynamo_regions.reuse_supported(),
                                reason="this PyTorch's Dynamo does not reuse a traced region")

_SCALE = 1.0
_CTX: dict[str, Any] = {}


class _Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ctx = getattr(self, "ctx", None)
        return self.lin(h if ctx is None else h + ctx)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = _Sub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = _CTX.get("t")
        if g is not None:
            x = x * g
        return x + torch.tanh(self.sub(x)) * _SCALE


class _Model(nn.Module):
    def __init__(self, wiring: str) -> None:
        super().__init__()
        self.wiring = wiring
        self.layers = nn.ModuleList(_Layer() for _ in range(4))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        global _SCALE
        x = x0
        for i, layer in enumerate(self.layers):
            if self.wiring == "submodule_attribute":
                layer.sub.ctx = x0 * (i + 1)
            elif self.wiring == "global_dict":
                _CTX["t"] = x0 * (i + 1)
            elif self.wiring == "global_number":
                _SCALE = float(i + 1)
            x = layer(x)
        _SCALE = 1.0
        _CTX.clear()
        for layer in self.layers:
            vars(layer.sub).pop("ctx", None)
        return x.square().sum()


def _subgraphs(model: nn.Module, x: torch.Tensor, gate: bool) -> tuple[int, int, torch.Tensor]:
    """(calls of invoke_subgraph, distinct subgraphs, output) of Dynamo's graph of the marked
    model, traced with or without the gate."""
    got: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        got["calls"] = sum(n.target is torch.ops.higher_order.invoke_subgraph
                           for n in gm.graph.nodes)
        got["subgraphs"] = len(list(gm.named_children()))
        return gm.forward

    torch._dynamo.reset()
    assert dynamo_regions.mark_layers(model) == [f"layers.{i}" for i in range(4)]
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        if gate:
            with dynamo_reuse.gated():
                out = compiled(x)
        else:
            out = compiled(x)
    finally:
        dynamo_regions.unmark_layers(model)
    return got["calls"], got["subgraphs"], out


@pytest.mark.parametrize("wiring", ["submodule_attribute", "global_dict", "global_number"])
def test_reuse_is_refused_while_the_forward_writes_outer_state(wiring: str) -> None:
    """Each layer reads state its caller set just before the call (a submodule's tensor
    attribute, a global dict's tensor, a global number), different per layer. Ungated, torch
    2.13's Dynamo stamps layer 0's trace out for layers 1-3, which then read layer 0's value:
    a wrong output, or torch's internal "Freevar has no source". Gated, each call is traced
    (Dynamo may still give alike traces one subgraph, the hidden tensor an operand of its own)
    and the output is the eager one."""
    torch.manual_seed(0)
    model = _Model(wiring)
    x = torch.randn(2, 3, 8, requires_grad=True)
    expected = model(x)
    _, _, out = _subgraphs(model, x, gate=True)
    torch.testing.assert_close(out, expected)
    try:  # ungated: the fault this guards against
        _, _, out = _subgraphs(model, x, gate=False)
    except Exception as e:  # noqa: BLE001 - Dynamo's internal error is the other outcome
        assert "Freevar has no source" in str(e), e
    else:
        assert not torch.allclose(out, expected)


def test_reuse_is_kept_for_a_forward_that_writes_nothing() -> None:
    """The same layers called plainly: gated, Dynamo still traces one layer and stamps it out
    for the other three (3 reuse hits, 4 calls of one subgraph), exactly, and the patched
    functions are restored afterwards."""
    from torch._dynamo.variables import invoke_subgraph

    torch.manual_seed(0)
    model = _Model("plain")
    x = torch.randn(2, 3, 8, requires_grad=True)
    expected = model(x)
    before = (invoke_subgraph.find_reuse_match, invoke_subgraph.save_reuse_entry)
    hits = [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        match = before[0](*args, **kwargs)
        hits[0] += match is not None
        return match

    invoke_subgraph.find_reuse_match = counting
    try:
        calls, subgraphs, out = _subgraphs(model, x, gate=True)
    finally:
        invoke_subgraph.find_reuse_match = before[0]
    assert (calls, subgraphs, hits[0]) == (4, 1, 3)  # layers 1-3 stamped out
    torch.testing.assert_close(out, expected)
    assert (invoke_subgraph.find_reuse_match, invoke_subgraph.save_reuse_entry) == before
