"""Graph rewrites for autosp's partition function (``autosp.remat_partition``) that give exactly
the graphs PyTorch's own helpers give, without copying every node into a new graph: at 16
layers a copy costs ~0.1 s (FX validates every argument of every node it creates)."""

from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.fx.graph import _Namespace

from autosp.errors import AutospError


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
    replay_namespace(graph, new_order)
    gm.recompile()
    return gm


class NameReplay:
    """A fresh namespace (``torch.fx.graph._Namespace``) filled as ``create_name(name, None)``
    calls in turn would fill it, for names already unique in one graph (the joint graph's, or
    the graph's own), without FX's regular expression per name: a name's base and number are
    parsed once per process (``_PARSED``) and replayed ~5 times per partition. A name FX would
    rename (used already, or a keyword or builtin) goes through FX's own ``create_name``."""

    def __init__(self, namespace: Any = None) -> None:
        from torch.fx.graph import _illegal_names

        if namespace is None:
            namespace = _Namespace()
        else:  # a LazyNamespace being filled
            _Namespace.__init__(namespace)
        self.namespace = namespace
        self.used, self.counts = self.namespace._used_names, self.namespace._base_count
        self.illegal = _illegal_names
        self.mirrored = _mirrors_create_name()

    def create_name(self, name: str) -> str:
        if not self.mirrored:
            return self.namespace.create_name(name, None)
        parsed = _PARSED.get(name)
        if parsed is None:
            parsed = _parse(name)
        if parsed is False or name in self.used or name in self.illegal:
            return self.namespace.create_name(name, None)
        base, num = parsed
        self.counts[base] = self.counts.get(base, 0) if num is None else num
        self.used.add(name)
        return name

    def add(self, node: fx.Node) -> None:
        """``node`` under its own name, which must stay its name."""
        name = self.create_name(node.name)
        if name != node.name:  # cannot happen: the names were unique in one namespace
            raise AutospError(f"[remat] replaying a graph's namespace renamed {node.name} to "
                              f"{name}; autosp bug")
        self.namespace._obj_to_name[node] = name


_PARSED: dict[str, tuple[str, int | None] | bool] = {}


@functools.lru_cache(maxsize=None)
def _mirrors_create_name() -> bool:
    """Whether FX's ``_Namespace.create_name`` is torch 2.13.0's, which :class:`NameReplay`
    mirrors (by the hash of its source); elsewhere (2.11, 2.12) FX's own names every node."""
    return source_is(_Namespace.create_name, {"7116b6050a366754"})


def source_is(fn: Any, hashes: set[str]) -> bool:
    """Whether ``fn``'s source is one of those mirrored here, by the first 16 hex digits of its
    sha256 (False where it has no source to read): a PyTorch internal this module or
    autosp.remat_extract mirrors to the letter is used only where it is unchanged."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest()[:16] in hashes


def _parse(name: str) -> tuple[str, int | None] | bool:
    from torch.fx.graph import _name_regex

    if len(_PARSED) > 1 << 18:
        _PARSED.clear()
    match = _name_regex.match(name)
    number = match and match.group(2)
    parsed = _PARSED[name] = False if match is None else (
        match.group(1), int(number) if number is not None else None)
    return parsed


class LazyNamespace(_Namespace):
    """A namespace that ``fill`` fills through a :class:`NameReplay` when it is first read or
    written. A graph extracted in a partition is often only read, or extended (which replaces
    its namespace), or reordered (which replays it): then it is never filled. A fill that
    raises leaves it unfilled, to raise again at the next use."""

    def __init__(self, fill: Callable[[NameReplay], None]) -> None:  # no state until used
        self.__dict__["_fill"] = fill

    def _filled(self) -> None:
        pending = self.__dict__.pop("_fill", None)
        if pending is None:
            return
        try:
            pending(NameReplay(self))
        except BaseException:
            for attr in ("_obj_to_name", "_used_names", "_base_count"):
                self.__dict__.pop(attr, None)
            self.__dict__["_fill"] = pending
            raise

    def __getattr__(self, attr: str) -> Any:  # an attribute it does not have yet
        if "_fill" not in self.__dict__:
            raise AttributeError(attr)
        self._filled()
        return getattr(self, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        self._filled()
        object.__setattr__(self, attr, value)

    def __reduce__(self) -> Any:  # copied (or pickled) as FX's own
        return _plain_namespace, (self._obj_to_name, self._used_names, self._base_count)


def _plain_namespace(obj_to_name: dict, used: set, counts: dict) -> Any:
    namespace = _Namespace()
    namespace._obj_to_name, namespace._used_names, namespace._base_count = \
        obj_to_name, used, counts
    return namespace


def replay_namespace(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Gives ``graph`` the namespace a copy making ``nodes`` in turn would end with."""
    replay = NameReplay()
    for node in nodes:
        replay.add(node)
    graph._graph_namespace = replay.namespace


class _NotSimple(Exception):
    """An argument whose flattening PyTorch's CSE leaves to pytree in a way not mirrored here
    (a raw symbolic value, a namedtuple, an unregistered container)."""


_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format, type(Ellipsis))
_IMMUTABLE_LIST = fx.immutable_collections.immutable_list
_IMMUTABLE_DICT = fx.immutable_collections.immutable_dict
_SEQUENCES = frozenset((tuple, list, _IMMUTABLE_LIST, torch.Size))
_FLAT = frozenset((fx.Node, *_LEAVES))  # leaves by their exact type


def _flatten(arg: object, leaves: list) -> object:
    """pytree's ``tree_flatten`` as PyTorch's CSE uses it (torch 2.13's registrations): appends
    the leaves to ``leaves`` and returns a key equal for equal tree specs."""
    t = type(arg)
    if t in _SEQUENCES:  # the common case first, a sequence's leaves without a call each
        specs = []
        for a in arg:  # type: ignore[union-attr]
            if type(a) in _FLAT:
                leaves.append(a)
                specs.append(None)
            else:
                specs.append(_flatten(a, leaves))
        return (t, tuple(specs))
    if t in _FLAT or isinstance(arg, torch._ops.OpOverload):
        leaves.append(arg)
        return None
    if t is dict or t is _IMMUTABLE_DICT:
        return (t, tuple(arg), tuple([_flatten(v, leaves)  # type: ignore[union-attr]
                                      for v in arg.values()]))  # type: ignore[union-attr]
    raise _NotSimple


def _cse_token(node: fx.Node) -> tuple[object, tuple]:
    """PyTorch's CSE's hash and token of ``node``: the hash of its flattened arguments, each with
    its type (so ``1`` and ``1.0`` hash apart), and what two nodes of one hash must share to be
    one (target, leaves compared by ``==``, tree specs). Its duplicates were already replaced,
    so a node argument is itself."""
    args: list = []
    kwargs: list = []
    args_spec = _flatten(node.args, args)
    given = node.kwargs
    if not given and (type(given) is _IMMUTABLE_DICT or type(given) is dict):
        kwargs_spec: object = (type(given), (), ())  # as _flatten gives, most nodes have none
    else:
        kwargs_spec = _flatten(given, kwargs)
    hashed = hash((tuple([(a, type(a)) for a in args]), tuple([(a, type(a)) for a in kwargs])))
    return (node.target, hashed), (node.target, tuple(args), args_spec, tuple(kwargs),
                                   kwargs_spec)


def cse_in_place(gm: fx.GraphModule) -> bool:
    """PyTorch's ``fx_graph_cse`` done in place: the same nodes removed (a node that repeats an
    earlier one's target and arguments, in the same mutation region, unless it is random,
    ``aten.empty``, aliases an output or binds an unbacked symbol; found as PyTorch finds it,
    by the hash of the flattened arguments, whose first holder alone is compared) and every use
    of it moved to the earlier one. The graph keeps its order and names, and gets the namespace
    a fresh copy would have. Returns False, changing nothing, where an argument is of a kind
    this mirror does not handle (the caller then uses PyTorch's copy)."""
    import sympy
    from torch._functorch.compile_utils import get_aten_target, rand_ops
    from torch._inductor.pattern_matcher import compute_mutation_region_ids, same_mutation_regions
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    graph = gm.graph
    nodes = list(graph.nodes)
    output = nodes[-1]
    if output.op != "output":
        return False

    def storage(n: fx.Node) -> object:
        """The storage's identity (PyTorch compares StorageWeakRefs, which compare it)."""
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        try:
            return val.untyped_storage()._cdata
        except NotImplementedError:
            return None

    # The keys first: nothing changes unless every argument is mirrored.
    skip_targets = (*rand_ops, torch.ops.aten.empty)
    candidates = []
    for n in nodes:
        if n.op != "call_function" or get_aten_target(n) in skip_targets:
            continue
        val = n.meta.get("val")
        if isinstance(val, sympy.Symbol) and free_unbacked_symbols(val):
            continue
        try:
            candidates.append((n, _cse_token(n)))
        except (_NotSimple, TypeError):  # TypeError: an unhashable argument
            return False
    outputs = {s for s in map(storage, output.all_input_nodes) if s is not None}
    if outputs:
        candidates = [(n, key) for n, key in candidates if storage(n) not in outputs]

    compute_mutation_region_ids(graph)  # type: ignore[arg-type]
    # PyTorch's lookup, hash first: the first node of a hash holds it, so a node whose token
    # differs from that one's is kept even where it repeats a later one (hash(-1) == hash(-2)),
    # unless a mutation between the two made the later one the holder.
    holders: dict[object, tuple[fx.Node, tuple]] = {}
    rewired: set[fx.Node] = set()  # nodes that read a removed node: their token is recomputed
    erased = False
    for n, (hashed, token) in candidates:
        if n in rewired:
            hashed, token = _cse_token(n)
        holder = holders.get(hashed)
        if holder is not None and holder[1] == token:
            if same_mutation_regions(n, holder[0]):
                rewired.update(n.users)
                n.replace_all_uses_with(holder[0])
                graph.erase_node(n)
                erased = True
                continue
            holders[hashed] = (n, token)
        elif holder is None:
            holders[hashed] = (n, token)
    if erased:
        replay_namespace(graph, graph.nodes)
        gm.recompile()
    return True


def eliminate_dead_code(graph: fx.Graph) -> bool:
    """``Graph.eliminate_dead_code`` asking whether a node is impure only of nodes no node uses
    (FX asks it of every node, and ``is_impure`` reads the op's schema and effects each time).
    A graph that reads attributes (subgraphs, which FX's also cleans) goes to FX's."""
    if graph.find_nodes(op="get_attr"):
        return graph.eliminate_dead_code()
    impure_random = True
    if torch._guards.TracingContext.try_get():
        impure_random = torch._inductor.config.fallback_random
    changed = False
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure(impure_random):
            graph.erase_node(node)
            changed = True
    return changed
