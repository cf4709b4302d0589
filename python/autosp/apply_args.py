"""Argument surgery for the apply stage (autosp.apply): FX arguments made mutable and back,
an operand set at its recorded path, an indexing node's slice taken whole, F.cross_entropy's
reduction rewritten, and small readers of FX nodes."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autosp.canon_attention import cross_entropy_reduction


def to_mutable(a: Any) -> Any:
    if isinstance(a, (tuple, list)):
        return [to_mutable(x) for x in a]
    return a


def to_tuples(a: Any, like: Any) -> Any:
    if isinstance(like, tuple):
        return tuple(to_tuples(x, y) for x, y in zip(a, like))
    if isinstance(like, list):
        return [to_tuples(x, y) for x, y in zip(a, like)]
    return a


def set_path(args: list, kwargs: dict, path: tuple, value: Any) -> None:
    where, key, *rest = path
    if where == "args":
        if not rest:
            args[key] = value
            return
        cont = args[key]
    else:
        if not rest:
            kwargs[key] = value
            return
        cont = kwargs[key]
    for k in rest[:-1]:
        cont = cont[k]
    cont[rest[-1]] = value


def unslice(fxn: fx.Node, args: Any, kwargs: dict, dim: int) -> tuple[Any, Any, dict]:
    """The indexing node ``fxn`` with its slice of input dim ``dim`` taken whole."""
    from autosp.canon_index import expand_index

    if fxn.target is operator.getitem:
        x, idx = args[0], args[1]
        items = expand_index(idx, len(example_shape(fxn.args[0])))
        seen = -1
        for j, it in enumerate(items):
            if it is not None:
                seen += 1
            if seen == dim and it is not None:
                items[j] = slice(None)
                break
        return operator.getitem, (x, tuple(items)), kwargs
    # narrow(x, dim, start, length): the whole dim
    x = args[0] if args else kwargs["input"]
    return operator.getitem, (x, (slice(None),) * (dim + 1)), {}


def example_shape(n: Any) -> tuple:
    ex = n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None
    return tuple(ex.shape) if isinstance(ex, torch.Tensor) else ()


def nodes_in(a: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(a, lambda n: found.append(n) or n)
    return found


def replaced_expr(s: torch.SymInt) -> Any:
    env = s.node.shape_env
    try:
        return env.replace(s.node.expr)
    except Exception:
        return s.node.expr


def node_loc(fxn: fx.Node) -> str:
    from autosp.fx_source import source_loc

    return str(source_loc(fxn))


def rewrite_target(fxn: fx.Node, name: str) -> Any:
    if isinstance(fxn.target, str):
        return name
    return getattr(torch, name)


def current_reduction(fxn: fx.Node) -> str:
    return cross_entropy_reduction(fxn)


def set_reduction(args: Any, kwargs: dict, reduction: str) -> tuple:
    """F.cross_entropy's arguments with ``reduction``, the deprecated size_average and reduce
    (which would override it) cleared."""
    args = list(args)
    for i, key in ((3, "size_average"), (5, "reduce")):
        if len(args) > i:
            args[i] = None
        elif key in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k != key}
    if len(args) > 6:
        args[6] = reduction
    else:
        kwargs = dict(kwargs, reduction=reduction)
    return tuple(args), kwargs
