"""Attention with a mask that is never materialised at ``[S, S]``.

Under Ulysses each rank attends with all S queries of its heads, so an SDPA mask built as an
``[S, S]`` (or ``[B, 1, S, S]``) tensor would cost O(S^2) on every rank whatever the SP
degree. The core (csrc/plan/mask_tiles.cpp) recognises masks computed from O(S) operands
(positions compared with each other, a ``[B, S]`` padding mask, ``tril`` of ones) and
records the chain of ops that computes one. This module turns that record into a small FX
graph, the *recipe*, which computes the mask's rows ``[start, end)`` from the operands, and
runs attention one tile of query rows at a time (``autosp::tiled_scaled_dot_product_attention``):
a rank holds one ``[B, 1, tile, S]`` mask at a time.

Exactness: each query row's attention is the same computation as in one SDPA call over all
rows (the same keys, values and mask row), so the tiles' rows are those of the untiled op.
The backward recomputes each tile's forward (with its mask tile) and back-propagates it,
summing the keys' and values' gradients over tiles: the attention forward runs twice,
which is the price of not keeping an ``[S, S]`` mask for the backward.

Tile size: ``AUTOSP_MASK_TILE_ROWS`` if set, otherwise as many rows as keep one mask tile
within 2^28 elements (a single tile, i.e. one SDPA call, when the whole mask fits).
"""

from __future__ import annotations

import hashlib
import operator
import os
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.apply_args import nodes_in, set_path, to_mutable, to_tuples
from autosp.canon import target_name
from autosp.tiled_ops import Recipes, autograd_inside_op

# How a chain node's replay on rows [start, end) differs from the op as written (the core's
# enum How in mask_tiles.cpp).
_PLAIN, _EXPAND_SIZE, _FACTORY_SIZE, _TRIL_ROWS, _TRIL_COLS, _EYE_ROWS, _RESHAPE_SIZE = range(7)

#: Mask tile size when AUTOSP_MASK_TILE_ROWS is not set: at most this many mask elements.
TILE_ELEMENTS = 1 << 28

_RECIPES = Recipes("mask recipe")


def tile_rows(batch: int, keys: int) -> int:
    env = os.environ.get("AUTOSP_MASK_TILE_ROWS")
    if env:
        return max(1, int(env))
    return max(128, TILE_ELEMENTS // max(1, batch * keys))


def _decode(chain: list[int]) -> list[tuple[int, int, int, list[tuple[int, int]], int]]:
    """[origin, how, qdim, n_in, (vid, dim) * n_in, out] * k -> tuples."""
    out, i = [], 0
    while i < len(chain):
        origin, how, qdim, n = chain[i : i + 4]
        pairs = [(chain[i + 4 + 2 * j], chain[i + 5 + 2 * j]) for j in range(n)]
        i += 4 + 2 * n
        out.append((origin, how, qdim, pairs, chain[i]))
        i += 1
    return out


def _sizes_at(args: list, kwargs: dict, first: int) -> tuple[list, Callable[[list], None]]:
    """The size list of a factory or expand call (varargs from ``first`` or one list/tuple
    argument, or kwarg ``size``) and a setter putting a changed list back."""
    if "size" in kwargs:
        sizes = list(kwargs["size"])
        return sizes, lambda s: kwargs.__setitem__("size", tuple(s))
    if len(args) > first and isinstance(args[first], (list, tuple)):  # ones((S, S)), full((S, S), v)
        return list(args[first]), lambda s: args.__setitem__(first, tuple(s))
    sizes = list(args[first:])

    def put(s: list) -> None:
        args[first:] = s

    return sizes, put


def eye_rows(start: int, end: int, n: int, m: int | None = None, *, dtype: torch.dtype | None = None,
             device: Any = None, layout: Any = None, requires_grad: bool = False,
             pin_memory: bool = False) -> torch.Tensor:
    """Rows [start, end) of torch.eye(n, m)."""
    rows = torch.arange(start, end, device=device)[:, None]
    cols = torch.arange(n if m is None else m, device=device)[None, :]
    return (rows == cols).to(dtype if dtype is not None else torch.get_default_dtype())


def _operands(fxn: fx.Node, paths: list) -> list[fx.Node]:
    """The FX nodes at an op's operand paths (the tensors the core sees as its inputs)."""
    found = []
    for path in paths:
        where, key, *rest = path
        a = fxn.args[key] if where == "args" else fxn.kwargs.get(key)
        for k in rest:
            a = a[k]
        if isinstance(a, fx.Node):
            found.append(a)
    return found


def build_recipe(bridge: Any, chain: list[int], leaf_dims: list[int],
                 leaves: list[int]) -> tuple[int, list[fx.Node]]:
    """Register the recipe of a tiled mask; returns its key and the input-graph nodes of the
    non-tensor arguments (sizes) it reads, which the caller passes as ``syms``."""

    entries = _decode(chain)
    fx_nodes = [bridge.fx_nodes[origin] for origin, *_ in entries]
    syms: list[fx.Node] = []
    dtypes: dict[fx.Node, torch.dtype] = {}  # x.to(y) / x.type_as(y): y read for its dtype
    for (origin, *_), fxn in zip(entries, fx_nodes):
        at_paths = set(_operands(fxn, bridge.input_paths[origin]))
        for a in nodes_in((fxn.args, fxn.kwargs)):
            ex = a.meta.get("example_value")
            if isinstance(ex, torch.Tensor) and a not in at_paths:
                if target_name(fxn) not in ("to", "type_as"):
                    raise AssertionError(f"mask recipe: {fxn.name} reads {a.name} outside its operands")
                dtypes[a] = ex.dtype
                continue
            if isinstance(ex, torch.Tensor) or a in syms:
                continue
            if not isinstance(ex, (int, torch.SymInt)):
                raise AssertionError(f"mask recipe: {fxn.name} reads {a.name} ({type(ex).__name__}), "
                                     "not a tensor or an integer")
            syms.append(a)
    g = fx.Graph()
    start, end = g.placeholder("start"), g.placeholder("end")
    leaf_ph = [g.placeholder(f"leaf{i}") for i in range(len(leaves))]
    sym_ph = {s: g.placeholder(f"sym{i}") for i, s in enumerate(syms)}
    length = g.call_function(operator.sub, (end, start))
    env: dict[tuple[int, int], fx.Node] = {}
    for ph, vid, d in zip(leaf_ph, leaves, leaf_dims):
        env[(vid, d)] = g.call_function(torch.narrow, (ph, d, start, length)) if d >= 0 else ph
    out = None
    for (origin, how, qdim, pairs, out_vid), fxn in zip(entries, fx_nodes):
        paths = bridge.input_paths[origin]
        def local(n: fx.Node) -> Any:
            return dtypes[n] if n in dtypes else sym_ph.get(n, n)

        args = to_mutable(fx.node.map_arg(fxn.args, local))
        kwargs = {k: to_mutable(v) for k, v in fx.node.map_arg(dict(fxn.kwargs), local).items()}
        for (vid, d), path in zip(pairs, paths):
            if vid >= 0:
                set_path(args, kwargs, path, env[(vid, d)])
        if how == _EXPAND_SIZE:
            sizes, put = _sizes_at(args, kwargs, 1)
            # -1 keeps the operand's (tiled) size; a dim the operand lacks or broadcasts is
            # created at the tile's length.
            sizes[qdim] = -1 if pairs[0][1] >= 0 else length
            put(sizes)
        elif how in (_FACTORY_SIZE, _RESHAPE_SIZE):  # ones(S, S); x.view(1, 1, S, S)
            sizes, put = _sizes_at(args, kwargs, 0 if how == _FACTORY_SIZE else 1)
            sizes[qdim] = length
            put(sizes)
        elif how in (_TRIL_ROWS, _TRIL_COLS):
            diag = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
            shifted = g.call_function(operator.add if how == _TRIL_ROWS else operator.sub, (diag, start))
            if len(args) > 1:
                args[1] = shifted
            else:
                kwargs["diagonal"] = shifted
        args = to_tuples(args, fxn.args)
        kwargs = {k: to_tuples(v, fxn.kwargs[k]) if k in fxn.kwargs else v for k, v in kwargs.items()}
        target, kind = fxn.target, fxn.op
        if target_name(fxn) == "type_as":  # x.type_as(y): the cast to y's dtype
            target, kind = "to", "call_method"
        if how == _EYE_ROWS:
            target, kind, args = eye_rows, "call_function", (start, end, *args)
        stale = [n for n in nodes_in((args, kwargs)) if n.graph is not g]
        if stale:
            raise AssertionError(f"mask recipe: {fxn.name} still reads {stale} of the input graph")
        out = g.create_node(kind, target, tuple(args), kwargs, name=fxn.name)
        env[(out_vid, qdim)] = out
    g.output(out)
    gm = fx.GraphModule(torch.nn.Module(), g)
    key = int.from_bytes(hashlib.sha256(gm.code.encode()).digest()[:7], "little")
    _RECIPES.setdefault(key, gm)
    return key, syms


def _tiles(q: torch.Tensor, k: torch.Tensor) -> list[tuple[int, int]]:
    rows, keys = q.shape[-2], k.shape[-2]
    t = tile_rows(q.shape[0] if q.dim() == 4 else 1, keys)
    return [(s, min(rows, s + t)) for s in range(0, rows, t)]


def _mask(key: int, s: int, e: int, leaves: list[torch.Tensor], syms: list[int]) -> torch.Tensor:
    return _RECIPES[key](s, e, *leaves, *syms)


@torch.library.custom_op("autosp::tiled_scaled_dot_product_attention", mutates_args=())
def tiled_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor],
               syms: list[int], recipe: int, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """SDPA of q against k and v with the mask of ``recipe``, one tile of query rows at a time."""
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    for s, e in _tiles(q, k):
        out[..., s:e, :] = F.scaled_dot_product_attention(
            q[..., s:e, :], k, v, attn_mask=_mask(recipe, s, e, leaves, syms), scale=scale,
            enable_gqa=enable_gqa)
    return out


@tiled_sdpa.register_fake
def _(q, k, v, leaves, syms, recipe, scale, enable_gqa):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("autosp::tiled_scaled_dot_product_attention_backward", mutates_args=())
def tiled_sdpa_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        leaves: list[torch.Tensor], syms: list[int], recipe: int, scale: float | None,
                        enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k and v: each tile's forward recomputed and back-propagated."""
    dq = torch.empty_like(q)
    # The keys' and values' gradients are sums over tiles: accumulated in fp32 (one SDPA
    # backward accumulates them internally), cast once.
    acc = torch.promote_types(k.dtype, torch.float32)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)
    with autograd_inside_op(), torch.enable_grad():
        kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
        for s, e in _tiles(q, k):
            qt = q[..., s:e, :].detach().requires_grad_()
            o = F.scaled_dot_product_attention(qt, kk, vv, attn_mask=_mask(recipe, s, e, leaves, syms),
                                               scale=scale, enable_gqa=enable_gqa)
            gq, gk, gv = torch.autograd.grad(o, (qt, kk, vv), grad[..., s:e, :])
            dq[..., s:e, :] = gq
            dk += gk
            dv += gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


@tiled_sdpa_backward.register_fake
def _(grad, q, k, v, leaves, syms, recipe, scale, enable_gqa):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    q, k, v, leaves, syms, recipe, scale, enable_gqa = inputs
    # The mask's operands are saved as copies (O(S) each): a batch tensor the caller refills
    # between forward and backward (a reused loader buffer) must not change the mask the
    # backward recomputes, as it does not change the mask one device computed in forward.
    ctx.save_for_backward(q, k, v, *[t.clone() for t in leaves])
    ctx.syms, ctx.recipe, ctx.scale, ctx.enable_gqa = syms, recipe, scale, enable_gqa


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    q, k, v, *leaves = ctx.saved_tensors
    dq, dk, dv = tiled_sdpa_backward(grad, q, k, v, leaves, ctx.syms, ctx.recipe, ctx.scale,
                                     ctx.enable_gqa)
    # One entry per input, in the structure torch.library's autograd wrapper flattens them:
    # a list of tensors (an empty list counts as one) is mirrored, any other list is one entry.
    return dq, dk, dv, [None] * len(leaves), (None if ctx.syms else []), None, None, None


tiled_sdpa.register_autograd(_backward, setup_context=_setup_context)


def emit(graph: fx.Graph, fxn: fx.Node, cn: Any, bridge: Any, ins: list[fx.Node],
         old_to_new: dict[fx.Node, fx.Node]) -> fx.Node:
    """The tiled attention standing for the SDPA node ``fxn`` (plan node ``cn``: q, k, v,
    then the mask's operands)."""
    leaves = list(cn.inputs[3:])
    key, syms = build_recipe(bridge, list(cn.attrs["mask_tiles"]), list(cn.attrs["mask_leaf_dims"]), leaves)
    # F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    scale = fxn.kwargs.get("scale", fxn.args[6] if len(fxn.args) > 6 else None)
    enable_gqa = bool(fxn.kwargs.get("enable_gqa", fxn.args[7] if len(fxn.args) > 7 else False))
    if isinstance(scale, fx.Node):
        raise AssertionError("tiled attention: a scale computed in the graph")
    args = (ins[0], ins[1], ins[2], list(ins[3:]), [old_to_new[s] for s in syms], key,
            None if scale is None else float(scale), enable_gqa)
    return graph.call_function(torch.ops.autosp.tiled_scaled_dot_product_attention.default, args)
