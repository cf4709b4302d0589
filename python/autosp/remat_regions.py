"""Sequence-aware remat per layer when layers are outlined into regions (``regions=True``).

``"sequence-aware"`` admits matmuls for recomputation while their FLOPs stay within a share of
the whole graph's attention FLOPs (``_core.admit_matmuls``), so the choice is one over every
layer: the allowance can end part-way through the layers, and then the first layers recompute a
matmul the later ones save. A region's subgraph is partitioned once for every layer that calls
it, on its own joint graph, where that choice cannot be seen. So:

1. each region's partition records what it saw (its candidate matmuls' FLOPs and bytes, its
   attention FLOPs) and what it admitted (:func:`record`);
2. the partition of the graph that calls the regions, which AOTAutograd makes after theirs,
   makes the choice over every call and its own matmuls, as the flat graph's partition would
   (:func:`calling_graph_admissions`). Where a call's layer needs other admissions than its
   region was partitioned with, it raises :class:`RegionAdmissions`, before anything is
   compiled;
3. autosp's backend then outlines the layers again, keyed by their admissions as well (layers
   that differ call subgraphs of their own; a layer alike no other stays inline), stamps each
   subgraph's nodes with its admissions (``node.meta["custom"]``, which reaches the region's
   joint graph), and compiles again. A stamped region is partitioned with them
   (:func:`stamped_admissions`), and the choice over every call then agrees.

The cost is the first attempt's joint trace and partitions, where the layers' choices differ.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.fx as fx

from autosp import _core
from autosp.errors import AutospError

#: The key under ``node.meta["custom"]`` of a region subgraph's admissions (per candidate matmul
#: of its joint graph, in graph order).
ADMIT_KEY = "autosp_admit"


class RegionAdmissions(AutospError):
    """The choice over every call differs from what a region was partitioned with: for each
    region call, in call order, the admissions its layer needs. Caught by autosp's backend,
    which outlines again (module docstring); it reaches a user only through a fault of
    autosp's."""

    def __init__(self, per_call: list[tuple[bool, ...]]) -> None:
        super().__init__(
            "[autosp:outline] internal error: a region's sequence-aware admissions differ from "
            "the choice over every layer, and nothing outlined the layers again; compile with "
            "regions=False and report this")
        self.per_call = per_call


@dataclasses.dataclass(frozen=True)
class _Region:
    flops: tuple[float, ...]  # the candidate matmuls', in graph order
    bytes: tuple[int, ...]
    attention_flops: float
    admitted: tuple[bool, ...]
    stamped: bool  # partitioned with admissions given (autosp outlined by them)


class RegionChoices:
    """One compile's records: each region's, by the forward module its partition returned."""

    def __init__(self) -> None:
        self.regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def applies(options: Any) -> bool:
    """Whether ``options`` make a choice over the whole graph that this module keeps per layer:
    sequence-aware without a memory budget (outline.whole_graph_policy keeps every layer inline
    under a budget)."""
    return (options.policy == _core.RematPolicy.SEQUENCE_AWARE and options.budget_bytes is None
            and options.budget_fraction is None)


def stamped_admissions(graph: fx.Graph, facts: list[Any]) -> list[int] | None:
    """A stamped region's admitted matmuls (node indices), or None where it is not stamped."""
    stamp = next((c[ADMIT_KEY] for n in graph.nodes
                  if isinstance(c := n.meta.get("custom"), dict) and ADMIT_KEY in c), None)
    if stamp is None:
        return None
    candidates = _core.matmul_candidates(facts)
    if len(candidates) != len(stamp):
        raise AutospError(
            f"[autosp:outline] internal error: a region stamped with {len(stamp)} matmul "
            f"admissions has {len(candidates)} candidate matmuls in its joint graph; compile "
            "with regions=False and report this")
    return [c for c, a in zip(candidates, stamp) if a]


def record(choices: RegionChoices, fw_module: fx.GraphModule, facts: list[Any],
           solution: Any, stamped: bool) -> None:
    """What a partition saw and admitted, for the graphs that call it."""
    candidates = _core.matmul_candidates(facts)
    admitted = set(solution.admitted)
    choices.regions[fw_module] = _Region(
        tuple(facts[c].flops for c in candidates), tuple(facts[c].bytes for c in candidates),
        solution.attention_flops, tuple(c in admitted for c in candidates), stamped)


def calling_graph_admissions(choices: RegionChoices, joint_module: fx.GraphModule,
                             nodes: list[fx.Node], facts: list[Any],
                             ratio: float) -> list[int] | None:
    """For a joint graph that calls regions: its own admitted matmuls (node indices) under the
    choice over every call and its own matmuls, in graph order, with each call's matmuls where
    the call is; None for a graph that calls none. Raises :class:`RegionAdmissions` where a
    call's region was partitioned with other admissions than its layer gets."""
    own_candidates = set(_core.matmul_candidates(facts))
    hop = torch.ops.higher_order.invoke_subgraph
    flops: list[float] = []
    nbytes: list[int] = []
    attention = _core.attention_flops(facts)
    calls: list[tuple[int, _Region]] = []
    own: list[tuple[int, int]] = []
    for i, n in enumerate(nodes):
        if n.target is hop and isinstance(n.args[0], fx.Node):
            region = choices.regions.get(getattr(joint_module, str(n.args[0].target), None))
            if region is not None:  # a forward call (a backward call's module has no record)
                calls.append((len(flops), region))
                flops += region.flops
                nbytes += region.bytes
                attention += region.attention_flops
        elif i in own_candidates:
            own.append((len(flops), i))
            flops.append(facts[i].flops)
            nbytes.append(facts[i].bytes)
    if not calls:
        return None
    admitted = _core.admit_matmuls(flops, nbytes, ratio * attention)
    per_call = [tuple(admitted[s:s + len(r.flops)]) for s, r in calls]
    if any(p != r.admitted for p, (_, r) in zip(per_call, calls)):
        if any(r.stamped for _, r in calls):
            raise AutospError(
                "[autosp:outline] internal error: regions outlined by their layers' "
                "sequence-aware admissions still differ from the choice over every layer; "
                "compile with regions=False and report this")
        raise RegionAdmissions(per_call)
    return [i for s, i in own if admitted[s]]
