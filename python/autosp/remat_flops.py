"""FLOPs of a joint-graph node for the remat solver and the planner: PyTorch's FLOP formulas
(torch.utils.flop_counter), attention by its own, with symbolic sizes at the trace's hint or at
another sequence length. Split from ``autosp.remat_facts``."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.fx as fx

from autosp import _core

_ATTENTION_NAME = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention")


def _hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental import symbolic_shapes

        # optimization_hint (2.12 and later), else size_hint (2.11): both put 4096 in for each
        # data-dependent symbol of a size that mixes them with known ones (2*u0 + s0).
        for name in ("optimization_hint", "size_hint"):
            fn = getattr(symbolic_shapes, name, None)
            if fn is not None:
                return int(fn(x, fallback=4096))
        hint = x.node.hint
        return int(hint) if hint is not None else 4096
    return int(x)


#: Concrete value of a (possibly symbolic) size: the trace's hint by default.
SizeFn = Callable[[Any], int]


def _hinted_meta(x: Any, size: SizeFn = _hint) -> Any:
    """A meta tensor with the concrete shape of a fake tensor (each size through `size`), so
    FLOP formulas evaluate at a real sequence length without adding guards."""
    if isinstance(x, torch.Tensor):
        return torch.empty([size(s) for s in x.shape], dtype=x.dtype, device="meta")
    return x


def _attention_flops(node: fx.Node, name: str, size: SizeFn = _hint) -> float:
    """4*b*h*Sq*Sk*d for the forward (QK^T and PV), 10*b*h*Sq*Sk*d for the backward (five
    matmuls), the convention of torch.utils.flop_counter's SDPA formulas."""
    tensors = [
        a.meta["val"]
        for a in node.args
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]
    backward = "backward" in name
    q, k = (tensors[1], tensors[2]) if backward else (tensors[0], tensors[1])
    if q.dim() != 4 or k.dim() != 4:
        return 0.0
    b, h, sq, d = (size(s) for s in q.shape)
    sk = size(k.shape[-2])
    return float((10 if backward else 4) * b * h * sq * sk * d)


def has_flops(node: fx.Node, kind: Any) -> bool:
    """Whether :func:`node_flops` may count FLOPs for ``node`` (an op with a FLOP formula, or
    attention): a property of the op alone."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    from torch.utils.flop_counter import flop_registry

    return node.target.overloadpacket in flop_registry or kind == _core.RematOpKind.ATTENTION


def node_flops(node: fx.Node, kind: Any, name: str, size: SizeFn = _hint,
               cache: dict[Any, float] | None = None) -> float:
    """FLOPs of one joint-graph node (PyTorch's FLOP formulas; attention by its own formula),
    with symbolic sizes evaluated by `size` (default: the trace's hint). The planner passes a
    `size` that evaluates S at another length. ``cache`` keeps a formula's answer per op and
    argument shapes, for one graph's nodes at one `size`: repeated layers repeat their
    matmuls."""
    if not has_flops(node, kind):
        return 0.0
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(node.target.overloadpacket)
    if formula is None:  # attention
        return _attention_flops(node, name, size)

    def value(a: Any) -> Any:
        return _hinted_meta(a.meta.get("val"), size) if isinstance(a, fx.Node) else a

    key = _flops_key(node, size) if cache is not None else None
    if key is not None and key in cache:  # type: ignore[operator]
        return cache[key]  # type: ignore[index]
    args, kwargs = tree_map(value, (node.args, node.kwargs))
    out = tree_map(lambda x: _hinted_meta(x, size), node.meta.get("val"))
    try:
        flops = float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not accept this overload's arguments
        flops = 0.0
    if key is not None:
        cache[key] = flops  # type: ignore[index]
    return flops


def _flops_key(node: fx.Node, size: SizeFn) -> Any:
    """What a FLOP formula reads of ``node``: its op, and each argument as (sizes, dtype) or its
    value, at the sizes `size` gives. None where an argument is not of these kinds."""
    def part(a: Any) -> Any:
        if isinstance(a, fx.Node):
            a = a.meta.get("val")
        if isinstance(a, torch.Tensor):
            return (tuple(size(s) for s in a.shape), a.dtype)
        if isinstance(a, (list, tuple)):
            return (type(a), tuple(part(x) for x in a))
        if a is None or type(a) in (int, float, bool, str, torch.dtype):
            return a
        raise TypeError

    try:
        return (node.target, part(node.args), tuple((k, part(v)) for k, v in node.kwargs.items()),
                part(node.meta.get("val")))
    except TypeError:
        return None
