"""Rows of the FX-to-core table (canon.py) for linear algebra and data movement: linear,
addmm, einsum, embedding, conv1d, scatter/gather, pad, repeat and repeat_interleave. Imported
by canon.py, which registers them."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autosp.canon import (Canon, _arg, _canon, _example, _int, _is_tensor_node, _norm, _rank,
                          _tensor_inputs)


@_canon("einsum")
def _c_einsum(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    equation = node.args[0] if node.args else node.kwargs.get("equation")
    return "einsum", _tensor_inputs(node), {"equation": str(equation).replace(" ", "")}


@_canon("scatter", "scatter_add", "scatter_reduce", "gather", "index_select", "index_add", "index_copy",
        "index_fill")
def _c_scatter(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    # (input, dim, index[, src]): the tensors in order, the dim normalised.
    return name, _tensor_inputs(node), {"dim": _norm(_int(_arg(node, 1, "dim")), xr)}


@_canon("one_hot", "tril", "triu", "fill_like", "rand_like", "randn_like")
def _c_first_only(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    return name, _tensor_inputs(node, only=[0]), {}


@_canon("pad")
def _c_pad(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    pad = _arg(node, 1, "pad")
    return "pad", _tensor_inputs(node, only=[0]), {"pad": [_int(p) if not isinstance(p, fx.Node) else 1 for p in pad]}


@_canon("repeat_interleave")
def _c_repeat_interleave(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    repeats = _arg(node, 1, "repeats")
    dim = _arg(node, 2, "dim")
    attrs = {} if dim is None else {"dim": _norm(_int(dim), xr)}
    if not _is_tensor_node(repeats):
        attrs["repeats"] = _int(repeats)
    return name, _tensor_inputs(node, only=[0, 1], kw=["repeats"]), attrs


@_canon("repeat", "tile")
def _c_repeat(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    reps = list(node.args[1:])
    if len(reps) == 1 and isinstance(reps[0], (tuple, list)):
        reps = list(reps[0])
    if not reps:
        reps = list(node.kwargs.get("repeats", node.kwargs.get("dims", ())))
    return "repeat", _tensor_inputs(node, only=[0]), {"repeats": [_int(r) for r in reps]}


@_canon("conv1d")
def _c_conv1d(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    return "conv1d", _tensor_inputs(node, only=[0, 1, 2], kw=["input", "weight", "bias"]), _conv1d_attrs(node)


@_canon("linear")
def _c_linear(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    first = (node.args[0], ("args", 0)) if node.args else (node.kwargs["input"], ("kwargs", "input"))
    return "linear", [first] + _tensor_inputs(node, only=[1, 2], kw=["weight", "bias"]), {}


@_canon("addmm")
def _c_addmm(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    # addmm(bias, x, w) = beta * bias + alpha * (x @ w): with a bias that broadcasts over
    # the rows (1-D), a linear layer with the weight transposed (GPT-2's Conv1D). The
    # placement rule sees the operands in linear's order: x, weight, bias.
    bias = (_arg(node, 0, "input"), ("args", 0) if node.args else ("kwargs", "input"))
    mat1 = (_arg(node, 1, "mat1"), ("args", 1) if len(node.args) > 1 else ("kwargs", "mat1"))
    mat2 = (_arg(node, 2, "mat2"), ("args", 2) if len(node.args) > 2 else ("kwargs", "mat2"))
    if _rank(bias[0]) <= 1 and all(_is_tensor_node(a) for a, _ in (bias, mat1, mat2)):
        return "linear", [mat1, mat2, bias], {}
    return "addmm", _tensor_inputs(node), {}


@_canon("embedding")
def _c_embedding(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    # max_norm renormalises the rows the ids hit, in place in the table: each rank would
    # renormalise only the rows its chunk uses.
    max_norm = _arg(node, 3, "max_norm")
    return "embedding", _tensor_inputs(node, only=[0, 1], kw=["input", "weight"]), (
        {"max_norm": True} if max_norm is not None else {})


def _conv1d_attrs(node: fx.Node) -> dict[str, Any]:
    """conv1d(input, weight, bias, stride, padding, dilation, groups) as static ints: stride,
    dilation, kernel and the padding on each side ('same' puts the odd element on the right);
    empty when any of them is not a static int."""
    def one(v: Any) -> Any:
        if isinstance(v, (tuple, list)) and len(v) == 1:
            v = v[0]
        return v if isinstance(v, int) else None

    w = _example(_arg(node, 1, "weight"))
    stride, dilation = one(_arg(node, 3, "stride", 1)), one(_arg(node, 5, "dilation", 1))
    kernel = w.shape[-1] if isinstance(w, torch.Tensor) and isinstance(w.shape[-1], int) else None
    padding = _arg(node, 4, "padding", 0)
    if None in (stride, dilation, kernel):
        return {}
    span = dilation * (kernel - 1)
    if padding == "valid":
        left = right = 0
    elif padding == "same":
        left, right = span // 2, span - span // 2
    elif one(padding) is not None:
        left = right = one(padding)
    else:
        return {}
    return {"stride": stride, "dilation": dilation, "kernel": kernel, "pad_left": left, "pad_right": right}
