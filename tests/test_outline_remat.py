"""``regions=True`` keeps remat decisions per layer (autosp.remat_regions): where sequence-aware's
FLOP allowance ends part-way through the layers, the layers that differ call subgraphs of their
own, and every layer recomputes what the flat compile's layer recomputes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distributed import assert_step_exact, make_batch, run_ranks, step_against_reference, tiny_config


def _per_layer(report: Any, outlined: list[str]) -> dict[str, tuple[int, float]]:
    """Recomputed nodes with FLOPs and recompute FLOPs per layer. A region's report names its
    representative layer; every layer that calls it gets its figures."""
    calls: dict[str, list[str]] = {}
    for line in outlined:
        layer, _, rest = line.partition(": calls ")
        if rest:
            calls.setdefault(rest.split()[0], []).append(layer)
    out: dict[str, tuple[int, float]] = {}
    for g in report.graphs:
        for row in g.layers:
            if not row.layer.startswith("layers."):
                continue
            members = [row.layer]
            if g.calls:  # which region: the one whose representative layer this is
                members = next(m for m in calls.values() if m[0] == row.layer)
            for layer in members:
                recomputed = sum(1 for n in g.nodes if n.layer == row.layer and n.fate == "recomputed"
                               and n.flops > 0)
                out[layer] = (recomputed, row.recompute_flops)
    return out


def _worker(rank: int, world: int, seq: int) -> dict[str, Any]:
    import autosp
    from autosp.models.llama import LlamaForCausalLM
    from autosp.remat_policy import RematReport

    mesh = autosp.init_mesh(world)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(4, 2, num_layers=4, vocab_size=256))
    ids, labels = make_batch(256, 2, seq, seed=1)
    out: dict[str, Any] = {}
    for regions in (True, False):
        report = RematReport()
        compiled = autosp.compile(model, mesh, remat="sequence-aware", backend="aot_eager",
                                  regions=regions, remat_report=report)
        if regions:
            out.update(step_against_reference(model, compiled, ids, labels))
        else:
            model.zero_grad(set_to_none=True)
            compiled(ids, labels).backward()
        outlined = compiled.last_compile.outlined
        out[regions] = {"outlined": outlined, "per_layer": _per_layer(report, outlined),
                        "recompute": sum(g.recompute_flops for g in report.graphs if not g.calls),
                        "saved": report.saved_bytes}
    return out


@pytest.mark.slow  # 50 s on 2 cores
def test_sequence_aware_admissions_stay_per_layer_with_regions() -> None:
    """World 2, 4 layers, S 512, aot_eager: the flat compile admits the MLP's matmuls in layers
    0 and 1, part of them in layer 2 and fewer in layer 3 (its allowance, 0.1x the attention
    FLOPs of all layers, ends part-way). Before, every outlined layer got one region's
    choice (a quarter of the allowance: the MLP's matmuls did not fit): 4 admitted of 19,
    recompute 16.8 against 57.7 MFLOP, 1.26x the flat compile's saved bytes. Now layers 0-1 call
    one subgraph stamped with their admissions, layers 2 and 3 (each alike no other) stay
    inline, every layer admits what it admits flat, and the step is exact against one device."""
    for rank, r in enumerate(run_ranks(2, _worker, 512)):
        assert_step_exact(r, f"rank {rank}")
        flat, regions = r[False], r[True]
        assert regions["per_layer"] == flat["per_layer"], (regions["per_layer"], flat["per_layer"])
        assert regions["recompute"] == pytest.approx(flat["recompute"], rel=1e-9)
        counts = [flat["per_layer"][f"layers.{i}"][0] for i in range(4)]
        assert counts[0] == counts[1] > counts[2] > counts[3], counts  # the allowance ends part-way
        lines = regions["outlined"]
        assert lines[0].startswith("layers.0: calls autosp_layer_0_r") and \
            lines[1].startswith(lines[0].replace("layers.0", "layers.1").split(" (")[0]), lines
        assert lines[2:] == ["layers.2: not outlined: no other layer is alike",
                             "layers.3: not outlined: no other layer is alike"], lines
        # What is left is where a region's outputs are saved (remat none: 1.6% more, docs).
        assert flat["saved"] <= regions["saved"] <= 1.05 * flat["saved"], (regions["saved"], flat["saved"])
