"""Canonicalisation of the shape rows: reshapes and views, expand, permutes, narrow and select,
cat and stack, split and its kin. Part of the FX-to-core table in canon.py (importing this
module registers the rows)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autosp.canon import (_RESHAPES, Canon, _arg, _canon, _example, _int, _norm, _tensor_inputs)


# x.view_as(y), x.reshape_as(y), x.expand_as(y): y's shape, read at run time from the local
# tensor, is an operand (input 1) so that the rule sees where it lies.
# Attributes for mask tiling (a reshape replayed on a tile of query rows): "size_args" when the
# sizes are the call's arguments after the tensor (x.view(1, 1, S, S), torch.reshape(x, shape)),
# "size_free" when the call names no size (unsqueeze, squeeze(dim), flatten).
@_canon(*_RESHAPES)
def _c_reshape(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    attrs: dict[str, Any] = {}
    sizes = node.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = sizes[0]
    if name in ("view", "reshape") and sizes and not node.kwargs and all(
            isinstance(_example(s), (int, torch.SymInt)) for s in sizes):
        attrs["size_args"] = True
    elif name in ("unsqueeze", "flatten"):
        attrs["size_free"] = True
    elif name == "squeeze":
        # The dims it may drop: x.squeeze() (any) is not replayed, and the core does not replay
        # a squeeze of the query dim (a no-op at full length, not on a tile of one row).
        dims = sizes if sizes else node.kwargs.get("dim", ())
        dims = dims if isinstance(dims, (list, tuple)) else (dims,)
        if dims and all(isinstance(d, int) for d in dims):
            attrs["size_free"] = True
            attrs["squeeze_dims"] = [_norm(d, xr) for d in dims]
    return "reshape", _tensor_inputs(node, only=[0, 1] if name.endswith("_as") else [0]), attrs


@_canon("expand", "expand_as", "broadcast_to")
def _c_expand(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    return "expand", _tensor_inputs(node, only=[0, 1] if name.endswith("_as") else [0]), {}


@_canon("transpose", "permute", "t", "movedim", "moveaxis")
def _c_permute(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    return "permute", _tensor_inputs(node, only=[0]), {"perm": _perm(node, name, xr)}


@_canon("narrow", "select")
def _c_narrow(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    d = _norm(_int(_arg(node, 1, "dim")), xr)
    dim_map = list(range(xr))
    start = -1
    if name == "select":
        dim_map = [i if i < d else (-1 if i == d else i - 1) for i in range(xr)]
    else:
        s0 = _arg(node, 2, "start")
        start = s0 if isinstance(s0, int) and s0 >= 0 else -1
    return "index", _tensor_inputs(node, only=[0]), {"dim_map": dim_map, "sliced_dims": [d],
                                                     "slice_starts": [start]}


@_canon("cat", "stack")
def _c_cat(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    ex = _example(node)
    rank = ex.dim() if isinstance(ex, torch.Tensor) else 0
    dim = _norm(_int(_arg(node, 1, "dim", 0)), rank)
    operands = _tensor_inputs(node, only=[0], kw=["tensors"])
    if name == "cat":
        # Operands that contribute nothing (torch.cat skips legacy 1-D empty tensors, and
        # one of size 0 along the cat dim adds no element) are not data inputs; they stay
        # alive as refs. A cat of one remaining operand is that operand: an alias (e.g. a
        # KV cache that starts from torch.tensor([]) and concatenates the new keys).
        operands = [(n, p) for n, p in operands if not _adds_nothing(_example(n), dim)]
        if len(operands) == 1:
            return "alias", operands, {}
    return name, operands, {"dim": dim}


@_canon("split", "chunk", "unbind", "split_with_sizes", "tensor_split")
def _c_split(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    d = _arg(node, 1 if name == "unbind" else 2, "dim", 0)
    return ("split" if name != "unbind" else "unbind"), _tensor_inputs(node, only=[0]), {"dim": _norm(_int(d), xr)}


def _adds_nothing(t: Any, dim: int) -> bool:
    """Whether a cat operand contributes no element: a legacy 1-D empty tensor (which
    torch.cat skips whatever the dim), or one whose size along the cat dim is 0."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.dim() == 1 and t.shape[0] == 0:
        return True
    return t.dim() > dim and isinstance(t.shape[dim], int) and t.shape[dim] == 0


def _perm(node: fx.Node, name: str, rank: int) -> list[int]:
    perm = list(range(rank))
    if name == "t":
        return perm[::-1] if rank == 2 else perm
    if name == "transpose":
        a, b = _norm(_int(node.args[1]), rank), _norm(_int(node.args[2]), rank)
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if name == "permute":
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        if not dims:
            dims = node.kwargs.get("dims", ())
        return [_norm(_int(d), rank) for d in dims]
    # movedim(source, destination)
    src, dst = node.args[1], node.args[2]
    src = [src] if not isinstance(src, (tuple, list)) else list(src)
    dst = [dst] if not isinstance(dst, (tuple, list)) else list(dst)
    src = [_norm(_int(s), rank) for s in src]
    dst = [_norm(_int(d), rank) for d in dst]
    out = [-1] * rank
    for s, d in zip(src, dst):
        out[d] = s
    rest = iter(i for i in range(rank) if i not in src)
    return [o if o >= 0 else next(rest) for o in out]
