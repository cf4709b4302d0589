"""The SP ops a plan inserts, as traceable functions with exact autograd.

Each function below is what an `sp.*` node of the core plan becomes in the FX graph.
They are built on torch.distributed's functional collectives, so AOTAutograd traces
them into the joint graph (as `_c10d_functional` ops) and Inductor compiles them.

Autograd follows from treating the loss on every rank as *the* single objective:

- ``grad_sync``: identity forward; the backward all-reduces, because each rank's gradient
  with respect to a replicated value it used on its chunk is one summand.
- ``reduce_partial``: all-reduce forward; identity backward (each summand's gradient is
  the gradient of the sum).
- ``all_gather_seq``: gathers the sequence; the backward keeps the local chunk (not a sum:
  every rank already holds the whole gradient of the replicated result).
- ``all_to_all``: the backward is the inverse exchange.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed._functional_collectives as funcol

from autosp.chunks import chunk_bounds
from autosp.errors import AutospError


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t)


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _wait(funcol.all_reduce(x.contiguous(), "sum", group))


class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(g, ctx.group), None


class _GradSyncMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: str, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple:
        # One all-reduce per dtype over the flattened gradients.
        out: list[torch.Tensor | None] = [None] * len(gs)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(gs):
            by_dtype.setdefault(g.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = torch.cat([gs[i].reshape(-1) for i in idx]) if len(idx) > 1 else gs[idx[0]].reshape(-1)
            summed = _all_reduce(flat, ctx.group)
            pieces = torch.split(summed, [gs[i].numel() for i in idx])
            for i, piece in zip(idx, pieces):
                out[i] = piece.view(gs[i].shape)
        return (None, *out)


class _ReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def grad_sync(x: torch.Tensor, group: str) -> torch.Tensor:
    return _GradSync.apply(x, group)


def grad_sync_many(xs: Sequence[torch.Tensor], group: str) -> tuple[torch.Tensor, ...]:
    """grad_sync for several tensors with one bucketed all-reduce in the backward."""
    return _GradSyncMany.apply(group, *xs)


def reduce_partial(x: torch.Tensor, group: str) -> torch.Tensor:
    if not x.is_floating_point():
        return _all_reduce(x, group)
    return _ReducePartial.apply(x, group)


def shift(x: torch.Tensor, dim: int, start: int, offset: int, in_offset: int, group: str, rank: int,
          world: int) -> torch.Tensor:
    """This rank's part of ``x[..., start:start + S + offset]`` along the sharded sequence dim
    ``dim``, from its part ``x`` of the S + in_offset positions of the input (both split as
    ``chunks.chunk_bounds`` says). Rank r's part begins ``start`` positions into its own and, on every
    rank but the last, takes the first ``start`` positions of rank r + 1's part (a boundary
    exchange; every rank takes part in it, the last one receives nothing). Its backward returns
    the gradient of those positions to rank r + 1."""
    n = x.size(dim)
    c = n - in_offset if in_offset and rank == world - 1 else n  # (a symbolic rank: see chunks)
    _, length = chunk_bounds(c * world + offset, offset, rank, world)
    if start > min(c, c + in_offset):
        raise AutospError(
            f"[autosp:apply] a slice starting {start} positions into the sequence: found {c} "
            f"positions per rank; expected at least {start}. Use a longer sequence.")
    if start == 0:
        return x.narrow(dim, 0, length)
    # Every rank runs the same ops, the last one included (it concatenates rank 0's positions
    # and never reads them): a gather whose result one rank left unused would be removed from
    # that rank's graph as dead code, and the other ranks would wait for it forever.
    heads = _GatherStack.apply(x.narrow(dim, 0, start), group, rank, True)
    return torch.cat([x, heads.select(0, (rank + 1) % world)], dim=dim).narrow(dim, start, length)


def halo(x: torch.Tensor, dim: int, left: int, right: int, last_pad: int, group: str, rank: int,
         world: int) -> torch.Tensor:
    """This rank's chunk ``x`` along the sharded sequence dim ``dim``, extended by what a
    convolution's outputs at its positions read beyond it: the last ``left`` positions of the
    previous rank's chunk (zeros on rank 0: the conv's left padding) and the first ``right``
    of the next one's; the last rank ends with ``last_pad`` zeros (the right padding) instead.
    Every rank gathers and reads the exchanged positions alike (slot 0 of the padded stack is
    rank 0's zeros), so no rank's compiler drops a collective the others wait in. The backward
    returns each exchanged position's gradient to the rank it came from."""
    c = x.size(dim)
    # Checked alike on every rank (the last one's output is the shortest: c + last_pad - right).
    if max(left, right) > c or c + last_pad - right < 1:
        raise AutospError(
            f"[autosp:apply] a convolution along the sequence reading {left} positions back and "
            f"{right} ahead, with {last_pad} of padding at the end: found {c} positions per rank; "
            f"expected at least {max(left, right, right - last_pad + 1)}, so that every rank has an "
            "output. Use a longer sequence or a smaller SP degree.")
    parts = []
    if left > 0:
        tails = _GatherStack.apply(x.narrow(dim, c - left, left), group, rank, True)
        padded = torch.cat([torch.zeros_like(tails[:1]), tails], dim=0)  # slot r: rank r-1's
        parts.append(padded.select(0, rank))
    parts.append(x)
    if right > 0:
        heads = _GatherStack.apply(x.narrow(dim, 0, right), group, rank, True)
        padded = torch.cat([heads, torch.zeros_like(heads[:1])], dim=0)  # slot world: zeros
        parts.append(padded.select(0, rank + 1))
    ext = torch.cat(parts, dim=dim) if len(parts) > 1 else x
    if last_pad != right and rank == world - 1:  # the right padding's zeros, not the next chunk
        n = ext.size(dim)
        if last_pad < right:
            ext = ext.narrow(dim, 0, n - (right - last_pad))
        else:
            shape = list(ext.shape)
            shape[dim] = last_pad - right
            ext = torch.cat([ext, ext.new_zeros(shape)], dim=dim)
    return ext


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, outer: int, inner: int, group: str, rank: int,
                world: int) -> torch.Tensor:
        t = x.unflatten(dim, (outer, -1, inner))  # [.., outer, n, inner, ..]
        ctx.args = (dim, outer, inner, rank, t.size(dim + 1))
        g = _wait(funcol.all_gather_tensor(t.unsqueeze(0).contiguous(), 0, group))  # [world, .., outer, n, inner, ..]
        g = g.movedim(0, dim + 1)  # [.., outer, world, n, inner, ..]
        return g.flatten(dim, dim + 3).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        # This rank's part, sized by the forward's chunk (n) rather than by g's length: where
        # g comes out of a region run on the gathered sequence, its length is an unsimplified
        # expression of S (padded to chunks, reshaped back) that equals world * n.
        dim, outer, inner, rank, n = ctx.args
        t = g.unflatten(dim, (outer, -1, inner))
        return (t.narrow(dim + 1, rank * n, n).flatten(dim, dim + 2).contiguous(),) + (None,) * 6


def all_gather_seq(x: torch.Tensor, dim: int, outer: int, inner: int, group: str, rank: int,
                   world: int) -> torch.Tensor:
    if x.dtype == torch.bool:  # Gloo has no bool collectives
        return _AllGatherSeq.apply(x.to(torch.uint8), dim, outer, inner, group, rank, world).bool()
    return _AllGatherSeq.apply(x, dim, outer, inner, group, rank, world)


def _exchange(xs: Sequence[torch.Tensor], scatter_dim: int, gather_dim: int, group: str,
              world: int) -> list[torch.Tensor]:
    """Scatter ``scatter_dim`` and gather ``gather_dim`` of every tensor in one
    all-to-all: chunk p of each tensor's scatter dim goes to rank p, and the chunks a rank
    receives are laid out along the gather dim in rank order."""
    # Split, permute, copy once (contiguous) and view: under a symbolic S, reshape and flatten
    # of a permuted tensor cost AOTAutograd's trace far more symbolic size arithmetic than these
    # views of contiguous tensors (the styles batch: a quarter of a rank's compile, in here).
    parts = []
    metas = []
    for x in xs:
        sizes = list(x.shape)
        sd = scatter_dim % x.dim()  # each tensor's own dims, negative ones too
        t = x.view(sizes[:sd] + [world, sizes[sd] // world] + sizes[sd + 1:])
        t = t.movedim(sd, 0).contiguous()  # [world, ...]
        metas.append(list(t.shape[1:]))
        parts.append(t.view(world, -1))
    flat = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    out = _wait(funcol.all_to_all_single(flat, None, None, group))
    sizes = [p.size(1) for p in parts]
    pieces = torch.split(out, sizes, dim=1) if len(parts) > 1 else [out]
    results = []
    for piece, shape in zip(pieces, metas):
        t = piece.view([world] + shape)  # [world(src), ...local...]
        # Place the source-rank dim right before the gather dim, copy, and merge them.
        # Contiguous, as the single-device value it stands for (see chunks.local_chunk).
        gd = gather_dim % len(shape)
        t = t.movedim(0, gd).contiguous()
        merged = list(t.shape)
        merged[gd:gd + 2] = [merged[gd] * merged[gd + 1]]
        results.append(t.view(merged))
    return results


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scatter_dim: int, gather_dim: int, group: str, world: int,
                *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (scatter_dim, gather_dim, group, world)
        return tuple(_exchange(xs, scatter_dim, gather_dim, group, world))

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple:
        scatter_dim, gather_dim, group, world = ctx.args
        back = _exchange([g.contiguous() for g in gs], gather_dim, scatter_dim, group, world)
        return (None, None, None, None) + tuple(back)


def all_to_all(xs: Sequence[torch.Tensor], scatter_dim: int, gather_dim: int, group: str,
               world: int) -> tuple[torch.Tensor, ...]:
    """One fused all-to-all for several tensors (q, k and v of one attention)."""
    return _AllToAll.apply(scatter_dim, gather_dim, group, world, *xs)


def repeat_heads(x: torch.Tensor, dim: int, repeats: int) -> torch.Tensor:
    return torch.repeat_interleave(x, repeats, dim=dim)


class _GatherStack(torch.autograd.Function):
    """Every rank's ``x`` stacked along a new leading dim.

    The backward returns this rank's slot of the gradient. When what the stack feeds is
    replicated (``sum_grads=False``: a max over the sequence), every rank already holds the
    whole gradient, as in ``all_gather_seq``. When it feeds sharded values (``sum_grads=True``:
    a scan, where rank r's chunk uses the totals of ranks < r), each rank holds one summand
    of it, and the slots are summed over the group first.

    A stack's slot is taken with ``select``, here and by its users, never ``stack[rank]``: the
    rank may be a symbol (autosp.shared_compile), and indexing with one makes PyTorch guard on
    its value, which ties the compiled graph to this rank (``select`` only checks the range)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str, rank: int, sum_grads: bool) -> torch.Tensor:
        ctx.args = (group, rank, sum_grads)
        return _wait(funcol.all_gather_tensor(x.unsqueeze(0).contiguous(), 0, group))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        group, rank, sum_grads = ctx.args
        if sum_grads:
            g = _all_reduce(g, group)
        return g.select(0, rank), None, None, None



def _reduce_stacked(g: torch.Tensor, op: str) -> torch.Tensor:
    if op in ("amax", "max"):
        return g.amax(0)
    if op in ("amin", "min"):
        return g.amin(0)
    if op in ("logsumexp", "logcumsumexp"):
        return torch.logsumexp(g, 0)
    if op in ("prod", "cumprod"):
        return g.prod(0)
    if op == "cumsum":
        return g.sum(0)
    raise AssertionError(f"no cross-rank combination for {op}")


def guarded_logsumexp(x: torch.Tensor, dim: Any, keepdim: bool = False) -> torch.Tensor:
    """``torch.logsumexp`` of a chunk, with the sum of exponentials kept above the smallest
    normal number: a chunk whose elements are all -inf gives about -87 (fp32) instead of -inf,
    which changes the combined result by about exp(-87) relative, and its gradient is 0
    instead of NaN."""
    m = x.detach().amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp(x - m).sum(dim=dim, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    out = total.log() + m
    if not keepdim:
        dims = [dim] if isinstance(dim, int) else list(dim)
        out = out.squeeze(tuple(d % x.dim() for d in dims))
    return out


def combine(x: torch.Tensor, op: str, group: str, rank: int) -> torch.Tensor:
    """The reduction ``op`` over the whole sequence, from each rank's reduction of its chunk
    (max of maxima, logsumexp of logsumexps, product of products)."""
    return _reduce_stacked(_GatherStack.apply(x, group, rank, False), op)


def scan(y: torch.Tensor, dim: int, op: str, group: str, rank: int) -> torch.Tensor:
    """The scan ``op`` along the sequence, from this rank's scan ``y`` of its chunk: the last
    element of each chunk is that chunk's total, and this rank adds (multiplies, log-adds) the
    exclusive prefix of the totals of the ranks before it. Every rank runs the same ops (rank 0
    combines an empty prefix), so no rank skips the collective."""
    totals = _GatherStack.apply(y.narrow(dim, y.size(dim) - 1, 1), group, rank, True)
    # The totals of the ranks before this one: every slot, those from this rank on replaced by
    # the op's identity (not ``totals[:rank]``, whose length would tie the graph to the rank).
    before = torch.arange(totals.size(0), device=totals.device) < rank
    identity = 0 if op == "cumsum" else 1 if op == "cumprod" else float("-inf")
    prefix = _reduce_stacked(
        torch.where(before.view(-1, *[1] * (totals.dim() - 1)), totals, identity), op)
    if op == "cumsum":
        return y + prefix
    if op == "cumprod":
        return y * prefix
    return torch.logaddexp(y, prefix)


def check_index(ids: torch.Tensor, below: int, where: str) -> torch.Tensor:
    """``ids``, after checking on the full-length value every rank holds that each id is in
    ``[0, below)``: a bad id fails on every rank alike (as on one device), instead of only in
    the rank whose chunk holds it while the others wait in a collective."""
    ok = ((ids >= 0) & (ids < below)).all()
    torch._assert_async(ok, f"[autosp:inputs] {where}: found an index outside [0, {below}) in the "
                            f"full-length input; expected every index in [0, {below}) (the table's "
                            "rows). Every rank fails here alike.")
    return ids


def count_valid(target: torch.Tensor, ignore_index: int, group: str) -> torch.Tensor:
    """The number of targets != ignore_index over the whole SP group."""
    local = (target != ignore_index).sum()
    return _all_reduce(local, group)
