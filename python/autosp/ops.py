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

The same metadata says which ops may return a value sharing an operand's storage
(:func:`may_alias`: the schema's alias annotation, ``Tensor(a) self -> Tensor(a)``) and which
draw random numbers (:func:`is_random`: the ``nondeterministic_seeded`` tag). The few
Torch-level functions with no ATen op of their name, or whose schema does not say, are listed
beside (``ALIASING_WITHOUT_SCHEMA``, ``RANDOM_WITHOUT_TAG``).
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


# Functions that may return an operand (or a view of it) where no ATen schema of their name
# says so: Tensor methods that are ``to`` under another name, ``type_as`` (its schema has no
# alias annotation; it returns ``self`` when the dtype matches), a functional collective's wait
# (returns its input), ``_unsafe_view`` (a view), ``operator.getitem``, and autosp's
# ``grad_sync`` (a view in the forward).
ALIASING_WITHOUT_SCHEMA = frozenset({
    "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "char", "byte",
    "bool", "cpu", "cuda", "type", "wait_tensor", "_unsafe_view", "getitem", "grad_sync",
    "grad_sync_many"})

# Functions that draw random numbers with no ATen op of their name (PyTorch's own are tagged
# ``nondeterministic_seeded``): functional dropouts, and autosp's per-chunk draws.
RANDOM_WITHOUT_TAG = frozenset({"dropout1d", "dropout2d", "dropout3d", "sharded_dropout",
                                "sharded_random_like"})


@functools.lru_cache(maxsize=None)
def is_random(name: str) -> bool:
    """Whether the Torch-level op ``name`` draws random numbers (any overload of its ATen op
    is tagged ``nondeterministic_seeded``; SDPA is, for its dropout).

    >>> is_random("dropout"), is_random("rrelu"), is_random("exp")
    (True, True, False)
    """
    if name in RANDOM_WITHOUT_TAG:
        return True
    p = _packet(name)
    return p is not None and any(torch.Tag.nondeterministic_seeded in getattr(p, o).tags
                                 for o in p.overloads())


@functools.lru_cache(maxsize=None)
def may_alias(name: str) -> bool:
    """Whether the Torch-level op ``name`` may return a value sharing an operand's storage: an
    overload of its ATen op returns an alias of an input that it does not write (``out=`` and
    in-place overloads, which return what they wrote, do not count).

    >>> may_alias("reshape"), may_alias("swapaxes"), may_alias("add"), may_alias("type_as")
    (True, True, False, True)
    """
    if name in ALIASING_WITHOUT_SCHEMA:
        return True
    p = _packet(name)
    if p is None:
        return False
    for o in p.overloads():
        for r in getattr(p, o)._schema.returns:
            if r.alias_info is not None and not r.alias_info.is_write:
                return True
    return False


@functools.lru_cache(maxsize=None)
def is_pointwise(name: str) -> bool:
    """Whether the Torch-level op ``name`` (canonical, in-place suffix removed) is pointwise.

    >>> is_pointwise("expm1"), is_pointwise("matmul"), is_pointwise("rrelu")
    (True, False, False)
    """
    if name in UNTAGGED_POINTWISE:
        return True
    p = _packet(name)
    if p is None or is_random(name):
        return False
    return any(torch.Tag.pointwise in getattr(p, o).tags for o in p.overloads())


def aten_pointwise_ops() -> list[str]:
    """Every ATen op (packet name) that torch tags pointwise and that is not seeded-random:
    the set the pointwise rule covers, for tests and documentation."""
    names = []
    for name in dir(torch.ops.aten):
        if not name.startswith("_") and _packet(name) is not None and is_pointwise(name):
            names.append(name)
    return sorted(names)
