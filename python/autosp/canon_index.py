"""Canonicalisation of indexing (``x[...]``, operator.getitem on tensors): which dims are
taken whole, sliced or indexed by tensors, where advanced-index dims land in the output, and
which input dim each index tensor indexes. Part of the FX-to-core table in canon.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autosp.canon import _example, _is_tensor_node, _rank


def _static_start(it: slice) -> int:
    """Where a step-1 slice with a static, non-negative start begins; -1 otherwise."""
    if it.step not in (None, 1):
        return -1
    if it.start is None:
        return 0
    return it.start if isinstance(it.start, int) and it.start >= 0 else -1


def _dim_size(n: Any, d: int) -> Any:
    ex = _example(n)
    return ex.shape[d] if isinstance(ex, torch.Tensor) and d < ex.dim() else None


def _same_size(a: Any, b: Any) -> bool:
    """Whether two sizes are the same int or the same symbolic expression (compared
    without adding a guard)."""
    if a is None or b is None:
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return bool(a.node.expr == b.node.expr)
    return False


def expand_index(idx: Any, rank: int) -> list[Any]:
    """The items of ``x[idx]`` for a tensor of ``rank`` dims, the Ellipsis expanded and
    trailing dims filled with full slices."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    n_consuming = sum(1 for it in items if it is not None and it is not Ellipsis)
    expanded: list[Any] = []
    for it in items:
        if it is Ellipsis:
            expanded.extend([slice(None)] * (rank - n_consuming))
        else:
            expanded.append(it)
    while sum(1 for it in expanded if it is not None) < rank:
        expanded.append(slice(None))
    return expanded


def canon_index(node: fx.Node) -> tuple[str, list, dict[str, Any]]:
    x, idx = node.args[0], node.args[1]
    rank = _rank(x)
    inputs = [(x, ("args", 0))]
    expanded = expand_index(idx, rank)
    # Advanced (tensor) indices: PyTorch puts the dims of their broadcast result where the
    # first of them stands when they are adjacent, and in front of all dims otherwise. A bool
    # index consumes as many dims as it has and gives one (its nonzero positions).
    def is_advanced(it: Any) -> bool:
        return _is_tensor_node(it) or isinstance(it, (list, tuple))

    adv = [j for j, it in enumerate(expanded) if is_advanced(it)]
    adv_bool = any(_is_tensor_node(expanded[j]) and _example(expanded[j]).dtype == torch.bool for j in adv)
    adv_rank = max((1 if not _is_tensor_node(expanded[j]) or _example(expanded[j]).dtype == torch.bool
                    else _rank(expanded[j]) for j in adv), default=0)
    adjacent = bool(adv) and adv == list(range(adv[0], adv[-1] + 1))
    dim_map: list[int] = []
    index_dims: list[int] = []  # per index tensor (inputs 1..): the input dim it indexes
    sliced: list[int] = []
    starts: list[int] = []  # per sliced dim: where a step-1 slice starts, or -1
    in_dim, out_dim = 0, (0 if adjacent or not adv else adv_rank)
    adv_out = 0
    for j, it in enumerate(expanded):
        if it is None:
            out_dim += 1
            continue
        if isinstance(it, slice):
            full = it.start in (None, 0) and it.stop is None and it.step in (None, 1)
            if not full and it.step in (None, 1):
                # A slice that keeps every element of the dim (x[:, -w:] with S <= w, which
                # Dynamo guards) takes it whole: its size is the input's.
                full = _same_size(_dim_size(x, in_dim), _dim_size(node, out_dim))
            if not full:
                sliced.append(in_dim)
                starts.append(_static_start(it))
            dim_map.append(out_dim)
            in_dim += 1
            out_dim += 1
        elif not is_advanced(it):  # an int: the dim goes away
            dim_map.append(-1)
            sliced.append(in_dim)
            starts.append(-1)
            in_dim += 1
        else:
            if adjacent and j == adv[0]:
                adv_out = out_dim
                out_dim += adv_rank
            consumed = _rank(it) if _is_tensor_node(it) and _example(it).dtype == torch.bool else 1
            first_in = in_dim
            for _ in range(consumed):
                dim_map.append(-1)
                sliced.append(in_dim)
                starts.append(-1)
                in_dim += 1
            if _is_tensor_node(it):
                inputs.append((it, ("args", 1, j) if isinstance(idx, tuple) else ("args", 1)))
                index_dims.append(first_in)
    attrs: dict[str, Any] = {"dim_map": dim_map, "sliced_dims": sliced, "slice_starts": starts,
                             "index_dims": index_dims}
    if adv:
        attrs.update(index_out=adv_out, index_bool=adv_bool)
    return "index", inputs, attrs
