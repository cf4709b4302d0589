"""``autosp.compile(regions=True)`` (autosp.outline, experimental): alike decoder layers call
one ``invoke_subgraph`` subgraph each, and training stays exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distributed import assert_step_exact, make_batch, run_ranks, step_against_reference, tiny_config


def _worker(rank: int, world: int, backend: str, remat: str) -> dict[str, Any]:
    import autosp
    from autosp.models.llama import LlamaForCausalLM

    mesh = autosp.init_mesh(world)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(4, 2, num_layers=4))
    ids, labels = make_batch(128, 2, 32, seed=1)
    compiled = autosp.compile(model, mesh, remat=remat, backend=backend, regions=True)
    out = step_against_reference(model, compiled, ids, labels)
    rec = compiled.last_compile
    out["outlined"] = rec.outlined
    gm = rec.graph_module
    out["calls"] = sum(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)
    out["subgraphs"] = sorted(name for name, _ in gm.named_children() if name.startswith("autosp_layer"))
    return out


@pytest.mark.slow  # 25 s (aot_eager) / 80 s (Inductor) on 2 cores; regions=True is opt-in
@pytest.mark.parametrize("backend,remat", [("aot_eager", "none"), ("inductor", "sequence-aware")])
def test_alike_layers_call_one_subgraph_and_stay_exact(backend: str, remat: str) -> None:
    """World 2, the reference Llama with 4 layers: all 4 layers call one subgraph (layer 0's
    nodes are interleaved with the rotary table's in the applied graph, and are gathered into
    one run), and the step is exact against one device (loss 1e-5, gradients 1e-4)."""
    for rank, r in enumerate(run_ranks(2, _worker, backend, remat)):
        assert_step_exact(r, f"rank {rank}, {backend}")
        assert r["outlined"] == [f"layers.{i}: calls autosp_layer_0" for i in range(4)], \
            r["outlined"]
        assert r["calls"] == 4 and r["subgraphs"] == ["autosp_layer_0"], (r["calls"], r["subgraphs"])


# The gathering of a layer into one run, on hand-built graphs (no compile): the applied graph's
# layer 0 is interleaved with nodes of no layer (the rotary table, inserted sizes), and a node
# that writes in place or draws random numbers must not be moved past the layer's nodes.

class _Record(torch.fx.Interpreter):
    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        n.meta["val"] = value
        return value


def _tag(n: torch.fx.Node, path: str) -> torch.fx.Node:
    n.meta["nn_module_stack"] = {path: (path, torch.nn.Module)}
    return n


def _layers_graph(interloper: str) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """Three alike layers h = relu(h * w_i + cos(t)); in layer 0, the node named by
    ``interloper`` sits between the layer's nodes."""
    g = torch.fx.Graph()
    x, t, *w = (g.placeholder(name) for name in ("x", "t", "w0", "w1", "w2"))
    h, shared = x, None
    for i in range(3):
        a = _tag(g.call_function(torch.mul, (h, w[i])), f"layers.{i}.mlp")
        if i == 0:
            shared = g.call_function(torch.cos, (t,))  # of no layer, read by every layer
            if interloper == "inplace":
                g.call_method("mul_", (t, 1.0))
            elif interloper == "random":
                noise = g.call_function(torch.rand_like, (t,))
                a = _tag(g.call_function(torch.add, (a, noise)), "layers.0.mlp")
            elif interloper == "other-layer":
                a = _tag(g.call_function(torch.neg, (a,)), "layers.1.mlp")
        b = _tag(g.call_function(torch.add, (a, shared)), f"layers.{i}.mlp")
        h = _tag(g.call_function(torch.relu, (b,)), f"layers.{i}")
    g.output(h)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(4, 8) for _ in range(5)]
    _Record(gm).run(*[a.clone() for a in args])
    return gm, args


def test_interleaved_layer_is_gathered_and_outlined() -> None:
    """Layer 0's nodes are split by a node of no layer it does not depend on: it moves before
    the layer, and the three layers call one subgraph with the same result."""
    from autosp.outline import outline_layers

    gm, args = _layers_graph("shared")
    expected = gm(*args)
    assert outline_layers(gm) == [f"layers.{i}: calls autosp_layer_0" for i in range(3)]
    assert sum(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes) == 3
    torch.testing.assert_close(gm(*args), expected, rtol=0, atol=0)


@pytest.mark.parametrize("interloper,why", [
    ("inplace", "may not move"), ("random", "may not move"), ("other-layer", "interleaved with layers.1")])
def test_layer_that_cannot_be_gathered_stays_inline(interloper: str, why: str) -> None:
    """An in-place write or a random draw between layer 0's nodes would change meaning if
    moved, and a node of layer 1 on a path between layer 0's nodes cannot leave the run: layer 0
    stays inline with the reason, the others are still outlined, and the result is unchanged."""
    from autosp.outline import outline_layers

    gm, args = _layers_graph(interloper)
    expected = gm(*[a.clone() for a in args])
    lines = outline_layers(gm)
    assert len(lines) == 3 and lines[0].startswith("layers.0: not outlined") and why in lines[0], lines
    if interloper != "other-layer":  # there, layer 1 is not alike the others either
        assert sorted(lines[1:]) == [f"layers.{i}: calls autosp_layer_0" for i in (1, 2)], lines
    result = gm(*[a.clone() for a in args])
    if interloper != "random":
        torch.testing.assert_close(result, expected, rtol=0, atol=0)
