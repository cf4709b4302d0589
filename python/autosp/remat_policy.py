"""Remat policies and reports: the policy names (defined once here), MemoryBudget, what a
compile decided per layer and node (RematReport), and a policy's options for the C++ solver.
Re-exported by ``autosp.remat``."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Union

from autosp import _core
from autosp.errors import AutospError

#: Sequence-aware policy: matmuls may be recomputed while their total forward FLOPs stay
#: within this fraction of the step's attention FLOPs (forward + backward attention). At 0.1
#: the recomputation adds at most ~10% of the attention work, which (with attention dominant
#: at long S) bounds the step-time cost to a few percent. Set 0 to never recompute matmuls.
DEFAULT_RECOMPUTE_FLOPS_RATIO = 0.1

POLICIES = ("none", "default", "sequence-aware")
INDUCTOR, AOT_EAGER = "inductor", "aot_eager"
BACKENDS = (INDUCTOR, AOT_EAGER)


@dataclass(frozen=True)
class MemoryBudget:
    """A cap on saved-for-backward bytes (parameters excluded): exactly one of ``bytes`` (an
    absolute cap) or ``fraction`` (of what policy ``"none"`` saves, in (0, 1])."""

    bytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.fraction is None):
            raise AutospError(
                f"[remat] MemoryBudget needs exactly one of bytes= or fraction=, got "
                f"bytes={self.bytes!r}, fraction={self.fraction!r}"
            )
        if self.bytes is not None and (
            not isinstance(self.bytes, int) or isinstance(self.bytes, bool) or self.bytes < 0
        ):
            raise AutospError(
                f"[remat] MemoryBudget.bytes must be an int >= 0, got {self.bytes!r}"
            )
        if self.fraction is not None and not (
            isinstance(self.fraction, (int, float)) and 0.0 < float(self.fraction) <= 1.0
        ):
            raise AutospError(
                f"[remat] MemoryBudget.fraction must be in (0, 1], got {self.fraction!r}"
            )


#: What Offload moves to host memory: the hidden states layers hand on, or all a layer saves.
OFFLOAD_SAVED = ("layer outputs", "all")


@dataclass(frozen=True)
class Offload:
    """A remat policy (``policy``: a name or a MemoryBudget) plus activation offload: the saved
    hidden states a decoder layer hands to the next (the values each layer's backward
    recomputes from, which sequence-aware remat always keeps) are copied to host memory in the
    forward and back in the backward, by PyTorch's activation-offloading pass
    (``torch._functorch._activation_offloading``). On CUDA the copies run on a side stream and
    the backward prefetches them ahead of use; on CPU they are plain copies (aliases: nothing
    moves), so exactness and the graph are testable there. Which values: the C++ solver
    (RematOptions.offload_layer_outputs).

    ``saved="all"`` offloads every tensor a decoder layer saves for its backward, not only the
    hidden state it hands on (as ALST offloads each layer's checkpoint): the device then holds
    the saved activations of about one layer in the backward, for more bytes on the host link
    (RematOptions.offload_layer_saved)."""

    policy: Union[str, MemoryBudget] = "sequence-aware"
    saved: str = "layer outputs"

    def __post_init__(self) -> None:
        if isinstance(self.policy, Offload) or not isinstance(self.policy, (str, MemoryBudget)):
            raise AutospError(
                f"[remat] Offload(policy=...) takes a policy name or a MemoryBudget, got "
                f"{self.policy!r}"
            )
        if self.saved not in OFFLOAD_SAVED:
            raise AutospError(
                f"[remat] Offload(saved=...) found {self.saved!r}; expected one of "
                f"{', '.join(repr(s) for s in OFFLOAD_SAVED)}"
            )


#: ``remat="auto"``: autosp.compile picks the policy (see Auto).
AUTO = "auto"


@dataclass(frozen=True)
class Auto:
    """``autosp.compile(remat=Auto(...))`` (``remat="auto"`` is ``Auto()``): at the first call,
    autosp predicts the peak memory per rank of a training step of the model at that call's
    sequence length for every combination of remat policy, tiled loss, tiled MLP and
    activation offload, and compiles the one with the least predicted step-time overhead
    that fits (autosp.remat_auto; the choice of ``autosp plan``).

    ``memory``: the device memory per rank the step must fit, bytes or a size such as
    ``"70GB"``; default, the CUDA device's total memory (a CPU model needs it given).
    ``host_memory``: the host memory per rank offloaded activations (and an offloaded
    optimizer) may take; default 80% of this machine's memory over its local ranks.
    ``offload_optimizer``: the optimizer is an autosp.OffloadOptimizer (its state in host
    memory); otherwise the peak counts AdamW's state on the device for the parameters that
    require gradients (fp32 moments, and fp32 master weights for bf16 parameters), as
    ``autosp plan`` does. The choice is made at the first call with gradients enabled (a
    first call under ``torch.no_grad()`` compiles without remat or tiling, which only a
    backward needs)."""

    memory: Union[int, str, None] = None
    host_memory: Union[int, str, None] = None
    offload_optimizer: bool = False

    def __post_init__(self) -> None:
        from autosp.plan_inputs import parse_bytes

        for what, value in (("memory", self.memory), ("host memory", self.host_memory)):
            if value is not None:
                try:
                    parse_bytes(value, what)
                except AutospError as e:
                    raise AutospError(str(e).replace("[plan]", "[remat] Auto:", 1)) from None
        if not isinstance(self.offload_optimizer, bool):
            raise AutospError(f"[remat] Auto(offload_optimizer=...) found "
                              f"{self.offload_optimizer!r}; expected True or False")


RematPolicy = Union[str, MemoryBudget, Offload, Auto]


@dataclass(frozen=True)
class LayerRemat:
    """One row of the report: what one layer (module path such as ``layers.3``) saves and
    recomputes."""

    layer: str
    saved_count: int
    saved_bytes: int
    recomputed_count: int
    recomputed_bytes: int
    recompute_flops: float


@dataclass(frozen=True)
class NodeRemat:
    """The decision for one forward node of the joint graph."""

    name: str
    target: str
    layer: str
    fate: str  # "saved" | "recomputed" | "forward-only"
    bytes: int
    flops: float
    ban_reason: str  # why it may not be recomputed; "" if it may


@dataclass(frozen=True)
class GraphRematReport:
    """What the partitioner decided for one joint graph."""

    policy: str
    saved_bytes: int
    none_saved_bytes: int
    budget_bytes: int | None
    recompute_flops: float
    attention_flops: float
    admitted_matmuls: int
    solve_seconds: float
    flow_vertices: int
    flow_edges: int
    layers: tuple[LayerRemat, ...]
    nodes: tuple[NodeRemat, ...]
    # FLOPs of the joint graph's forward and backward nodes on this rank, at the traced
    # sizes, recomputation not included: the model FLOPs of one micro-batch (for MFU).
    model_flops: float = 0.0
    # With Offload: the saved bytes kept in host memory, and the copies to host PyTorch's pass
    # inserted in the forward graph: the values the solver chose but model outputs and
    # non-contiguous values, which the pass skips (a warning says when nothing is offloaded).
    offloaded_bytes: int = 0
    offload_copies: int = 0
    # With regions=True (autosp.outline): a region's graph, partitioned once, is called this
    # many times by the enclosing graph, whose report counts its FLOPs once per call and its
    # saved values among its own. 0 for a graph that is not a region.
    calls: int = 0

    def saved(self) -> list[NodeRemat]:
        return [n for n in self.nodes if n.fate == "saved"]

    def recomputed(self) -> list[NodeRemat]:
        return [n for n in self.nodes if n.fate == "recomputed"]

    def __str__(self) -> str:
        mib = 1 << 20
        lines = [
            f"remat policy {self.policy}: saves {self.saved_bytes / mib:.2f} MiB for backward "
            f"('none' saves {self.none_saved_bytes / mib:.2f} MiB); recomputes "
            f"{self.recompute_flops / 1e9:.3f} GFLOP (step attention "
            f"{self.attention_flops / 1e9:.3f} GFLOP); solved in "
            f"{self.solve_seconds * 1e3:.1f} ms on {self.flow_vertices} vertices / "
            f"{self.flow_edges} edges"
            + (f"; a region, called {self.calls} times per step" if self.calls else "")
            + (f"; offloads {self.offloaded_bytes / mib:.2f} MiB to host in "
               f"{self.offload_copies} copies" if self.offloaded_bytes else ""),
            f"{'layer':<24} {'saved':>6} {'saved MiB':>10} {'recomp':>7} "
            f"{'recomp MiB':>11} {'recomp GFLOP':>13}",
        ]
        for row in self.layers:
            lines.append(
                f"{row.layer or '(unattributed)':<24} {row.saved_count:>6} "
                f"{row.saved_bytes / mib:>10.3f} {row.recomputed_count:>7} "
                f"{row.recomputed_bytes / mib:>11.3f} {row.recompute_flops / 1e9:>13.4f}"
            )
        return "\n".join(lines)


@dataclass
class RematReport:
    """Collects a :class:`GraphRematReport` for every joint graph partitioned with it."""

    graphs: list[GraphRematReport] = field(default_factory=list)
    # The forward module each report's partition returned, while it lives: an enclosing graph's
    # invoke_subgraph calls name it (autosp.remat_partition).
    forwards: Any = field(default_factory=weakref.WeakKeyDictionary, repr=False, compare=False)

    @property
    def saved_bytes(self) -> int:
        """Saved bytes of every graph; a region's are counted by the graph that calls it."""
        return sum(g.saved_bytes for g in self.graphs if not g.calls)

    def __str__(self) -> str:
        if not self.graphs:
            return "remat: no joint graph partitioned yet"
        return "\n\n".join(str(g) for g in self.graphs)


# --------------------------------------------------------------------------------------------
# Policy resolution


def _core_options(policy: RematPolicy, recompute_flops_ratio: float) -> Any:
    if isinstance(policy, Offload):
        options = _core_options(policy.policy, recompute_flops_ratio)
        options.offload_layer_outputs = True
        options.offload_layer_saved = policy.saved == "all"
        return options
    options = _core.RematOptions()
    if isinstance(policy, MemoryBudget):
        options.policy = _core.RematPolicy.SEQUENCE_AWARE
        if policy.bytes is not None:
            options.budget_bytes = int(policy.bytes)
        else:
            options.budget_fraction = float(policy.fraction)
    elif policy == "none":
        options.policy = _core.RematPolicy.NONE
    elif policy == "default":
        options.policy = _core.RematPolicy.DEFAULT
    elif policy == "sequence-aware":
        options.policy = _core.RematPolicy.SEQUENCE_AWARE
    else:
        raise AutospError(
            f"[remat] unknown policy {policy!r}; expected one of "
            f"{', '.join(repr(p) for p in POLICIES)}, a MemoryBudget or an Offload"
        )
    if not isinstance(recompute_flops_ratio, (int, float)) or not (
        0.0 <= float(recompute_flops_ratio) < float("inf")
    ):
        raise AutospError(
            f"[remat] recompute_flops_ratio must be a finite number >= 0, got "
            f"{recompute_flops_ratio!r}"
        )
    options.recompute_flops_ratio = float(recompute_flops_ratio)
    from torch._functorch import config as functorch_config

    options.max_dist_from_bw = int(functorch_config.max_dist_from_bw)
    return options


def _policy_name(policy: RematPolicy) -> str:
    if isinstance(policy, Offload):
        return f"{_policy_name(policy.policy)} + offload" + (" all" if policy.saved == "all" else "")
    if isinstance(policy, MemoryBudget):
        if policy.bytes is not None:
            return f"sequence-aware, budget {policy.bytes} bytes"
        return f"sequence-aware, budget {policy.fraction:g} of 'none'"
    return str(policy)
