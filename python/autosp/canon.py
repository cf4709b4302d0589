"""FX nodes to canonical core ops: for each Torch-level function, method or operator Dynamo
records, the core op name, its tensor operands (with where they sit in the call's arguments)
and the attributes the placement rules read.

``canonicalize`` looks the function up in ``CANONICAL`` (one entry per Torch-level name or
name family); a name without an entry keeps its own name, its tensor operands in order and
no attributes (the core then finds a rule by name, takes it as pointwise from torch's tags,
or refuses it).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from autosp.ops import GRAD_MODE_SETTERS, is_pointwise

ArgPath = tuple

_ALIASES = {
    "truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "clip": "clamp",
    "and_": "bitwise_and", "or_": "bitwise_or", "invert": "logical_not", "multiply": "mul",
    "subtract": "sub", "divide": "div", "true_divide": "div", "negative": "neg",
    "concat": "cat", "concatenate": "cat", "swapaxes": "transpose", "swapdims": "transpose",
    "scaled_dot_product_attention": "sdpa", "matmul": "matmul", "mm": "matmul", "bmm": "matmul",
    "greater": "gt", "less": "lt", "greater_equal": "ge", "less_equal": "le", "not_equal": "ne",
    "zeros_like": "fill_like", "ones_like": "fill_like", "full_like": "fill_like",
    "empty_like": "fill_like",
    "new_zeros": "new_full", "new_ones": "new_full", "new_empty": "new_full",
    # In-place operators (x /= y) compute what their out-of-place forms do.
    "iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "div", "ifloordiv": "floor_divide",
    "imod": "remainder", "ipow": "pow", "iand": "bitwise_and", "ior": "bitwise_or",
}


_CASTS = {"float", "half", "bfloat16", "double", "to", "type_as", "type", "int", "long", "bool"}


_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "logsumexp",
               "norm", "all", "any", "argmax", "argmin"}


_ALONG_DIM = {"softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "sort", "argsort"}


_RESHAPES = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as",
             "reshape_as", "ravel"}


_FACTORIES = {"arange", "ones", "zeros", "full", "empty", "rand", "randn", "randint",
              "tensor", "scalar_tensor", "linspace"}


_NONTENSOR = {"_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled",
              "autocast", "_record_function_enter_new", "_record_function_exit"}


# ATen ops whose arguments sit where their Torch-level function's do, so the rows read them
# as they read the Torch call (ATen name -> Torch name). Such ops come from the
# decompositions autosp splices (autosp.decompose) or from a model calling torch.ops.aten.
# Not listed because they differ: embedding (weight, indices), cross_entropy_loss (an int
# reduction), einsum (a list of operands).
ATEN_AS_TORCH = {name: name for name in (
    "linear", "matmul", "bmm", "mm", "view", "reshape", "unflatten", "flatten", "unsqueeze",
    "squeeze", "transpose", "permute", "expand", "contiguous", "clone", "detach", "alias",
    "select", "narrow", "split", "split_with_sizes", "chunk", "unbind", "cat", "stack",
    "scaled_dot_product_attention", "softmax", "log_softmax", "layer_norm", "dropout",
    "sym_size", "sum", "mean", "amax", "amin", "masked_fill", "triu", "tril",
    "repeat_interleave", "index_select", "gather", "pad")} | {"_to_copy": "to"}


def aten_torch_name(op: torch._ops.OpOverload) -> str:
    """The Torch-level name the rows read an ATen op as, or ``"aten.<op>.<overload>"`` (no
    row, no rule: refused or gathered on sharded operands) for an op whose arguments are not
    read like a Torch function's, or one that writes into an operand."""
    name = op.overloadpacket.__name__
    if not op._schema.is_mutable:
        if name in ATEN_AS_TORCH:
            return ATEN_AS_TORCH[name]
        if is_pointwise(name):
            return name
    return str(op)


def target_name(node: fx.Node) -> str:
    """The Torch-level name of a call (in-place suffix removed, aliases not resolved)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return aten_torch_name(t)
    if isinstance(t, str):
        name = t
    else:
        name = getattr(t, "__name__", None) or str(t)
        if (getattr(t, "__module__", None) or "").startswith("torch.masked"):
            # torch.masked.mean(x, mask=m) is not mean(x): its own name, no rule of mean's.
            return "masked_" + name
    if name.endswith("_") and not name.startswith("_") and name not in ("and_", "or_"):
        name = name[:-1]  # in-place variants
    return name


def _example(node: Any) -> Any:
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def _is_tensor_node(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(_example(a), torch.Tensor)


def _flatten_args(a: Any, path: ArgPath) -> Iterable[tuple[Any, ArgPath]]:
    if isinstance(a, (tuple, list)):
        for j, x in enumerate(a):
            yield from _flatten_args(x, path + (j,))
    else:
        yield a, path


def _tensor_inputs(node: fx.Node, only: Iterable[int] | None = None,
                   kw: Iterable[str] | None = None) -> list[tuple[fx.Node, ArgPath]]:
    out = []
    for i, a in enumerate(node.args):
        if only is not None and i not in only:
            continue
        for n, p in _flatten_args(a, ("args", i)):
            if _is_tensor_node(n):
                out.append((n, p))
    for k, a in node.kwargs.items():
        if kw is not None and k not in kw:
            continue
        for n, p in _flatten_args(a, ("kwargs", k)):
            if _is_tensor_node(n):
                out.append((n, p))
    return out


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _rank(n: Any) -> int:
    ex = _example(n)
    return ex.dim() if isinstance(ex, torch.Tensor) else 0


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _int(x: Any) -> int:
    if isinstance(x, fx.Node):
        ex = _example(x)
        return int(ex) if not isinstance(ex, torch.SymInt) else 1
    return int(x)


Canon = tuple[str, list[tuple[fx.Node | None, ArgPath]], dict[str, Any]]
# A handler gets the node, its (alias-resolved) name, its first argument and that argument's
# rank, and returns the canonical op, tensor operands with arg paths, and attributes.
Handler = Callable[[fx.Node, str, Any, int], Canon]
CANONICAL: dict[str, Handler] = {}


def _canon(*names: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for n in names:
            if n in CANONICAL:
                raise AssertionError(f"two canonicalisations for {n!r}")
            CANONICAL[n] = fn
        return fn
    return register


def canonicalize(node: fx.Node) -> Canon:
    """(canonical op, tensor operands with their arg paths, attributes) for one FX node."""
    if node.op not in ("call_function", "call_method"):
        return node.op, _tensor_inputs(node), {}
    name = target_name(node)
    name = _ALIASES.get(name, name)
    ex = _example(node)
    if name in GRAD_MODE_SETTERS and node.args and isinstance(node.args[0], bool):
        # The plan needs the grad mode: a gradient sync placed in a no_grad region is lost.
        return "nontensor", [], {"grad_enabled": node.args[0]}
    if name in ("_enter_autocast", "_exit_autocast"):
        # torch.autocast regions: ops inside compute in another dtype than their operands'.
        return "nontensor", [], {"autocast": 1 if name == "_enter_autocast" else -1}
    if name in _NONTENSOR or (not isinstance(ex, (torch.Tensor, tuple, list)) and not _tensor_inputs(node)):
        return ("sym_arith" if isinstance(ex, (torch.SymInt, int, float)) else "nontensor"), [], {}
    x = node.args[0] if node.args else None
    handler = CANONICAL.get(name)
    if handler is None:
        return name, _tensor_inputs(node), {}
    op, operands, attrs = handler(node, name, x, _rank(x))
    if op == "nontensor" and isinstance(ex, torch.Tensor) and _tensor_inputs(node):
        # A tensor computed from tensors is never "nontensor" (which has no placement): keep
        # its own name, which the core refuses on sharded operands unless it has a rule.
        return name, _tensor_inputs(node), {}
    return op, operands, attrs


@_canon("where")
def _c_where(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    if len(node.args) + len(node.kwargs) == 1:
        # torch.where(cond) is nonzero (data-dependent indices), not the pointwise where(c, a, b)
        # whose overloads carry torch's pointwise tag.
        return "nonzero", _tensor_inputs(node), {"as_tuple": True}
    return name, _tensor_inputs(node), {}


@_canon("nonzero", "argwhere")
def _c_nonzero(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    # One index tensor per dim (as_tuple) or one [n, ndim] tensor.
    return "nonzero", _tensor_inputs(node, only=[0]), {"as_tuple": bool(node.kwargs.get("as_tuple", False))}


# Tensor attributes Dynamo keeps as getattr(x, name): the transposes are permutes; .data and
# a real tensor's .real are x itself. Any other tensor-valued attribute keeps its own name
# ("getattr.imag"), which the core refuses on sharded operands.
_TENSOR_ATTRS = {"mT": "swap_last", "mH": "swap_last", "T": "reverse", "H": "reverse",
                 "data": "alias", "real": "alias"}


@_canon("size", "sym_size", "sym_size.int", "dim", "numel", "stride", "getattr")
def _c_size(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    if name == "getattr" and isinstance(_example(node), torch.Tensor) and _is_tensor_node(x):
        attr = node.args[1] if len(node.args) > 1 else None
        kind = _TENSOR_ATTRS.get(attr) if isinstance(attr, str) else None
        if kind == "alias" and (attr == "data" or not _example(x).is_complex()):
            return ("detach" if attr == "data" else "alias"), _tensor_inputs(node, only=[0]), {}
        if kind in ("swap_last", "reverse") and xr >= 2:
            perm = list(range(xr))
            perm = perm[:-2] + perm[:-3:-1] if kind == "swap_last" else perm[::-1]
            return "permute", _tensor_inputs(node, only=[0]), {"perm": perm}
        return f"getattr.{attr}", _tensor_inputs(node, only=[0]), {}
    if name in ("size", "sym_size", "sym_size.int") and len(node.args) > 1:
        return "sym_size", _tensor_inputs(node, only=[0]), {"dim": _norm(_int(node.args[1]), xr)}
    if name in ("size", "numel") and _is_tensor_node(x):
        # x.size() / x.shape (a torch.Size) and x.numel() of a tensor: global on one device,
        # so the plan must see them (a sharded x reports its local sizes).
        return "sym_size", _tensor_inputs(node, only=[0]), {"whole": name}
    return "nontensor", [], {}


@_canon("setitem")
def _c_setitem(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    # x[mask] = value with a boolean mask of x's own shape and a scalar value writes each
    # element where the mask is set: masked_fill_, an elementwise write (the placement rules
    # then split it like x; the call itself runs as written). Any other setitem keeps its name.
    idx, val = (node.args[1], node.args[2]) if len(node.args) == 3 else (None, None)
    ex, ei, ev = _example(x), _example(idx), _example(val)
    if (isinstance(ex, torch.Tensor) and isinstance(ei, torch.Tensor) and ei.dtype == torch.bool
            and [str(s) for s in ei.shape] == [str(s) for s in ex.shape]
            and (isinstance(val, (bool, int, float)) or (isinstance(ev, torch.Tensor) and ev.dim() == 0))):
        return "masked_fill", _tensor_inputs(node, only=[0, 1, 2]), {"inplace": True}
    return name, _tensor_inputs(node), {}


@_canon("getitem")
def _c_getitem(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    if isinstance(_example(x), torch.Tensor):
        from autosp.canon_index import canon_index  # the index rules import this module

        return canon_index(node)
    return "nontensor", [], {}


@_canon(*_CASTS)
def _c_cast(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    return "to", _tensor_inputs(node, only=[0]), {}


# Where dim and keepdim sit among a reduction's positional arguments: norm(x, p, dim, keepdim),
# var/std(x, dim, unbiased, keepdim), the others (x, dim, keepdim).
_REDUCTION_DIM_KEEPDIM = {"norm": (2, 3), "var": (1, 3), "std": (1, 3)}


def _refuse_arguments(node: fx.Node, name: str, found: str, expected: str) -> None:
    from autosp.fx_source import source_loc
    from autosp.errors import AutospError

    raise AutospError(f"[autosp:bridge] op '{name}' at {source_loc(node)}: found {found}; expected "
                      f"{expected}. autosp could not read this call's arguments; rather than "
                      "guess, it stops here.")


@_canon(*_REDUCTIONS)
def _c_reduction(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    if name in ("max", "min") and len(node.args) > 1 and _is_tensor_node(node.args[1]):
        return ("maximum" if name == "max" else "minimum"), _tensor_inputs(node), {}
    dim_at, keepdim_at = _REDUCTION_DIM_KEEPDIM.get(name, (1, 2))
    dims = _arg(node, dim_at, "dim")
    if dims is None:
        dims = node.kwargs.get("axis")
    if isinstance(dims, (int, fx.Node)):
        dims = [dims]
    if dims is not None and not all(isinstance(d, (int, fx.Node)) for d in dims):
        _refuse_arguments(node, name, f"dim={dims!r}", "int dims")
    dims = [] if dims is None else sorted({_norm(_int(d), xr) for d in dims})
    keepdim = bool(_arg(node, keepdim_at, "keepdim", False))
    # The traced result's rank checks the reading: a misread keepdim or dim would place the
    # output's dims wrongly, silently.
    out = _example(node)
    out = out[0] if isinstance(out, (tuple, list)) and out else out
    if isinstance(out, torch.Tensor):
        want = xr if keepdim else xr - (len(dims) if dims else xr)
        if out.dim() != want:
            _refuse_arguments(node, name, f"a result of rank {out.dim()} for dims={dims}, "
                              f"keepdim={keepdim} of a rank-{xr} input",
                              f"rank {want}")
    return name, _tensor_inputs(node, only=[0]), {"dims": dims, "keepdim": keepdim}


@_canon(*_ALONG_DIM)
def _c_along_dim(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    return name, _tensor_inputs(node, only=[0]), {"dim": _norm(_int(_arg(node, 1, "dim", -1)), xr)}


@_canon("topk")
def _c_topk(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    return name, _tensor_inputs(node, only=[0]), {"dim": _norm(_int(_arg(node, 2, "dim", -1)), xr)}


@_canon("layer_norm", "rms_norm", "group_norm")
def _c_norm(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    if name == "group_norm":  # (x, num_groups, ...): statistics over every dim after the batch
        return "layer_norm", _tensor_inputs(node), {"norm_dims": xr - 1}
    shape = _example(_arg(node, 1, "normalized_shape"))  # a list, or a torch.Size (x.shape[1:])
    if isinstance(shape, int):
        shape = [shape]
    if not isinstance(shape, (tuple, list, torch.Size)):
        _refuse_arguments(node, name, f"normalized_shape={shape!r}", "a list or torch.Size")
    return "layer_norm", _tensor_inputs(node), {"norm_dims": len(shape)}


@_canon("new_full", "new_tensor", *_FACTORIES)
def _c_factory(node: fx.Node, name: str, x: Any, xr: int) -> Canon:
    if name == "new_full" and _is_tensor_node(x):
        # x.new_empty(size) / new_zeros / new_ones / new_full: values that do not depend on the
        # position, so the core may allocate them sharded like x (MLA's key buffer).
        return "new_full", _tensor_inputs(node, only=[0]), {}
    return ("new_full" if name in ("new_full", "new_tensor") else name), [], {}


# The attention and loss rows, the linear-algebra and data-movement rows, and the shape rows
# (reshapes, permutes, slices, cat and split) live in their own modules; importing them
# registers them.
from autosp import canon_attention, canon_ops, canon_shape  # noqa: E402,F401
