"""Row-wise blocks (an MLP) run a chunk of rows at a time: ALST's TiledMLP on the user's
unchanged model.

With ``autosp.compile(..., tile_mlp=True)`` the core (csrc/plan/tiled_rows.cpp) finds each
block of linears and elementwise ops that ends in a linear (the down projection) and whose
intermediates nothing else reads, and replaces it with one ``autosp::tiled_rows`` op:

- forward: the block on each chunk of rows (along ``row_dim``, the sequence), without
  gradients, so one chunk's intermediates (``[rows, ffn]``, 3.5x the hidden state in Llama)
  exist at a time; only the block's operands are saved for backward;
- backward (``autosp::tiled_rows_backward``): each chunk's forward recomputed with gradients
  and back-propagated; the row operands' gradients row by row, the whole operands' (weights,
  biases) summed over chunks in fp32.

Exactness: each row of the result is the computation one device does for that row, so the
result is the untiled one; the weights' gradients differ only by the order of their sum over
chunks. Cost: the block's forward runs twice (as under full remat of the block).

Rows per chunk (:func:`chunk_rows`): ``AUTOSP_MLP_TILE_ROWS`` if set, else the core's
(``_core.tiled_rows_chunk``: one chunk's intermediates as large as the block's inputs).
"""

from __future__ import annotations

import hashlib
import os
from math import prod
from typing import Any

import torch
import torch.fx as fx

from autosp import _core
from autosp.errors import AutospError
from autosp.tiled_ops import (Recipes, autocast_state, autograd_inside_op, replayed_autocast,
                              stable_name)

# recipe key -> f(rows: list[Tensor] (chunks), wholes: list[Tensor]) -> Tensor
_RECIPES = Recipes("row-wise block recipe")
# recipe key -> (row_in_bytes, row_inner_bytes, forward FLOPs per row of the chunk dim)
_FACTS: dict[int, tuple[int, int, int]] = {}


def env_rows() -> int | None:
    """``AUTOSP_MLP_TILE_ROWS`` as a positive int, None when unset; an AutospError otherwise."""
    env = os.environ.get("AUTOSP_MLP_TILE_ROWS", "").strip()
    if not env:
        return None
    try:
        rows = int(env)
    except ValueError:
        rows = 0
    if rows < 1:
        raise AutospError(f"[autosp:tiled_rows] found AUTOSP_MLP_TILE_ROWS={env!r}; expected a "
                          "positive integer (rows per chunk of a tiled MLP), or unset")
    return rows


def chunk_rows(rows: int, recipe: int) -> int:
    """Rows per chunk of block ``recipe`` over ``rows`` rows."""
    in_bytes, inner_bytes, _ = _FACTS[recipe]
    return _core.tiled_rows_chunk(rows, in_bytes, inner_bytes, env_rows() or 0)


def build_recipe(bridge: Any, cn: Any) -> int:
    """Registers the function computing the block of plan node ``cn`` (attributes row_nodes,
    row_args: see csrc/plan/ulysses.h) on chunks of its row operands; returns its key."""
    origins = list(cn.attrs["row_nodes"])
    codes = list(cn.attrs["row_args"])
    steps: list[tuple[Any, str, Any, dict, list[tuple[tuple, int]]]] = []
    dim = int(cn.attrs["row_dim"])
    flops_per_row = 0
    at = 0
    for origin in origins:
        fxn = bridge.fx_nodes[origin]
        paths = bridge.input_paths[origin]
        count = codes[at]
        refs = codes[at + 1: at + 1 + count]
        at += 1 + count
        if count != len(paths):
            raise AssertionError(f"tiled rows: {fxn.name} has {len(paths)} operands, plan {count}")
        subs = [(tuple(p), int(code)) for p, code in zip(paths, refs) if code != -1]
        if any(len(p) != 2 for p, _ in subs):
            raise AssertionError(f"tiled rows: {fxn.name} has a nested operand path")
        args, kwargs = list(fxn.args), dict(fxn.kwargs)
        for (where, key), _ in subs:
            if where == "args":
                args[key] = None
            else:
                kwargs[key] = None
        left: list[fx.Node] = []
        fx.node.map_arg((args, kwargs), left.append)
        if left:
            raise AssertionError(f"tiled rows: {fxn.name} reads {left} besides its operands")
        steps.append((fxn.target, fxn.op, tuple(args), kwargs, subs))
        if fxn.target is torch.nn.functional.linear:
            out = fxn.meta["example_value"]
            between = [out.shape[i] for i in range(dim + 1, out.dim() - 1)]
            if all(isinstance(s, int) for s in between):
                weight = _operand(fxn.args, fxn.kwargs, paths[1]).meta["example_value"]
                flops_per_row += (2 * int(weight.shape[0]) * int(weight.shape[1])
                                  * int(prod(between)))

    amp = autocast_state()  # the step's mixed precision, replayed inside the op

    def run(rows: list[torch.Tensor], wholes: list[torch.Tensor]) -> torch.Tensor:
        with replayed_autocast(amp):
            return _replay(rows, wholes)

    def _replay(rows: list[torch.Tensor], wholes: list[torch.Tensor]) -> torch.Tensor:
        operands = list(rows) + list(wholes)
        made: list[torch.Tensor] = []
        for target, kind, args, kwargs, subs in steps:
            a, k = list(args), dict(kwargs)
            for (where, key), code in subs:
                x = operands[code] if code >= 0 else made[-2 - code]
                if where == "args":
                    a[key] = x
                else:
                    k[key] = x
            made.append(getattr(a[0], target)(*a[1:], **k) if kind == "call_method" else target(*a, **k))
        return made[-1]

    # What the block computes, and the widths that set its chunks and FLOPs: equal keys, equal
    # blocks (the same in every process, for the compile caches).
    desc = repr(([(stable_name(t), k, _describe(a), _describe(kw), s) for t, k, a, kw, s in steps],
                 int(cn.attrs["row_inputs"]), dim, int(cn.attrs["row_in_bytes"]),
                 int(cn.attrs["row_inner_bytes"]), flops_per_row, amp))
    key = int(hashlib.sha1(desc.encode()).hexdigest()[:12], 16)
    _RECIPES.setdefault(key, run)
    _FACTS.setdefault(key, (int(cn.attrs["row_in_bytes"]), int(cn.attrs["row_inner_bytes"]),
                            flops_per_row))
    return key


def _operand(args: tuple, kwargs: dict, path: Any) -> Any:
    return (args if path[0] == "args" else kwargs)[path[1]]


def _describe(x: Any) -> str:
    return repr(fx.node.map_arg(x, lambda n: "<node>"))


def _spans(rows: int, recipe: int) -> list[tuple[int, int]]:
    t = chunk_rows(rows, recipe)
    return [(s, min(rows, s + t)) for s in range(0, rows, t)]


@torch.library.custom_op("autosp::tiled_rows", mutates_args=())
def tiled_rows(rows: list[torch.Tensor], wholes: list[torch.Tensor], recipe: int,
               dim: int) -> torch.Tensor:
    """The block ``recipe`` over ``rows`` (cut along ``dim``) and ``wholes`` (read whole), a
    chunk at a time, without gradients."""
    run = _RECIPES[recipe]
    n = rows[0].shape[dim]
    out: torch.Tensor | None = None
    with torch.no_grad():
        for s, e in _spans(n, recipe):
            part = run([r.narrow(dim, s, e - s) for r in rows], wholes)
            if out is None:
                shape = list(part.shape)
                shape[dim] = n
                out = part.new_empty(shape)
            out.narrow(dim, s, e - s).copy_(part)
    assert out is not None, "tiled rows: no rows"
    return out


@tiled_rows.register_fake
def _(rows, wholes, recipe, dim):
    # The block run once on the fake operands: its result's shape, dtype and strides.
    with torch.no_grad():
        return _RECIPES[recipe](rows, wholes).clone()


@torch.library.custom_op("autosp::tiled_rows_backward", mutates_args=())
def tiled_rows_backward(grad: torch.Tensor, rows: list[torch.Tensor], wholes: list[torch.Tensor],
                        recipe: int, dim: int) -> list[torch.Tensor]:
    """Gradients of ``rows`` then ``wholes``: each chunk's forward recomputed and
    back-propagated; the whole operands' gradients summed over chunks in fp32."""
    run = _RECIPES[recipe]
    n = rows[0].shape[dim]
    d_rows = [torch.zeros_like(r) for r in rows]
    d_wholes = [torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32))
                for w in wholes]
    with autograd_inside_op(), torch.enable_grad():
        ws = [w.detach().requires_grad_(w.is_floating_point()) for w in wholes]
        for s, e in _spans(n, recipe):
            rs = [r.narrow(dim, s, e - s).detach().requires_grad_(r.is_floating_point())
                  for r in rows]
            out = run(rs, ws)
            wrt = [t for t in rs + ws if t.requires_grad]
            got = iter(torch.autograd.grad(out, wrt, grad.narrow(dim, s, e - s), allow_unused=True))
            for i, r in enumerate(rs):
                g = next(got) if r.requires_grad else None
                if g is not None:
                    d_rows[i].narrow(dim, s, e - s).copy_(g)
            for i, w in enumerate(ws):
                g = next(got) if w.requires_grad else None
                if g is not None:
                    d_wholes[i] += g
    return d_rows + [d.to(w.dtype) for d, w in zip(d_wholes, wholes)]


@tiled_rows_backward.register_fake
def _(grad, rows, wholes, recipe, dim):
    return [torch.empty_like(r) for r in rows] + [torch.empty_like(w) for w in wholes]


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    rows, wholes, recipe, dim = inputs
    ctx.save_for_backward(*rows, *wholes)
    ctx.n_rows, ctx.recipe, ctx.dim = len(rows), recipe, dim
    ctx.wants = [r.requires_grad for r in rows], [w.requires_grad for w in wholes]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    saved = ctx.saved_tensors
    rows, wholes = list(saved[:ctx.n_rows]), list(saved[ctx.n_rows:])
    grads = tiled_rows_backward(grad, rows, wholes, ctx.recipe, ctx.dim)
    want_r, want_w = ctx.wants
    g_rows = [g if w else None for g, w in zip(grads[:len(rows)], want_r)]
    g_wholes = [g if w else None for g, w in zip(grads[len(rows):], want_w)]
    return g_rows, g_wholes, None, None


tiled_rows.register_autograd(_backward, setup_context=_setup_context)


def emit(graph: fx.Graph, fxn: fx.Node, cn: Any, bridge: Any, ins: list[fx.Node]) -> fx.Node:
    """The tiled op standing for the block of plan node ``cn`` (its root: ``fxn``)."""
    env_rows()  # a bad AUTOSP_MLP_TILE_ROWS stops the compile, not the first step
    key = build_recipe(bridge, cn)
    k = int(cn.attrs["row_inputs"])
    return graph.call_function(torch.ops.autosp.tiled_rows.default,
                               (ins[:k], ins[k:], key, int(cn.attrs["row_dim"])))


def workspace(node: fx.Node) -> tuple[Any, fx.Node, int] | None:
    """What a tiled op of a joint graph allocates and frees while it runs, for ``autosp plan``'s
    memory model: ``(core TiledRowsWorkspace, the first row operand, the chunk dim)``; the
    tokens are that operand's dims up to the chunk dim. None for any other node. The estimate
    is the core's (``_core.tiled_rows_workspace``, csrc/plan/memory.h)."""
    forward = node.target is torch.ops.autosp.tiled_rows.default
    if not forward and node.target is not torch.ops.autosp.tiled_rows_backward.default:
        return None
    rows, wholes, recipe, dim = node.args if forward else node.args[1:]
    in_bytes, inner_bytes, _ = _FACTS[recipe]
    out = (node if forward else node.args[0]).meta["val"]
    out_bytes = out.dtype.itemsize * int(prod(out.shape[dim + 1:]))
    vals = [w.meta["val"] for w in wholes]
    batch = int(prod(rows[0].meta["val"].shape[:dim]))
    w = _core.tiled_rows_workspace(not forward, in_bytes, inner_bytes, out_bytes,
                                   sum(v.numel() * v.dtype.itemsize for v in vals),
                                   sum(v.numel() for v in vals), batch, env_rows() or 0)
    return w, rows[0], dim


def recomputed_share(node: fx.Node) -> float:
    """Of a tiled backward node's FLOPs (its model FLOPs: twice the block's forward), the share
    it computes again inside: the block's forward, a half; 0 for any other node."""
    return 0.5 if node.target is torch.ops.autosp.tiled_rows_backward.default else 0.0


def _register_flops() -> None:
    """Model FLOPs (torch.utils.flop_counter): the block's linears forward, twice that
    backward; the backward's recomputation is not model work, as remat's is not."""
    from torch.utils.flop_counter import register_flop_formula

    def forward_flops(rows_shapes: Any, recipe: int, dim: int) -> int:
        # per row of the chunk dim, times the rows: the dims up to and including it
        return _FACTS.get(recipe, (0, 0, 0))[2] * int(prod(rows_shapes[0][:dim + 1]))

    @register_flop_formula(torch.ops.autosp.tiled_rows)
    def _forward(rows_shapes: Any, wholes_shapes: Any, recipe: int, dim: int, *args: Any,
                 **kwargs: Any) -> int:
        return forward_flops(rows_shapes, recipe, dim)

    @register_flop_formula(torch.ops.autosp.tiled_rows_backward)
    def _backward(grad_shape: Any, rows_shapes: Any, wholes_shapes: Any, recipe: int, dim: int,
                  *args: Any, **kwargs: Any) -> int:
        return 2 * forward_flops(rows_shapes, recipe, dim)


_register_flops()
