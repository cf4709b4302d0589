"""FX-to-core rows for attention and the loss (SDPA, flex_attention, cross-entropy): their
operands in order, absent ones as None, and the attributes the core reads. Registered in
canon.py's table with ``@_canon``."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from autosp.canon import ArgPath, Canon, _arg, _canon, _int, _is_tensor_node, _tensor_inputs


def _optional_tensors(node: fx.Node, keys: tuple[str, ...]) -> list[tuple[fx.Node | None, ArgPath]]:
    """The operands at ``keys`` (positional or keyword), None where absent or not a tensor."""
    ins: list[tuple[fx.Node | None, ArgPath]] = []
    for i, k in enumerate(keys):
        a, p = (node.args[i], ("args", i)) if len(node.args) > i else (node.kwargs.get(k), ("kwargs", k))
        ins.append((a if _is_tensor_node(a) else None, p))
    return ins


@_canon("sdpa")
def _c_sdpa(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    ins = _optional_tensors(node, ("query", "key", "value", "attn_mask"))
    if ins[3][0] is None:
        ins = ins[:3]
    attrs = {
        "is_causal": bool(_arg(node, 5, "is_causal", False)),
        "enable_gqa": bool(node.kwargs.get("enable_gqa", False)),
    }
    dropout_p = _arg(node, 4, "dropout_p", 0.0)
    if isinstance(dropout_p, fx.Node) or float(dropout_p) != 0.0:
        attrs["dropout_p"] = 1.0 if isinstance(dropout_p, fx.Node) else float(dropout_p)
    return "sdpa", ins, attrs


@_canon("flex_attention")
def _c_flex(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    return _canon_flex(node)


def cross_entropy_reduction(node: fx.Node) -> str:
    """The reduction an F.cross_entropy call applies: ``reduction``, unless the deprecated
    ``size_average``/``reduce`` are given, which then decide it (as torch does)."""
    size_average, reduce = _arg(node, 3, "size_average"), _arg(node, 5, "reduce")
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction

        return _reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return str(_arg(node, 6, "reduction", "mean"))


@_canon("cross_entropy")
def _c_cross_entropy(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    ins = _optional_tensors(node, ("input", "target", "weight"))
    if ins[2][0] is None:
        ins = ins[:2]
    ignore = _arg(node, 4, "ignore_index", -100)
    attrs = {"reduction": cross_entropy_reduction(node), "ignore_index": _int(ignore)}
    if isinstance(ignore, fx.Node):
        attrs["ignore_index_from_graph"] = True  # a mean under SP needs its value: refused
    return "cross_entropy", ins, attrs


def _reads_head_index(gm: Any, index: int) -> bool:
    """Whether a score_mod / mask_mod graph reads its head-index argument (placeholder
    ``index``): under Ulysses each rank runs H/P heads and flex_attention passes the local
    head index."""
    if not isinstance(gm, fx.GraphModule):
        return True  # unknown: assume it does
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return index < len(holders) and len(holders[index].users) > 0


def _canon_flex(node: fx.Node) -> tuple[str, list, dict[str, Any]]:
    """flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_mod_buffers,
    mask_mod_buffers): q, k and v, then the block mask's tensors, then the mods' buffers."""
    owner = node.graph.owning_module
    q_k_v = _tensor_inputs(node, only=[0, 1, 2])
    block_mask = _tensor_inputs(node, only=[4])
    buffers = _tensor_inputs(node, only=[7, 8])
    score_mod = node.args[3] if len(node.args) > 3 else None
    mask_mod = node.args[4][-1] if len(node.args) > 4 and isinstance(node.args[4], (tuple, list)) else None

    def mod(n: Any) -> Any:
        return getattr(owner, n.target, None) if isinstance(n, fx.Node) and n.op == "get_attr" else n

    heads = _reads_head_index(mod(score_mod), 2) or (mask_mod is not None and _reads_head_index(mod(mask_mod), 1))
    return "flex_attention", q_k_v + block_mask + buffers, {
        "enable_gqa": True, "block_mask_inputs": len(block_mask), "reads_head_index": heads}
