"""Compiling a decoder layer once (``autosp.compile(..., regions=True)``, experimental).

After the SP rewrite, the layers of the applied graph that are node for node alike (same ops,
same constants, same wiring, operands of the same kinds) are each replaced by a call of
PyTorch's ``invoke_subgraph`` higher-order op on one shared subgraph. AOTAutograd then traces
and partitions that subgraph once (with autosp's partition function, on the region's own joint
graph), and Inductor lowers and generates its kernels once, so the compile's work stops growing
with depth (docs/regional_compile.md).

A layer stays inline, with the reason recorded, when it is not one contiguous run of nodes, when
an operand is neither a tensor nor a symbolic int, when it reads a module attribute, writes in
place, or hands on a value that may alias an operand (a view, ``view_as``, a collective's wait):
PyTorch assumes a region's outputs alias nothing, and checks none of it.

Remat decisions are then made per region, not per layer: every outlined layer saves what one
layer saves when solved alone. That is exact, but it is not what the flat solve of
``"sequence-aware"`` gives when its FLOP allowance ends part-way through the layers.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autosp.remat_facts import _layer_of

#: Ops whose result may share its operand's storage: a region may not hand one on.
_ALIASING = {"view", "_unsafe_view", "reshape", "view_as", "t", "transpose", "permute",
             "expand", "squeeze", "unsqueeze", "alias", "detach", "slice", "select", "narrow",
             "split", "chunk", "unbind", "as_strided", "wait_tensor", "contiguous", "flatten",
             "unflatten", "diagonal", "movedim", "__getitem__", "getitem", "real", "imag",
             "view_as_real", "view_as_complex", "grad_sync", "to", "type_as", "float"}


def _name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t)


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _operand_kind(node: fx.Node) -> Any:
    v = _value(node)
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.dim(), v.requires_grad)
    if isinstance(v, torch.SymInt):
        return ("symint",)
    return None


class _Region:
    def __init__(self, layer: str, nodes: list[fx.Node]) -> None:
        self.layer = layer
        self.nodes = nodes
        inside = set(nodes)
        self.operands: list[fx.Node] = []
        seen: set[fx.Node] = set()
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in seen:
                    seen.add(a)
                    self.operands.append(a)
        self.outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        self.why_not = self._check(inside)
        self.key = None if self.why_not else self._key()

    def _check(self, inside: set[fx.Node]) -> str:
        for n in self.nodes:
            if n.op not in ("call_function", "call_method", "call_module"):
                return f"it has a {n.op} node {n.name}"
            name = _name(n)
            if name.endswith("_") and not name.startswith("_") or "inplace" in str(n.kwargs):
                return f"it writes in place ({n.name})"
        for a in self.operands:
            if _operand_kind(a) is None:
                return f"its operand {a.name} is neither a tensor nor a symbolic int"
        for o in self.outputs:
            if _name(o) in _ALIASING or o.target is operator.getitem:
                return f"its output {o.name} ({_name(o)}) may alias a value it reads"
            if not isinstance(_value(o), torch.Tensor):
                return f"its output {o.name} is not a tensor"
        return ""

    def _key(self) -> tuple:
        index = {n: i for i, n in enumerate(self.nodes)}
        operand = {a: i for i, a in enumerate(self.operands)}

        def arg(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return ("n", index[a]) if a in index else ("in", operand[a])
            if isinstance(a, (list, tuple)):
                return (type(a).__name__, tuple(arg(x) for x in a))
            if isinstance(a, dict):
                return ("dict", tuple(sorted((k, arg(v)) for k, v in a.items())))
            if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
                return str(a)
            return (type(a).__name__, repr(a))

        ops = tuple((n.op, str(n.target), arg(n.args), arg(n.kwargs)) for n in self.nodes)
        kinds = tuple(_operand_kind(a) for a in self.operands)
        outs = tuple(index[o] for o in self.outputs)
        return ops, kinds, outs


def _regions(gm: fx.GraphModule) -> tuple[list[_Region], list[str]]:
    """The graph's layers as regions (each a contiguous run of nodes of one layer)."""
    cache: dict[str, str] = {}
    runs: list[tuple[str, list[fx.Node]]] = []
    for n in gm.graph.nodes:
        layer = _layer_of(n, cache) if n.op in ("call_function", "call_method", "call_module") else ""
        numbered = layer.rpartition(".")[2].isdigit()
        if runs and runs[-1][0] == layer and numbered:
            runs[-1][1].append(n)
        else:
            runs.append((layer if numbered else "", [n]))
    # Nodes of no layer between two runs of one layer (sizes, inserted SP glue) join it.
    merged: list[tuple[str, list[fx.Node]]] = []
    for layer, nodes in runs:
        if (layer and len(merged) >= 2 and merged[-2][0] == layer and not merged[-1][0]
                and all(n.op == "call_function" or n.op == "call_method" for n in merged[-1][1])):
            gap = merged.pop()[1]
            merged[-1][1].extend(gap + nodes)
        elif layer and merged and merged[-1][0] == layer:
            merged[-1][1].extend(nodes)
        else:
            merged.append((layer, list(nodes)))
    runs = merged
    skipped: list[str] = []
    seen: set[str] = set()
    regions = []
    for layer, nodes in runs:
        if not layer:
            continue
        if layer in seen:
            skipped.append(f"{layer}: not outlined: its nodes are not one contiguous run")
            regions = [r for r in regions if r.layer != layer]
            continue
        seen.add(layer)
        regions.append(_Region(layer, nodes))
    return regions, skipped


def outline_layers(gm: fx.GraphModule) -> list[str]:
    """Replaces, in place, each class of two or more alike layers of ``gm`` by
    ``invoke_subgraph`` calls of one subgraph per class. Returns one line per layer: which
    subgraph it calls, or why it stays inline."""
    regions, lines = _regions(gm)
    classes: dict[Any, list[_Region]] = {}
    for r in regions:
        if r.why_not:
            lines.append(f"{r.layer}: not outlined: {r.why_not}")
        else:
            classes.setdefault(r.key, []).append(r)
    graph = gm.graph
    replaced: dict[fx.Node, fx.Node] = {}  # an earlier region's output -> its getitem
    for k, members in enumerate(classes.values()):
        if len(members) < 2:
            lines.append(f"{members[0].layer}: not outlined: no other layer is alike")
            continue
        name = f"autosp_layer_{k}"
        gm.add_submodule(name, _subgraph(gm, members[0]))
        for r in members:
            with graph.inserting_before(r.nodes[0]):
                attr = graph.get_attr(name)
                operands = [replaced.get(a, a) for a in r.operands]
                call = graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                           (attr, name, *operands))
                for i, o in enumerate(r.outputs):
                    item = graph.call_function(operator.getitem, (call, i))
                    item.meta.update(o.meta)
                    o.replace_all_uses_with(item)
                    replaced[o] = item
            for n in reversed(r.nodes):
                graph.erase_node(n)
            lines.append(f"{r.layer}: calls {name}")
    graph.lint()
    gm.recompile()
    return lines


def _subgraph(gm: fx.GraphModule, region: _Region) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(region.operands):
        p = g.placeholder(f"arg{i}_{a.name}")
        p.meta.update(a.meta)
        env[a] = p
    for n in region.nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in region.outputs))
    return fx.GraphModule(gm, g)
