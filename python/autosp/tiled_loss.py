"""Cross-entropy over a projection to the vocabulary, one chunk of tokens at a time.

A language model's loss reads ``[tokens, vocab]`` logits: at 128k tokens per rank and a 128k
vocabulary that is 64 GiB in fp32, more than all the layers' activations together. With
``autosp.compile(..., tile_loss=True)`` the core (csrc/plan/loss.cpp) recognises a
cross-entropy whose logits come from a linear (the lm_head) through row-wise ops only (casts
such as ``.float()``, pointwise ops with constant operands such as soft-capping, reshapes that
keep the class dim) and that nothing else reads. This module replays that chain on chunks of
rows; the ops are autosp.tiled_loss_ops':

- a scalar loss ("sum" or "mean") that needs gradients: for each chunk of rows, its logits,
  the chain's ops, the loss, and at once its back-propagation
  (``autosp::tiled_head_loss_with_grads``); the backward scales those gradients by the loss's.
  Nothing is recomputed. ``AUTOSP_LOSS_RECOMPUTE=1`` selects the recomputing form below
  instead (it saves h rather than the gradients of h and of the weight);
- reduction "none", or a loss without gradients: the forward computes each chunk's loss and
  saves only the linear's operands (``autosp::tiled_head_loss``); the backward recomputes
  each chunk's forward and back-propagates it.

A rank holds one chunk's logits at a time; the weight's and bias's gradients are summed over
chunks in fp32.

Exactness: each row's loss is the computation one device does for that row (the same
matmul row, casts, ops and loss), so the sum differs from the untiled one only by the order
of its additions.

Chunk size (:func:`chunk_rows`): ``AUTOSP_LOSS_TILE_ROWS`` rows if set, else the rows split
into ``autosp.compile(loss_chunks=...)`` chunks, by default ``ceil(classes / hidden)``: each
chunk's logits then hold as many elements as the hidden states they come from (the core's
``tiled_loss_chunks``). Fewer chunks are faster, since each reads the whole weight;
``autosp plan`` and ``autosp train --remat auto`` pick the fewest that fit the memory budget.
"""

from __future__ import annotations

import hashlib
import operator
import os
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp import _core
from autosp.canon import _arg
from autosp.errors import AutospError
from autosp.tiled_ops import (Recipes, autocast_state, replayed_autocast,
                              stable_name)

# recipe key -> f(h_rows [n, D], weight, bias or None, targets [n], reduction) -> loss
_RECIPES = Recipes("loss recipe")


#: The most chunks per tiled loss a user may ask for (autosp.compile, autosp plan, autosp train);
#: more chunks than rows run one row each.
MAX_CHUNKS = 2**31 - 1


def chunk_rows(rows: int, classes: int, hidden: int, chunks: int = 0) -> int:
    """Rows per chunk: ``AUTOSP_LOSS_TILE_ROWS`` if set, else ``ceil(rows / n)`` for ``n``
    chunks: ``chunks`` when positive, else ``ceil(classes / hidden)`` (``_core.tiled_loss_chunks``),
    so that one chunk's ``[rows / n, classes]`` logits hold as many elements as the hidden
    states ``[rows, hidden]`` they come from: the loss's working set then stays the size of one
    activation, whatever the vocabulary (32 chunks for Llama-3's 128256 / 4096)."""
    fixed = env_rows()
    if fixed is not None:
        return fixed
    n = _core.tiled_loss_chunks(classes, hidden, chunks)
    return max(1, -(-rows // n))


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


def _chunks(rows: int, classes: int, hidden: int, chunks: int) -> list[tuple[int, int]]:
    t = chunk_rows(rows, classes, hidden, chunks)
    return [(s, min(rows, s + t)) for s in range(0, rows, t)]


_PASSES = {"tiled_head_loss": "FORWARD", "tiled_head_loss_backward": "BACKWARD",
           "tiled_head_loss_with_grads": "FORWARD_WITH_GRADS"}


def workspace(node: fx.Node) -> tuple[int, int, int, int] | None:
    """What a tiled loss op of a joint graph allocates and frees while it runs, for ``autosp
    plan``'s memory model, as ``(bytes per row of h in one chunk, cap, constant, chunks)``:
    with ``AUTOSP_LOSS_TILE_ROWS`` the workspace is ``min(bytes per row * rows, cap) +
    constant`` (chunks 0), else ``bytes per row * rows / chunks + constant``; None for any other
    node. The estimate is the core's (``_core.tiled_loss_workspace``, csrc/plan/memory.h)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "autosp" \
            or target._opname not in _PASSES:
        return None
    weight = weight_node(node).meta["val"]
    w = _core.tiled_loss_workspace(getattr(_core.TiledLossPass, _PASSES[target._opname]),
                                   int(weight.shape[0]), int(weight.shape[1]),
                                   weight.dtype.itemsize, env_rows() or 0, op_chunks(node))
    return w.per_row, w.cap, w.constant, w.chunks


def op_chunks(node: fx.Node) -> int:
    """The ``chunks`` argument of a tiled loss op's node (its last; 0: the default rule)."""
    return int(node.args[-1]) if node.args and isinstance(node.args[-1], int) \
        and not isinstance(node.args[-1], bool) else 0


def h_node(node: fx.Node) -> fx.Node:
    """The hidden states operand of a tiled loss op (the backward's first operand is the
    loss's gradient)."""
    return node.args[1 if node.target is torch.ops.autosp.tiled_head_loss_backward.default else 0]


def weight_node(node: fx.Node) -> fx.Node:
    return node.args[2 if node.target is torch.ops.autosp.tiled_head_loss_backward.default else 1]


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


def emit(graph: fx.Graph, fxn: fx.Node, cn: Any, bridge: Any, ins: list[fx.Node | None],
         reduction: str) -> fx.Node:
    """The tiled loss standing for the cross-entropy node ``fxn`` (plan node ``cn``: inputs
    -1, targets, h, weight, bias). A scalar loss that needs gradients computes them in its
    forward (``autosp::tiled_head_loss_with_grads``: nothing recomputed); reduction "none",
    or a loss without gradients (an evaluation step), recomputes in the backward."""
    env_rows()  # a bad AUTOSP_LOSS_TILE_ROWS stops the compile, not the first step
    key = build_recipe(bridge, list(cn.attrs["head_chain"]), list(cn.attrs["head_regroup"]), fxn)
    out = fxn.meta["example_value"]
    _, target, h, weight, bias = ins
    args = (h, weight, bias, target, key, reduction, int(cn.attrs["ignore_index"]), out.dtype)
    chunks = int(cn.attrs.get("loss_chunks", 0))
    if reduction == "none" or not _requires_grad(fxn) or os.environ.get(
            "AUTOSP_LOSS_RECOMPUTE", "").strip() == "1":
        return graph.call_function(torch.ops.autosp.tiled_head_loss.default, args + (chunks,))
    wants = (_requires_grad(h), _requires_grad(weight), bias is not None and _requires_grad(bias))
    fused = graph.call_function(torch.ops.autosp.tiled_head_loss_with_grads.default,
                                args + wants + (chunks,))
    return graph.call_function(operator.getitem, (fused, 0))


def _requires_grad(node: fx.Node) -> bool:
    """Whether the value of a node of the step's graph needs a gradient, as Dynamo traced it
    (True where the graph does not say)."""
    ex = node.meta.get("example_value")
    return bool(ex.requires_grad) if isinstance(ex, torch.Tensor) else True


def recomputed_share(node: fx.Node) -> float:
    """Of a node's model FLOPs (autosp.tiled_loss_ops' formulas), the share it computes again
    inside: the recomputing backward recomputes each chunk's logits (2 of its
    4 * rows * hidden * classes). A tiled forward whose logits the graph also makes whole (the
    model returns them, or a z-loss reads them: autosp then leaves that projection as written
    and the loss recomputes it chunk by chunk) computes those logits a second time: 2 of its
    FLOPs (all of the plain forward's, 2 of the 2 + 2 per gradient of the one that computes
    the gradients). 0 for any other node. ``autosp plan`` and ``remat="auto"`` count it as
    recomputation (MemoryNode.inner_recompute_flops)."""
    target = node.target
    if target is torch.ops.autosp.tiled_head_loss_backward.default:
        return 0.5
    if target is torch.ops.autosp.tiled_head_loss.default and _logits_made_elsewhere(node):
        return 1.0
    if target is torch.ops.autosp.tiled_head_loss_with_grads.default \
            and _logits_made_elsewhere(node):
        args = list(node.args) + [None] * 10
        grad_h = node.kwargs.get("grad_h", args[8])
        grad_weight = node.kwargs.get("grad_weight", args[9])
        return 2.0 / (2 + 2 * bool(grad_h) + 2 * bool(grad_weight))
    return 0.0


_VIEWS = {"t", "transpose", "permute", "view", "_unsafe_view", "reshape", "expand", "alias",
          "_to_copy", "detach"}
_MATMULS = {"mm", "addmm", "bmm", "matmul", "linear"}


def _logits_made_elsewhere(node: fx.Node) -> bool:
    """Whether the tiled loss's weight (through views and casts) also feeds a matmul: the
    projection of the logits the graph makes whole."""
    seen: set[fx.Node] = set()
    frontier = [node.args[1]] if isinstance(node.args[1], fx.Node) else []
    while frontier:
        v = frontier.pop()
        for u in v.users:
            if u is node or u in seen or u.op != "call_function":
                continue
            seen.add(u)
            name = getattr(getattr(u.target, "_overloadpacket", None), "__name__", "")
            if name in _MATMULS:
                return True
            if name in _VIEWS:
                frontier.append(u)
    return False


from autosp import tiled_loss_ops  # noqa: E402,F401  (registers the ops; it imports this module)
