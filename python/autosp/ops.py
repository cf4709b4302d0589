"""What autosp knows about a Torch-level op from PyTorch's own metadata.

The pointwise set is torch's: an op is pointwise when the ATen op of the same name has an
overload tagged ``torch.Tag.pointwise`` (``exp``, ``expm1``, ``silu``, ``where``, ...), and
is not seeded-random (``torch.Tag.nondeterministic_seeded``: ``rrelu`` draws random numbers,
and every rank would draw the same ones for its chunk). The bridge passes the answer to the
core as the node attribute ``pointwise``; the core's elementwise rule takes every such op,
so no list of pointwise names is kept anywhere in autosp.

A few elementwise Torch-level functions have an ATen op that PyTorch does not tag
(``floor_divide``, ``hardswish``, ``log_sigmoid``); they are listed in
``UNTAGGED_POINTWISE``, each checked by a test to compute elementwise.
"""

from __future__ import annotations

import functools

import torch

# Elementwise functions whose ATen op carries no pointwise tag.
UNTAGGED_POINTWISE = frozenset({"floor_divide", "hardswish", "log_sigmoid", "fix"})


def _packet(name: str) -> torch._ops.OpOverloadPacket | None:
    try:
        p = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    return p if isinstance(p, torch._ops.OpOverloadPacket) else None


@functools.lru_cache(maxsize=None)
def is_pointwise(name: str) -> bool:
    """Whether the Torch-level op ``name`` (canonical, in-place suffix removed) is pointwise.

    >>> is_pointwise("expm1"), is_pointwise("matmul"), is_pointwise("rrelu")
    (True, False, False)
    """
    if name in UNTAGGED_POINTWISE:
        return True
    p = _packet(name)
    if p is None:
        return False
    tags = [set(getattr(p, o).tags) for o in p.overloads()]
    if any(torch.Tag.nondeterministic_seeded in t for t in tags):
        return False
    return any(torch.Tag.pointwise in t for t in tags)


def aten_pointwise_ops() -> list[str]:
    """Every ATen op (packet name) that torch tags pointwise and that is not seeded-random:
    the set the pointwise rule covers, for tests and documentation."""
    names = []
    for name in dir(torch.ops.aten):
        if not name.startswith("_") and _packet(name) is not None and is_pointwise(name):
            names.append(name)
    return sorted(names)
