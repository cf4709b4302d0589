"""This rank's part of a sequence-sharded value: where it lies, its sizes as the single-device
graph sees them, and random draws made at full length of which the rank keeps its part.

Like :mod:`autosp.collectives`, each public function here is what a node of the core plan
becomes in the FX graph (the apply stage inserts them); unlike those, nothing here
communicates. A sequence of ``S + offset`` positions is split as :func:`chunk_bounds` says:
S/world per rank, the last rank's part ``offset`` longer.
"""

from __future__ import annotations

from typing import Any

import torch

from autosp.errors import AutospError


def chunk_bounds(n: int, offset: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of this rank's part of a sequence factor of ``n = S + offset``
    positions: every rank holds S/world of them, the last one S/world + offset (what is left
    after a few positions were sliced off, or added, at the end)."""
    c = (n - offset) // world
    # Checked on every rank alike (not only on the last, whose part is short), so that all
    # ranks stop here together.
    if c + offset < 1 or c < 1:
        raise AutospError(
            f"[autosp:apply] a sequence of {n - offset} positions with {offset:+d} at its end: found "
            f"{c} positions per rank for an SP degree of {world}; expected more than {-offset} per "
            "rank, so that every rank keeps at least one. Use a longer sequence or a smaller SP degree.")
    # ``offset`` is tested first: the rank may be symbolic (autosp.specialize), and only the
    # last rank's part differs, where an offset makes it.
    return rank * c, (c + offset if offset and rank == world - 1 else c)


def local_chunk(x: torch.Tensor, dim: int, outer: int, inner: int, rank: int, world: int,
                offset: int = 0) -> torch.Tensor:
    """This rank's chunk of the factor of ``dim`` that lies between ``outer`` and ``inner``
    (the sequence factor of a possibly merged dim): 1/world of it, or, for a factor of
    S + offset positions, the part ``chunk_bounds`` gives.

    The chunk is contiguous: a narrowed view keeps the full tensor's strides, and a later
    ``view`` (``targets.view(-1)``), ``view(dtype)`` or in-place op that is valid on the
    single-device value must stay valid on this rank's chunk. A contiguous tensor admits
    every view of its shape."""
    if outer == 1 and inner == 1:
        start, n = chunk_bounds(x.size(dim), offset, rank, world)
        return x.narrow(dim, start, n).contiguous()
    t = x.unflatten(dim, (outer, -1, inner))
    start, n = chunk_bounds(t.size(dim + 1), offset, rank, world)
    return t.narrow(dim + 1, start, n).flatten(dim, dim + 2).contiguous()


def _global_shape(x: torch.Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] *= world
    return shape


def _full_in_layout(x: torch.Tensor, shape: list[int], fill: Any) -> torch.Tensor:
    """A tensor of the global ``shape`` laid out in memory like ``x`` (its dims in x's stride
    order). One device draws a random tensor like x (``empty_like``) in memory order, so a
    draw for a transposed view (``F.dropout(att.transpose(1, 2))``) is only the single-device
    draw when the full-length tensor has the view's layout too."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost first (stable)
    physical = fill([shape[d] for d in order], dtype=x.dtype, device=x.device)
    inverse = [0] * x.dim()
    for i, d in enumerate(order):
        inverse[d] = i
    return physical.permute(inverse)


def sharded_dropout(x: torch.Tensor, p: float, training: bool, dim: int, outer: int, inner: int,
                    rank: int, world: int) -> torch.Tensor:
    """``F.dropout(x, p, training)`` for this rank's chunk ``x`` of a sequence-sharded value,
    with the mask of the single-device draw: the mask is drawn at full length (as one device
    draws it, from the same random state every rank holds) and this rank keeps its chunk. Under
    Inductor the draw fuses into the chunk's kernel; eagerly it is a transient full-length
    tensor."""
    if not training or p == 0.0:
        return x
    ones = _full_in_layout(x, _global_shape(x, dim, world), torch.ones)
    mask = torch.nn.functional.dropout(ones, p, True)
    return x * local_chunk(mask, dim, outer, inner, rank, world)


def sharded_random_like(x: torch.Tensor, kind: str, dim: int, outer: int, inner: int, rank: int,
                        world: int, **kwargs: Any) -> torch.Tensor:
    """``torch.rand_like`` / ``torch.randn_like`` for a chunk: drawn at full length, chunk kept
    (see sharded_dropout)."""
    like = torch.rand_like if kind == "rand_like" else torch.randn_like
    full = like(_full_in_layout(x, _global_shape(x, dim, world), torch.empty), **kwargs)
    return local_chunk(full, dim, outer, inner, rank, world)


def global_extent(n: int, unit: int, offset: int, rank: int, world: int) -> int:
    """The single-device size of a sharded dim whose local size is ``n``, for a dim of
    ``unit * (S + offset)`` elements (see ``chunk_bounds``)."""
    if offset == 0:
        return n * world
    local = n // unit - (offset if rank == world - 1 else 0)  # offset != 0 here
    return (local * world + offset) * unit


def local_extent(n: int, unit: int, offset: int, rank: int, world: int) -> int:
    """This rank's size of a dim of ``n = unit * (S + offset)`` elements (see ``chunk_bounds``)."""
    if offset == 0:
        return n // world
    return chunk_bounds(n // unit, offset, rank, world)[1] * unit


def global_size(size: torch.Size, dim: int, world: int, unit: int = 1, offset: int = 0,
                rank: int = 0) -> torch.Size:
    """``x.size()`` of a chunk as the single-device graph sees it: entry ``dim`` (the sharded
    one) at its global extent."""
    out = list(size)
    out[dim] = global_extent(out[dim], unit, offset, rank, world)
    return torch.Size(out)
