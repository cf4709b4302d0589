"""FX <-> core bridge: translate a Dynamo (Torch-level) FX graph into autosp's core IR.

Each FX node becomes one core node with a canonical op name, its tensor operands as
core values (with the path of each operand inside the FX node's args, so a plan can
replace it), attributes normalised (non-negative dims, full permutations, index maps),
the user's source line, and output values whose shapes are symbolic in S.

The bridge only translates; every decision about placements is the core's.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autosp import _core
from autosp.canon import _REDUCTIONS, _example, _flatten_args, _is_tensor_node, _tensor_inputs, canonicalize
from autosp.errors import AutospError, at_node
from autosp.fx_source import input_name, module_path, source_loc, where_size_fixed
from autosp.ops import is_pointwise

ArgPath = tuple  # ("args", i) | ("args", i, j) | ("kwargs", name) | ("kwargs", name, j)

_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
}


@dataclass
class BridgeResult:
    """The core graph and what is needed to map a plan back onto the FX graph."""

    graph: Any  # _core.Graph
    fx_nodes: list[fx.Node]                       # core node id -> FX node
    input_paths: dict[int, list[ArgPath]]         # core node id -> FX arg path per core input
    tuple_items: dict[int, list[list[fx.Node]]]  # core node id -> getitem FX nodes per output
    value_of: dict[fx.Node, int] = field(default_factory=dict)  # FX node -> core value id
    seq_symbols: set = field(default_factory=set)


def _is_inplace(node: fx.Node) -> bool:
    """x.add_(y), torch.relu_(x), x += y, and functional ops called with inplace=True
    (F.relu(x, inplace=True), F.dropout(x, p, True, True)): they write into their first
    operand."""
    t = node.target
    if isinstance(t, str):
        return t.endswith("_") and not t.startswith("_")
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable
    name = getattr(t, "__name__", "")
    if getattr(t, "__module__", "") in ("_operator", "operator"):
        return name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                        "ixor", "ilshift", "irshift", "imatmul")
    if name.endswith("_") and not name.startswith("_"):
        return True
    if node.kwargs.get("inplace") is True:
        return True
    try:
        bound = inspect.signature(t).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a builtin without a signature, or not bindable
        return False
    return bound.arguments.get("inplace") is True


def _writes_statistics(node: fx.Node) -> bool:
    """A training ``batch_norm`` with running statistics: it writes them in place."""
    if "batch_norm" not in getattr(node.target, "__name__", ""):
        return False
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments
    except (TypeError, ValueError):
        return False
    return bound.get("training") is True and bound.get("running_mean") is not None


def _refuse_hidden_write(node: fx.Node) -> None:
    """Writes the plan would not see, so would drop with their unused results (silently
    wrong, found by breaker helper-40): a result written through ``out=``, and a training
    ``batch_norm`` called only to update its running statistics."""
    found = expected = ""
    if isinstance(node.kwargs.get("out"), (fx.Node, tuple, list)):
        found = "a result written through out="
        expected = ("the result assigned instead (buf.copy_(torch.mul(a, b)) is an in-place write, "
                    "which autosp keeps)")
    elif not node.users and _writes_statistics(node):
        found = "a training batch_norm whose result is unused (called for its running statistics)"
        expected = "its result used, as nn.BatchNorm uses it"
    if found:
        raise AutospError(f"[autosp:bridge] op '{_target_text(node)}' at {source_loc(node)}: found "
                          f"{found}, a write autosp's plan does not see and would drop; expected "
                          f"{expected}.")


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes into a tensor it reads: an in-place op (``_is_inplace``), an
    indexed assignment ``x[i] = v`` (``operator.setitem``, which canon reads as a
    ``masked_fill`` or keeps as it is), or a training ``batch_norm`` updating its running
    statistics."""
    return _is_inplace(node) or node.target is operator.setitem or _writes_statistics(node)


def _target_text(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return f"Tensor.{t}"
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", str(t))
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if mod.startswith("torch._C._nn") or mod == "torch.nn.functional":
        return f"torch.nn.functional.{name}"
    if mod.startswith("torch"):
        return f"torch.{name}"
    return f"{mod}.{name}" if mod else name


class _Converter:
    def __init__(self, gm: fx.GraphModule, seq_dim: int, example_inputs: list[Any]) -> None:
        self.gm = gm
        self.seq_dim = seq_dim
        self.example_inputs = example_inputs
        self.g = _core.Graph()
        self.res = BridgeResult(self.g, [], {}, {})
        self.shape_env = None

    # -- sizes ---------------------------------------------------------------------------
    def _expr(self, s: Any) -> Any:
        expr = s.node.expr
        if self.shape_env is not None:
            try:
                expr = self.shape_env.replace(expr)
            except Exception:  # older/newer ShapeEnv without replace(): use as is
                pass
        return expr

    def dim(self, s: Any) -> Any:
        if isinstance(s, int):
            return _core.Dim.constant(int(s))
        expr = self._expr(s)
        if expr.is_Integer:
            return _core.Dim.constant(int(expr))
        coef, rest = expr.as_coeff_Mul()
        if coef.is_Integer:
            if rest in self.res.seq_symbols:
                return _core.Dim.seq(int(coef), 1)
            if rest.is_Pow and rest.base in self.res.seq_symbols and rest.exp.is_Integer:
                return _core.Dim.seq(int(coef), int(rest.exp))
        if expr.is_Add and len(expr.free_symbols) == 1 and next(iter(expr.free_symbols)) in self.res.seq_symbols:
            # a*S + b with a | b: a*(S + b/a), what slicing a few positions off the sequence
            # leaves (S - 1; 2*S - 2 for [2, S-1] merged).
            s = next(iter(expr.free_symbols))
            a, b = expr.coeff(s, 1), expr.coeff(s, 0)
            if a.is_Integer and b.is_Integer and a > 0 and int(b) % int(a) == 0 and expr == a * s + b:
                return _core.Dim.seq(int(a), 1, int(b) // int(a))
        return _core.Dim.expr(str(expr))

    def value_for(self, ex: Any) -> Any:
        v = _core.Value()
        if isinstance(ex, torch.Tensor):
            v.kind = _core.ValueKind.Tensor
            v.shape = [self.dim(s) for s in ex.shape]
            v.dtype = _DTYPES.get(ex.dtype, str(ex.dtype).replace("torch.", ""))
            v.requires_grad = bool(ex.requires_grad)
        elif isinstance(ex, torch.SymInt):
            v.kind = _core.ValueKind.Symbol
        else:
            v.kind = _core.ValueKind.Other
        return v

    # -- driver --------------------------------------------------------------------------
    def run(self) -> BridgeResult:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self._find_seq_symbols(placeholders)
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and node.target is operator.getitem and self._is_tuple_item(node):
                continue  # an output of a multi-output node; mapped there
            with at_node("bridge", node):
                self.convert(node)
        return self.res

    def _find_seq_symbols(self, placeholders: list[fx.Node]) -> None:
        for n in placeholders:
            ex = _example(n)
            if isinstance(ex, torch.Tensor) and ex.dim() > self.seq_dim:
                if self.shape_env is None and isinstance(ex.shape[self.seq_dim], torch.SymInt):
                    self.shape_env = ex.shape[self.seq_dim].node.shape_env
                s = ex.shape[self.seq_dim]
                if isinstance(s, torch.SymInt):
                    expr = self._expr(s)
                    if expr.is_Symbol:
                        self.res.seq_symbols.add(expr)

    def _is_tuple_item(self, node: fx.Node) -> bool:
        src = node.args[0]
        return isinstance(src, fx.Node) and isinstance(_example(src), (tuple, list)) and src in self.tuple_nodes

    @property
    def tuple_nodes(self) -> set:
        if not hasattr(self, "_tuple_nodes"):
            self._tuple_nodes: set = set()
        return self._tuple_nodes

    def add_node(self, node: fx.Node, op: str, inputs: list[tuple[fx.Node | None, ArgPath]],
                 attrs: dict[str, Any]) -> None:
        core = _core.Node()
        core.op = op
        core.target = _target_text(node) if node.op in ("call_function", "call_method") else node.op
        core.inputs = [self.res.value_of[a] if a is not None else -1 for a, _ in inputs]
        core.attrs = attrs
        core.loc = source_loc(node)
        ex = _example(node)
        if ex is None and attrs.get("inplace") and inputs and inputs[0][0] is not None:
            # x[mask] = v (canon: an in-place masked_fill): returns None, writes x's shape
            ex = _example(inputs[0][0])
        outs: list[int] = []
        items: list[list[fx.Node]] = []
        if node.op == "output":
            pass
        elif isinstance(ex, (tuple, list)) and any(isinstance(e, torch.Tensor) for e in ex):
            self.tuple_nodes.add(node)
            users: dict[int, list[fx.Node]] = {}
            for u in node.users:  # Dynamo may read one item more than once (x = t[0]; y = t[0])
                if u.target is operator.getitem and isinstance(u.args[1], int):
                    users.setdefault(u.args[1], []).append(u)
            for i, e in enumerate(ex):
                vid = self.g.add_value(self.value_for(e))
                outs.append(vid)
                readers = users.get(i, [])
                items.append(readers)
                for user in readers:
                    self.res.value_of[user] = vid
        else:
            vid = self.g.add_value(self.value_for(ex))
            outs.append(vid)
            self.res.value_of[node] = vid
        core.outputs = outs
        idx = self.g.add_node(core)
        assert idx == len(self.res.fx_nodes)
        self.res.fx_nodes.append(node)
        self.res.input_paths[idx] = [p for _, p in inputs]
        if items:
            self.res.tuple_items[idx] = items

    def convert(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            ex = _example(node)
            idx = len(self.res.fx_nodes)
            role = "data"
            if idx < len(self.example_inputs):
                real = self.example_inputs[idx]
                if isinstance(real, torch.nn.Parameter):
                    role = "param"
                elif "_buffers_" in node.name:
                    role = "buffer"
            if "_parameters_" in node.name:
                role = "param"
            if not isinstance(ex, torch.Tensor):
                role = "symbol"
            attrs = {"role": role, "name": node.name}
            if role == "param":
                # The core buckets gradient all-reduces by layer (SpConfig.bucket_grad_sync).
                attrs["path"] = module_path(node)
            self.add_node(node, "input", [], attrs)
            return
        if node.op == "output":
            inputs = []
            for i, a in enumerate(_flatten_args(node.args[0], ("args", 0))):
                n, path = a
                if n in self.res.value_of and _is_tensor_node(n):
                    inputs.append((n, path))
            self.add_node(node, "output", inputs, {})
            return
        if node.op == "get_attr":
            self.add_node(node, "input", [], {"role": "const", "name": str(node.target)})
            return
        _refuse_hidden_write(node)
        op, inputs, attrs = canonicalize(node)
        inputs = [(n, p) for n, p in inputs if n is None or n in self.res.value_of]
        used = {n for n, _ in inputs}
        refs = [self.res.value_of[n] for n, _ in _tensor_inputs(node) if n not in used and n in self.res.value_of]
        if refs:
            attrs = dict(attrs, refs=refs)
        if _is_inplace(node):
            attrs = dict(attrs, inplace=True)
        operands = [*node.args, *(v for k, v in node.kwargs.items() if k != "alpha")]
        if any(isinstance(_example(a) if isinstance(a, fx.Node) else a,
                          (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(a, bool)
               for a in operands):
            # x + 1: the core must not add the scalar on every rank to a partial sum.
            attrs = dict(attrs, scalar_operand=True)
        if (is_pointwise(op) or op == "cross_entropy") and any(
                isinstance(a, fx.Node) and not _is_tensor_node(a) for a in operands):
            # x / s.shape[1], ignore_index=-n: a scalar computed in the graph, which the core
            # does not see as an operand (the tiled loss replays only constant ones).
            attrs = dict(attrs, scalar_from_graph=True)
        unbacked = _unbacked_symbols(node)
        if unbacked:
            # Sizes that depend on data (the count torch.where finds): a rank's count is not the
            # single device's, so the core refuses them where they would change values.
            attrs = dict(attrs, unbacked=",".join(unbacked))
        if is_pointwise(op) and op not in _REDUCTIONS:
            # The core's elementwise rule takes it. Torch tags ops per overload and the bridge
            # sees packets: max(x, dim) is a reduction though max(x, y) is pointwise.
            attrs = dict(attrs, pointwise=True)
        self.add_node(node, op, inputs, attrs)
        if _is_inplace(node) and _is_tensor_node(node.args[0]) and node in self.res.value_of:
            # x.add_(y): later uses of x read the mutated value, i.e. this node's result.
            self.res.value_of[node.args[0]] = self.res.value_of[node]


def _unbacked_symbols(node: fx.Node) -> list[str]:
    """The data-dependent (unbacked) symbols among ``node``'s scalar arguments, sorted."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found: set[str] = set()
    for a in (*node.args, *node.kwargs.values()):
        for item in (a if isinstance(a, (list, tuple)) else (a,)):
            ex = _example(item) if isinstance(item, fx.Node) else item
            if isinstance(ex, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                found.update(str(s) for s in free_unbacked_symbols(ex))
    return sorted(found)


def fx_to_core(gm: fx.GraphModule, example_inputs: list[Any], seq_dim: int = 1) -> BridgeResult:
    """Translate a Dynamo FX graph into the core IR."""
    conv = _Converter(gm, seq_dim, example_inputs)
    result = conv.run()
    if not result.seq_symbols:
        static = [(input_name(n), _example(n).shape[seq_dim]) for n in gm.graph.nodes
                  if n.op == "placeholder" and isinstance(_example(n), torch.Tensor)
                  and _example(n).dim() > seq_dim and not _example(n).is_floating_point()]
        found = (f"found the inputs {', '.join(f'{name} (length {size})' for name, size in static)} "
                 f"with a fixed length in dim {seq_dim}" if static else
                 f"found no input with a symbolic sequence length in dim {seq_dim}")
        why = (" autosp.compile marks that dim dynamic, so Dynamo fixed it while tracing the model: "
               "the model uses the length where only one value fits, typically an op that needs it "
               "equal to a model dimension (a matmul contracting the sequence with a weight, a "
               "reshape to a fixed size, a buffer of that length). Make that op independent of "
               "the length, or report it if it is a torch op; a sequence length that equals no "
               "model dimension shows whether a coincidence of sizes is the cause."
               if static else
               " autosp.compile marks it dynamic for you; if you call torch.compile with "
               "autosp.backend directly, call torch._dynamo.mark_dynamic(input_ids, seq_dim) first.")
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        where = where_size_fixed(inputs, seq_dim) if static else ""
        at = f" Dynamo fixed it at {where}." if where else ""
        raise AutospError(
            f"[autosp:bridge] {found}; expected token ids (or embeddings) whose dim {seq_dim} is "
            f"the sequence, with a length that can vary.{at}{why}"
        )
    return result
