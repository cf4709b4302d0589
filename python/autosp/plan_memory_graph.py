"""The joint forward+backward graph of a traced training step as the core's MemoryGraph: each
value's bytes per rank as a closed form in S (``sum(coef * S^power / shard)``), each op's FLOPs
fitted from its sizes, and each node's decoder layer (for replicating layers in the core).
Used by ``autosp.plan_trace``."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from autosp import _core, tiled_loss, tiled_rows
from autosp.errors import AutospError
from autosp.remat_facts import _COLLECTIVE_NAMESPACES, aliased_arg, layer_of_path


class _OneSequence:
    """A shape env whose ``replace`` also writes every symbol of ``seqs`` as the first one."""

    def __init__(self, shape_env: Any, seqs: list) -> None:
        self._env = shape_env
        self.seq = seqs[0]
        self._same = {s: self.seq for s in seqs[1:]}

    def replace(self, expr: Any) -> Any:
        return self._env.replace(expr).xreplace(self._same)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def _seq_symbols(joint: Any, shape_env: Any) -> set:
    import torch

    symbols: set = set()
    for n in joint.graph.nodes:
        if n.op != "placeholder" or not n.name.startswith("primals"):
            continue
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            for s in val.shape:
                if isinstance(s, torch.SymInt):
                    symbols |= _canonical(s, shape_env).free_symbols
    return symbols


def _canonical(s: Any, shape_env: Any) -> Any:
    import sympy
    import torch

    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        if shape_env is not None:
            expr = shape_env.replace(expr)
        return expr
    return sympy.Integer(int(s))


def _to_seq_bytes(expr: Any, seq: Any) -> Any:
    """A sympy polynomial in the sequence symbol (floor divisions by the SP degree are exact
    for S a multiple of it) as a core SeqBytes."""
    import sympy
    from torch.utils._sympy.functions import CeilDiv, FloorDiv

    expr = expr.replace(FloorDiv, lambda a, b: a / b).replace(CeilDiv, lambda a, b: a / b)
    expr = sympy.expand(expr)
    if expr.free_symbols - {seq}:
        raise AutospError(
            f"[plan] found a size {expr} with symbols other than the sequence length {seq}; "
            "expected sizes that depend on S only"
        )
    poly = sympy.Poly(expr, seq) if expr.free_symbols else None
    terms = []
    if poly is None:
        value = sympy.Rational(expr)
        terms.append(_core.SeqTerm(int(value.p), 0, int(value.q)))
    else:
        for (power,), coef in poly.terms():
            coef = sympy.Rational(coef)
            terms.append(_core.SeqTerm(int(coef.p), int(power), int(coef.q)))
    return _core.SeqBytes(terms)


def _tensor_bytes_expr(val: Any, shape_env: Any) -> Any:
    import sympy
    import torch

    if isinstance(val, torch.Tensor):
        numel = sympy.Integer(1)
        for s in val.shape:
            numel *= _canonical(s, shape_env)
        return numel * val.dtype.itemsize
    return sympy.Integer(0)


def _value_bytes_expr(val: Any, shape_env: Any) -> Any:
    """PyTorch's _size_of as an expression (what remat._node_bytes evaluates at the hint)."""
    import sympy
    import torch

    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return sympy.Integer(1)
    if isinstance(val, (list, tuple)):
        return sum((_tensor_bytes_expr(v, shape_env) for v in val), sympy.Integer(0))
    if isinstance(val, dict):
        return sum((_tensor_bytes_expr(v, shape_env) for v in val.values()), sympy.Integer(0))
    return _tensor_bytes_expr(val, shape_env)


def _size_at(seq_value: int, seq_symbol: Any, shape_env: Any) -> Any:
    """A size function for remat.node_flops that evaluates symbolic sizes at S = seq_value
    instead of the trace's hint, so the partitioner's own FLOP formulas give FLOPs at any S."""
    import torch

    def size(x: Any) -> int:
        if isinstance(x, torch.SymInt):
            return int(_canonical(x, shape_env).subs(seq_symbol, seq_value))
        return int(x)

    return size


def _fit_flops(values: dict[int, float]) -> Any:
    """coef * S^power through FLOPs measured at S, 2S and 4S."""
    (s1, f1), (s2, f2), (s4, f4) = sorted(values.items())
    if f1 == 0.0:
        return _core.SeqFlops(0.0, 0)
    power = int(round(math.log2(f2 / f1))) if f2 > 0 else 0
    coef = f1 / float(s1) ** power
    if not math.isclose(coef * float(s4) ** power, f4, rel_tol=1e-6):
        raise AssertionError(f"FLOPs {values} are not a monomial in S")
    return _core.SeqFlops(coef, power)


def _layer_index(path: str) -> int:
    """The decoder layer a dotted module or parameter path lies in (``layers.3.mlp`` -> 3),
    or NO_LAYER (``lm_head``)."""

    last = layer_of_path(path).rpartition(".")[2]
    return int(last) if last.isdigit() else _core.NO_LAYER


def _layer_seed(node: Any) -> int:
    """The layer of a forward node from its module stack, or of a backward node from the
    module stack of the forward op it differentiates (AOTAutograd's fwd_nn_module_stack);
    LAYER_UNKNOWN for ops autosp or AOTAutograd inserted."""
    from autosp.fx_source import dotted_path

    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return _core.LAYER_UNKNOWN
    return _layer_index(dotted_path(str(list(stack.values())[-1][0])))


def _graph_device(nodes: list[Any]) -> str:
    """``"cuda"`` when a tensor of the graph is on a CUDA device, else ``"cpu"``."""
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type == "cuda":
            return "cuda"
    return "cpu"


def _memory_graph(
    joint: Any, node_info: Any, num_fwd_outputs: int, shape_env: Any, param_primals: dict[int, str],
    *, device: str | None = None,
) -> Any:
    """The core's MemoryGraph of a captured joint graph. ``device``: where it will run
    (``"cpu"``/``"cuda"``); by default the device of the graph's tensors. On ``"cuda"`` the
    CUDA kernels' scratch tensors (autosp.cuda_kernels) are counted."""
    from autosp import cuda_kernels, remat

    nodes, facts = remat.gather_facts(joint.graph, node_info)
    index = {n: i for i, n in enumerate(nodes)}
    seqs = _seq_symbols(joint, shape_env)
    hints = getattr(shape_env, "backed_var_to_val", None) or getattr(shape_env, "var_to_val", {})
    values = {int(hints[s]) if s in hints else None for s in seqs}
    if len(seqs) > 1 and len(values) == 1 and None not in values:
        # Inputs marked along the sequence, each with its own symbol (token ids and an
        # attention mask): autosp.compile marks only dims of the call's sequence length, so
        # they are one S.
        shape_env = _OneSequence(shape_env, sorted(seqs, key=str))
        seqs = {shape_env.seq}
    if len(seqs) != 1:
        raise AutospError(
            f"[plan] found {len(seqs)} sequence lengths in the traced inputs "
            f"(sizes {sorted(values, key=str)}); expected one, the sequence length S of every "
            "input marked along it"
        )
    (seq,) = seqs
    hint = int(hints[seq]) if seq in hints else None

    output = next(n for n in joint.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    fwd_outputs = {o for o in outs[:num_fwd_outputs] if isinstance(o, torch.fx.Node)}
    grads = {o for o in outs[num_fwd_outputs:] if isinstance(o, torch.fx.Node)}
    static = set(node_info.static_lifetime_input_nodes)
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    primal_index = {n: i for i, n in enumerate(primals)}
    # Layer seeds for replicating layers (csrc/plan/layers.h): parameters and their gradients
    # by the parameter's name, other ops by their module.
    layer_seed = {n: _layer_seed(n) for n in nodes}
    for n in nodes:
        if n.op == "placeholder":
            name = param_primals.get(primal_index.get(n, -1))
            layer_seed[n] = _core.NO_LAYER if name is None else _layer_index(name)
    grad_outs = outs[num_fwd_outputs:]
    if len(grad_outs) == len(primals):
        for primal, g in zip(primals, grad_outs):
            if isinstance(g, torch.fx.Node) and layer_seed.get(g) == _core.LAYER_UNKNOWN:
                layer_seed[g] = layer_seed[primal]

    probe = [1 << 12, 1 << 13, 1 << 14]
    flops_at: dict[int, list[float]] = {}
    for s in probe:
        size = _size_at(s, seq, shape_env)
        flops_at[s] = [remat.node_flops(n, f.kind, f.target, size) for n, f in zip(nodes, facts)]

    if device is None:
        device = _graph_device(nodes)
    cuda_scratch = cuda_kernels.OUTPUT_SIZED_SCRATCH if device == "cuda" else {}
    mem_nodes = []
    for i, (n, f) in enumerate(zip(nodes, facts)):
        m = _core.MemoryNode()
        val = n.meta.get("val")
        save_bytes = _to_seq_bytes(_value_bytes_expr(val, shape_env), seq)
        if hint is not None and save_bytes.at(hint) != f.bytes:
            raise AssertionError(f"{n.name}: {save_bytes} at S={hint} != remat bytes {f.bytes}")
        m.save_bytes = save_bytes
        m.flops = _fit_flops({s: flops_at[s][i] for s in probe})
        if share := tiled_loss.recomputed_share(n) or tiled_rows.recomputed_share(n):
            m.inner_recompute_flops = _fit_flops({s: share * flops_at[s][i] for s in probe})
        if n.op == "placeholder":
            # Parameters: static-lifetime inputs, or (where the SP rewrite dropped Dynamo's
            # static-input metadata) the primals whose example input is an nn.Parameter.
            is_param = n in static or primal_index.get(n, -1) in param_primals
            if is_param:
                m.role = _core.MemoryRole.PARAMETER
            elif n.name.startswith("tangents"):
                m.role = _core.MemoryRole.TANGENT
            else:
                m.role = _core.MemoryRole.INPUT
            m.alloc_bytes = _to_seq_bytes(_tensor_bytes_expr(val, shape_env), seq)
        else:
            m.role = _core.MemoryRole.COMPUTE
            if n.target is operator.getitem:
                parent = n.args[0]
                base = aliased_arg(parent) if isinstance(parent, torch.fx.Node) else None
                if base is not None and base in index:
                    m.alias_of = index[base]
                else:
                    m.alloc_bytes = _to_seq_bytes(_tensor_bytes_expr(val, shape_env), seq)
            elif isinstance(val, (list, tuple)):
                # A multi-output op: each output used through a getitem is allocated there;
                # the unused ones live only while the op runs.
                if aliased_arg(n) is None:
                    used = {u.args[1] for u in n.users if u.target is operator.getitem}
                    unused = [v for k, v in enumerate(val) if k not in used]
                    m.scratch_bytes = _to_seq_bytes(_value_bytes_expr(unused, shape_env), seq)
            else:
                base = aliased_arg(n)
                if base is not None and base in index:
                    m.alias_of = index[base]
                else:
                    m.alloc_bytes = _to_seq_bytes(_tensor_bytes_expr(val, shape_env), seq)
            work = tiled_loss.workspace(n)
            if work is not None:
                per_row, cap, constant, chunks = work
                h = tiled_loss.h_node(n)
                rows = math.prod(_canonical(d, shape_env) for d in h.meta["val"].shape[:-1])
                whole = _to_seq_bytes(rows * per_row, seq)
                terms = list(m.scratch_bytes.terms)
                if chunks:  # split over the chunks (MemoryOptions.loss_chunks may change them)
                    m.chunked_bytes, m.chunks = whole, chunks
                else:
                    for t in whole.terms:
                        t.cap = cap  # a fixed number of rows per chunk: one chunk at a time
                        terms.append(t)
                m.scratch_bytes = _core.SeqBytes(terms + [_core.SeqTerm(constant, 0, 1)])
            block = tiled_rows.workspace(n)
            if block is not None:
                w, first, dim = block
                tokens = math.prod(_canonical(d, shape_env) for d in first.meta["val"].shape[:dim + 1])
                terms = list(m.scratch_bytes.terms)
                terms += list(_to_seq_bytes(tokens * w.per_row, seq).terms)
                for t in _to_seq_bytes(tokens * w.capped_per_row, seq).terms:
                    t.cap = w.cap
                    terms.append(t)
                m.scratch_bytes = _core.SeqBytes(terms + [_core.SeqTerm(w.constant, 0, 1)])
            if copies := cuda_scratch.get(f.target):
                terms = list(m.scratch_bytes.terms)
                out = _to_seq_bytes(_tensor_bytes_expr(val, shape_env), seq)
                m.scratch_bytes = _core.SeqBytes(terms + list(out.terms) * copies)
            target = n.target
            if (
                isinstance(target, torch._ops.OpOverload)
                and target.namespace in _COLLECTIVE_NAMESPACES
                and "wait_tensor" not in target.name()
            ):
                m.collective = True
        m.gradient = n in grads
        m.forward_output = n in fwd_outputs
        m.facts = f
        m.layer = layer_seed[n]
        mem_nodes.append(m)
    return _core.MemoryGraph(mem_nodes)
