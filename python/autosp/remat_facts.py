"""Facts about a joint forward+backward graph for the remat solver: each node's kind (PyTorch's
op types), FLOPs (``autosp.remat_flops``), bytes at the real sequence length, save cost and
decoder layer (``gather_facts``). Re-exported by ``autosp.remat``; the collective namespaces are
shared with ``autosp.plan_memory_graph``."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autosp import _core
from autosp.ops import ALIASING_WITHOUT_SCHEMA
from autosp.remat_flops import _ATTENTION_NAME, _hint, has_flops, node_flops


def _partitioners():
    from torch._functorch import partitioners

    return partitioners


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target))


def _classify(node: fx.Node, op_types: Any) -> Any:
    K = _core.RematOpKind
    if node.op == "placeholder":
        return K.INPUT
    if node.op != "call_function":
        return K.CHEAP  # get_attr: re-reading an attribute is free
    target = node.target
    if target is operator.getitem:
        return K.CHEAP
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace in _COLLECTIVE_NAMESPACES:
            return K.COLLECTIVE
        # Before the random check: SDPA is tagged nondeterministic_seeded (for dropout_p), and
        # it is banned either way; as attention its FLOPs count towards the step's.
        if _ATTENTION_NAME.search(target.name()):
            return K.ATTENTION
        if op_types.is_random(node) or torch.Tag.nondeterministic_seeded in target.tags:
            return K.RANDOM
    if op_types.is_view(node):
        return K.VIEW
    if op_types.is_compute_intensive(node):
        return K.MATMUL
    if op_types.is_recomputable(node):
        return K.CHEAP
    return K.OTHER


def _save_cost(node: fx.Node) -> Any:
    C = _core.RematSaveCost
    if isinstance(node.meta.get("val"), torch.Tensor):  # the common case, first
        return C.TENSOR
    from torch.fx.experimental.proxy_tensor import is_sym_node

    if is_sym_node(node):
        return C.SYM_FLOAT if isinstance(node.meta.get("val"), torch.SymFloat) else C.SYM_INT
    val = node.meta.get("val")
    non_tensor = ("val" not in node.meta and "tensor_meta" not in node.meta) or (
        "val" in node.meta and not isinstance(val, torch.Tensor)
    )
    if not non_tensor:
        return C.TENSOR
    from torch._library.fake_class_registry import FakeScriptObject
    from torch.fx.experimental._backward_state import BackwardState

    opaque = False
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node

        opaque = is_opaque_node(node)
    except ImportError:
        pass
    if isinstance(val, (BackwardState, FakeScriptObject)) or opaque:
        return C.FREE
    return C.UNSAVEABLE


def _node_bytes(node: fx.Node) -> int:
    """PyTorch's _size_of (bytes of the value, hinted sizes), 0 where it has no answer."""
    if "val" not in node.meta:
        return 0
    val = node.meta["val"]
    if isinstance(val, torch.Tensor):
        return _tensor_bytes(val)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return 1
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v) for v in val)
    if isinstance(val, dict):
        return sum(_tensor_bytes(v) for v in val.values())
    return 0


def _tensor_bytes(x: Any) -> int:
    if not isinstance(x, torch.Tensor):
        return 0
    numel = x.numel()
    if type(numel) is int:  # static sizes: their product
        return numel * x.dtype.itemsize
    numel = 1
    for s in x.shape:
        numel *= s if type(s) is int else _hint(s)
    return numel * x.dtype.itemsize


def layer_of_path(path: str) -> str:
    """The layer of a dotted module or parameter path: the path up to its first numbered
    component ("layers.3.mlp" -> "layers.3"), else its top-level module ("lm_head"), else ""."""
    parts = [p for p in path.split(".") if p]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def _layer_of(node: fx.Node, cache: dict[str, str] | None = None) -> str:
    """layer_of_path of the node's module (its nn_module_stack), or "" without one; ``cache``
    keeps the answer per module path."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(next(reversed(stack.values()))[0])
    layer = cache.get(path) if cache is not None else None
    if layer is None:
        from autosp.fx_source import dotted_path

        layer = layer_of_path(dotted_path(path))
        if cache is not None:
            cache[path] = layer
    return layer


_SHARD_PREP = ("convert_element_type", "_to_copy", "view", "clone", "contiguous", "constant_pad_nd")


def is_parameter_collective(node: fx.Node) -> bool:
    """The forward all-gather of a parameter sharded by autosp.fully_shard (or its wait): over a
    group parameters are sharded on, of a graph input, possibly cast or padded first. (The
    activations' collectives of SP may use the same group when dp is 1: they gather computed
    values, never a graph input.)"""
    from autosp.shard import parameter_groups

    groups = parameter_groups()
    if not groups or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target.namespace != "_c10d_functional":
        return False
    src = node.args[0] if node.args else None
    if node.target.__name__.startswith("wait_tensor"):
        return isinstance(src, fx.Node) and is_parameter_collective(src)
    if not node.target.__name__.startswith("all_gather_into_tensor"):
        return False
    if not any(isinstance(a, str) and a in groups for a in node.args):
        return False
    while isinstance(src, fx.Node) and src.op == "call_function":
        name = getattr(src.target, "__name__", "").split(".")[0]
        if name not in _SHARD_PREP:
            return False
        src = src.args[0] if src.args else None
    return isinstance(src, fx.Node) and src.op == "placeholder"


def _aliased_positions(target: Any) -> tuple[tuple[int, str], ...]:
    """(index, name) of the arguments whose storage ``target``'s outputs share, from its
    schema's alias annotations; worked out once per op overload."""
    found = _ALIASED_POSITIONS.get(target)
    if found is None:
        schema = target._schema
        sets: set = set()
        for ret in schema.returns:
            if ret.alias_info is not None:
                sets |= set(ret.alias_info.before_set)
        found = tuple((i, arg.name) for i, arg in enumerate(schema.arguments)
                      if sets and arg.alias_info is not None
                      and set(arg.alias_info.before_set) & sets)
        _ALIASED_POSITIONS[target] = found
    return found


_ALIASED_POSITIONS: dict[Any, tuple[tuple[int, str], ...]] = {}


def aliased_arg(node: Any) -> Any:
    """The input node whose storage `node`'s output shares, or None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target._opname in ALIASING_WITHOUT_SCHEMA:  # a collective's wait, _unsafe_view
        return node.args[0]
    for i, name in _aliased_positions(target):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        if isinstance(value, fx.Node):
            return value
    return None


def _may_alias(node: fx.Node) -> bool:
    """Whether aliased_arg can find an input for a node of this op (a view's, an in-place op's):
    else none for any of its nodes."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        target._opname in ALIASING_WITHOUT_SCHEMA or bool(_aliased_positions(target)))


def _alias_index(node: fx.Node, index: dict[fx.Node, int],
                 overrides: dict[fx.Node, fx.Node] | None = None) -> int:
    """The index of the node whose storage `node`'s value is a view of (aliased_arg, or an
    override), or -1."""
    base = aliased_arg(node) if node.op == "call_function" else None
    if overrides:
        base = overrides.get(node, base)
    return index.get(base, -1) if isinstance(base, fx.Node) else -1


def _storage_owners(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node of `graph` to the node whose storage its value lives in (aliased_arg followed
    by the C++ core's one rule, _core.storage_owners)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    aliases = [_alias_index(node, index) for node in nodes]
    return {node: nodes[k] for node, k in zip(nodes, _core.storage_owners(aliases))}


def region_call_aliases(joint_graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """For each output of a region call (a getitem of ``invoke_subgraph``, autosp.outline)
    whose value shares storage with one of the call's operands or an earlier output, the node
    it shares with. A region's forward hands on what its backward reads, and some of it is the
    region's input (the layer's hidden state) or one of its own outputs (a layer ending in tanh
    saves its result): the graph calling it holds that storage once."""
    aliases: dict[fx.Node, fx.Node] = {}
    owners: dict[fx.GraphModule, dict[fx.Node, fx.Node]] = {}
    owner = joint_graph.owning_module
    for call in joint_graph.find_nodes(op="call_function",
                                       target=torch.ops.higher_order.invoke_subgraph):
        if owner is None or not isinstance(call.args[0], fx.Node):
            continue
        sub = owner
        for part in str(call.args[0].target).split("."):
            sub = getattr(sub, part, None)
        if not isinstance(sub, fx.GraphModule):
            continue
        inputs = {p: i for i, p in enumerate(sub.graph.find_nodes(op="placeholder"))}
        outputs = next(iter(sub.graph.find_nodes(op="output"))).args[0]
        if sub not in owners:  # the layers' calls share one subgraph
            owners[sub] = _storage_owners(sub.graph)
        owner_of = owners[sub]
        getitems = {u.args[1]: u for u in call.users if u.target is operator.getitem}
        first: dict[fx.Node, int] = {}  # a storage's owner in the region -> its first output
        for k, value in enumerate(outputs):
            if not isinstance(value, fx.Node):
                continue
            base = owner_of[value]
            shared = None
            if base in inputs and 2 + inputs[base] < len(call.args):
                shared = call.args[2 + inputs[base]]
            elif base in first:
                shared = getitems.get(first[base])
            else:
                first[base] = k
            if k in getitems and isinstance(shared, fx.Node):
                aliases[getitems[k]] = shared
    return aliases


def _contiguous(val: torch.Tensor, cache: dict[Any, bool]) -> bool:
    """PyTorch's ``is_contiguous_or_false`` (no guard on a symbolic size), kept per sizes and
    strides: the layers repeat them. A symbolic size is keyed by its expression, which the
    answer depends on alone within one partition (one shape env)."""
    from torch._prims_common import is_contiguous_or_false

    key = tuple(s if type(s) is int else s.node.expr for s in (*val.shape, *val.stride()))
    found = cache.get(key)
    if found is None:
        found = cache[key] = bool(is_contiguous_or_false(val))
    return found


def gather_facts(joint_graph: fx.Graph, node_info: Any,
                 forward_outputs: Any = ()) -> tuple[list[fx.Node], list[Any]]:
    """The remat solver's facts (``_core.RematNode``) for every non-output node of a joint
    graph, in graph order, with sizes and FLOPs at the trace's hint; the planner builds its
    memory graph from the same facts. ``forward_outputs``: the nodes the forward hands on."""
    partitioners = _partitioners()
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd.utils import _is_fwd_seed_offset, _is_primal
    from torch._functorch.compile_utils import get_aten_target
    op_types = partitioners.get_default_op_list()
    nodes = [n for n in joint_graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    params_free = bool(getattr(functorch_config, "treat_parameters_as_free_to_save", True))
    aten_cat = torch.ops.aten.cat
    # Plain sets: membership in PyTorch's OrderedSets is a Python call per test.
    required_fw = set(node_info.required_fw_nodes)
    required_bw = set(node_info.required_bw_nodes)
    tangents_closure = set(node_info.tangents_closure)
    static_lifetime = set(node_info.static_lifetime_input_nodes) if params_free else set()
    outputs = set(forward_outputs)
    must_save_policy = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE

    # What depends on the op alone (its kind, name, fusibility) is worked out once per op.
    by_op: dict[Any, tuple[Any, str, bool, bool, bool, bool]] = {}
    per_node = []
    for node in nodes:
        key = (node.op, node.target)
        try:
            op = by_op.get(key)
        except TypeError:  # an unhashable target
            key, op = None, None
        if op is None:
            kind = _classify(node, op_types)
            op = (kind, _op_name(node), op_types.is_fusible(node),
                  get_aten_target(node) == aten_cat, has_flops(node, kind), _may_alias(node))
            if key is not None:
                by_op[key] = op
        per_node.append(op)
    layers: dict[str, str] = {}
    contiguous: dict[Any, bool] = {}
    flops: dict[Any, float] = {}
    from autosp.shard import parameter_groups

    sharded = bool(parameter_groups())  # else no node is a parameter's collective
    region_aliases = region_call_aliases(joint_graph)

    facts = []
    for i, node in enumerate(nodes):
        kind, name, fusible, _, counted, may_alias = per_node[i]
        f = _core.RematNode()
        f.name = node.name
        f.target = name
        f.layer = _layer_of(node, layers)
        f.kind = kind
        f.save_cost = _save_cost(node)
        f.bytes = _node_bytes(node)
        f.flops = node_flops(node, kind, name, cache=flops) if counted else 0.0
        f.required_fw = forward = node in required_fw
        f.required_bw = node in required_bw
        f.tangents_closure = node in tangents_closure
        f.primal_input = node.op == "placeholder" and (_is_primal(node)
                                                       or _is_fwd_seed_offset(node))
        f.static_lifetime = node in static_lifetime
        f.forward_output = node in outputs
        f.must_save = node.meta.get("recompute") == must_save_policy
        f.must_recompute = partitioners.must_recompute(node)
        f.parameter_collective = sharded and is_parameter_collective(node)
        f.fusible = fusible
        f.getitem = node.op == "call_function" and node.target is operator.getitem
        # Known contiguous (offload copies only those), asked of forward values alone; without
        # guards on a symbolic length (unknown: false).
        val = node.meta.get("val") if forward else None
        f.contiguous = isinstance(val, torch.Tensor) and _contiguous(val, contiguous)
        users = sorted([index[u] for u in node.users if u in index])
        f.users = users
        f.fusible_user = [int(per_node[u][3] or (fusible and per_node[u][2])) for u in users]
        f.args = [index[a] for a in node.args if isinstance(a, fx.Node)]
        f.aliases = _alias_index(node, index, region_aliases) \
            if may_alias or node in region_aliases else -1
        facts.append(f)
    return nodes, facts
