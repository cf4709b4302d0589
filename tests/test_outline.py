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
    """World 2, the reference Llama with 4 layers: layers 1 to 3 call one subgraph (layer 0's
    nodes are not one contiguous run in the applied graph, so it stays inline), and the step is
    exact against one device (loss 1e-5, gradients 1e-4)."""
    for rank, r in enumerate(run_ranks(2, _worker, backend, remat)):
        assert_step_exact(r, f"rank {rank}, {backend}")
        assert r["outlined"][1:] == [f"layers.{i}: calls autosp_layer_0" for i in (1, 2, 3)], \
            r["outlined"]
        assert r["outlined"][0].startswith("layers.0: not outlined"), r["outlined"]
        assert r["calls"] == 3 and r["subgraphs"] == ["autosp_layer_0"], (r["calls"], r["subgraphs"])
