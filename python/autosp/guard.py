"""Guardrails around a compiled call: the inputs must agree across the SP group.

autosp is exact only when every rank of an SP group is fed the same full-length batch
(each rank slices its own chunk inside the compiled graph). Ranks fed different data,
e.g. each its own shard of the sequence (as DeepSpeed-Ulysses/ALST data loaders do) or
a different batch (sampling by global rank instead of by data-parallel rank), would
otherwise train silently on garbage, or hang in a collective with mismatched sizes.

:class:`InputGuard` compares the inputs across the group in two all-gathers:

1. a fixed-size descriptor of every argument (tensors: ndim, shape, dtype; Python
   scalars: a hash of the value), so that ranks with different numbers, shapes or
   dtypes of arguments still take part in the same, equally sized collective. It holds
   the model's state too (autosp.model_state: which parameters require gradients, their
   dtypes, the module hooks), which the plan's collectives and each rank's part of the
   result follow as they do the inputs;
2. only if the descriptors agree: two int64 checksums of every tensor's bytes (the sum
   of its elements' bit patterns, and that sum weighted by a position ramp, so that a
   permuted or shifted batch differs, not only a different sum);
3. with a data-parallel axis, one all-reduce over it, so that every SP group learns
   whether another one failed.

Every rank holds the gathered data, so every rank decides alike and raises an
:class:`AutospError` (the same text within an SP group). No rank leaves the check early,
so none hangs in it.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autosp.errors import AutospError
from autosp.model_state import state_text

CHECK_INPUTS = ("on_change", "always", "never")

MAX_SLOTS = 32  # arguments described one by one; the rest are folded into one hash
MAX_NDIM = 8  # dims described one by one; the rest are folded into one hash
_ROW = 4 + MAX_NDIM + 1  # kind, key, ndim, dtype (or value hash), dims, overflow dims hash
_HEADER = 7  # magic, number of arguments, overflow-arguments hash, model state (4)
_MAGIC = 0x5A5A
_EMPTY, _TENSOR, _SCALAR, _OTHER = 0, 1, 2, 3
_CHUNK = 1 << 22  # elements checksummed at a time (bounds the int64 temporaries)

_EXPECTED = (
    "expected every rank of an SP group to be fed the same full-length batch: autosp "
    "slices each rank's chunk of the sequence inside the compiled model. Do not shard the "
    "sequence in the data loader, and sample by data-parallel rank (the mesh's 'dp' "
    "coordinate, mesh.get_local_rank('dp')), not by global rank."
)
_OPT_OUT = " (autosp.compile(..., check_inputs='never') turns this check off.)"
EXPECTED = _EXPECTED + _OPT_OUT

_DTYPES = {zlib.crc32(str(d).encode()): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_mode(check_inputs: Any) -> str:
    """``check_inputs`` validated: one of :data:`CHECK_INPUTS`."""
    if not isinstance(check_inputs, str) or check_inputs not in CHECK_INPUTS:
        raise AutospError(
            f"[autosp:compile] found check_inputs={check_inputs!r}; expected one of {CHECK_INPUTS}: "
            "'on_change' compares the inputs across the SP group on the first call and whenever "
            "their shapes or dtypes change, 'always' on every call, 'never' not at all."
        )
    return check_inputs


@dataclass(frozen=True)
class Leaf:
    """One argument of a call: a tensor, a Python scalar, or anything else (by type)."""

    key: int  # stable across processes: crc32 of the pytree path
    name: str  # for messages: "argument 0 (input_ids)", "keyword argument 'labels'"
    value: Any


def describe_tensor(shape: Sequence[int], dtype: torch.dtype | None) -> str:
    """``i64[2, 16]``-style text for a shape and dtype."""
    short = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
             torch.int64: "i64", torch.int32: "i32", torch.bool: "bool", torch.uint8: "u8"}
    d = short.get(dtype, str(dtype).replace("torch.", "")) if dtype is not None else "?"
    return f"{d}[{', '.join(str(s) for s in shape)}]"


def positional_names(fn: Callable) -> list[str]:
    """Names of ``fn``'s positional parameters, for messages (empty if unknown)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _name(path: tuple, names: Sequence[str]) -> str:
    where, key, *rest = path
    if where.idx == 0:
        i = key.idx
        base = f"argument {i}" + (f" ({names[i]})" if i < len(names) else "")
    else:
        base = f"keyword argument {key.key!r}"
    return base + pytree.keystr(tuple(rest))


def flatten_inputs(args: tuple, kwargs: dict, names: Sequence[str] = ()) -> list[Leaf]:
    """Every leaf of ``(args, kwargs)`` (tensors inside lists, tuples and dicts too)."""
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(sorted(kwargs.items()))))
    return [Leaf(zlib.crc32(pytree.keystr(p).encode()), _name(p, names), v) for p, v in leaves]


def signature(leaves: Sequence[Leaf]) -> tuple:
    """What a change of triggers a new check: keys, shapes and dtypes, and scalar values."""
    sig = []
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, torch.Tensor):
            sig.append((leaf.key, tuple(v.shape), v.dtype, v.device))
        elif _is_scalar(v):
            sig.append((leaf.key, type(v).__name__, repr(v)))
        else:
            sig.append((leaf.key, type(v).__name__))
    return tuple(sig)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _row(leaf: Leaf) -> list[int]:
    v = leaf.value
    row = [_EMPTY] * _ROW
    row[1] = leaf.key
    if isinstance(v, torch.Tensor):
        row[0], row[2], row[3] = _TENSOR, v.dim(), _crc(str(v.dtype))
        dims = list(v.shape)
        row[4:4 + min(len(dims), MAX_NDIM)] = dims[:MAX_NDIM]
        row[-1] = _crc(repr(dims[MAX_NDIM:])) if len(dims) > MAX_NDIM else 0
    elif _is_scalar(v):
        row[0], row[3] = _SCALAR, _crc(type(v).__name__ + ":" + repr(v))
    else:
        row[0], row[3] = _OTHER, _crc(type(v).__name__)
    return row


def descriptor(leaves: Sequence[Leaf], params: tuple[int, int, int, int] = (0, 0, 0, 0)) -> list[int]:
    """The fixed-size (``_HEADER + MAX_SLOTS * _ROW`` int64) description of a call, with the
    model state ``params`` (autosp.model_state.ModelState.state)."""
    rows = [_row(leaf) for leaf in leaves]
    overflow = _crc(repr(rows[MAX_SLOTS:])) if len(rows) > MAX_SLOTS else 0
    out = [_MAGIC, len(rows), overflow, *params]
    for i in range(MAX_SLOTS):
        out.extend(rows[i] if i < len(rows) else [_EMPTY] * _ROW)
    return out


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of ``t``'s element bit patterns: their sum and their sum weighted
    by the position (1, 2, 3, ...) in row-major order. Integer sums wrap and are exact, so
    every rank computes the same value for the same data whatever the reduction order."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    elif x.is_floating_point():
        x = x.view(_INT_OF_SIZE[x.element_size()])
    x = x.reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    ramped = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, x.numel(), _CHUNK):
        part = x[start:start + _CHUNK].to(torch.int64)
        ramp = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=x.device)
        total += part.sum()
        ramped += (part * ramp).sum()
    return torch.stack([total, ramped])


def _comm_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.accelerator.is_available():
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _all_gather(values: torch.Tensor, group: Any) -> list[list[int]]:
    world = dist.get_world_size(group)
    out = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(out, values, group=group)
    return [o.cpu().tolist() for o in out]


def _groups(values: Sequence[Any], ranks: Sequence[int]) -> list[tuple[Any, list[int]]]:
    """Distinct values in first-seen order, each with the global ranks that hold it."""
    seen: dict[Any, list[int]] = {}
    for v, r in zip(values, ranks):
        seen.setdefault(v if not isinstance(v, list) else tuple(v), []).append(r)
    return list(seen.items())


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _row_text(row: Sequence[int]) -> str:
    kind = row[0]
    if kind == _EMPTY:
        return "no argument"
    if kind == _TENSOR:
        ndim = row[2]
        shape = [str(s) for s in row[4:4 + min(ndim, MAX_NDIM)]] + (["..."] if ndim > MAX_NDIM else [])
        return describe_tensor(shape, _DTYPES.get(row[3]))
    if kind == _SCALAR:
        return f"a Python value (hash {row[3]:08x})"
    return "a non-tensor object"


class InputGuard:
    """Checks that every rank of the SP ``group`` is called with the same arguments.

    ``mode``: ``"on_change"`` checks on the first call and whenever some rank's signature
    (argument structure, shapes, dtypes, scalar values) differs from its last checked one;
    the ranks agree on that with a one-element all-reduce over the SP group and one over "dp"
    per call, so a change on some ranks only (one dp group's longer batch, one rank's
    different length) is checked by every rank together instead of leaving the others
    waiting in a different collective. ``"always"`` checks every call; ``"never"`` not at
    all.

    With a ``dp_group`` (the mesh's "dp" axis), the SP groups also tell each other the
    outcome (one all-reduce over "dp"), so that when one SP group's inputs disagree every
    rank of the mesh raises, not only that group's (the others would wait for it in the
    gradient all-reduce over "dp").
    """

    def __init__(self, group: Any, mode: str = "on_change", names: Sequence[str] = (),
                 dp_group: Any = None) -> None:
        self.group = group
        self.dp_group = dp_group
        self.mode = check_mode(mode)
        self.names = list(names)
        self.checked: tuple | None = None  # the last signature that passed
        self.checks = 0  # how many comparisons ran (for tests and benchmarks)

    def check_call(self, leaves: Sequence[Leaf], sig: tuple | None = None,
                   params: tuple[int, int, int, int] = (0, 0, 0, 0)) -> None:
        """Check one call's ``leaves`` (from :func:`flatten_inputs`; ``sig`` their
        :func:`signature`) and the model's parameter state ``params`` as the mode says."""
        if self.mode == "never" or self.group is None or dist.get_world_size(self.group) < 2:
            return
        sig = (signature(leaves) if sig is None else sig, params)
        if self.mode == "on_change" and not self._any_rank_changed(sig != self.checked):
            return
        self.checked = None
        self.check(leaves, params)
        self.checked = sig

    def _any_rank_changed(self, changed: bool) -> bool:
        """Whether any rank of the mesh (this SP group, then over "dp") has a new signature:
        check() runs collectives, so every rank must take the same branch."""
        flag = torch.tensor([int(changed)], dtype=torch.int64, device=_comm_device(self.group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            flag = flag.to(_comm_device(self.dp_group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_group)
        return bool(flag.item())

    def check(self, leaves: Sequence[Leaf], params: tuple[int, int, int, int] = (0, 0, 0, 0)) -> None:
        """Compare ``leaves`` and ``params`` across the group; raise the same AutospError on
        every rank."""
        self.checks += 1
        error, states = self._compare(leaves, params)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            # Every SP group's model states, over "dp": each rank of the mesh holds them all, so
            # that a mismatch is worded alike on every rank.
            sp_ranks = dist.get_process_group_ranks(self.group)
            rows = torch.tensor([[r, *st] for r, st in zip(sp_ranks, states)], dtype=torch.int64,
                                device=_comm_device(self.dp_group))
            width = 1 + len(params)
            mesh = sorted(tuple(flat[i:i + width])
                          for flat in _all_gather(rows.flatten(), self.dp_group)
                          for i in range(0, len(flat), width))
            error = self._compare_params([m[1:] for m in mesh], [m[0] for m in mesh],
                                         "mesh (its SP and data-parallel groups)") or error
            # The smallest global rank of an SP group that failed, over the "dp" axis.
            none = 1 << 62
            first = torch.tensor([min(dist.get_process_group_ranks(self.group)) if error else none],
                                 dtype=torch.int64, device=_comm_device(self.dp_group))
            dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.dp_group)
            failed = int(first.item())
            if error is None and failed != none:
                error = AutospError(
                    f"[autosp:inputs] found the inputs of another SP group (the one with global "
                    f"rank {failed}) different across its ranks, which raise the details; " + EXPECTED)
        if error is not None:
            raise error

    def _compare(self, leaves: Sequence[Leaf], params: tuple[int, int, int, int]
                 ) -> tuple[AutospError | None, list[list[int]]]:
        """The error for this SP group, if any, and its ranks' model states."""
        device = _comm_device(self.group)
        ranks = dist.get_process_group_ranks(self.group)
        desc = _all_gather(torch.tensor(descriptor(leaves, params), dtype=torch.int64, device=device),
                           self.group)
        states = [d[3:7] for d in desc]
        error = self._compare_params(states, ranks, "SP group") \
            or self._compare_descriptors(desc, ranks, leaves)
        tensors = [leaf for leaf in leaves if isinstance(leaf.value, torch.Tensor)]
        if error is not None or not tensors:  # every rank of the group takes the same branch
            return error, states
        local = torch.stack([checksum(leaf.value).to(device) for leaf in tensors])
        sums = _all_gather(local, self.group)
        bad = [i for i in range(len(tensors)) if len({tuple(s[i]) for s in sums}) > 1]
        if not bad:
            return None, states
        parts = []
        for i in bad:
            leaf = tensors[i]
            held = " vs ".join(_ranks_text(rs) for _, rs in _groups([s[i] for s in sums], ranks))
            parts.append(f"{leaf.name} {describe_tensor(leaf.value.shape, leaf.value.dtype)} "
                         f"(same shape and dtype; different values on {held})")
        return AutospError(
            "[autosp:inputs] found different values across the SP group (global ranks "
            f"{', '.join(map(str, ranks))}) in {'; '.join(parts)}; " + EXPECTED
        ), states

    def _compare_params(self, states: list[list[int]], ranks: list[int],
                        group: str) -> AutospError | None:
        """The model states (autosp.model_state) gathered over ``group``'s ``ranks``."""
        if len({tuple(s) for s in states}) == 1:
            return None
        held = "; ".join(f"{_ranks_text(rs)}: {state_text(*s)}" for s, rs in _groups(states, ranks))
        if len({s[3] for s in states}) > 1:
            under = [r for s, r in zip(states, ranks) if s[3]]
            return AutospError(
                f"[autosp:inputs] found a torch dispatch mode (FlopCounterMode, a "
                f"TorchDispatchMode) active around the call on {_ranks_text(under)} only, across "
                f"the {group} (global ranks {', '.join(map(str, ranks))}); expected none: "
                "torch.compile does not run a compiled graph under one, and ranks that differ "
                "would wait in different collectives. Leave the mode before calling the compiled "
                "module (count FLOPs on the model outside autosp).")
        return AutospError(
            f"[autosp:inputs] found the model's parameters or hooks set up differently across the "
            f"{group} (global ranks {', '.join(map(str, ranks))}): {held}; expected every rank to "
            "hold the same model, with the same parameters, requiring gradients alike and of the "
            "same dtypes, and the same module hooks: the compiled step's collectives and the "
            "gradients' averaging follow the parameters, and each rank computes its part of every "
            "hooked module. Freeze, unfreeze, convert or add parameters, and register hooks, on "
            "every rank alike." + _OPT_OUT)

    def _compare_descriptors(self, desc: list[list[int]], ranks: list[int],
                             leaves: Sequence[Leaf]) -> AutospError | None:
        if len({tuple(d) for d in desc}) == 1:
            return None
        group = f"the SP group (global ranks {', '.join(map(str, ranks))})"
        counts = [d[1] for d in desc]
        if len(set(counts)) > 1:
            held = "; ".join(f"{_ranks_text(rs)}: {n}" for n, rs in _groups(counts, ranks))
            return AutospError(f"[autosp:inputs] found a different number of arguments across {group} "
                               f"({held}); " + EXPECTED)
        names = {leaf.key: leaf.name for leaf in leaves}
        for slot in range(min(counts[0], MAX_SLOTS)):
            lo, hi = _HEADER + slot * _ROW, _HEADER + (slot + 1) * _ROW
            rows = [tuple(d[lo:hi]) for d in desc]
            if len(set(rows)) == 1:
                continue
            name = names.get(rows[0][1], f"argument #{slot}") if len({r[1] for r in rows}) == 1 \
                else f"argument #{slot} (named differently on different ranks)"
            held = "; ".join(f"{_ranks_text(rs)}: {_row_text(r)}" for r, rs in _groups(rows, ranks))
            hint = ""
            if all(r[0] == _TENSOR for r in rows) and len({r[2] for r in rows}) == 1:
                hint = (" If each rank was given its own part of the sequence, pass the whole "
                        "sequence on every rank of the group instead.")
            return AutospError(f"[autosp:inputs] found {name} different across {group} ({held}); "
                               + _EXPECTED + hint + _OPT_OUT)
        return AutospError(f"[autosp:inputs] found the arguments beyond the first {MAX_SLOTS} different "
                           f"across {group}; " + EXPECTED)
