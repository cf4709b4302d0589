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
        moved = _offload(fw_module, bw_module, list(chosen), num_fwd_outputs,
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


def _offload(fw_module: fx.GraphModule, bw_module: fx.GraphModule, names: list[str],
             num_fwd_outputs: int, static_lifetime_input_nodes: Any) -> list[str]:
    """Has PyTorch's activation-offloading pass copy the saved values ``names`` (chosen by the
    solver) to host memory after the forward computes them and back where the backward first
    reads them: on CUDA on a side stream, the backward prefetching ahead of use; elsewhere as
    plain copies. Returns the names it copied (the pass skips model outputs and non-contiguous
    values; views and getitems it is handed as copies, :func:`_copy_views_and_getitems`)."""
    import torch
    from torch._functorch import config as functorch_config

    try:
        from torch._functorch._activation_offloading.activation_offloading import (
            CPU_OFFLOAD_PREFIX, enable_activation_offloading)
    except ImportError:
        raise AutospError(
            f"[remat] remat=Offload(...) needs PyTorch's activation-offloading pass "
            f"(torch._functorch._activation_offloading), which torch {torch.__version__} does "
            "not have; use a remat policy without Offload") from None
    copies_of = _copy_views_and_getitems(fw_module, bw_module, names, num_fwd_outputs)
    chosen = {copies_of.get(name, name) for name in names}
    on_cuda = False
    for node in fw_module.graph.nodes:
        if node.name in chosen:
            node.meta["should_offload"] = True
            val = node.meta.get("val")
            on_cuda = on_cuda or (isinstance(val, torch.Tensor) and val.is_cuda)
    # Side stream, waits sunk to the end of the forward, reloads prefetched: CUDA only.
    flags = {k: on_cuda for k in ("activation_offload_separate_stream",
                                  "activation_offload_sink_wait", "activation_reload_prefetch")
             if hasattr(functorch_config, k)}
    with functorch_config.patch(flags):
        _call_supported(enable_activation_offloading, fw_module, bw_module, num_fwd_outputs,
                        static_lifetime_input_nodes)
    moved_copies = {n.name for n in fw_module.graph.nodes
                    if n.name in chosen and n.meta.get("saved_for_offloading", False)}
    moved = [name for name in names if copies_of.get(name, name) in moved_copies]
    fw_module.recompile()
    bw_module.recompile()
    copies = sum(1 for n in fw_module.graph.nodes if n.name.startswith(CPU_OFFLOAD_PREFIX))
    if copies != len(moved):  # PyTorch's pass changed how it marks what it moves
        raise AutospError(f"[remat] Offload: PyTorch's offloading pass made {copies} copies of "
                          f"{len(moved)} values marked saved_for_offloading; autosp bug")
    return moved


def _copy_views_and_getitems(fw_module: fx.GraphModule, bw_module: fx.GraphModule,
                             names: list[str], num_fwd_outputs: int) -> dict[str, str]:
    """PyTorch's offloading pass copies neither views nor getitems (a view shares its base's
    storage; a getitem, one output of a multi-output op such as SDPA's, may alias the others).
    For each contiguous one in ``names`` the forward saves a contiguous copy of it in its place
    (``aten.clone``: the storage it views is then freed after its last forward use, as a saved
    tensor of its own would be once offloaded), and the backward's input takes the copy's name,
    which is how the pass pairs them. The copy has the value's sizes and strides, so the
    backward is unchanged. Returns {name: the copy's name}."""
    import operator

    import torch
    from torch._functorch.partitioners import get_default_op_list
    from torch._guards import detect_fake_mode

    wanted = set(names)
    views = get_default_op_list()
    outputs = fw_module.graph.find_nodes(op="output")[0]
    bw_inputs = {n.name: n for n in bw_module.graph.find_nodes(op="placeholder")}
    taken = {n.name for n in fw_module.graph.nodes} | set(bw_inputs)
    copies: dict[str, str] = {}
    for node in list(fw_module.graph.nodes):
        if node.name not in wanted or node.name not in bw_inputs:
            continue
        if not (views.is_view(node) or node.target is operator.getitem):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_contiguous():
            continue
        name, k = f"{node.name}_copy", 0
        while name in taken:
            k += 1
            name = f"{node.name}_copy{k}"
        taken.add(name)
        with fw_module.graph.inserting_after(node):
            copy = fw_module.graph.create_node("call_function", torch.ops.aten.clone.default,
                                               (node,), {}, name=name)
        mode = detect_fake_mode([val])
        if mode is not None:
            with mode:
                copy.meta["val"] = val.clone()
        else:
            copy.meta["val"] = val
        if "tensor_meta" in node.meta:
            copy.meta["tensor_meta"] = node.meta["tensor_meta"]
        for key in ("nn_module_stack", "stack_trace", "seq_nr"):
            if key in node.meta:
                copy.meta[key] = node.meta[key]
        flat = list(outputs.args[0])
        flat[num_fwd_outputs:] = [copy if a is node else a for a in flat[num_fwd_outputs:]]
        outputs.args = (tuple(flat), *outputs.args[1:])
        bw_inputs[node.name]._rename(name)
        if bw_inputs[node.name].name != name:  # the pass pairs them by name
            raise AutospError(f"[remat] Offload: could not name the backward's input {name!r} "
                              "after the copy of the value it reads; autosp bug")
        copies[node.name] = name
    return copies


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
