"""Cross-entropy over a projection to the vocabulary, one chunk of tokens at a time.

A language model's loss reads ``[tokens, vocab]`` logits: at 128k tokens per rank and a 128k
vocabulary that is 64 GiB in fp32, more than all the layers' activations together. With
``autosp.compile(..., tile_loss=True)`` the core (csrc/plan/loss.cpp) recognises a
cross-entropy whose logits come from a linear (the lm_head) through row-wise ops only (casts
such as ``.float()``, pointwise ops with constant operands such as soft-capping, reshapes that
keep the class dim) and that nothing else reads. This module replays that chain on chunks of
rows (``autosp::tiled_head_loss``):

- forward: for each chunk of rows, its logits, the chain's ops and the loss (reduction "sum"
  or "none"); a rank holds one chunk's logits at a time and saves only the linear's operands;
- backward: each chunk's forward is recomputed and back-propagated: the gradient of the
  hidden states row by row, the weight's and bias's summed over chunks in fp32.

Exactness: each row's loss is the computation one device does for that row (the same
matmul row, casts, ops and loss), so the sum differs from the untiled one only by the order
of its additions. The cost: the projection's forward runs twice.

Chunk size (:func:`chunk_rows`): ``AUTOSP_LOSS_TILE_ROWS`` if set, else chunks whose logits
hold as many elements as the hidden states they come from.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp import _core
from autosp.canon import _arg
from autosp.errors import AutospError
from autosp.tiled_ops import (Recipes, autocast_state, autograd_inside_op, replayed_autocast,
                              stable_name)

# recipe key -> f(h_rows [n, D], weight, bias or None, targets [n], reduction) -> loss
_RECIPES = Recipes("loss recipe")


def chunk_rows(rows: int, classes: int, hidden: int) -> int:
    """Rows per chunk: ``AUTOSP_LOSS_TILE_ROWS`` if set, else ``ceil(rows * hidden / classes)``,
    so that one chunk's ``[chunk, classes]`` logits hold as many elements as the hidden states
    ``[rows, hidden]`` they come from: the loss's working set then stays the size of one
    activation, whatever the vocabulary (``classes / hidden`` chunks; 32 for Llama-3's
    128256 / 4096)."""
    fixed = env_rows()
    if fixed is not None:
        return fixed
    return max(1, -(-rows * hidden // max(1, classes)))


def env_rows() -> int | None:
    """``AUTOSP_LOSS_TILE_ROWS`` as a positive int, None when unset; an AutospError otherwise."""
    env = os.environ.get("AUTOSP_LOSS_TILE_ROWS", "").strip()
    if not env:
        return None
    try:
        rows = int(env)
    except ValueError:
        rows = 0
    if rows < 1:
        raise AutospError(f"[autosp:tiled_loss] found AUTOSP_LOSS_TILE_ROWS={env!r}; expected a "
                          "positive integer (rows per chunk of the tiled loss), or unset")
    return rows


def _chunks(rows: int, classes: int, hidden: int) -> list[tuple[int, int]]:
    t = chunk_rows(rows, classes, hidden)
    return [(s, min(rows, s + t)) for s in range(0, rows, t)]


def workspace(node: fx.Node) -> tuple[int, int, int] | None:
    """What a tiled loss op of a joint graph allocates and frees while it runs, for ``autosp
    plan``'s memory model, as ``(bytes per row of h, cap, constant)``: the workspace is
    ``min(bytes per row * rows, cap) + constant`` (no cap when 0); None for any other node.
    The estimate is the core's (``_core.tiled_loss_workspace``, csrc/plan/memory.h)."""
    forward = node.target is torch.ops.autosp.tiled_head_loss.default
    if not forward and node.target is not torch.ops.autosp.tiled_head_loss_backward.default:
        return None
    weight = node.args[1 if forward else 2].meta["val"]
    w = _core.tiled_loss_workspace(not forward, int(weight.shape[0]), int(weight.shape[1]),
                                   weight.dtype.itemsize, env_rows() or 0)
    return w.per_row, w.cap, w.constant


def build_recipe(bridge: Any, chain: list[int], regroup: list[int], ce: fx.Node) -> int:
    """Registers the function computing the loss of ``chain`` (input-graph node ids: the
    linear, then row-wise ops) on a chunk of rows; returns its key. The reshapes among them
    (``regroup``, marked by the core) are dropped: the chunk stays [rows, classes]. Every
    other op is replayed with the chunk for its one tensor operand."""
    ops: list[tuple[Any, str, tuple, dict, Any]] = []
    for origin, skip in zip(chain[1:], regroup[1:]):
        if skip:
            continue
        fxn = bridge.fx_nodes[origin]
        path = bridge.input_paths[origin][0]
        others = [n for n in fxn.all_input_nodes if n is not _operand(fxn, path)]
        if others:
            raise AssertionError(f"tiled loss: {fxn.name} reads {others} besides the logits")
        ops.append((fxn.target, fxn.op, fxn.args, dict(fxn.kwargs), path))
    # F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction,
    # label_smoothing): the core tiles only a loss without class weights; the deprecated
    # size_average and reduce are resolved into the reduction the op is given
    # (canon_attention.cross_entropy_reduction).
    kwargs = {"ignore_index": _arg(ce, 4, "ignore_index", -100),
              "label_smoothing": _arg(ce, 7, "label_smoothing", 0.0)}
    for a in kwargs.values():
        if isinstance(a, fx.Node):
            raise AssertionError(f"tiled loss: {ce.name} has an operand computed in the graph")

    amp = autocast_state()  # the step's mixed precision, replayed inside the op

    def run(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: torch.Tensor,
            reduction: str) -> torch.Tensor:
        with replayed_autocast(amp):
            x = F.linear(h, weight, bias)
            for target, kind, args, kw, path in ops:
                a, k = _with_operand(args, kw, path, x)
                x = getattr(x, target)(*a[1:], **k) if kind == "call_method" else target(*a, **k)
            return F.cross_entropy(x, t, **kwargs, reduction=reduction)

    desc = repr(([(stable_name(t), k, _describe(a), _describe(kw), p) for t, k, a, kw, p in ops],
                 _describe(kwargs), amp))
    key = int(hashlib.sha1(desc.encode()).hexdigest()[:12], 16)
    _RECIPES.setdefault(key, run)
    return key


def _describe(x: Any) -> str:
    return repr(fx.node.map_arg(x, lambda n: "<node>"))


def _operand(fxn: fx.Node, path: tuple) -> Any:
    where, key = path[0], path[1]
    return (fxn.args if where == "args" else fxn.kwargs)[key]


def _with_operand(args: tuple, kwargs: dict, path: tuple, x: torch.Tensor) -> tuple[list, dict]:
    a, k = list(args), dict(kwargs)
    where, key = path[0], path[1]
    if len(path) != 2:
        raise AssertionError(f"tiled loss: operand path {path} is nested")
    if where == "args":
        a[key] = x
    else:
        k[key] = x
    return a, k


def _rows(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return h.reshape(-1, h.shape[-1]), t.reshape(-1)


def _reduce(parts: list[torch.Tensor], t: torch.Tensor, reduction: str, ignore: int,
            like: torch.Tensor) -> torch.Tensor:
    if reduction == "none":
        return torch.cat(parts) if parts else like.new_zeros((0,))
    total = torch.stack(parts).sum() if parts else like.new_zeros(())
    # F.cross_entropy's mean divides by the targets it does not ignore (0/0 = nan for none).
    return total / (t != ignore).sum() if reduction == "mean" else total


@torch.library.custom_op("autosp::tiled_head_loss", mutates_args=())
def tiled_head_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    target: torch.Tensor, recipe: int, reduction: str, ignore_index: int,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """The loss of ``recipe`` over all rows of ``h`` ([..., D], the targets [...]), a chunk of
    rows at a time. ``reduction``: "sum", "mean" (over the targets not equal to
    ``ignore_index``, as F.cross_entropy) or "none" (one loss per row)."""
    h2, t = _rows(h, target)
    run = _RECIPES[recipe]
    each = "none" if reduction == "none" else "sum"
    parts = [run(h2[s:e], weight, bias, t[s:e], each)
             for s, e in _chunks(h2.shape[0], weight.shape[0], weight.shape[1])]
    return _reduce(parts, t, reduction, ignore_index, h2.new_zeros((), dtype=out_dtype)).to(out_dtype)


@tiled_head_loss.register_fake
def _(h, weight, bias, target, recipe, reduction, ignore_index, out_dtype):
    return h.new_empty((target.numel(),) if reduction == "none" else (), dtype=out_dtype)


@torch.library.custom_op("autosp::tiled_head_loss_backward", mutates_args=())
def tiled_head_loss_backward(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, target: torch.Tensor, recipe: int,
                             reduction: str, ignore_index: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of h, weight and bias (an empty tensor without one): each chunk's forward
    recomputed and back-propagated; the weight's and bias's summed over chunks in fp32, as one
    matmul's backward accumulates them."""
    h2, t = _rows(h, target)
    run = _RECIPES[recipe]
    dh = torch.empty_like(h2)
    acc = torch.promote_types(weight.dtype, torch.float32)
    dw = torch.zeros_like(weight, dtype=acc)
    db = torch.zeros_like(bias, dtype=acc) if bias is not None else weight.new_zeros((0,))
    g = grad
    if reduction == "mean":
        g = grad / (t != ignore_index).sum()
    with autograd_inside_op(), torch.enable_grad():
        w = weight.detach().requires_grad_()
        b = bias.detach().requires_grad_() if bias is not None else None
        for s, e in _chunks(h2.shape[0], weight.shape[0], weight.shape[1]):
            hc = h2[s:e].detach().requires_grad_()
            loss = run(hc, w, b, t[s:e], "none" if reduction == "none" else "sum")
            wrt = (hc, w) if b is None else (hc, w, b)
            grads = torch.autograd.grad(loss, wrt, g[s:e] if reduction == "none" else g,
                                        allow_unused=True)
            dh[s:e] = grads[0] if grads[0] is not None else 0
            if grads[1] is not None:
                dw += grads[1]
            if b is not None and grads[2] is not None:
                db += grads[2]
    return dh.reshape(h.shape), dw.to(weight.dtype), db.to(weight.dtype if bias is None else bias.dtype)


@tiled_head_loss_backward.register_fake
def _(grad, h, weight, bias, target, recipe, reduction, ignore_index):
    db = torch.empty_like(bias) if bias is not None else weight.new_empty((0,))
    return torch.empty_like(h), torch.empty_like(weight), db


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    h, weight, bias, target, recipe, reduction, ignore, _ = inputs
    # The targets are saved as a copy: a batch tensor the caller refills between forward and
    # backward must not change the loss the backward recomputes.
    ctx.save_for_backward(h, weight, bias, target.clone())
    ctx.recipe, ctx.reduction, ctx.ignore = recipe, reduction, ignore


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    h, weight, bias, target = ctx.saved_tensors
    dh, dw, db = tiled_head_loss_backward(grad, h, weight, bias, target, ctx.recipe,
                                          ctx.reduction, ctx.ignore)
    return dh, dw, (db if bias is not None else None), None, None, None, None, None


tiled_head_loss.register_autograd(_backward, setup_context=_setup_context)


def emit(graph: fx.Graph, fxn: fx.Node, cn: Any, bridge: Any, ins: list[fx.Node | None],
         reduction: str) -> fx.Node:
    """The tiled loss standing for the cross-entropy node ``fxn`` (plan node ``cn``: inputs
    -1, targets, h, weight, bias)."""
    env_rows()  # a bad AUTOSP_LOSS_TILE_ROWS stops the compile, not the first step
    key = build_recipe(bridge, list(cn.attrs["head_chain"]), list(cn.attrs["head_regroup"]), fxn)
    out = fxn.meta["example_value"]
    _, target, h, weight, bias = ins
    return graph.call_function(torch.ops.autosp.tiled_head_loss.default,
                               (h, weight, bias, target, key, reduction,
                                int(cn.attrs["ignore_index"]), out.dtype))


def recomputed_share(node: fx.Node) -> float:
    """Of a node's model FLOPs (the formulas below), the share it computes again inside: the
    backward recomputes each chunk's logits (2 of its 4 * rows * hidden * classes); 0 for any
    other node. ``autosp plan`` counts it as recomputation (MemoryNode.inner_recompute_flops)."""
    return 0.5 if node.target is torch.ops.autosp.tiled_head_loss_backward.default else 0.0


def _register_flops() -> None:
    """Model FLOPs of the tiled ops (torch.utils.flop_counter, read by autosp's remat facts and
    the trainer's MFU): the projection's 2 * rows * hidden * classes forward, and its backward's
    4 * rows * hidden * classes (the gradients of h and of the weight). The backward's
    recomputation of each chunk's logits is not model work, as remat's is not."""
    from math import prod

    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.autosp.tiled_head_loss)
    def _forward(h_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
        return 2 * prod(h_shape) * w_shape[0]

    @register_flop_formula(torch.ops.autosp.tiled_head_loss_backward)
    def _backward(grad_shape: Any, h_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
        return 4 * prod(h_shape) * w_shape[0]


_register_flops()
