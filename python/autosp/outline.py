"""Compiling a decoder layer once (``autosp.compile``'s default ``regions="compile"``, and
``regions=True``).

After the SP rewrite, the layers of the applied graph that are node for node alike (same ops,
same constants, same wiring, operands of the same kinds and shapes) are each replaced by a call of
PyTorch's ``invoke_subgraph`` higher-order op on one shared subgraph. AOTAutograd then traces
and partitions that subgraph once (with autosp's partition function, on the region's own joint
graph), and Inductor lowers and generates its kernels once, so the compile's work stops growing
with depth (docs/regional_compile.md).

A layer's nodes are first gathered into one contiguous run (``autosp.outline_gather``). It
stays inline, with the reason recorded, when that would move a node that writes in place or
draws random numbers, when its nodes are interleaved with another layer's, when an operand is
neither a tensor, a symbolic int nor the rank, when it reads a module attribute, writes in
place, or hands on a value that may alias an operand (a view, ``view_as``, a collective's
wait): PyTorch assumes a region's outputs alias nothing, and checks none of it. The compile of
a graph with regions turns off Inductor's buffer reuse (autosp.remat.compile_joint), which
that assumption broke.

Remat stays per layer. ``"sequence-aware"`` chooses the matmuls to recompute over every layer,
and its allowance can end part-way through them: layers whose choices then differ call
subgraphs of their own (``outline_by_admissions``, autosp.remat_regions). ``MemoryBudget`` and
``Offload``, which decide over the whole graph in other ways, keep every layer inline
(``whole_graph_policy``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autosp.apply import RANK_INPUT
from autosp.bridge import writes_in_place
from autosp.ops import may_alias_call
from autosp.outline_gather import contexts, gather, numbered_layers, op_name
from autosp.remat_policy import MemoryBudget, Offload
from autosp.remat_regions import ADMIT_KEY, CALLS_KEY, LAYER_KEY

_SIZE_ARITHMETIC = (operator.mul, operator.floordiv, operator.add, operator.sub,
                    operator.truediv, operator.mod, operator.neg)


#: The identifier of autosp's region calls (``invoke_subgraph``'s second argument).
REGION_PREFIX = "autosp_layer_"


@contextlib.contextmanager
def regions_known_pure(gm: fx.GraphModule) -> Iterator[None]:
    """While AOTAutograd traces ``gm``: where every ``invoke_subgraph`` call in it is one of
    autosp's regions (no layer that writes in place is outlined, ``_Region._check``), PyTorch's
    check that a region writes none of its operands is skipped. PyTorch makes that check at
    every call it traces with gradients (``HigherOrderOperator.py_autograd_impl``: the region's
    schema, made by tracing the region again), 0.18 s a call under cProfile: 5.8 of the 51 s
    first call of a 16-layer Llama. Nothing else reads the flag; it is restored after."""
    hop = torch.ops.higher_order.invoke_subgraph
    ids = [n.args[1] for n in gm.graph.nodes if n.target is hop]
    flag = "_supports_training_input_mutation"  # torch 2.13; absent where no check is made
    if not ids or not hasattr(hop, flag) or not all(
            isinstance(i, str) and i.startswith(REGION_PREFIX) for i in ids):
        yield
        return
    before = getattr(hop, flag)
    setattr(hop, flag, True)
    try:
        yield
    finally:
        setattr(hop, flag, before)


def whole_graph_policy(remat: Any) -> str | None:
    """Why no layer may be outlined under remat policy ``remat``, or None. A region is
    partitioned on its own joint graph, so a policy whose decision is one for the whole graph
    would be applied to each region and to the calling graph separately."""
    if isinstance(remat, Offload):
        return ("no layer outlined: remat=Offload(...) offloads the hidden state each layer "
                "hands on, which an outlined layer keeps")
    if isinstance(remat, MemoryBudget):
        return ("no layer outlined: remat=MemoryBudget(...) caps the saved bytes of the whole "
                "graph; each region would be held to the whole budget alone, and the calling "
                "graph to it for what every region saves")
    return None


def _reads_inner_size(node: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether size arithmetic ``node`` reads, through other size arithmetic, the size of a
    tensor made inside the region (``inside``)."""
    for a in node.all_input_nodes:
        if a not in inside:
            continue
        if a.target in _SIZE_ARITHMETIC and _reads_inner_size(a, inside):
            return True
        if op_name(a) in ("sym_size", "sym_numel", "size", "numel") and any(
                t in inside for t in a.all_input_nodes):
            return True
    return False


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _operand_kind(node: fx.Node) -> Any:
    v = _value(node)
    if isinstance(v, torch.Tensor):  # a subgraph is traced once, with its first call's shapes
        # and strides (a layer handed a transposed copy failed in a view traced for a
        # contiguous operand: breaker helper-80)
        return ("tensor", v.dtype, tuple(str(d) for d in v.shape),
                tuple(str(d) for d in v.stride()), v.requires_grad)
    if isinstance(v, torch.SymInt):
        # By its expression in the symbolic sizes: a static compile (autosp.specialize) hands
        # the subgraph a plain int, and PyTorch traces a subgraph once, with its first call's
        # ints. Layers handed different sizes (S - 7 * i) shared one subgraph and all ran with
        # one layer's (breaker helper-80); one with an equal expression has an equal value.
        return ("symint", str(v.node.expr))
    if node.op == "placeholder" and node.target == RANK_INPUT:
        # The rank, which a static compile hands the graph as a symbol of its own
        # (autosp.shared_compile.rank_symbol): one value for every layer of a call.
        return ("rank",)
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
        self._add_size_symbols()
        self.why_not = self._check(inside)
        self.key = None if self.why_not else self._key()

    def _add_size_symbols(self) -> None:
        """Hands each symbol the operands' sizes are written in (S, with a dynamic S) to the
        region as an operand of its own, from the node before it that holds it (Dynamo's
        placeholder), unless an operand is that symbol already. The traced sizes are the single
        device's [B, S, H]; AOTAutograd's trace after the SP rewrite makes them [B, S//P, H],
        and Inductor binds a subgraph's symbols from its inputs, which it cannot do from S//P: a
        token-local layer (no attention, so no operand of size S) failed with "expected [s27]
        to have been codegen-ed")."""
        bound, needed = set(), set()
        for a in self.operands:
            v = _value(a)
            sizes = (list(v.shape) + list(v.stride()) if isinstance(v, torch.Tensor)
                     else [v] if isinstance(v, torch.SymInt) else [])
            for d in sizes:
                if isinstance(d, torch.SymInt):
                    needed.update(d.node.expr.free_symbols)
            if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
                bound.add(v.node.expr)
        missing = needed - bound
        first = self.nodes[0]
        if not missing:
            return
        # Dynamo's placeholders hold the symbols (an indexed lookup); the walk of the nodes
        # before the region only for one they do not.
        holders = itertools.chain(first.graph.find_nodes(op="placeholder"), first.graph.nodes)
        for n in holders:
            if n is first or not missing:
                break
            v = _value(n)
            if isinstance(v, torch.SymInt) and v.node.expr in missing:
                missing.discard(v.node.expr)
                self.operands.append(n)

    def _check(self, inside: set[fx.Node]) -> str:
        for n in self.nodes:
            if n.op not in ("call_function", "call_method", "call_module"):
                return f"it has a {n.op} node {n.name}"
            if n.target in _SIZE_ARITHMETIC and _reads_inner_size(n, inside):
                # The SP rewrite's size arithmetic (S/P from P * S/P) on the size of a tensor
                # made inside: AOTAutograd's trace of the subgraph loses track of the symbol
                # (nn.TransformerEncoder's decomposed attention, dynamic S).
                return f"it computes a size from one of its own tensors' sizes ({n.name})"
            if writes_in_place(n):
                return f"it writes in place ({n.name})"
            if n.meta.get("unbacked_bindings") or free_unbacked_symbols(_value(n)):
                # Inductor's code for the subgraph handed the caller a data-dependent size it
                # never defined ("name 'u7' is not defined", mask.nonzero(); helper-49).
                return f"it makes a data-dependent size ({n.name})"
        for a in self.operands:
            if _operand_kind(a) is None:
                return f"its operand {a.name} is neither a tensor, a symbolic int nor the rank"
        for n in self.operands + self.nodes:
            v = _value(n)
            if isinstance(v, torch.Tensor) and v.is_complex():
                return (f"it holds a complex tensor ({n.name}), for which PyTorch's "
                        "invoke_subgraph has no kernel (Conjugate)")
        for o in self.outputs:
            if not isinstance(_value(o), torch.Tensor):
                return f"its output {o.name} is not a tensor"
            if may_alias_call(op_name(o), o.args, o.kwargs) or o.target is operator.getitem:
                return f"its output {o.name} ({op_name(o)}) may alias a value it reads"
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
    """The graph's numbered layers as regions, each made one contiguous run of nodes. A
    region's key holds the autocast and grad mode it runs under: a subgraph is traced once, in
    its first call's mode (found: a layer under ``torch.autocast`` called the subgraph of fp32
    layers and ran in fp32; breaker helper-49). One that enters or leaves a mode, or that the
    gathering moved into another, stays inline."""
    before = contexts(gm.graph)
    layers = numbered_layers(gm.graph)
    tag = {n: layer for layer, nodes in layers.items() for n in nodes}
    skipped: list[str] = []
    regions = []
    for layer, members in layers.items():
        run, why = gather(gm.graph, layer, members, tag)
        if why:
            skipped.append(f"{layer}: not outlined: {why}")
        else:
            regions.append(_Region(layer, run))
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    after = contexts(gm.graph)
    for r in regions:  # a later layer's moves may not split an earlier run
        if not r.why_not and pos[r.nodes[-1]] - pos[r.nodes[0]] != len(r.nodes) - 1:
            r.why_not, r.key = "its nodes are not one contiguous run", None
        modes = {before[n] for n in r.nodes} | {after[n] for n in r.nodes}
        if not r.why_not and len(modes) > 1:
            r.why_not, r.key = "it enters or leaves torch.autocast or a grad mode", None
        elif not r.why_not:
            r.key = (r.key, modes.pop())
    return regions, skipped


def outline_layers(gm: fx.GraphModule,
                   admissions: dict[str, tuple[bool, ...]] | None = None) -> list[str]:
    """Replaces, in place, each class of two or more alike layers of ``gm`` by
    ``invoke_subgraph`` calls of one subgraph per class. Returns one line per layer: which
    subgraph it calls, or why it stays inline. ``admissions``, by layer: the sequence-aware
    admissions each layer needs (autosp.remat_regions); layers alike but for them call
    subgraphs of their own, each stamped with its admissions."""
    admissions = admissions or {}
    regions, lines = _regions(gm)
    classes: dict[Any, list[_Region]] = {}
    for r in regions:
        if r.why_not:
            lines.append(f"{r.layer}: not outlined: {r.why_not}")
        else:
            classes.setdefault((r.key, admissions.get(r.layer)), []).append(r)
    graph = gm.graph
    replaced: dict[fx.Node, fx.Node] = {}  # an earlier region's output -> its getitem
    for k, members in enumerate(classes.values()):
        if len(members) < 2:
            lines.append(f"{members[0].layer}: not outlined: no other layer is alike")
            continue
        admitted = admissions.get(members[0].layer)
        # A name of its own for each admission (PyTorch caches a region's partition by its
        # name, also across a compile made again under the same tracing context).
        name = f"{REGION_PREFIX}{k}" + ("" if admitted is None else
                                        "_r" + "".join("1" if a else "0" for a in admitted))
        for i, r in enumerate(members):
            # An operand may be an output of a layer replaced before (its getitem now).
            r.operands = [replaced.get(a, a) for a in r.operands]
            if i == 0:
                gm.add_submodule(name, _subgraph(gm, r, tuple(m.layer for m in members),
                                                 admitted))
            with graph.inserting_before(r.nodes[0]):
                attr = graph.get_attr(name)
                call = graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                           (attr, name, *r.operands))
                # The layer a call stands for, in `custom`: it reaches the joint graph's call.
                call.meta["custom"] = {**(call.meta.get("custom") or {}), LAYER_KEY: r.layer}
                for i, o in enumerate(r.outputs):
                    item = graph.call_function(operator.getitem, (call, i))
                    item.meta.update(o.meta)
                    o.replace_all_uses_with(item)
                    replaced[o] = item
            for n in reversed(r.nodes):
                graph.erase_node(n)
            lines.append(f"{r.layer}: calls {name}" + (
                "" if admitted is None else f" (sequence-aware admits {sum(admitted)} of its "
                f"{len(admitted)} matmuls, chosen over every layer)"))
    graph.lint()
    gm.recompile()
    return lines


def outline_by_admissions(pristine: fx.GraphModule, admissions: dict[str, tuple[bool, ...]]
                          ) -> tuple[fx.GraphModule, list[str]]:
    """A copy of ``pristine`` (a graph before outlining) outlined with these layers'
    sequence-aware admissions, and its lines as :func:`outline_layers` gives them."""
    gm = fx.GraphModule(pristine, copy.deepcopy(pristine.graph))
    gm.meta = dict(pristine.meta)
    return gm, outline_layers(gm, admissions)


def _subgraph(gm: fx.GraphModule, region: _Region, calls: tuple[str, ...],
              admitted: tuple[bool, ...] | None) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(region.operands):
        p = g.placeholder(f"arg{i}_{a.name}")
        p.meta.update(a.meta)
        env[a] = p
    for n in region.nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
        # On every node, so that it reaches the region's joint graph (remat_regions).
        custom = {**(n.meta.get("custom") or {}), CALLS_KEY: calls}
        if admitted is not None:
            custom[ADMIT_KEY] = admitted
        env[n].meta["custom"] = custom
    g.output(tuple(env[o] for o in region.outputs))
    return fx.GraphModule(gm, g)
