"""Sequence-aware remat per layer when layers are outlined into regions (``regions=True``).

``"sequence-aware"`` admits matmuls for recomputation while their FLOPs stay within a share of
the whole graph's attention FLOPs (``_core.admit_matmuls``), so the choice is one over every
layer. It admits a matmul in every alike layer or in none (by class: see csrc/plan/remat.h),
so the calls of one region agree; but a region's subgraph is partitioned once for every layer
that calls it, on its own joint graph, where the rest of the graph (the head's matmuls, other
regions, layers of another stack or width) cannot be seen, and that can change what fits. So:

1. each region's partition records what it saw (its candidate matmuls' FLOPs and bytes, its
   attention FLOPs) and what it admitted (:func:`record`). Before that, a region not yet
   outlined by admissions makes the choice over its own calls alone; where that already splits
   them, it raises :class:`RegionAdmissions` at once (:func:`split_early`: the first attempt
   then stops at the first region's partition, not after the whole calling graph's trace);
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

Each attempt changes some layer's admissions (the backend checks it), so they end; the usual
count is one (two where the rest of the graph changes what fits). What each layer
needs is kept beside the caches (autosp.compile_cache.save_admissions): a later process outlines
by it at once.
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
#: The key under ``node.meta["custom"]`` of the layers that call a region subgraph (on its
#: nodes), and of the layer a region call stands for (on the call).
CALLS_KEY = "autosp_calls"
LAYER_KEY = "autosp_layer"


class RegionAdmissions(AutospError):
    """The choice over every call differs from what a region was partitioned with: by layer,
    the admissions the layers that call regions need. Caught by autosp's backend, which
    outlines again (module docstring); it reaches a user only through a fault of autosp's."""

    def __init__(self, per_layer: dict[str, tuple[bool, ...]]) -> None:
        super().__init__(
            "[autosp:outline] internal error: a region's sequence-aware admissions differ from "
            "the choice over every layer, also after outlining the layers by it; compile with "
            "regions=False and report this")
        self.per_layer = per_layer


@dataclasses.dataclass(frozen=True)
class _Region:
    flops: tuple[float, ...]  # the candidate matmuls', in graph order
    bytes: tuple[int, ...]
    attention_flops: float
    admitted: tuple[bool, ...]


class RegionChoices:
    """One compile's records: each region's, by the forward module its partition returned,
    and the backward modules its partitions returned."""

    def __init__(self) -> None:
        self.regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.backwards: weakref.WeakSet = weakref.WeakSet()


def applies(options: Any) -> bool:
    """Whether ``options`` make a choice over the whole graph that this module keeps per layer:
    sequence-aware without a memory budget (outline.whole_graph_policy keeps every layer inline
    under a budget)."""
    return (options.policy == _core.RematPolicy.SEQUENCE_AWARE and options.budget_bytes is None
            and options.budget_fraction is None)


def stamped_admissions(graph: fx.Graph, facts: list[Any]) -> list[int] | None:
    """A stamped region's admitted matmuls (node indices), or None where it is not stamped
    (or is a graph that calls regions: autosp's regions call none)."""
    stamp = next((c[ADMIT_KEY] for n in graph.nodes
                  if isinstance(c := n.meta.get("custom"), dict) and ADMIT_KEY in c), None)
    if stamp is None or any(n.target is torch.ops.higher_order.invoke_subgraph
                            for n in graph.nodes):
        return None
    candidates = _core.matmul_candidates(facts)
    if len(candidates) != len(stamp):
        raise AutospError(
            f"[autosp:outline] internal error: a region stamped with {len(stamp)} matmul "
            f"admissions has {len(candidates)} candidate matmuls in its joint graph; compile "
            "with regions=False and report this")
    return [c for c, a in zip(candidates, stamp) if a]


def _custom(node: fx.Node, key: str) -> Any:
    custom = node.meta.get("custom")
    return custom.get(key) if isinstance(custom, dict) else None


def split_early(graph: fx.Graph, facts: list[Any], ratio: float) -> None:
    """For a region not yet stamped: the choice over its own calls alone (its matmuls and
    attention FLOPs once per call, as if the rest of the graph had none). Where that already
    gives its calls different admissions, raises :class:`RegionAdmissions` with them at once,
    before the calling graph is traced further: the calling graph's choice, which also counts
    its own matmuls and the other regions, corrects them after the layers are outlined again,
    where it differs."""
    layers = next((c for n in graph.nodes if (c := _custom(n, CALLS_KEY)) is not None), None)
    if not layers:
        return
    candidates = _core.matmul_candidates(facts)
    m = len(candidates)
    flops = [facts[c].flops for c in candidates] * len(layers)
    nbytes = [facts[c].bytes for c in candidates] * len(layers)
    admitted = _core.admit_matmuls(flops, nbytes,
                                   ratio * _core.attention_flops(facts) * len(layers),
                                   [layer for layer in layers for _ in candidates])
    own = [tuple(admitted[i * m:(i + 1) * m]) for i in range(len(layers))]
    if len(set(own)) > 1:
        raise RegionAdmissions(dict(zip(layers, own)))


def record(choices: RegionChoices, fw_module: fx.GraphModule, bw_module: fx.GraphModule,
           facts: list[Any], solution: Any) -> None:
    """What a partition saw and admitted, for the graphs that call it."""
    candidates = _core.matmul_candidates(facts)
    admitted = set(solution.admitted)
    choices.regions[fw_module] = _Region(
        tuple(facts[c].flops for c in candidates), tuple(facts[c].bytes for c in candidates),
        solution.attention_flops, tuple(c in admitted for c in candidates))
    choices.backwards.add(bw_module)


def _unpartitioned(module: fx.GraphModule) -> _Region:
    """A region called without gradients, which no partition saw: its matmuls and attention
    as the flat graph's choice sees them (forward nodes all), by the same facts and rules."""
    import types

    from autosp.remat_facts import gather_facts

    nodes = [n for n in module.graph.nodes if n.op != "output"]
    info = types.SimpleNamespace(required_fw_nodes=nodes, required_bw_nodes=[],
                                 tangents_closure=[], static_lifetime_input_nodes=[])
    _, facts = gather_facts(module.graph, info)
    candidates = _core.matmul_candidates(facts)
    return _Region(tuple(facts[c].flops for c in candidates),
                   tuple(facts[c].bytes for c in candidates), _core.attention_flops(facts),
                   (False,) * len(candidates))


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
    layer_of: list[str] = []  # each candidate's layer, for admit_matmuls' classes
    attention = _core.attention_flops(facts)
    calls: list[tuple[int, _Region]] = []
    own: list[tuple[int, int]] = []
    layers: list[str | None] = []
    for i, n in enumerate(nodes):
        if n.target is hop and isinstance(n.args[0], fx.Node):
            # A forward call of a partitioned region, a backward call (not counted: its
            # region's record has its backward attention), or a call without gradients.
            module = getattr(joint_module, str(n.args[0].target), None)
            region = choices.regions.get(module)
            if region is not None:
                layers.append(_custom(n, LAYER_KEY))
                calls.append((len(flops), region))
            elif isinstance(module, fx.GraphModule) and module not in choices.backwards:
                region = _unpartitioned(module)  # counted, as flat; it recomputes nothing
            if region is not None:
                flops += region.flops
                nbytes += region.bytes
                layer_of += [_custom(n, LAYER_KEY) or ""] * len(region.flops)
                attention += region.attention_flops
        elif i in own_candidates:
            own.append((len(flops), i))
            flops.append(facts[i].flops)
            nbytes.append(facts[i].bytes)
            layer_of.append(facts[i].layer)
    if not calls:
        return None
    admitted = _core.admit_matmuls(flops, nbytes, ratio * attention, layer_of)
    per_call = [tuple(admitted[s:s + len(r.flops)]) for s, r in calls]
    if any(p != r.admitted for p, (_, r) in zip(per_call, calls)):
        if None not in layers:
            raise RegionAdmissions(dict(zip(layers, per_call)))
        # A call that does not say its layer (its meta did not reach the joint graph): each
        # region keeps its own choice, exact but not per layer.
        import warnings

        warnings.warn("[autosp:outline] a region call in the joint graph does not say which "
                      "layer it stands for: sequence-aware's admissions stay per region, not "
                      "per layer (exact; what is recomputed may differ from regions=False)",
                      stacklevel=2)
    return [i for s, i in own if admitted[s]]
