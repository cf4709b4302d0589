"""The partition function's offloading (``autosp.remat_partition``, policy ``Offload``): the
saved values the solver chose go to host memory through PyTorch's activation-offloading pass,
views and getitems handed to it as copies. Split from ``autosp.remat_partition``."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from autosp.errors import AutospError


def offload(fw_module: fx.GraphModule, bw_module: fx.GraphModule, names: list[str],
            num_fwd_outputs: int, static_lifetime_input_nodes: Any) -> list[str]:
    """Has PyTorch's activation-offloading pass copy the saved values ``names`` (chosen by the
    solver) to host memory after the forward computes them and back where the backward first
    reads them: on CUDA on a side stream, the backward prefetching ahead of use; elsewhere as
    plain copies. Returns the names it copied (the pass skips model outputs and non-contiguous
    values; views and getitems it is handed as copies, :func:`_copy_views_and_getitems`)."""
    import torch
    from torch._functorch import config as functorch_config

    from autosp.remat_partition import _call_supported

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
