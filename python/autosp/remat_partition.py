"""autosp's AOTAutograd partition function (see autosp.remat): gathers the joint graph's facts,
has the C++ solver decide the saved set, builds the forward and backward graphs with PyTorch's
own extraction, and reports what it decided."""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from autosp import _core, remat_regions
from autosp.errors import AutospError
from autosp.remat_facts import _partitioners, gather_facts
from autosp.remat_extract import fast_extraction
from autosp.remat_graphs import cse_in_place, eliminate_dead_code, reorder_like_autograd
from autosp.remat_offload import offload
from autosp.remat_policy import (DEFAULT_RECOMPUTE_FLOPS_RATIO, GraphRematReport, LayerRemat, NodeRemat,
                                 RematPolicy, RematReport, _core_options, _policy_name)
from autosp.remat_regions import RegionChoices

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
    choices: RegionChoices | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    from torch._dynamo import config as dynamo_config
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    # As Dynamo and Inductor run AOTAutograd (and so PyTorch's partitioner): the modules built
    # here generate their Python code when it is first needed, not at every step. PyTorch's
    # helpers extract subgraphs without copying what they would then remove
    # (autosp.remat_extract).
    with _use_lazy_graph_module(dynamo_config.use_lazy_graph_module), fast_extraction():
        return _partition_graphs(
            joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices, policy=policy,
            options=options, report=report, choices=choices,
        )


def _partition_graphs(
    joint_module: fx.GraphModule,
    joint_inputs: Any,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    policy: RematPolicy,
    options: Any,
    report: RematReport | None,
    choices: RegionChoices | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    partitioners = _partitioners()
    from torch._functorch import config as functorch_config
    from torch._functorch.compile_utils import fx_graph_cse, raise_getitems
    from torch.fx._lazy_graph_module import _make_graph_module
    from torch.fx.experimental.proxy_tensor import is_sym_node

    # The same preparation as min_cut_rematerialization_partition, so the flow network is built
    # on the same graph PyTorch's partitioner would see. The joint module's code is regenerated
    # only where its graph changed, and the CSE is done in place (autosp.remat_graphs) rather
    # than by copying every node.
    if eliminate_dead_code(joint_module.graph):
        joint_module.recompile()
    if functorch_config.cse and not cse_in_place(joint_module):
        joint_module = _make_graph_module(joint_module, fx_graph_cse(joint_module.graph))
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

    fwd_outputs = joint_graph.output_node().args[0][:num_fwd_outputs]
    nodes, facts = gather_facts(joint_graph, node_info,
                                [n for n in fwd_outputs if isinstance(n, fx.Node)])
    # With regions (autosp.outline), sequence-aware's choice is kept per layer
    # (autosp.remat_regions): a stamped region takes its layers' admissions, a graph calling
    # regions makes the choice over every call.
    per_layer = choices is not None and remat_regions.applies(options)
    stamped = None
    if per_layer:
        stamped = remat_regions.stamped_admissions(joint_graph, facts)
        if stamped is None:
            remat_regions.split_early(joint_graph, facts, options.recompute_flops_ratio)
        options.admitted = stamped if stamped is not None else \
            remat_regions.calling_graph_admissions(choices, joint_module, nodes, facts,
                                                   options.recompute_flops_ratio)
    start = time.perf_counter()
    try:
        solution = _core.solve_remat(facts, options)
    except (RuntimeError, ValueError) as e:
        raise AutospError(
            f"{e} [policy {_policy_name(policy)}; joint graph of {len(nodes)} nodes]"
        ) from None
    solve_seconds = time.perf_counter() - start

    saved = [nodes[i] for i in solution.saved]
    # torch < 2.13 has no _is_assert_only_symbool: its partitioner saves every sym node.
    assert_only = getattr(partitioners, "_is_assert_only_symbool", lambda n: False)
    saved_sym_nodes = [n for n in saved if is_sym_node(n) and not assert_only(n)]
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
    bw_module = reorder_like_autograd(bw_module)
    offload_copies, offloaded_bytes = 0, 0
    if solution.offloaded:
        chosen = {nodes[i].name: facts[i].bytes for i in solution.offloaded}
        moved = offload(fw_module, bw_module, list(chosen), num_fwd_outputs,
                         node_info.static_lifetime_input_nodes)
        offload_copies, offloaded_bytes = len(moved), sum(chosen[name] for name in moved)
    if (options.offload_layer_outputs or options.offload_layer_saved) and offload_copies == 0:
        import warnings

        why = ("the values it chose are model outputs or not contiguous, which PyTorch's "
               "offloading pass skips" if solution.offloaded else
               "no saved value that leaves a numbered decoder layer can be offloaded: none is "
               "saved (Inductor's decomposition of LayerNorm, for one, saves the normalised "
               "value inside the next layer instead), or they are strided views")
        warnings.warn(f"[remat] Offload: nothing offloaded in this graph of {len(nodes)} nodes: "
                      f"{why}; it trains as {_policy_name(policy).split(' + offload')[0]}",
                      stacklevel=2)
    fw_module = raise_getitems(fw_module)
    bw_module = raise_getitems(bw_module)
    if hasattr(partitioners, "thread_graphsafe_rng_from_hops"):
        fw_module = partitioners.thread_graphsafe_rng_from_hops(fw_module, is_backward=False)
        bw_module = partitioners.thread_graphsafe_rng_from_hops(bw_module, is_backward=True)

    if per_layer:
        remat_regions.record(choices, fw_module, bw_module, facts, solution)
    if report is not None:
        graph_report = _graph_report(policy, solution, facts, solve_seconds, offload_copies,
                                     offloaded_bytes)
        report.graphs.append(_count_regions(report, joint_module, graph_report))
        report.forwards[fw_module] = report.graphs[-1]
    return fw_module, bw_module


def _count_regions(report: RematReport, joint_module: fx.GraphModule,
                   graph_report: GraphRematReport) -> GraphRematReport:
    """With regions (autosp.outline), the report of a graph that calls region graphs: their
    model, recompute and attention FLOPs are added once per forward call, and each region's
    report records its number of calls. The saved values of the regions are already the
    enclosing graph's (the forward calls return them)."""
    calls: dict[int, list[Any]] = {}
    for n in joint_module.graph.nodes:
        if n.target is torch.ops.higher_order.invoke_subgraph and isinstance(n.args[0], fx.Node):
            module = getattr(joint_module, str(n.args[0].target), None)
            region = report.forwards.get(module)
            if region is not None:
                calls.setdefault(id(region), [region, 0, module])[1] += 1
    if not calls:
        return graph_report
    for region, count, module in calls.values():
        i = next(i for i, g in enumerate(report.graphs) if g is region)
        report.graphs[i] = report.forwards[module] = dataclasses.replace(region, calls=count)
    return dataclasses.replace(
        graph_report,
        model_flops=graph_report.model_flops + sum(r.model_flops * c for r, c, _ in calls.values()),
        recompute_flops=graph_report.recompute_flops
        + sum(r.recompute_flops * c for r, c, _ in calls.values()),
        attention_flops=graph_report.attention_flops
        + sum(r.attention_flops * c for r, c, _ in calls.values()))


def _graph_report(
    policy: RematPolicy, solution: Any, facts: list[Any], solve_seconds: float,
    offload_copies: int = 0, offloaded_bytes: int = 0,
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
        offloaded_bytes=offloaded_bytes,
        offload_copies=offload_copies,
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
    choices = RegionChoices()

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
            choices=choices,
        )

    autosp_remat_partition.autosp_policy = policy  # type: ignore[attr-defined]
    return autosp_remat_partition
