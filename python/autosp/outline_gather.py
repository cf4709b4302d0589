"""Gathering a decoder layer's nodes for autosp.outline: the graph's numbered layers
(``layers.3``), each made one contiguous run of nodes in place (``gather``), and the autocast
and grad mode each node runs under (``contexts``). A node that writes in place or draws random
numbers is never moved (``movable``)."""

from __future__ import annotations

import torch
import torch.fx as fx

from autosp.bridge import writes_in_place
from autosp.canon import target_name
from autosp.ops import AUTOCAST_SETTERS, GRAD_MODE_SETTERS, is_random
from autosp.remat_facts import _layer_of


def op_name(node: fx.Node) -> str:
    """The name autosp.ops knows a call by: canon's Torch-level name, but an ATen overload's op
    name (``aten.t.default``: "t") and a ``getattr``'s attribute (Dynamo records ``x.mT`` as
    ``getattr(x, "mT")``)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    if t is getattr and len(node.args) > 1 and isinstance(node.args[1], str):
        return node.args[1]
    return target_name(node)


def movable(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if writes_in_place(node) or is_random(op_name(node)):
        return False
    try:
        return not node.is_impure()
    except Exception:  # a call_module the purity check cannot resolve
        return False


def numbered_layers(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    cache: dict[str, str] = {}
    layers: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            layer = _layer_of(n, cache)
            if layer.rpartition(".")[2].isdigit():
                layers.setdefault(layer, []).append(n)
    return layers


def gather(graph: fx.Graph, layer: str, members: list[fx.Node],
            tag: dict[fx.Node, str]) -> tuple[list[fx.Node], str]:
    """Makes one layer's nodes a contiguous run, in place. Between its first and last node,
    what lies on a path between two of its nodes (SP glue without a module), or is read by it
    alone (an inserted size), joins it; what else it does not depend on moves before it (the
    rotary table); what depends on it but feeds none of it moves after it; its last nodes that
    hang off it past other modules' nodes join its end (:func:`_hanging`). Returns the run, or
    why there is none."""
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    hanging = _hanging(graph, order, pos, members)
    if hanging:
        members = members[:len(members) - len(hanging)]
    span = order[pos[members[0]]: pos[members[-1]] + 1]
    mset = set(members)
    down: set[fx.Node] = set()
    for n in span:
        if n in mset or any(a in down for a in n.all_input_nodes):
            down.add(n)
    up: set[fx.Node] = set()
    for n in reversed(span):
        if n in mset or any(u in up for u in n.users):
            up.add(n)
    inside = {n for n in span if n in down and n in up}
    for n in reversed(span):  # what only the layer reads (an inserted size) joins it
        if n not in down and n.users and all(u in inside for u in n.users) and movable(n):
            inside.add(n)
    run = [n for n in span if n in inside]
    for n in run:
        other = tag.get(n, layer)
        if other != layer:
            return [], f"its nodes are interleaved with {other}'s ({n.name})"
    before = [n for n in span if n not in down and n not in inside]
    after = [n for n in span if n in down and n not in up]
    if not before and not after:
        return _join(run, hanging), ""
    # Moving a node across a write in place can change what it reads: the write may reach
    # it through a view the graph does not connect (breaker helper-82: a helper's node read
    # the layer's input through a view, moved before the layer's x.mul_, and the step was
    # wrong although the layer then stayed inline for writing in place).
    write = next((n for n in span if writes_in_place(n)), None)
    if write is not None:
        return [], (f"its nodes are not one contiguous run, and {write.name} between them "
                    "writes in place (nothing is moved across it)")
    stuck = next((n for n in before + after if not movable(n)), None)
    if stuck is not None:
        what = ("a module attribute the graph reads, such as a flex attention score_mod"
                if stuck.op == "get_attr" else
                "it writes in place or draws random numbers" if stuck.op.startswith("call_")
                else stuck.op)
        return [], (f"its nodes are not one contiguous run, and {stuck.name} between them "
                    f"may not move ({what})")
    anchor = order[pos[members[-1]] + 1]
    for n in before + run + after:
        anchor.prepend(n)
    return _join(run, hanging), ""


def _hanging(graph: fx.Graph, order: list[fx.Node], pos: dict[fx.Node, int],
             members: list[fx.Node]) -> list[fx.Node]:
    """The layer's last nodes that hang off it after other modules' nodes: each movable, read
    by none of the layer's nodes, and reading only the layer's nodes or what comes before
    the layer. The SP rewrite's gather of a value the graph returns takes the layer's module
    path but sits before the graph's output: a Hugging Face model with ``use_cache=True`` returns
    each layer's keys and values, and every layer but the last spanned the rest of the graph.
    They join the end of the layer's run (:func:`_join`), unless that would move one across a
    write in place or into another autocast or grad mode (breaker helper-86: the layer's module
    called again after the loop under ``torch.no_grad()`` was moved out of it, and its gradients
    were wrong although the layer then stayed inline)."""
    mset = set(members)
    hanging: list[fx.Node] = []
    for m in reversed(members[1:]):
        if not movable(m) or any(u in mset for u in m.users):
            break
        hanging.append(m)
    hanging.reverse()
    core = members[:len(members) - len(hanging)]
    if not hanging or pos[hanging[-1]] - pos[core[-1]] == len(hanging):
        return []  # none, or already next to the layer
    first, core_set = pos[core[0]], set(core)
    if any(a not in core_set and a not in hanging and pos[a] >= first
           for h in hanging for a in h.all_input_nodes):
        return []
    between = order[pos[core[-1]] + 1: pos[hanging[-1]]]
    if any(writes_in_place(n) for n in between):
        return []
    mode = contexts(graph)
    if any(mode[h] != mode[core[-1]] for h in hanging):
        return []
    return hanging


def _join(run: list[fx.Node], hanging: list[fx.Node]) -> list[fx.Node]:
    """Moves the :func:`_hanging` nodes to right after ``run``, in their order."""
    prev = run[-1]
    for h in hanging:
        prev.append(h)
        prev = h
    return run + hanging


def contexts(graph: fx.Graph) -> dict[fx.Node, tuple]:
    """The autocast and grad mode each node runs under, from the graph's context nodes
    (Dynamo's ``_enter_autocast``/``_exit_autocast``, ``_set_grad_enabled``, and the autocast
    setters such as ``set_autocast_dtype``: every call so far, so a node after one never shares
    a mode with a node before it)."""
    state: dict[fx.Node, tuple] = {}
    stack: list[tuple] = []
    grad = None
    setters: tuple = ()
    for n in graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == "_enter_autocast":
            stack.append(tuple(repr(a) for a in n.args))
        elif name == "_exit_autocast" and stack:
            stack.pop()
        elif name in GRAD_MODE_SETTERS:
            grad = repr(n.args)
        elif name in AUTOCAST_SETTERS:
            setters += ((name, repr(n.args)),)
        state[n] = (tuple(stack), grad, setters)
    return state
