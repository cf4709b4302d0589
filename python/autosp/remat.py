"""Sequence-aware activation checkpointing: autosp's AOTAutograd partitioner.

AOTAutograd traces one training step into a joint forward+backward graph and asks a
*partition function* to split it into a forward graph (which also returns the values the
backward needs, the "saved" activations) and a backward graph (which may recompute forward
values from what was saved). This module is that partition function. It gathers the facts of
the joint graph -- every value's size in bytes at the actual sequence length, each op's FLOPs
and kind, which nodes belong to the forward and the backward -- and hands them to the C++
solver (``autosp._core.solve_remat``, csrc/plan/remat.h), which builds PyTorch's min-cut flow
network and decides the saved set. Python then builds the forward and backward graphs from
that set with PyTorch's own ``_extract_fwd_bwd_modules``.

Policies (``policy=``):

``"none"``
    Save what the backward reads; recompute nothing.
``"default"``
    PyTorch's partitioner behaviour (its allowlist, so matmuls are never recomputed, and its
    heuristics), solved by autosp's C++ min-cut. The baseline.
``"sequence-aware"`` (autosp.compile's default)
    Attention, collectives and random ops are never recomputed. Cheap ops (PyTorch's
    allowlist) may be. Matmuls may be recomputed while their summed forward FLOPs stay within
    ``recompute_flops_ratio`` times the step's attention FLOPs (forward plus backward attention
    of the graph, from the shapes at the real sequence length): as S grows, attention's
    O(S^2) cost dwarfs the projections' O(S), so recomputing them costs little time and saves
    their activations.
``MemoryBudget(bytes=...)`` / ``MemoryBudget(fraction=...)``
    Sequence-aware bans, but instead of the FLOP ratio: the fewest matmul recomputations (in
    cost-model order) whose saved bytes fit the budget, or an :class:`AutospError` if even
    recomputing every allowed matmul does not fit.

Use it with plain ``torch.compile`` (no sequence parallelism)::

    model = torch.compile(model, backend=autosp.remat.backend("sequence-aware"))

and ask what it did::

    report = autosp.remat.RematReport()
    model = torch.compile(model, backend=autosp.remat.backend(report=report))
    model(x).sum().backward()
    print(report)          # per layer: saved and recomputed values, bytes and FLOPs
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import torch
import torch.fx as fx

from autosp import _core
from autosp.errors import AutospError

__all__ = [
    "DEFAULT_RECOMPUTE_FLOPS_RATIO",
    "POLICIES",
    "GraphRematReport",
    "MemoryBudget",
    "RematPolicy",
    "RematReport",
    "SizeFn",
    "backend",
    "compile_joint",
    "gather_facts",
    "make_partition_fn",
    "node_flops",
]

#: Sequence-aware policy: matmuls may be recomputed while their total forward FLOPs stay
#: within this fraction of the step's attention FLOPs (forward + backward attention). At 0.1
#: the recomputation adds at most ~10% of the attention work, which (with attention dominant
#: at long S) bounds the step-time cost to a few percent. Set 0 to never recompute matmuls.
DEFAULT_RECOMPUTE_FLOPS_RATIO = 0.1

POLICIES = ("none", "default", "sequence-aware")
BACKENDS = ("inductor", "aot_eager")


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


RematPolicy = Union[str, MemoryBudget]


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
            f"{self.flow_edges} edges",
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

    @property
    def saved_bytes(self) -> int:
        return sum(g.saved_bytes for g in self.graphs)

    def __str__(self) -> str:
        if not self.graphs:
            return "remat: no joint graph partitioned yet"
        return "\n\n".join(str(g) for g in self.graphs)


# --------------------------------------------------------------------------------------------
# Policy resolution


def _core_options(policy: RematPolicy, recompute_flops_ratio: float) -> Any:
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
            f"{', '.join(repr(p) for p in POLICIES)} or a MemoryBudget"
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
    if isinstance(policy, MemoryBudget):
        if policy.bytes is not None:
            return f"sequence-aware, budget {policy.bytes} bytes"
        return f"sequence-aware, budget {policy.fraction:g} of 'none'"
    return str(policy)


# --------------------------------------------------------------------------------------------
# Facts about the joint graph


def _partitioners():
    from torch._functorch import partitioners

    return partitioners


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_ATTENTION_NAME = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention")


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target))


def _hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        try:
            from torch.fx.experimental.symbolic_shapes import optimization_hint

            return int(optimization_hint(x, fallback=4096))
        except ImportError:  # torch < 2.13
            hint = x.node.hint
            return int(hint) if hint is not None else 4096
    return int(x)


#: Concrete value of a (possibly symbolic) size: the trace's hint by default.
SizeFn = Callable[[Any], int]


def _hinted_meta(x: Any, size: SizeFn = _hint) -> Any:
    """A meta tensor with the concrete shape of a fake tensor (each size through `size`), so
    FLOP formulas evaluate at a real sequence length without adding guards."""
    if isinstance(x, torch.Tensor):
        return torch.empty([size(s) for s in x.shape], dtype=x.dtype, device="meta")
    return x


def _attention_flops(node: fx.Node, name: str, size: SizeFn = _hint) -> float:
    """4*b*h*Sq*Sk*d for the forward (QK^T and PV), 10*b*h*Sq*Sk*d for the backward (five
    matmuls), the convention of torch.utils.flop_counter's SDPA formulas."""
    tensors = [
        a.meta["val"]
        for a in node.args
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]
    backward = "backward" in name
    q, k = (tensors[1], tensors[2]) if backward else (tensors[0], tensors[1])
    if q.dim() != 4 or k.dim() != 4:
        return 0.0
    b, h, sq, d = (size(s) for s in q.shape)
    sk = size(k.shape[-2])
    return float((10 if backward else 4) * b * h * sq * sk * d)


def node_flops(node: fx.Node, kind: Any, name: str, size: SizeFn = _hint) -> float:
    """FLOPs of one joint-graph node (PyTorch's FLOP formulas; attention by its own formula),
    with symbolic sizes evaluated by `size` (default: the trace's hint). The planner passes a
    `size` that evaluates S at another length."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(node.target.overloadpacket)
    if formula is None:
        if kind == _core.RematOpKind.ATTENTION:
            return _attention_flops(node, name, size)
        return 0.0

    def value(a: Any) -> Any:
        return _hinted_meta(a.meta.get("val"), size) if isinstance(a, fx.Node) else a

    args, kwargs = tree_map(value, (node.args, node.kwargs))
    out = tree_map(lambda x: _hinted_meta(x, size), node.meta.get("val"))
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not accept this overload's arguments
        return 0.0


def _classify(node: fx.Node, op_types: Any) -> Any:
    K = _core.RematOpKind
    if node.op == "placeholder":
        return K.INPUT
    if node.op != "call_function":
        return K.CHEAP  # get_attr: re-reading an attribute is free
    target = node.target
    if target is operator.getitem:
        return K.CHEAP
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace in _COLLECTIVE_NAMESPACES:
            return K.COLLECTIVE
        # Before the random check: SDPA is tagged nondeterministic_seeded (for dropout_p), and
        # it is banned either way; as attention its FLOPs count towards the step's.
        if _ATTENTION_NAME.search(target.name()):
            return K.ATTENTION
        if op_types.is_random(node) or torch.Tag.nondeterministic_seeded in target.tags:
            return K.RANDOM
    if op_types.is_view(node):
        return K.VIEW
    if op_types.is_compute_intensive(node):
        return K.MATMUL
    if op_types.is_recomputable(node):
        return K.CHEAP
    return K.OTHER


def _save_cost(node: fx.Node) -> Any:
    C = _core.RematSaveCost
    from torch.fx.experimental.proxy_tensor import is_sym_node

    if is_sym_node(node):
        return C.SYM_FLOAT if isinstance(node.meta.get("val"), torch.SymFloat) else C.SYM_INT
    val = node.meta.get("val")
    non_tensor = ("val" not in node.meta and "tensor_meta" not in node.meta) or (
        "val" in node.meta and not isinstance(val, torch.Tensor)
    )
    if not non_tensor:
        return C.TENSOR
    from torch._library.fake_class_registry import FakeScriptObject
    from torch.fx.experimental._backward_state import BackwardState

    opaque = False
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node

        opaque = is_opaque_node(node)
    except ImportError:
        pass
    if isinstance(val, (BackwardState, FakeScriptObject)) or opaque:
        return C.FREE
    return C.UNSAVEABLE


def _node_bytes(node: fx.Node) -> int:
    """PyTorch's _size_of (bytes of the value, hinted sizes), 0 where it has no answer."""
    def tensor_bytes(x: Any) -> int:
        if not isinstance(x, torch.Tensor):
            return 0
        numel = 1
        for s in x.shape:
            numel *= _hint(s)
        return numel * x.dtype.itemsize

    if "val" not in node.meta:
        return 0
    val = node.meta["val"]
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return 1
    if isinstance(val, (list, tuple)):
        return sum(tensor_bytes(v) for v in val)
    if isinstance(val, dict):
        return sum(tensor_bytes(v) for v in val.values())
    return tensor_bytes(val)


def layer_of_path(path: str) -> str:
    """The layer of a dotted module or parameter path: the path up to its first numbered
    component ("layers.3.mlp" -> "layers.3"), else its top-level module ("lm_head"), else ""."""
    parts = [p for p in path.split(".") if p]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def _layer_of(node: fx.Node) -> str:
    """layer_of_path of the node's module (its nn_module_stack), or "" without one."""
    from autosp.bridge import dotted_path

    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return layer_of_path(dotted_path(str(list(stack.values())[-1][0])))


def gather_facts(joint_graph: fx.Graph, node_info: Any) -> tuple[list[fx.Node], list[Any]]:
    """The remat solver's facts (``_core.RematNode``) for every non-output node of a joint
    graph, in graph order, with sizes and FLOPs at the trace's hint; the planner builds its
    memory graph from the same facts."""
    partitioners = _partitioners()
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd.utils import _is_fwd_seed_offset, _is_primal
    from torch._functorch.compile_utils import get_aten_target

    op_types = partitioners.get_default_op_list()
    nodes = [n for n in joint_graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    params_free = bool(getattr(functorch_config, "treat_parameters_as_free_to_save", True))
    aten_cat = torch.ops.aten.cat

    facts = []
    for node in nodes:
        f = _core.RematNode()
        kind = _classify(node, op_types)
        name = _op_name(node)
        f.name = node.name
        f.target = name
        f.layer = _layer_of(node)
        f.kind = kind
        f.save_cost = _save_cost(node)
        f.bytes = _node_bytes(node)
        f.flops = node_flops(node, kind, name)
        f.required_fw = node_info.is_required_fw(node)
        f.required_bw = node in node_info.required_bw_nodes
        f.tangents_closure = node in node_info.tangents_closure
        f.primal_input = _is_primal(node) or _is_fwd_seed_offset(node)
        f.static_lifetime = params_free and node in node_info.static_lifetime_input_nodes
        recompute = node.meta.get("recompute")
        f.must_save = recompute == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        f.must_recompute = partitioners.must_recompute(node)
        f.fusible = op_types.is_fusible(node)
        f.getitem = node.op == "call_function" and node.target is operator.getitem
        users = sorted((index[u] for u in node.users if u in index), key=int)
        f.users = users
        f.fusible_user = [
            int(get_aten_target(nodes[u]) == aten_cat or (f.fusible and op_types.is_fusible(nodes[u])))
            for u in users
        ]
        f.args = [index[a] for a in node.args if isinstance(a, fx.Node)]
        facts.append(f)
    return nodes, facts


# --------------------------------------------------------------------------------------------
# The partition function


def _call_supported(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Calls a torch-internal helper with only the keyword arguments its signature (which
    varies across torch 2.11-2.13) accepts."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def _partition(
    joint_module: fx.GraphModule,
    joint_inputs: Any,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    policy: RematPolicy,
    options: Any,
    report: RematReport | None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    partitioners = _partitioners()
    from torch._functorch import config as functorch_config
    from torch._functorch.compile_utils import fx_graph_cse, raise_getitems
    from torch.fx.experimental.proxy_tensor import is_sym_node

    # The same preparation as min_cut_rematerialization_partition, so the flow network is built
    # on the same graph PyTorch's partitioner would see.
    joint_module.graph.eliminate_dead_code()
    joint_module.recompile()
    if functorch_config.cse:
        joint_module.graph = fx_graph_cse(joint_module.graph)
    joint_graph = joint_module.graph

    has_recompute_tags = partitioners.has_recomputable_ops(joint_module)
    has_recompute_rng = partitioners.has_recomputable_rng_ops(joint_module)
    if has_recompute_tags:
        joint_module = _call_supported(
            partitioners.cleanup_recompute_tags, joint_module, is_default_partition=False
        )
    if not getattr(functorch_config, "unsafe_allow_optimization_of_collectives", False):
        partitioners.force_save_collectives(joint_module)
    for helper in ("force_save_effectful_ops", "force_save_bw_mutation_src"):
        if hasattr(partitioners, helper):
            getattr(partitioners, helper)(joint_module)

    static_lifetime_input_indices = static_lifetime_input_indices or []
    node_info = partitioners.classify_nodes(
        joint_module, static_lifetime_input_indices, num_fwd_outputs
    )
    if len(node_info.required_bw_nodes) == 0:
        # Nothing for the backward: the forward saves nothing (PyTorch does the same).
        return _call_supported(
            partitioners.default_partition,
            joint_module,
            joint_inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
            static_lifetime_input_nodes=node_info.static_lifetime_input_nodes,
        )

    nodes, facts = gather_facts(joint_graph, node_info)
    start = time.perf_counter()
    try:
        solution = _core.solve_remat(facts, options)
    except (RuntimeError, ValueError) as e:
        raise AutospError(
            f"{e} [policy {_policy_name(policy)}; joint graph of {len(nodes)} nodes]"
        ) from None
    solve_seconds = time.perf_counter() - start

    saved = [nodes[i] for i in solution.saved]
    saved_sym_nodes = [
        n for n in saved if is_sym_node(n) and not partitioners._is_assert_only_symbool(n)
    ]
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:  # torch < 2.13

        def is_opaque_node(n: fx.Node) -> bool:
            return False

    saved_opaque_nodes = [n for n in saved if is_opaque_node(n)]
    saved_values = [n for n in saved if not is_sym_node(n) and not is_opaque_node(n)]

    fw_module, bw_module = _call_supported(
        partitioners._extract_fwd_bwd_modules,
        joint_module,
        saved_values,
        saved_sym_nodes=saved_sym_nodes,
        saved_opaque_nodes=saved_opaque_nodes,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=node_info.static_lifetime_input_nodes,
    )
    if has_recompute_tags and has_recompute_rng:
        # Only user-annotated (MUST_RECOMPUTE) random ops can be recomputed; PyTorch's RNG
        # functionalisation makes the backward replay the forward's random values.
        fw_module, bw_module = partitioners.functionalize_rng_ops(
            joint_module, fw_module, bw_module, len(saved_sym_nodes)
        )
    bw_module = partitioners.reordering_to_mimic_autograd_engine(bw_module)
    fw_module = raise_getitems(fw_module)
    bw_module = raise_getitems(bw_module)
    if hasattr(partitioners, "thread_graphsafe_rng_from_hops"):
        fw_module = partitioners.thread_graphsafe_rng_from_hops(fw_module, is_backward=False)
        bw_module = partitioners.thread_graphsafe_rng_from_hops(bw_module, is_backward=True)

    if report is not None:
        report.graphs.append(_graph_report(policy, solution, facts, solve_seconds))
    return fw_module, bw_module


def _graph_report(
    policy: RematPolicy, solution: Any, facts: list[Any], solve_seconds: float
) -> GraphRematReport:
    F = _core.RematFate
    fate_names = {
        F.SAVED: "saved",
        F.RECOMPUTED: "recomputed",
        F.FORWARD_ONLY: "forward-only",
    }
    node_rows = tuple(
        NodeRemat(
            name=f.name,
            target=f.target,
            layer=f.layer,
            fate=fate_names[fate],
            bytes=f.bytes,
            flops=f.flops,
            ban_reason=reason,
        )
        for f, fate, reason in zip(facts, solution.fate, solution.ban_reason)
        if fate != F.BACKWARD_ONLY
    )
    layers = tuple(
        LayerRemat(
            layer=s.layer,
            saved_count=s.saved_count,
            saved_bytes=s.saved_bytes,
            recomputed_count=s.recomputed_count,
            recomputed_bytes=s.recomputed_bytes,
            recompute_flops=s.recompute_flops,
        )
        for s in solution.layers
    )
    return GraphRematReport(
        policy=_policy_name(policy),
        saved_bytes=solution.saved_bytes,
        none_saved_bytes=solution.none_saved_bytes,
        budget_bytes=solution.budget_bytes if solution.budget_bytes >= 0 else None,
        recompute_flops=solution.recompute_flops,
        attention_flops=solution.attention_flops,
        admitted_matmuls=solution.admitted_matmuls,
        solve_seconds=solve_seconds,
        flow_vertices=solution.flow_vertices,
        flow_edges=solution.flow_edges,
        layers=layers,
        nodes=node_rows,
    )


def make_partition_fn(
    policy: RematPolicy = "sequence-aware",
    *,
    recompute_flops_ratio: float = DEFAULT_RECOMPUTE_FLOPS_RATIO,
    report: RematReport | None = None,
) -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
    """Returns an AOTAutograd partition function,
    ``(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs) -> (fw_module, bw_module)``,
    that decides the saved set with autosp's C++ min-cut under ``policy``.

    ``recompute_flops_ratio`` is the sequence-aware allowance (see
    :data:`DEFAULT_RECOMPUTE_FLOPS_RATIO`); ``report``, if given, receives one
    :class:`GraphRematReport` per partitioned graph. Raises :class:`AutospError` for an unknown
    policy at once, and from the call for a budget no recomputation meets.
    """
    # Validate now (a bad policy fails at compile set-up), but build the core options per call:
    # torch keeps partition functions alive until exit, and they should not pin core objects.
    _core_options(policy, recompute_flops_ratio)

    def autosp_remat_partition(
        joint_module: fx.GraphModule,
        joint_inputs: Any,
        *,
        num_fwd_outputs: int,
        static_lifetime_input_indices: list[int] | None = None,
        **kwargs: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        return _partition(
            joint_module,
            joint_inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
            policy=policy,
            options=_core_options(policy, recompute_flops_ratio),
            report=report,
        )

    autosp_remat_partition.autosp_policy = policy  # type: ignore[attr-defined]
    return autosp_remat_partition


def _cache_key(policy: RematPolicy, recompute_flops_ratio: float) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(Path(_core.__file__).read_bytes())
    h.update(repr((_policy_name(policy), float(recompute_flops_ratio))).encode())
    return h.hexdigest()


def _custom_partitioner_base() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


class AutospRematPartitioner(_custom_partitioner_base()):  # type: ignore[misc]
    """autosp's partition function in Inductor's ``custom_partitioner_fn`` hook. Inductor
    pickles its config into cache keys, so this pickles as (policy, ratio) -- a report is a
    per-run side channel, not part of the identity."""

    def __init__(
        self,
        policy: RematPolicy,
        recompute_flops_ratio: float,
        report: RematReport | None = None,
        partition_fn: Callable | None = None,
    ) -> None:
        self.policy = policy
        self.recompute_flops_ratio = recompute_flops_ratio
        self.report = report
        self.partition_fn = partition_fn or make_partition_fn(
            policy, recompute_flops_ratio=recompute_flops_ratio, report=report
        )

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        kwargs.pop("compiler", None)
        return self.partition_fn(gm, joint_inputs, **kwargs)

    def uuid(self) -> Any:
        return _cache_key(self.policy, self.recompute_flops_ratio)

    def __reduce__(self) -> tuple[Any, ...]:
        return (AutospRematPartitioner, (self.policy, self.recompute_flops_ratio))

    # Config snapshots copy their values; a copy must keep the same partition function and
    # report, not be rebuilt from __reduce__.
    def __copy__(self) -> "AutospRematPartitioner":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "AutospRematPartitioner":
        return self


def compile_joint(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    policy: RematPolicy = "sequence-aware",
    backend: str = "inductor",
    recompute_flops_ratio: float = DEFAULT_RECOMPUTE_FLOPS_RATIO,
    report: RematReport | None = None,
) -> Callable:
    """What a Dynamo backend returns for ``gm``: AOTAutograd over it with autosp's partition
    function, then Inductor (``backend="inductor"``, through Inductor's
    ``custom_partitioner_fn`` hook, so Inductor's joint-graph passes still run first) or eager
    execution of the forward and backward graphs (``backend="aot_eager"``).

    With a ``report``, Inductor's caches are bypassed so that the partitioner runs and reports.
    """
    if backend not in BACKENDS:
        raise AutospError(
            f"[remat] unknown backend {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}"
        )
    partition_fn = make_partition_fn(
        policy, recompute_flops_ratio=recompute_flops_ratio, report=report
    )
    if backend == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd

        from autosp.backend import eager_graph

        return aot_autograd(
            fw_compiler=eager_graph,
            bw_compiler=eager_graph,
            partition_fn=partition_fn,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # Inductor's supported hook (torch >= 2.9): compile_fx runs its joint-graph passes, then
    # calls this partitioner instead of min_cut_rematerialization_partition.
    partitioner = AutospRematPartitioner(
        policy, recompute_flops_ratio, report=report, partition_fn=partition_fn
    )
    if report is None:
        with inductor_config.patch(custom_partitioner_fn=partitioner):
            return compile_fx(gm, example_inputs)
    # A report is filled only when the partitioner runs: bypass the graph-level caches (compiled
    # kernels stay cached).
    from torch._functorch import config as functorch_config

    with (
        inductor_config.patch(
            custom_partitioner_fn=partitioner, fx_graph_cache=False, fx_graph_remote_cache=False
        ),
        functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False),
    ):
        return compile_fx(gm, example_inputs)


def backend(
    policy: RematPolicy = "sequence-aware",
    backend: str = "inductor",
    **kw: Any,
) -> Callable[[fx.GraphModule, list[Any]], Callable]:
    """A Dynamo backend for plain ``torch.compile`` (no sequence parallelism) that partitions
    with ``policy``: ``torch.compile(model, backend=autosp.remat.backend("sequence-aware"))``.
    Keyword arguments (``recompute_flops_ratio``, ``report``) go to :func:`compile_joint`."""
    _core_options(policy, kw.get("recompute_flops_ratio", DEFAULT_RECOMPUTE_FLOPS_RATIO))
    if backend not in BACKENDS:
        raise AutospError(
            f"[remat] unknown backend {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}"
        )
    compiler_backend = backend

    def autosp_remat_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return compile_joint(gm, example_inputs, policy=policy, backend=compiler_backend, **kw)

    return autosp_remat_backend
