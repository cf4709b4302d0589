"""PyTorch's subgraph extraction for the partition function (``autosp.remat_partition``), without
the copies it throws away.

PyTorch builds the forward and backward graphs with ``_extract_graph_with_inputs_outputs``: it
copies every node of the joint graph that the inputs can compute, then removes, by dead-code
elimination, the ones the outputs do not need. It is called four times per partition (the
forward once to learn which nodes it needs, the backward twice, the forward again): on the
16-layer Llama joint graph (3,383 nodes) 8,800 node copies for graphs of about 4,000 nodes, and
FX checks every argument of every node it creates. :func:`fast_extraction` has PyTorch's
``classify_nodes`` and ``_extract_fwd_bwd_modules`` call :func:`_extract` instead, which works
out first which nodes the elimination would keep and copies only those, and which extends a
graph it built from the same inputs rather than building it again (:func:`_built_from`).
Everything else, the saved-value conventions included, stays PyTorch's. Its graphs are
PyTorch's: the same nodes, order, names, metadata and namespace (``tests/test_remat_graphs.py``).

Used where PyTorch's three functions are, to the letter, the ones mirrored (torch 2.13.0's,
:func:`mirrored`); elsewhere PyTorch's own runs, as it does for a graph with nodes of a kind not
mirrored here, or an output the inputs cannot compute (PyTorch then looks for a
replacement)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.fx.graph import _Namespace
from torch.fx.node import map_arg

from autosp.errors import AutospError
from autosp.remat_graphs import LazyNamespace, NameReplay, source_is

# The PyTorch functions this relies on, by the hash of their source as mirrored (torch 2.13.0):
# the extraction itself, and its two callers, which read a first graph only before asking for
# a second from the same inputs (the extension in _build). Another source runs PyTorch's own.
_MIRRORED = {
    "_extract_graph_with_inputs_outputs": {"ccb91fdf1d9e9e39"},
    "_extract_fwd_bwd_modules": {"06d2d976916e85d8"},
    "classify_nodes": {"256f486422341dfe"},
}
_lock = threading.RLock()


@functools.lru_cache(maxsize=None)
def mirrored() -> bool:
    """Whether this torch's partitioner helpers are the ones :func:`_extract` mirrors."""
    from torch._functorch import partitioners

    for name, hashes in _MIRRORED.items():
        if not source_is(getattr(partitioners, name, None), hashes):
            return False
    return _DIRECT


def _extract(original: Callable[..., fx.Graph], joint_graph: fx.Graph, inputs: list[fx.Node],
             outputs: list[Any], outputs_descs: list[Any], subgraph: str | None = None,
             ignore_must_be_in_fw_bw: bool = False) -> fx.Graph:
    def theirs() -> fx.Graph:
        return original(joint_graph, inputs, outputs, outputs_descs, subgraph,
                        ignore_must_be_in_fw_bw)

    given = set(inputs)
    if len(given) != len(inputs):
        return theirs()  # an input twice: PyTorch makes two placeholders, the first unused
    earlier = _built_from(joint_graph, given, subgraph, ignore_must_be_in_fw_bw)
    valid = earlier.valid if earlier is not None else _computed(
        joint_graph, given, subgraph, ignore_must_be_in_fw_bw)
    if valid is None:
        return theirs()  # a call_module or call_method: PyTorch fails on its users
    outputs = [x for x, _ in zip(outputs, outputs_descs)]
    needed = {x for x in outputs if isinstance(x, fx.Node)}
    if not needed <= given.union(valid):
        return theirs()  # PyTorch looks for a replacement of an invalid output, or raises

    # What the elimination keeps: an output, an impure node, or an input of a kept node.
    impure_random = True
    if torch._guards.TracingContext.try_get():
        impure_random = torch._inductor.config.fallback_random
    kept: set[fx.Node] = set()
    for node in reversed(valid):
        if node in needed or not kept.isdisjoint(node.users) \
                or _is_impure(node, impure_random):
            kept.add(node)

    built = earlier if earlier is not None and earlier.kept <= kept else None
    if built is None:
        built = _Built(joint_graph, subgraph, ignore_must_be_in_fw_bw, given, valid, set(), {},
                       fx.Graph())
        if _built is not None:
            _built.append(built)
    return _build(built, inputs, kept, outputs, outputs_descs)


def _is_impure(node: fx.Node, impure_random: bool) -> bool:
    """``node.is_impure(impure_random)``, asked once per op overload in a partition: for one,
    torch 2.13's answer reads the op's schema, tags and effects, not the node's arguments."""
    target = node.target
    key = (target if node.op == "call_function" and type(target) is torch._ops.OpOverload
           else node, impure_random)
    impure = _impure.get(key) if _impure is not None else None
    if impure is None:
        impure = node.is_impure(impure_random)
        if _impure is not None:
            _impure[key] = impure
    return impure


def _computed(joint_graph: fx.Graph, given: set[fx.Node], subgraph: str | None,
              ignore_must_be_in_fw_bw: bool) -> list[fx.Node] | None:
    """The nodes of ``joint_graph`` that ``given`` computes, in order, as PyTorch's extraction
    finds them (a node that must be in the other graph is not; None where the graph has a node
    of a kind not mirrored here)."""
    from torch._functorch import partitioners

    in_backward, in_forward = partitioners._must_be_in_backward, partitioners._must_be_in_forward
    # Where a node must be is asked again by each extraction: kept for the partition.
    placed = _placed if _placed is not None else {}
    invalid: set[fx.Node] = set()
    valid: list[fx.Node] = []
    for node in joint_graph.nodes:
        if node in given:
            continue
        op = node.op
        must = placed.get(node)
        if must is None:
            must = placed[node] = (in_backward(node), in_forward(node))
        if not ignore_must_be_in_fw_bw and (
                (subgraph != "backward" and must[0]) or (subgraph != "forward" and must[1])):
            invalid.add(node)
        elif op == "call_function":
            if invalid and not invalid.isdisjoint(node._input_nodes):
                invalid.add(node)
            else:
                valid.append(node)
        elif op == "placeholder":
            invalid.add(node)
        elif op == "get_attr":
            valid.append(node)
        elif op != "output":
            return None
    return valid


@dataclasses.dataclass
class _Built:
    """A graph :func:`_extract` built within one :func:`fast_extraction`, and what from: the
    joint graph, the subgraph asked for, the inputs, the nodes they compute (``valid``), the
    nodes kept and each one's copy (``env``, the inputs' placeholders too), and the valid
    nodes' names once asked for."""
    joint_graph: fx.Graph
    subgraph: str | None
    ignore: bool
    given: set[fx.Node]
    valid: list[fx.Node]
    kept: set[fx.Node]
    env: dict[fx.Node, fx.Node]
    graph: fx.Graph
    valid_names: list[str] | None = None


_built: list[_Built] | None = None
_placed: dict[fx.Node, tuple[bool, bool]] | None = None
_impure: dict[tuple[Any, bool], bool] | None = None


def _built_from(joint_graph: fx.Graph, given: set[fx.Node], subgraph: str | None,
               ignore: bool) -> _Built | None:
    """A graph built earlier in this partition from the same inputs (in any order). PyTorch asks
    for such pairs and reads only the second: ``classify_nodes`` extracts the forward to learn
    which nodes it needs, then ``_extract_fwd_bwd_modules`` the forward again with the saved
    values as outputs too; it extracts the backward once to find the saved values it does not
    read, then again with the rest in another order. The nodes the inputs compute are the
    earlier graph's, and where it keeps no node the second drops, the earlier graph is handed
    back extended (:func:`_build`) rather than built anew. The joint graph does not change
    between the two within a partition."""
    for b in _built or ():
        if (b.joint_graph is joint_graph and b.subgraph == subgraph and b.ignore == ignore
                and b.given == given):
            return b
    return None


def _build(b: _Built, inputs: list[fx.Node], kept: set[fx.Node], outputs: list[Any],
           outputs_descs: list[Any]) -> fx.Graph:
    """The extracted graph: placeholders for ``inputs`` in their order, copies of the ``kept``
    nodes in the joint graph's order, and the output; into ``b.graph``, which holds the copies
    of ``b.kept`` already (nothing at first). Its namespace is the one PyTorch's copy, node by
    node, would end with: every node the inputs compute took its name, kept or not."""
    graph, env = b.graph, b.env
    table = graph._find_nodes_lookup_table
    old_output = next(iter(graph.find_nodes(op="output")), None)
    if old_output is not None:
        graph.erase_node(old_output)
    # Nodes are made with the names PyTorch's copy gives them (the joint graph's), and the
    # namespace is replayed when it is first used (:func:`_namespace`).
    for node in inputs:
        placeholder = env.get(node)
        if placeholder is None:
            placeholder = env[node] = graph.placeholder(node.name)
            object.__setattr__(placeholder, "meta", node.meta)  # as _copy does
        else:  # to the new order
            table.remove(placeholder)
            table.insert(placeholder)
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if first is not None:  # placeholders first
        for node in inputs:
            first.prepend(env[node])
    prev = env[inputs[-1]] if inputs else graph._root
    for node in b.valid:
        if node not in kept:
            continue
        copied = env.get(node)
        if copied is None:
            copied = env[node] = _copy(graph, node, env.__getitem__)
            if prev._next is not copied:
                prev.append(copied)
        prev = copied
    b.kept = set(kept)

    values = [env[x] if isinstance(x, fx.Node) else x for x in outputs]
    if b.valid_names is None:
        b.valid_names = [node.name for node in b.valid]
    # What the namespace is filled from: names and this graph's nodes, not the joint graph's
    # (a graph whose namespace is never filled does not keep the joint graph alive).
    fill = functools.partial(_namespace, [(node.name, env[node]) for node in inputs],
                             b.valid_names, weakref.ref(graph))
    joint_output = next(iter(b.joint_graph.find_nodes(op="output")), None)
    if joint_output is None or joint_output.name != "output":  # a node may be named "output"
        graph._graph_namespace = fill(None, NameReplay())
        out = graph.output(tuple(values))
    else:  # the output is named "output", as PyTorch's is: the names it would see are unique
        graph._graph_namespace = _Namespace()
        out = graph.output(tuple(values))
        graph._graph_namespace = LazyNamespace(functools.partial(fill, out))
    out.meta["desc"] = outputs_descs
    out.meta["output_stack_traces"] = [
        v.meta.get("stack_trace") if isinstance(v, fx.Node) else None for v in values]
    return graph


def _namespace(inputs: list[tuple[str, fx.Node]], valid_names: list[str],
               graph_ref: Callable[[], fx.Graph | None], output: fx.Node | None,
               replay: NameReplay) -> Any:
    """Fills ``replay`` as PyTorch's copy, node by node, fills the graph's namespace: the inputs'
    placeholders, then every node the inputs compute, kept (a node of the graph by that name)
    or not, and then the output (if given)."""
    namespace = replay.namespace
    graph = graph_ref()
    copies = {n.name: n for n in graph.nodes} if graph is not None else {}
    for name, placeholder in inputs:
        namespace._obj_to_name[placeholder] = replay.create_name(name)
    for name in valid_names:
        given = replay.create_name(name)
        copied = copies.get(name)
        if copied is not None:
            if given != name:  # cannot happen: the joint graph's names are unique
                raise AutospError(f"[remat] extracting a subgraph renamed {name} to {given}; "
                                  f"autosp bug")
            namespace._obj_to_name[copied] = given
    if output is not None:
        replay.add(output)
    return namespace


def _has_internals() -> bool:
    graph = fx.Graph()
    return all(hasattr(graph, a) for a in ("_graph_namespace", "_insert",
                                           "_find_nodes_lookup_table", "_len"))


_DIRECT = _has_internals()


def _copy(graph: fx.Graph, node: fx.Node, arg: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """``graph.node_copy(node, arg)`` as ``Graph.create_node`` makes a node, with ``node``'s
    name (the namespace is replayed by :func:`_build`) and without its check that no argument
    is a raw symbolic value (a tree walk over every argument, most of a copy's time in torch
    2.13): the node it copies passed that check when it was made."""
    args, kwargs = map_arg(node.args, arg), map_arg(node.kwargs, arg)
    new = fx.Node(graph, node.name, node.op, node.target, args, kwargs, node.type)
    graph._insert(new)
    graph._find_nodes_lookup_table.insert(new)
    graph._len += 1
    # Not through Node.__setattr__, which takes the node out of the find_nodes table and puts
    # it back at the end, where it is already.
    object.__setattr__(new, "meta", copy.copy(node.meta))
    return new


@contextlib.contextmanager
def fast_extraction() -> Iterator[None]:
    """Within it, PyTorch's partitioner helpers extract subgraphs with :func:`_extract`."""
    from torch._functorch import partitioners

    original = partitioners._extract_graph_with_inputs_outputs
    if not mirrored():
        yield
        return

    def extract(*args: Any, **kwargs: Any) -> fx.Graph:
        return _extract(original, *args, **kwargs)

    global _built, _placed, _impure
    with _lock:
        partitioners._extract_graph_with_inputs_outputs = extract
        outer = _built, _placed, _impure
        _built, _placed, _impure = [], {}, {}
        try:
            yield
        finally:
            partitioners._extract_graph_with_inputs_outputs = original
            _built, _placed, _impure = outer
