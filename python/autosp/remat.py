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

Modules: ``autosp.remat_policy`` (policies, MemoryBudget, reports, the solver's options),
``autosp.remat_facts`` (facts about the joint graph), and this one (the partition function,
the partitioner and the backend).
"""

from __future__ import annotations

import hashlib
import inspect
import time
from typing import Any, Callable, Sequence

import torch.fx as fx

from autosp import _core
from autosp.compile_cache import load_reports, marked_cacheable, report_key, save_reports, source_hash
from autosp.errors import AutospError
from autosp.remat_facts import SizeFn, _partitioners, gather_facts, node_flops
from autosp.remat_policy import (BACKENDS, DEFAULT_RECOMPUTE_FLOPS_RATIO, POLICIES,
                                 GraphRematReport, LayerRemat, MemoryBudget, NodeRemat,
                                 RematPolicy, RematReport, _core_options, _policy_name)

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
        model_flops=float(sum(f.flops for f in facts)),
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
    h = hashlib.sha256(source_hash().encode())
    # A budget by its exact value (its display name rounds the fraction).
    h.update(repr((policy if isinstance(policy, MemoryBudget) else str(policy),
                   float(recompute_flops_ratio))).encode())
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

    PyTorch's AOTAutograd and FX graph caches take these graphs (autosp.compile_cache). A
    ``report`` gets the partition's report also on a cache hit: the one saved beside the cache
    when the partition was made, or, where there is none, by compiling again without the
    graph-level caches.
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
    # autosp's SP functions in the graph get a key (autosp.compile_cache), so that AOTAutograd's
    # cache takes the graph rather than bypassing it.
    cacheable = marked_cacheable()
    with inductor_config.patch(custom_partitioner_fn=partitioner,
                               unsafe_marked_cacheable_functions=cacheable):
        if report is None:
            return compile_fx(gm, example_inputs)
        # A report is filled when the partitioner runs; on a cache hit it is read back from
        # beside the cache (autosp.compile_cache), or, where it is not there, the graph is
        # compiled again with the graph-level caches off (compiled kernels stay cached).
        key = report_key(gm, example_inputs, partitioner.uuid())
        before = len(report.graphs)
        compiled = compile_fx(gm, example_inputs)
        if len(report.graphs) > before:
            save_reports(key, report.graphs[before:])
            return compiled
        stored = load_reports(key)
        if stored is not None:
            report.graphs.extend(stored)
            return compiled
    from torch._functorch import config as functorch_config

    with (
        inductor_config.patch(
            custom_partitioner_fn=partitioner, fx_graph_cache=False, fx_graph_remote_cache=False,
            unsafe_marked_cacheable_functions=cacheable,
        ),
        functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False),
    ):
        compiled = compile_fx(gm, example_inputs)
    save_reports(key, report.graphs[before:])
    return compiled


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
