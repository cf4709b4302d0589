"""The tiled loss's custom ops (autosp.tiled_loss builds their recipes and emits them).

- ``autosp::tiled_head_loss``: the loss, a chunk of rows at a time, saving only the linear's
  operands; its backward (``autosp::tiled_head_loss_backward``) recomputes each chunk's logits
  and back-propagates them. Used for reduction "none" (one loss per row: the gradient is not
  known until the backward) and for a loss that needs no gradient.
- ``autosp::tiled_head_loss_with_grads``: for a scalar loss ("sum" or "mean", the usual
  language-model loss), the forward back-propagates each chunk as soon as its loss is known
  (as Liger-Kernel's fused linear cross-entropy does) and returns the gradients of h, the
  weight and the bias for a loss gradient of 1; the backward only scales them by the loss's
  actual gradient. Nothing is recomputed: the projection's forward runs once, not twice.
  Memory: it saves the gradient of h (the size of h) and the weight's in fp32 from the forward
  to the backward, instead of h.

Exactness: each chunk's gradients are those one device computes for its rows, accumulated in
fp32 over chunks as one matmul's backward does. With reduction "mean" the forward seeds the
chunks with 1 / (count of valid targets), as the backward of the untiled mean does; the
scaling by the loss's gradient happens once at the end (for a gradient of 1, the usual
``loss.backward()``, the result is bitwise the recomputing op's; otherwise it differs by one
rounding of the product).
"""

from __future__ import annotations

from typing import Any

import torch

from autosp.tiled_loss import _RECIPES, _chunks, _reduce, _rows
from autosp.tiled_ops import autograd_inside_op


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _chunk_grads(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 target: torch.Tensor, recipe: int, reduction: str, seed: torch.Tensor,
                 wrt: tuple[bool, bool, bool], chunks: int
                 ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chunk's loss, back-propagated from ``seed`` (a scalar, or one value per row for
    reduction "none"): the chunks' losses, h's gradient ([rows, D], in h's dtype), and the
    weight's and bias's summed over chunks in fp32 (empty tensors where ``wrt`` says no
    gradient is needed)."""
    h2, t = _rows(h, target)
    run = _RECIPES[recipe]
    acc = torch.promote_types(weight.dtype, torch.float32)
    dh = torch.empty_like(h2) if wrt[0] else h2.new_empty((0,))
    dw = torch.zeros_like(weight, dtype=acc) if wrt[1] else weight.new_empty((0,), dtype=acc)
    db = torch.zeros_like(bias, dtype=acc) if bias is not None and wrt[2] \
        else weight.new_empty((0,), dtype=acc)
    each = "none" if reduction == "none" else "sum"
    parts = []
    # Identity hooks shadow the caller's saved-tensor hooks (save_on_cpu, a memory probe): the
    # chunk's autograd graph lives only inside this op, its tensors are not the step's.
    with autograd_inside_op(), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        w = weight.detach().requires_grad_(wrt[1])
        b = bias.detach().requires_grad_(wrt[2]) if bias is not None else None
        for s, e in _chunks(h2.shape[0], weight.shape[0], weight.shape[1], chunks):
            hc = h2[s:e].detach().requires_grad_(wrt[0])
            loss = run(hc, w, b, t[s:e], each)
            parts.append(loss.detach())
            inputs = [x for x, need in ((hc, wrt[0]), (w, wrt[1]), (b, wrt[2]))
                      if need and x is not None]
            if not inputs:
                continue
            grads = iter(torch.autograd.grad(loss, inputs, seed[s:e] if seed.dim() else seed,
                                             allow_unused=True))
            if wrt[0]:
                g = next(grads)
                dh[s:e] = g if g is not None else 0
            if wrt[1]:
                g = next(grads)
                if g is not None:
                    dw += g
            if wrt[2] and b is not None:
                g = next(grads)
                if g is not None:
                    db += g
    return parts, dh, dw, db


@torch.library.custom_op("autosp::tiled_head_loss", mutates_args=())
def tiled_head_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    target: torch.Tensor, recipe: int, reduction: str, ignore_index: int,
                    out_dtype: torch.dtype, chunks: int) -> torch.Tensor:
    """The loss of ``recipe`` over all rows of ``h`` ([..., D], the targets [...]), a chunk of
    rows at a time. ``reduction``: "sum", "mean" (over the targets not equal to
    ``ignore_index``, as F.cross_entropy) or "none" (one loss per row). ``chunks``: how many
    chunks of rows (0: ``ceil(classes / hidden)``; autosp.tiled_loss.chunk_rows)."""
    h2, t = _rows(h, target)
    run = _RECIPES[recipe]
    each = "none" if reduction == "none" else "sum"
    parts = [run(h2[s:e], weight, bias, t[s:e], each)
             for s, e in _chunks(h2.shape[0], weight.shape[0], weight.shape[1], chunks)]
    return _reduce(parts, t, reduction, ignore_index, h2.new_zeros((), dtype=out_dtype)).to(out_dtype)


@tiled_head_loss.register_fake
def _(h, weight, bias, target, recipe, reduction, ignore_index, out_dtype, chunks):
    return h.new_empty((target.numel(),) if reduction == "none" else (), dtype=out_dtype)


@torch.library.custom_op("autosp::tiled_head_loss_backward", mutates_args=())
def tiled_head_loss_backward(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, target: torch.Tensor, recipe: int,
                             reduction: str, ignore_index: int, chunks: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of h, weight and bias (an empty tensor without one): each chunk's forward
    recomputed and back-propagated; the weight's and bias's summed over chunks in fp32, as one
    matmul's backward accumulates them."""
    t = target.reshape(-1)
    g = grad / (t != ignore_index).sum() if reduction == "mean" else grad
    _, dh, dw, db = _chunk_grads(h, weight, bias, target, recipe, reduction, g,
                                 (True, True, True), chunks)
    return dh.reshape(h.shape), dw.to(weight.dtype), db.to(weight.dtype if bias is None else bias.dtype)


@tiled_head_loss_backward.register_fake
def _(grad, h, weight, bias, target, recipe, reduction, ignore_index, chunks):
    db = torch.empty_like(bias) if bias is not None else weight.new_empty((0,))
    return torch.empty_like(h), torch.empty_like(weight), db


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    h, weight, bias, target, recipe, reduction, ignore, _, chunks = inputs
    # The targets are saved as a copy: a batch tensor the caller refills between forward and
    # backward must not change the loss the backward recomputes.
    ctx.save_for_backward(h, weight, bias, target.clone())
    ctx.recipe, ctx.reduction, ctx.ignore, ctx.chunks = recipe, reduction, ignore, chunks


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    h, weight, bias, target = ctx.saved_tensors
    dh, dw, db = tiled_head_loss_backward(grad, h, weight, bias, target, ctx.recipe,
                                          ctx.reduction, ctx.ignore, ctx.chunks)
    return dh, dw, (db if bias is not None else None), None, None, None, None, None, None


tiled_head_loss.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("autosp::tiled_head_loss_with_grads", mutates_args=())
def tiled_head_loss_with_grads(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               target: torch.Tensor, recipe: int, reduction: str,
                               ignore_index: int, out_dtype: torch.dtype, grad_h: bool,
                               grad_weight: bool, grad_bias: bool, chunks: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scalar loss of ``recipe`` (reduction "sum" or "mean") over the rows of ``h``, and
    the gradients of h, the weight and the bias (fp32) for a loss gradient of 1, computed
    chunk by chunk in the same pass; an empty tensor for each gradient not asked for."""
    if reduction not in ("sum", "mean"):
        raise AssertionError(f"tiled_head_loss_with_grads: reduction {reduction!r} is not scalar")
    t = target.reshape(-1)
    seed = h.new_ones((), dtype=out_dtype)
    if reduction == "mean":
        seed = seed / (t != ignore_index).sum()
    parts, dh, dw, db = _chunk_grads(h, weight, bias, target, recipe, reduction, seed,
                                     (grad_h, grad_weight, grad_bias), chunks)
    loss = _reduce(parts, t, reduction, ignore_index, h.new_zeros((), dtype=out_dtype))
    return loss.to(out_dtype), dh.reshape(h.shape) if grad_h else dh, dw, db


@tiled_head_loss_with_grads.register_fake
def _(h, weight, bias, target, recipe, reduction, ignore_index, out_dtype, grad_h, grad_weight,
      grad_bias, chunks):
    acc = torch.promote_types(weight.dtype, torch.float32)
    empty = weight.new_empty((0,), dtype=acc)
    return (h.new_empty((), dtype=out_dtype), torch.empty_like(h) if grad_h else h.new_empty((0,)),
            torch.empty_like(weight, dtype=acc) if grad_weight else empty,
            torch.empty_like(bias, dtype=acc) if grad_bias and bias is not None else empty)


def _setup_with_grads(ctx: Any, inputs: tuple, output: tuple) -> None:
    h, weight, bias, target = inputs[:4]
    ctx.wants = inputs[8:11]
    ctx.dtypes = (h.dtype, weight.dtype, bias.dtype if bias is not None else None)
    # Which rows have a target that is not ignored: their gradients are scaled by the loss's
    # gradient; an ignored row's stay 0, as in the untiled backward (which never multiplies
    # them), also when that gradient is inf: a mean over no valid target divides by 0.
    valid = target.reshape(h.shape[:-1]) != inputs[6]
    ctx.save_for_backward(*output[1:], valid)
    ctx.mark_non_differentiable(*output[1:])


def _backward_with_grads(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
    dh, dw, db, valid = ctx.saved_tensors
    want_h, want_w, want_b = ctx.wants
    h_dtype, w_dtype, b_dtype = ctx.dtypes
    zero = grad.new_zeros(())
    rows = torch.where(valid, grad, zero).unsqueeze(-1)  # the loss's gradient, 0 where ignored
    whole = torch.where(valid.any(), grad, zero)  # 0 when every row is ignored
    return ((dh * rows).to(h_dtype) if want_h else None,
            (dw * whole).to(w_dtype) if want_w else None,
            (db * whole).to(b_dtype) if want_b and b_dtype is not None else None,
            None, None, None, None, None, None, None, None, None)


tiled_head_loss_with_grads.register_autograd(_backward_with_grads, setup_context=_setup_with_grads)


def _register_flops() -> None:
    """Model FLOPs of the tiled ops (torch.utils.flop_counter, read by autosp's remat facts and
    the trainer's MFU): the projection's 2 * rows * hidden * classes forward, and its backward's
    4 * rows * hidden * classes (the gradients of h and of the weight); the forward that
    computes the gradients does both (2 for the logits, 2 for each gradient it computes). The backward's recomputation of each chunk's logits
    is not model work, as remat's is not."""
    from math import prod

    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.autosp.tiled_head_loss)
    def _forward(h_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
        return 2 * prod(h_shape) * w_shape[0]

    @register_flop_formula(torch.ops.autosp.tiled_head_loss_backward)
    def _backward(grad_shape: Any, h_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
        return 4 * prod(h_shape) * w_shape[0]

    @register_flop_formula(torch.ops.autosp.tiled_head_loss_with_grads)
    def _with_grads(h_shape: Any, w_shape: Any, b_shape: Any, t_shape: Any, recipe: Any,
                    reduction: Any, ignore: Any, dtype: Any, grad_h: bool, grad_weight: bool,
                    *args: Any, **kwargs: Any) -> int:
        return (2 + 2 * bool(grad_h) + 2 * bool(grad_weight)) * prod(h_shape) * w_shape[0]


_register_flops()
