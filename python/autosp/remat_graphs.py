"""Graph rewrites for autosp's partition function (``autosp.remat_partition``) that give exactly
the graphs PyTorch's own helpers give, without copying every node into a new graph: at 16
layers a copy costs ~0.1 s (FX validates every argument of every node it creates)."""

from __future__ import annotations

import torch
import torch.fx as fx


def reorder_like_autograd(gm: fx.GraphModule) -> fx.GraphModule:
    """PyTorch's ``reordering_to_mimic_autograd_engine`` done in place: the same nodes, names and
    order, and the namespace a fresh copy would have, so nodes added later get the same names.

    PyTorch copies into a new graph: the placeholders; then, from the first user of a tangent to
    the end (and any ``copy_`` before it), each node after the inputs it needs that are not yet
    placed, in graph order. Nodes never reached are left out. Here the same order is computed,
    the unreached nodes are erased, the rest moved into that order, and the namespace replayed.
    A graph with ``get_attr`` nodes goes to PyTorch's pass (its new module keeps only the
    attributes the new graph reads)."""
    from torch._functorch import partitioners
    from torch.fx.graph import _Namespace

    graph = gm.graph
    if graph.find_nodes(op="get_attr"):
        return partitioners.reordering_to_mimic_autograd_engine(gm)
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    first = min(
        (order[user] for node in nodes if partitioners._is_tangent(node) for user in node.users),
        default=None,
    )
    if first is None:  # the gradients do not depend on the tangents: PyTorch keeps gm
        return gm

    placed = {node for node in nodes if node.op == "placeholder"}
    new_order = [node for node in nodes if node.op == "placeholder"]

    def place(node: fx.Node) -> None:
        pending, reached = [node], set()
        while pending:
            n = pending.pop()
            if n in reached or n in placed:
                continue
            reached.add(n)
            pending += n.all_input_nodes
        for n in sorted(reached, key=order.__getitem__):
            placed.add(n)
            new_order.append(n)

    copy_ = torch.ops.aten.copy_.default
    for node in nodes[:first]:
        if node.op == "call_function" and node.target is copy_:
            place(node)
    for node in nodes[first:]:
        place(node)

    for node in reversed(nodes):  # users before their inputs
        if node not in placed:
            graph.erase_node(node)
    prev = graph._root
    for node in new_order:
        if prev._next is not node:
            prev.append(node)
        prev = node
    namespace = _Namespace()
    for node in new_order:
        name = namespace.create_name(node.name, None)
        if name != node.name:  # cannot happen: the names were unique in one namespace
            raise AssertionError(f"[remat] reorder renamed {node.name} to {name}")
        namespace.associate_name_with_obj(name, node)
    graph._graph_namespace = namespace
    gm.recompile()
    return gm
