"""PyTorch's subgraph extraction for the partition function (``autosp.remat_partition``), without
the copies it throws away.

PyTorch builds the forward and backward graphs with ``_extract_graph_with_inputs_outputs``: it
copies every node of the joint graph that the inputs can compute, then removes, by dead-code
elimination, the ones the outputs do not need. On the 16-layer Llama joint graph (3,383 nodes)
that is 8,800 node copies for graphs of about 5,000 nodes, and FX checks every argument of every
node it creates. :func:`fast_extraction` has PyTorch's ``_extract_fwd_bwd_modules`` (and
``classify_nodes``) call :func:`_extract` instead, which works out first which nodes the
elimination would keep and copies only those. Everything else, the saved-value conventions
included, stays PyTorch's. Its graphs are PyTorch's: the same nodes, order, names, metadata and
namespace (``tests/test_remat.py::test_extraction_matches_pytorch``).

Used where PyTorch's function has the signature this mirrors (torch 2.13); elsewhere PyTorch's
own runs, as it does for a graph with nodes of a kind not mirrored here, or an output the inputs
cannot compute (PyTorch then looks for a replacement)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import threading
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.fx.node import map_arg

# The parameters of the PyTorch function mirrored here.
_MIRRORED = ("joint_graph", "inputs", "outputs", "outputs_descs", "subgraph",
             "ignore_must_be_in_fw_bw")
_lock = threading.RLock()


def _extract(original: Callable[..., fx.Graph], joint_graph: fx.Graph, inputs: list[fx.Node],
             outputs: list[Any], outputs_descs: list[Any], subgraph: str | None = None,
             ignore_must_be_in_fw_bw: bool = False) -> fx.Graph:
    from torch._functorch import partitioners

    def theirs() -> fx.Graph:
        return original(joint_graph, inputs, outputs, outputs_descs, subgraph,
                        ignore_must_be_in_fw_bw)

    given = set(inputs)
    again = _built_before(joint_graph, inputs, given, outputs, outputs_descs, subgraph,
                          ignore_must_be_in_fw_bw)
    if again is not None:
        return again
    in_backward, in_forward = partitioners._must_be_in_backward, partitioners._must_be_in_forward
    invalid: set[fx.Node] = set()
    valid: list[fx.Node] = []
    for node in joint_graph.nodes:
        if node in given:
            continue
        op = node.op
        if not ignore_must_be_in_fw_bw and (
                (subgraph != "backward" and in_backward(node))
                or (subgraph != "forward" and in_forward(node))):
            invalid.add(node)
        elif op == "call_function":
            if invalid and any(x in invalid for x in node._input_nodes):
                invalid.add(node)
            else:
                valid.append(node)
        elif op == "placeholder":
            invalid.add(node)
        elif op == "get_attr":
            valid.append(node)
        elif op != "output":
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
        if node in needed or any(user in kept for user in node.users) \
                or node.is_impure(impure_random):
            kept.add(node)

    graph = fx.Graph()
    namespace = graph._graph_namespace
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        placeholder = graph.placeholder(node.name)
        placeholder.meta = node.meta
        env[node] = placeholder
    copy_node = _copy if _DIRECT else lambda graph, node, arg: graph.node_copy(node, arg)
    for node in valid:
        if node in kept:
            env[node] = copy_node(graph, node, env.__getitem__)
        else:  # PyTorch's copy took its name before the elimination removed it
            namespace.create_name(node.name, None)
    values = [env[x] if isinstance(x, fx.Node) else x for x in outputs]
    out = graph.output(tuple(values))
    out.meta["desc"] = outputs_descs
    out.meta["output_stack_traces"] = [
        v.meta.get("stack_trace") if isinstance(v, fx.Node) else None for v in values]
    if _built is not None and len(given) == len(inputs):
        _built.append(_Built(joint_graph, subgraph, ignore_must_be_in_fw_bw, outputs,
                             outputs_descs, given, valid, kept, env, graph))
    return graph


@dataclasses.dataclass
class _Built:
    """A graph :func:`_extract` built within one :func:`fast_extraction`, with what it was built
    from."""
    joint_graph: fx.Graph
    subgraph: str | None
    ignore: bool
    outputs: list[Any]
    outputs_descs: list[Any]
    given: set[fx.Node]
    valid: list[fx.Node]
    kept: set[fx.Node]
    env: dict[fx.Node, fx.Node]
    graph: fx.Graph


_built: list[_Built] | None = None


def _built_before(joint_graph: fx.Graph, inputs: list[fx.Node], given: set[fx.Node],
                  outputs: list[Any], outputs_descs: list[Any], subgraph: str | None,
                  ignore: bool) -> fx.Graph | None:
    """PyTorch extracts the backward twice: the first time only to find the saved values it does
    not read, the second with them left out and the rest in another order. Where none was left
    out, the second graph is the first with its inputs in the new order (and the namespace that
    order gives): that graph is handed back again, rearranged, rather than built anew. PyTorch
    reads the first only for its inputs' users, before asking for the second."""
    from torch.fx.graph import _Namespace

    if _built is None or len(given) != len(inputs):
        return None
    outputs = [x for x, _ in zip(outputs, outputs_descs)]
    for b in _built:
        if (b.joint_graph is joint_graph and b.subgraph == subgraph and b.ignore == ignore
                and b.given == given and len(b.outputs) == len(outputs)
                and all(x is y for x, y in zip(b.outputs, outputs))
                and b.outputs_descs == outputs_descs):
            break
    else:
        return None
    graph, env = b.graph, b.env
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    table = graph._find_nodes_lookup_table
    for node in inputs:
        placeholder = env[node]
        anchor.prepend(placeholder)
        table.remove(placeholder)
        table.insert(placeholder)
    namespace = _Namespace()
    for node in inputs:
        namespace.associate_name_with_obj(namespace.create_name(node.name, None), env[node])
    for node in b.valid:
        name = namespace.create_name(node.name, None)
        if node in b.kept:
            namespace.associate_name_with_obj(name, env[node])
    out = graph.output_node()
    namespace.associate_name_with_obj(namespace.create_name(out.name, None), out)
    graph._graph_namespace = namespace
    return graph


def _has_internals() -> bool:
    graph = fx.Graph()
    return all(hasattr(graph, a) for a in ("_graph_namespace", "_insert",
                                           "_find_nodes_lookup_table", "_len"))


_DIRECT = _has_internals()


def _copy(graph: fx.Graph, node: fx.Node, arg: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """``graph.node_copy(node, arg)`` as ``Graph.create_node`` makes a node, less its check
    that no argument is a raw symbolic value (a tree walk over every argument, most of a copy's
    time in torch 2.13): the node it copies passed that check when it was made."""
    args, kwargs = map_arg(node.args, arg), map_arg(node.kwargs, arg)
    namespace = graph._graph_namespace
    name = namespace.create_name(node.name, None)
    new = fx.Node(graph, name, node.op, node.target, args, kwargs, node.type)
    namespace.associate_name_with_obj(name, new)
    graph._insert(new)
    graph._find_nodes_lookup_table.insert(new)
    graph._len += 1
    new.meta = copy.copy(node.meta)
    return new


@contextlib.contextmanager
def fast_extraction() -> Iterator[None]:
    """Within it, PyTorch's partitioner helpers extract subgraphs with :func:`_extract`."""
    from torch._functorch import partitioners

    original = partitioners._extract_graph_with_inputs_outputs
    if tuple(inspect.signature(original).parameters) != _MIRRORED:
        yield
        return

    def extract(*args: Any, **kwargs: Any) -> fx.Graph:
        return _extract(original, *args, **kwargs)

    global _built
    with _lock:
        partitioners._extract_graph_with_inputs_outputs = extract
        outer, _built = _built, []
        try:
            yield
        finally:
            partitioners._extract_graph_with_inputs_outputs = original
            _built = outer
