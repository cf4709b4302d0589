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

#: Dynamo's graph nodes that set a mode: grad mode, and autocast's enter and exit.
GRAD_MODE_SETTERS = frozenset({"_set_grad_enabled", "set_grad_enabled"})
#: What changes the autocast in effect without entering or leaving one
#: (``torch.set_autocast_dtype`` between two layers under one ``torch.autocast``; helper-51).
AUTOCAST_SETTERS = frozenset({
    "set_autocast_dtype", "set_autocast_enabled", "set_autocast_cpu_dtype",
    "set_autocast_cpu_enabled", "set_autocast_gpu_dtype", "set_autocast_ipu_dtype",
    "set_autocast_xla_dtype", "set_autocast_cache_enabled"})
#: Every node that enters, leaves or changes a mode (grad, autocast, inference mode).
MODE_NODES = GRAD_MODE_SETTERS | AUTOCAST_SETTERS | {
    "_enter_autocast", "_exit_autocast", "_enter_inference_mode", "_exit_inference_mode"}


def _packet(name: str) -> torch._ops.OpOverloadPacket | None:
    try:
        p = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    return p if isinstance(p, torch._ops.OpOverloadPacket) else None


# Functions that may return an operand (or a view of it) where no ATen schema of their name
# says so: Tensor methods that are ``to`` under another name, ``type_as``, ``atleast_*d``,
# ``sum_to_size`` and ``einsum`` (their schemas have no alias annotation, yet each returns its
# input, or a view, in some cases), Tensor properties Dynamo records as ``getattr`` (``T``,
# ``H``, ``data``) and ``+x`` (``operator.pos``), a functional collective's wait (returns its
# input), ``_unsafe_view`` (a view), ``operator.getitem``, and autosp's ``grad_sync`` (a view in
# the forward). Dropout returns its input when it is off: see :func:`may_alias_call`.
ALIASING_WITHOUT_SCHEMA = frozenset({
    "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "char", "byte",
    "bool", "cpu", "cuda", "type", "atleast_1d", "atleast_2d", "atleast_3d", "sum_to_size",
    "einsum", "T", "H", "data", "_get_data_attr", "pos", "wait_tensor", "_unsafe_view",
    "getitem", "grad_sync", "grad_sync_many"})

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


# Dropouts return their input itself when off (p = 0, or not training), a fresh tensor when on;
# the value is the training flag's default. autosp's sharded_dropout (x, p, training, ...) is
# what the SP plan makes of a dropout on a sequence-sharded value.
DROPOUTS = {"dropout": True, "dropout1d": True, "dropout2d": True, "dropout3d": True,
            "feature_dropout": True, "alpha_dropout": False, "feature_alpha_dropout": False,
            "sharded_dropout": True}


def may_alias_call(name: str, args: tuple, kwargs: dict) -> bool:
    """:func:`may_alias` for one call, whose arguments can settle it: a dropout aliases its
    input unless its probability is a positive constant and it is constantly training
    (``F.dropout(x, p, training)``, ``torch.dropout(x, p, train)``).

    >>> may_alias_call("dropout", (None, 0.1, True), {}), may_alias_call("dropout", (None, 0.0), {})
    (False, True)
    """
    if name not in DROPOUTS:
        return may_alias(name)
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train",
                                                                            DROPOUTS[name]))
    on = isinstance(p, (int, float)) and p > 0 and training is True
    return not on


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
