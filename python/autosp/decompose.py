"""Composite Torch functions taken apart by PyTorch itself, before the SP pass reads the graph.

Dynamo records some Torch-level functions whole although they are Python code built from
other ops: ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer``) is the common one. autosp has
no rule for such a call, so without this stage its sequence-sharded inputs are all-gathered
and it runs on the whole sequence on every rank.

``decompose_composites`` traces each such call with PyTorch's own decomposition,
``make_fx(pre_dispatch=True)``: the ATen ops before autograd, on the call's own fake inputs
and symbolic sizes (Dynamo's shape environment, so the sequence length stays the symbol the
plan reads). The call is replaced by those ops when every one of them is an op the bridge
reads as its Torch-level function (``canon.aten_torch_name``: listed in
``canon.ATEN_AS_TORCH`` or pointwise by torch's tags, and not in-place) or size arithmetic.
Otherwise, or when the trace fails, the call stays whole (gathered, or refused with
``unsupported="error"``, as before). The spliced ops keep the call's stack trace, so an error
still names the user's line. AOTAutograd then differentiates them like any other op.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autosp import _core
from autosp.canon import aten_torch_name, canonicalize
from autosp.ops import is_pointwise

_KNOWN = frozenset(_core.registered_ops())


def _example(a: Any) -> Any:
    return a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else a


def is_composite(node: fx.Node) -> bool:
    """A call of a Python function in torch that autosp has no row, rule or pointwise tag
    for."""
    t = node.target
    if node.op != "call_function" or not inspect.isfunction(t):
        return False
    if not (getattr(t, "__module__", "") or "").startswith("torch."):
        return False
    try:
        name = canonicalize(node)[0]
    except Exception:  # a row that refuses its arguments: the bridge reports it
        return False
    return name not in _KNOWN and not is_pointwise(name)


def _readable(g: fx.Graph) -> bool:
    """Whether every op of a traced decomposition is one the bridge reads."""
    for n in g.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op != "call_function":
            return False  # get_attr (a constant tensor), call_module
        t = n.target
        if isinstance(t, torch._ops.OpOverload):
            if aten_torch_name(t).startswith("aten."):
                return False
        elif getattr(t, "__module__", "") not in ("_operator", "operator"):
            return False  # anything else than size arithmetic
    return True


def _trace(node: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]] | None:
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    at = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    inputs = [_example(flat[i]) for i in at]
    if any(v is None for v in inputs):
        return None
    target = node.target

    def call(*values: Any) -> Any:
        args = list(flat)
        for i, v in zip(at, values):
            args[i] = v
        a, k = pytree.tree_unflatten(args, spec)
        return target(*a, **k)

    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        gm = make_fx(call, tracing_mode="symbolic", pre_dispatch=True)(*inputs)
    except Exception:  # data-dependent control flow, an op make_fx cannot trace, ...
        return None
    return gm, [flat[i] for i in at]


def _requires_grad(a: fx.Node) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(_example(a)))


def _with_grad(v: Any, requires_grad: bool) -> Any:
    """``v`` (a traced value or a tuple of them) marked as requiring grad, for float
    tensors, when ``requires_grad``."""
    if isinstance(v, (tuple, list)):
        return type(v)(_with_grad(x, requires_grad) for x in v)
    if (requires_grad and isinstance(v, torch.Tensor) and not v.requires_grad
            and (v.is_floating_point() or v.is_complex())):
        return v.detach().requires_grad_(True)
    return v


def _splice(gm: fx.GraphModule, node: fx.Node, traced: fx.GraphModule, inputs: list[fx.Node]) -> bool:
    """Replace ``node`` by the traced ops; False (nothing changed) when its users cannot be
    rewired: a tuple result read other than by constant indexes, or an index the
    decomposition returns as None."""
    out = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    users = list(node.users)
    if isinstance(out, (tuple, list)):
        for u in users:
            if not (u.target is operator.getitem and isinstance(u.args[1], int) and u.args[1] < len(out)):
                return False
            if out[u.args[1]] is None and u.users:
                return False
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs))
    trace = node.meta.get("stack_trace")
    # make_fx traces below autograd: its metadata says no value requires grad. The bridge
    # reads requires_grad to place gradient syncs (a replicated weight slice feeding sharded
    # values needs one), so it is derived as Dynamo would: from the inputs, where the call
    # itself ran with grad (its result requires grad).
    grad_on = any(isinstance(t, torch.Tensor) and t.requires_grad
                  for t in pytree.tree_leaves(_example(node)))
    with gm.graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op != "call_function":
                continue
            new = gm.graph.call_function(n.target, fx.map_arg(n.args, env.__getitem__),
                                         fx.map_arg(n.kwargs, env.__getitem__))
            rg = grad_on and any(_requires_grad(a) for a in new.all_input_nodes)
            new.meta["example_value"] = _with_grad(n.meta.get("val"), rg)
            if trace:
                new.meta["stack_trace"] = trace
            new.meta["autosp_decomposed"] = getattr(node.target, "__name__", str(node.target))
            env[n] = new
    mapped = fx.map_arg(out, lambda n: env[n])
    if isinstance(out, (tuple, list)):
        for u in users:
            r = mapped[u.args[1]]
            if r is not None:
                u.replace_all_uses_with(r)
            gm.graph.erase_node(u)
    else:
        node.replace_all_uses_with(mapped)
    gm.graph.erase_node(node)
    return True


def decompose_composites(gm: fx.GraphModule) -> list[str]:
    """Replace each composite call without a rule by its ATen decomposition where every op of
    it is readable; returns the names of the calls taken apart, in program order."""
    done = []
    for node in list(gm.graph.nodes):
        if not is_composite(node):
            continue
        got = _trace(node)
        if got is None or not _readable(got[0].graph):
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if _splice(gm, node, *got):
            done.append(name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
