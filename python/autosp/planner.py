"""``autosp plan``: predicted peak memory per rank and the longest trainable sequence.

    result = autosp.planner.plan("llama-3.1-8b", gpus=8, gpu_memory="80GB", sp=8)
    print(result.table())

How it works. The model is built under ``FakeTensorMode`` (no weights, no GPU) and traced
once, with the sequence length S dynamic, through the same pipeline ``autosp.compile`` uses:
Dynamo -> the bridge -> ``plan_ulysses`` -> the plan applied to the FX graph (collectives
traced against a fake process group of size P) -> AOTAutograd's joint forward+backward graph.
Every value of that joint graph has a shape symbolic in S, so its bytes per rank are a closed
form ``sum(coef * S^power / shard)``; the remat solver's facts (bytes, FLOPs, forward/backward
membership) are gathered exactly as autosp's partition function gathers them. A model deeper
than three decoder layers is traced with three and the core builds the rest
(``csrc/plan/layers.h``: copies of the middle layer, node for node what a full trace gives),
so planning takes seconds whatever the depth. The C++ core
(``csrc/plan/memory.h``) then evaluates that graph at any S: it decides the saved set with the
remat solver for the strategy, walks the schedule's liveness, and returns the peak with its
breakdown; the longest trainable S is a search in the core. See docs/plan.md for the model's
assumptions and what it leaves out.

Strategies: ``no-sp`` (P = 1, each GPU trains whole sequences; the GPUs are data parallel) and
``ulysses`` (P = sp), each with remat ``none`` / ``default`` / ``sequence-aware`` / ``full``
(checkpoint every decoder layer: save only its input).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import operator
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from autosp import _core
from autosp.errors import AutospError
from autosp.models.llama import LlamaConfig

__all__ = [
    "PRESETS",
    "REMAT_STRATEGIES",
    "MemoryPrediction",
    "PlanResult",
    "StrategyPlan",
    "TracedStep",
    "load_model_config",
    "main",
    "parse_bytes",
    "plan",
    "trace_step",
]

#: Published configurations (Hugging Face config.json of each model).
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-3.2-3b": LlamaConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
        num_heads=24, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "llama-2-13b": LlamaConfig(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
        num_heads=40, num_kv_heads=40, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}

REMAT_STRATEGIES = ("none", "default", "sequence-aware", "full")
SP_MODES = ("no-sp", "ulysses")
DTYPES = ("bf16", "fp32")
OPTIMIZER_SHARDING = ("none", "dp", "world")

_STRATEGY_ENUM = {
    "none": "NONE",
    "default": "DEFAULT",
    "sequence-aware": "SEQUENCE_AWARE",
    "full": "FULL_CHECKPOINT",
}

# --------------------------------------------------------------------------------------------
# Inputs


def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` -> 80 GiB. GPU vendors' "GB" are binary (an A100 80GB has 81920 MiB), so
    GB/GiB, MB/MiB, TB/TiB and KB/KiB are all powers of 1024; a bare number is bytes."""
    if isinstance(text, bool):
        raise AutospError(f"[plan] found GPU memory {text!r}; expected a size such as '80GB'")
    if isinstance(text, (int, float)):
        if text <= 0:
            raise AutospError(f"[plan] found GPU memory {text!r}; expected a positive size")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise AutospError(
            f"[plan] found GPU memory {text!r}; expected a positive size such as '80GB', "
            "'96GiB' or a number of bytes"
        )
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def _config_from_hf(data: dict[str, Any], where: str) -> LlamaConfig:
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in data]
    if missing:
        raise AutospError(
            f"[plan] config {where} lacks {', '.join(missing)}; expected a Llama-style Hugging "
            f"Face config.json with {', '.join(required)}"
        )
    model_type = data.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise AutospError(
            f"[plan] config {where} has model_type {model_type!r}; expected 'llama' (the planner "
            "traces autosp.models.llama, a Llama-architecture decoder)"
        )
    try:
        return LlamaConfig(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=int(data["num_attention_heads"]),
            num_kv_heads=int(data.get("num_key_value_heads") or data["num_attention_heads"]),
            rope_theta=float(data.get("rope_theta", 10000.0)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )
    except (TypeError, ValueError) as e:
        raise AutospError(f"[plan] config {where} is not a valid Llama configuration: {e}") from None


def load_model_config(model: str | LlamaConfig) -> tuple[str, LlamaConfig]:
    """``(name, config)`` for a preset name (case-insensitive), a path to a Hugging Face
    config.json (or a directory holding one), or a LlamaConfig."""
    if isinstance(model, LlamaConfig):
        return "custom", model
    key = str(model).strip().lower()
    if key in PRESETS:
        return key, PRESETS[key]
    path = Path(str(model)).expanduser()
    looks_like_path = path.suffix == ".json" or "/" in str(model) or path.exists()
    if not looks_like_path:
        raise AutospError(
            f"[plan] unknown model {model!r}; expected a preset ({', '.join(PRESETS)}) or a path "
            "to a Hugging Face config.json"
        )
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise AutospError(
            f"[plan] cannot read config {str(path)!r}: {e.strerror if isinstance(e, OSError) else e}; "
            "expected a readable Hugging Face config.json"
        ) from None
    except json.JSONDecodeError as e:
        raise AutospError(
            f"[plan] config {str(path)!r} is not valid JSON ({e}); expected a Hugging Face "
            "config.json"
        ) from None
    if not isinstance(data, dict):
        raise AutospError(
            f"[plan] config {str(path)!r} holds a {type(data).__name__}; expected a JSON object"
        )
    return path.parent.name or path.stem, _config_from_hf(data, repr(str(path)))


# --------------------------------------------------------------------------------------------
# Tracing: one joint graph per (model, P, dtype, batch), sizes symbolic in S


@dataclass
class TracedStep:
    """The joint forward+backward graph of one training step for one rank, as the core's
    MemoryGraph (sizes as functions of S), with what the trace found."""

    graph: Any  # _core.MemoryGraph
    num_params: int
    sp_size: int
    trace_seq: int
    seconds: float
    traced_layers: int = 0  # decoder layers traced
    replicated: bool = False  # the other layers are copies of a traced one (plan/layers.h)


class _Captured(Exception):
    """Raised by the capturing partition function once the joint graph is recorded: nothing
    is compiled or run."""


_FAKE_GROUPS: dict[int, tuple[str, Any]] = {}  # world -> (name, the group: kept alive here)


def _fake_sp_group(world: int) -> str:
    """The name of a registered fake process group of `world` ranks (this process is rank 0):
    functional collectives trace against it, and it never communicates. It is registered by
    name only, so an initialised torch.distributed (or none) is left alone."""
    import torch
    import torch.distributed as dist
    import torch._C._distributed_c10d as c10d

    if world in _FAKE_GROUPS:
        # dist.destroy_process_group() unregisters every named group, this one included.
        try:
            c10d._resolve_process_group(_FAKE_GROUPS[world][0])
            return _FAKE_GROUPS[world][0]
        except RuntimeError:
            del _FAKE_GROUPS[world]

    name = f"autosp-plan-fake-sp{world}"
    backend = c10d.FakeProcessGroup._create_internal(0, world)
    pg = c10d.ProcessGroup(dist.HashStore(), 0, world)
    pg._set_default_backend(c10d.ProcessGroup.BackendType.CUSTOM)
    for device in ("cpu", "cuda", "meta"):
        pg._register_backend(torch.device(device), c10d.ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_group_name(name)
    c10d._register_process_group(name, pg)
    _FAKE_GROUPS[world] = (name, pg)
    return name


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


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


def _aliased_arg(node: Any) -> Any:
    """The input node whose storage `node`'s output shares, or None."""
    import torch
    import torch.fx as fx

    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace in _COLLECTIVE_NAMESPACES and "wait_tensor" in target.name():
        return node.args[0]
    if target is torch.ops.aten._unsafe_view.default:  # a view of a fresh clone
        return node.args[0]
    schema = target._schema
    sets = set()
    for ret in schema.returns:
        if ret.alias_info is not None:
            sets |= set(ret.alias_info.before_set)
    if not sets:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not (set(arg.alias_info.before_set) & sets):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            return value
    return None


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
    from autosp.remat import layer_of_path

    last = layer_of_path(path).rpartition(".")[2]
    return int(last) if last.isdigit() else _core.NO_LAYER


def _layer_seed(node: Any) -> int:
    """The layer of a forward node from its module stack, or of a backward node from the
    module stack of the forward op it differentiates (AOTAutograd's fwd_nn_module_stack);
    LAYER_UNKNOWN for ops autosp or AOTAutograd inserted."""
    from autosp.bridge import dotted_path

    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return _core.LAYER_UNKNOWN
    return _layer_index(dotted_path(str(list(stack.values())[-1][0])))


def _memory_graph(
    joint: Any, node_info: Any, num_fwd_outputs: int, shape_env: Any, param_primals: dict[int, str]
) -> Any:
    from autosp import remat

    nodes, facts = remat.gather_facts(joint.graph, node_info)
    index = {n: i for i, n in enumerate(nodes)}
    seqs = _seq_symbols(joint, shape_env)
    if len(seqs) != 1:
        raise AutospError(
            f"[plan] found {len(seqs)} symbolic sizes ({sorted(map(str, seqs))}) in the traced "
            "inputs; expected exactly one, the sequence length"
        )
    (seq,) = seqs
    hints = getattr(shape_env, "backed_var_to_val", None) or getattr(shape_env, "var_to_val", {})
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

    mem_nodes = []
    for i, (n, f) in enumerate(zip(nodes, facts)):
        m = _core.MemoryNode()
        val = n.meta.get("val")
        save_bytes = _to_seq_bytes(_value_bytes_expr(val, shape_env), seq)
        if hint is not None and save_bytes.at(hint) != f.bytes:
            raise AssertionError(f"{n.name}: {save_bytes} at S={hint} != remat bytes {f.bytes}")
        m.save_bytes = save_bytes
        m.flops = _fit_flops({s: flops_at[s][i] for s in probe})
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
                base = _aliased_arg(parent) if isinstance(parent, torch.fx.Node) else None
                if base is not None and base in index:
                    m.alias_of = index[base]
                else:
                    m.alloc_bytes = _to_seq_bytes(_tensor_bytes_expr(val, shape_env), seq)
            elif isinstance(val, (list, tuple)):
                # A multi-output op: each output used through a getitem is allocated there;
                # the unused ones live only while the op runs.
                if _aliased_arg(n) is None:
                    used = {u.args[1] for u in n.users if u.target is operator.getitem}
                    unused = [v for k, v in enumerate(val) if k not in used]
                    m.scratch_bytes = _to_seq_bytes(_value_bytes_expr(unused, shape_env), seq)
            else:
                base = _aliased_arg(n)
                if base is not None and base in index:
                    m.alias_of = index[base]
                else:
                    m.alloc_bytes = _to_seq_bytes(_tensor_bytes_expr(val, shape_env), seq)
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


class _RotaryInDtype(torch.nn.Module):
    """The model's rotary embedding with its tables cast to the activations' dtype."""

    def __init__(self, rotary: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.rotary = rotary
        self.dtype = dtype

    def forward(self, position_ids: torch.Tensor,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # The model asks for its activations' dtype; the planner's dtype is that one.
        cos, sin = self.rotary(position_ids)
        return cos.to(self.dtype), sin.to(self.dtype)


def _build_fake_model(config: LlamaConfig, dtype: str, batch_size: int, seq: int) -> tuple:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autosp.models.llama import LlamaForCausalLM

    mode = FakeTensorMode()
    previous = torch.get_default_dtype()
    # Parameters are created in the training dtype (fake tensors cannot be converted in place).
    torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)
    try:
        with mode:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if dtype == "bf16":
        # The reference model computes its RoPE tables in fp32, which would promote q and k
        # (and SDPA's inputs) to fp32 in a bf16 model; Hugging Face's Llama casts them to the
        # activations' dtype, and so does the traced model.
        model.rotary = _RotaryInDtype(model.rotary, torch.bfloat16)
    with mode:
        ids = torch.zeros(batch_size, seq, dtype=torch.long)
        labels = torch.zeros(batch_size, seq, dtype=torch.long)
    return model, ids, labels


def capture_joint(
    model: Any, args: Sequence[Any], *, sp_size: int, group: str | None = None
) -> tuple[Any, Any, int, Any, set[int]]:
    """Traces `model(*args)` as autosp.compile would (Ulysses plan for `sp_size` ranks when
    sp_size > 1) up to AOTAutograd's prepared joint graph, and returns
    ``(joint_module, node_info, num_fwd_outputs, shape_env, param_primals)`` (the indices of
    the primal inputs that are parameters, with their names) without compiling or running it.
    Mark the inputs' sequence dim dynamic first."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch import partitioners

    from autosp import remat
    from autosp.apply import RankContext, apply_plan
    from autosp.bridge import fx_to_core

    captured: dict[str, Any] = {}

    def partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        # autosp's own partition function prepares the joint graph (DCE, CSE, forced saves)
        # in place; the facts are then gathered from exactly what it solved on.
        remat.make_partition_fn("none")(joint, joint_inputs, **kwargs)
        static = kwargs.get("static_lifetime_input_indices") or []
        captured["joint"] = joint
        captured["node_info"] = partitioners.classify_nodes(
            joint, static, kwargs["num_fwd_outputs"]
        )
        captured["num_fwd_outputs"] = kwargs["num_fwd_outputs"]
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode(joint_inputs)
        captured["shape_env"] = fake_mode.shape_env if fake_mode is not None else None
        raise _Captured()

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        names = {id(p): name for name, p in model.named_parameters()}
        captured["param_primals"] = {
            i: names.get(id(x), "")
            for i, x in enumerate(example_inputs)
            if isinstance(x, torch.nn.Parameter)
        }
        if sp_size > 1:
            bridge = fx_to_core(gm, list(example_inputs), 1)
            cfg = _core.SpConfig()
            cfg.sp_size = sp_size
            try:
                sp_plan = _core.plan_ulysses(bridge.graph, cfg)
            except _core.PlanError as e:
                raise AutospError(str(e)) from None
            ctx = RankContext(rank=0, world=sp_size, group=group or _fake_sp_group(sp_size))
            gm = apply_plan(gm, bridge, sp_plan, ctx)
        return aot_autograd(
            fw_compiler=boxed_nop,
            bw_compiler=boxed_nop,
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    try:
        compiled(*args)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, AutospError):
            raise inner.with_traceback(None) from None
        if not isinstance(inner, _Captured):
            raise
    if "joint" not in captured:
        raise AutospError("[plan] the model's training step did not reach AOTAutograd")
    return (captured["joint"], captured["node_info"], captured["num_fwd_outputs"],
            captured["shape_env"], captured["param_primals"])


_TRACE_CACHE: dict[tuple, TracedStep] = {}
# Core objects must not outlive the extension module at interpreter exit.
atexit.register(_TRACE_CACHE.clear)

#: Decoder layers traced when a model has more: the rest are copies of the middle one
#: (csrc/plan/layers.h). Three is the fewest with a layer between two others.
TRACED_LAYERS = 3


def trace_step(
    config: LlamaConfig,
    *,
    sp_size: int,
    dtype: str = "bf16",
    batch_size: int = 1,
    replicate: bool = True,
) -> TracedStep:
    """Traces one training step of `config` for one rank of an SP group of `sp_size` on fake
    tensors (no memory) and returns its MemoryGraph. Cached per process.

    With ``replicate`` (the default), a model of more than :data:`TRACED_LAYERS` decoder layers
    is traced with that many and the core inserts copies of a middle layer up to
    ``config.num_layers``: the same graph a full trace gives (tests/test_planner.py checks the
    predictions are equal), in seconds instead of minutes. If the trace does not have the
    structure replication needs, all layers are traced (``TracedStep.replicated`` says which).
    """
    key = (config, sp_size, dtype, batch_size, replicate)
    if key in _TRACE_CACHE:
        return _TRACE_CACHE[key]
    import dataclasses

    import torch

    start = time.perf_counter()
    layers = config.num_layers
    traced_config = config
    if replicate and layers > TRACED_LAYERS:
        traced_config = dataclasses.replace(config, num_layers=TRACED_LAYERS)
    trace_seq = 16 * sp_size
    model, ids, labels = _build_fake_model(traced_config, dtype, batch_size, trace_seq)
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(labels, 1)
    captured = capture_joint(model, (ids, labels), sp_size=sp_size)
    graph = _memory_graph(*captured)
    num_params = sum(p.numel() for p in model.parameters())
    fallback = None
    if traced_config is not config:
        per_layer = sum(p.numel() for p in model.layers[1].parameters())
        num_params += (layers - TRACED_LAYERS) * per_layer
        try:
            graph = _core.replicate_layers(graph, layers)
        except ValueError as e:
            fallback = str(e)
    if fallback is not None:
        import warnings

        warnings.warn(
            f"autosp plan: {fallback}; tracing all {layers} layers instead (slower)", stacklevel=2
        )
        traced = trace_step(config, sp_size=sp_size, dtype=dtype, batch_size=batch_size,
                            replicate=False)
    else:
        traced = TracedStep(graph, num_params, sp_size, trace_seq, time.perf_counter() - start,
                            traced_layers=traced_config.num_layers,
                            replicated=traced_config is not config)
    _TRACE_CACHE[key] = traced
    return traced


# --------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes per rank at the peak of one training step at ``seq_len``."""

    seq_len: int
    peak: int
    parameters: int
    gradients: int
    optimizer_state: int
    saved_activations: int
    transient: int
    communication: int
    inputs: int
    phase: str
    peak_node: str
    saved_bytes: int  # the whole saved set (distinct storages), parameters excluded

    @staticmethod
    def from_core(b: Any) -> "MemoryPrediction":
        return MemoryPrediction(
            seq_len=b.seq_len, peak=b.peak, parameters=b.parameters, gradients=b.gradients,
            optimizer_state=b.optimizer_state, saved_activations=b.saved_activations,
            transient=b.transient, communication=b.communication, inputs=b.inputs,
            phase=b.phase, peak_node=b.peak_node, saved_bytes=b.saved_bytes,
        )


@dataclass(frozen=True)
class StrategyPlan:
    name: str  # "ulysses + sequence-aware"
    sp_mode: str  # "no-sp" | "ulysses"
    remat: str
    sp_size: int
    dp_size: int
    longest_seq: int  # 0: does not fit at the smallest S searched
    capped: bool  # the search reached max_seq
    at_longest: MemoryPrediction | None
    at_seq: MemoryPrediction | None  # at PlanResult.seq_len
    curve: tuple[tuple[int, int], ...]  # (S, predicted peak)


@dataclass(frozen=True)
class PlanResult:
    model: str
    config: LlamaConfig
    gpus: int
    sp: int
    gpu_memory: int
    dtype: str
    batch_size: int
    optimizer_sharding: str
    seq_multiple: int
    seq_len: int
    strategies: tuple[StrategyPlan, ...]
    num_params: int
    trace_seconds: float
    plot: str | None = None

    def strategy(self, name: str) -> StrategyPlan:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(f"no strategy {name!r}; have {[s.name for s in self.strategies]}")

    def table(self) -> str:
        gib = float(1 << 30)
        lines = [
            f"autosp plan (prediction): {self.model}, {self.num_params / 1e9:.2f}B parameters, "
            f"{self.gpus} GPUs x {self.gpu_memory / gib:.0f} GiB, dtype {self.dtype}, "
            f"batch {self.batch_size}, optimizer state sharded over {self.optimizer_sharding}",
            f"peak and breakdown at S = {self.seq_len} (GiB per rank): params, grads, optimizer "
            "state, saved activations, transient, communication",
            f"{'strategy':<28} {'mesh dp x sp':>12} {'longest S':>10} {'peak':>8} "
            f"{'params':>7} {'grads':>7} {'optim':>7} {'saved':>7} {'trans':>7} {'comm':>6}  "
            "peak during",
        ]
        for s in self.strategies:
            longest = "none" if s.longest_seq == 0 else (
                f">={s.longest_seq}" if s.capped else str(s.longest_seq))
            b = s.at_seq
            if b is None:
                detail = "   (S not a multiple of this strategy's SP degree)"
            else:
                oom = "*" if b.peak > self.gpu_memory else " "
                detail = (
                    f"{b.peak / gib:>7.2f}{oom} {b.parameters / gib:>6.2f} {b.gradients / gib:>7.2f} "
                    f"{b.optimizer_state / gib:>7.2f} {b.saved_activations / gib:>7.2f} "
                    f"{b.transient / gib:>7.2f} {b.communication / gib:>6.2f}  "
                    f"{b.phase} ({b.peak_node})"
                )
            lines.append(
                f"{s.name:<28} {f'{s.dp_size} x {s.sp_size}':>12} {longest:>10} {detail}"
            )
        lines.append("* over the budget. Longest S is searched over multiples of "
                     f"{self.seq_multiple}.")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = asdict(self.config)
        return d


def _core_options(remat: str, dtype: str, num_params: int, shards: int) -> Any:
    options = _core.MemoryOptions()
    options.strategy = getattr(_core.RematStrategy, _STRATEGY_ENUM[remat])
    from autosp.remat import DEFAULT_RECOMPUTE_FLOPS_RATIO

    options.recompute_flops_ratio = DEFAULT_RECOMPUTE_FLOPS_RATIO
    training = _core.TrainingConfig()
    training.num_params = num_params
    training.dtype = _core.DtypePolicy.BF16_MIXED if dtype == "bf16" else _core.DtypePolicy.FP32
    training.optimizer_shards = shards
    options.training = training
    return options


def _parse_strategies(strategies: Sequence[str] | None) -> list[tuple[str, str]]:
    if strategies is None:
        return [(mode, r) for mode in SP_MODES for r in REMAT_STRATEGIES]
    out = []
    for s in strategies:
        mode, _, r = s.replace(" ", "").partition("+")
        if mode not in SP_MODES or r not in REMAT_STRATEGIES:
            raise AutospError(
                f"[plan] unknown strategy {s!r}; expected '<{'|'.join(SP_MODES)}>+"
                f"<{'|'.join(REMAT_STRATEGIES)}>', e.g. 'ulysses+sequence-aware'"
            )
        out.append((mode, r))
    return out


def _raise_core(e: Exception) -> None:
    raise AutospError(str(e)) from None


def plan(
    model: str | LlamaConfig,
    *,
    gpus: int = 8,
    gpu_memory: str | int = "80GB",
    sp: int | None = None,
    dtype: str = "bf16",
    batch_size: int = 1,
    optimizer_sharding: str = "dp",
    seq_len: int | None = None,
    seq_multiple: int = 1024,
    max_seq: int = 1 << 22,
    strategies: Sequence[str] | None = None,
    curve_points: int = 24,
    plot: str | Path | None = None,
) -> PlanResult:
    """Predicted peak memory per rank and the longest trainable sequence for each strategy.

    ``model``: a preset (:data:`PRESETS`), a path to a Hugging Face config.json, or a
    LlamaConfig. The mesh is ``gpus = dp x sp``; strategy ``no-sp`` uses all GPUs for data
    parallelism. ``dtype``: ``"bf16"`` (bf16 weights and gradients, fp32 master weights and
    AdamW state) or ``"fp32"``. ``optimizer_sharding``: ZeRO-1 over ``"dp"``, ``"world"`` (all
    GPUs) or ``"none"``. ``seq_len``: where to report the peak and breakdown (default: the
    longest S of ``ulysses + sequence-aware``). With ``plot``, writes a PNG of predicted peak
    against S per strategy with the budget line.
    """
    name, config = load_model_config(model)
    for label, v in (("gpus", gpus), ("batch_size", batch_size), ("seq_multiple", seq_multiple)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise AutospError(f"[plan] found {label}={v!r}; expected a positive integer")
    sp = gpus if sp is None else sp
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise AutospError(f"[plan] found sp={sp!r}; expected a positive integer")
    if gpus % sp != 0:
        raise AutospError(
            f"[plan] found {gpus} GPUs not divisible by sp={sp}; expected gpus = dp x sp "
            f"(e.g. --gpus {sp * max(1, gpus // sp)})"
        )
    if dtype not in DTYPES:
        raise AutospError(f"[plan] found dtype={dtype!r}; expected one of {DTYPES}")
    if optimizer_sharding not in OPTIMIZER_SHARDING:
        raise AutospError(
            f"[plan] found optimizer_sharding={optimizer_sharding!r}; expected one of "
            f"{OPTIMIZER_SHARDING}"
        )
    budget = parse_bytes(gpu_memory)
    chosen = _parse_strategies(strategies)
    multiple = seq_multiple * sp // math.gcd(seq_multiple, sp)
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise AutospError(f"[plan] found seq_len={seq_len!r}; expected a positive integer")

    results: list[tuple[str, str, int, int, Any, Any]] = []
    traces: dict[int, TracedStep] = {}
    num_params = 0
    for mode, remat in chosen:
        p = sp if mode == "ulysses" else 1
        dp = gpus // p
        traced = traces.setdefault(
            p, trace_step(config, sp_size=p, dtype=dtype, batch_size=batch_size))
        num_params = traced.num_params
        shards = {"none": 1, "dp": dp, "world": gpus}[optimizer_sharding]
        options = _core_options(remat, dtype, traced.num_params, shards)
        query = _core.TrainabilityQuery()
        query.budget_bytes = budget
        query.seq_multiple = multiple
        query.max_seq = max(max_seq, multiple)
        try:
            found = _core.longest_trainable_seq(traced.graph, options, query)
        except ValueError as e:
            _raise_core(e)
        results.append((mode, remat, p, dp, found, (traced, options)))

    if seq_len is None:
        pick = [r for r in results if r[0] == "ulysses" and r[1] == "sequence-aware"] or results
        seq_len = max(r[4].longest_seq for r in pick) or multiple
    top = max([r[4].longest_seq for r in results] + [seq_len, multiple])
    grid = sorted({max(multiple, (top * 5 // 4 * k // curve_points) // multiple * multiple)
                   for k in range(1, curve_points + 1)})

    plans = []
    for mode, remat, p, dp, found, (traced, options) in results:
        at_seq = None
        if seq_len % p == 0:
            at_seq = MemoryPrediction.from_core(
                _core.simulate_peak_memory(traced.graph, seq_len, options))
        curve = tuple(
            (s, _core.simulate_peak_memory(traced.graph, s, options).peak) for s in grid
        )
        plans.append(StrategyPlan(
            name=f"{mode} + {remat}", sp_mode=mode, remat=remat, sp_size=p, dp_size=dp,
            longest_seq=found.longest_seq, capped=found.capped,
            at_longest=MemoryPrediction.from_core(found.at_longest) if found.longest_seq else None,
            at_seq=at_seq, curve=curve,
        ))
    result = PlanResult(
        model=name, config=config, gpus=gpus, sp=sp, gpu_memory=budget, dtype=dtype,
        batch_size=batch_size, optimizer_sharding=optimizer_sharding, seq_multiple=multiple,
        seq_len=seq_len, strategies=tuple(plans), num_params=num_params,
        trace_seconds=sum(t.seconds for t in traces.values()), plot=None,
    )
    if plot is not None:
        write_plot(result, plot)
        result = PlanResult(**{**result.__dict__, "plot": str(plot)})
    return result


def write_plot(result: PlanResult, path: str | Path) -> None:
    """A PNG of predicted peak memory per rank against S, one line per strategy, with the
    budget line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AutospError(
            "[plan] writing a plot needs matplotlib; expected it installed "
            "(pip install 'autosp[plot]'), or pass --no-plot"
        ) from None
    gib = float(1 << 30)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for s in result.strategies:
        xs = [x / 1024 for x, _ in s.curve]
        ys = [y / gib for _, y in s.curve]
        style = "-" if s.sp_mode == "ulysses" else "--"
        ax.plot(xs, ys, style, marker=".", label=f"{s.name} (longest {s.longest_seq // 1024}k)")
    ax.axhline(result.gpu_memory / gib, color="black", linewidth=1.5,
               label=f"budget {result.gpu_memory / gib:.0f} GiB")
    ax.set_xlabel("sequence length S (k tokens)")
    ax.set_ylabel("predicted peak memory per rank (GiB)")
    ax.set_title(f"{result.model}: {result.gpus} GPUs, sp={result.sp}, {result.dtype} "
                 f"(prediction)")
    top = max(result.gpu_memory / gib * 1.6, 1.0)
    ax.set_ylim(0, top)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autosp plan",
        description=("Predict peak memory per rank and the longest trainable sequence length for "
                     "each strategy (no SP / Ulysses SP x remat none / default / sequence-aware / "
                     "full checkpointing). Traces the model on fake tensors: no weights, no GPU."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(PRESETS)}) or path to a Hugging Face config.json")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the mesh (dp x sp)")
    p.add_argument("--gpu-memory", default="80GB", help="memory per GPU (GB = GiB)")
    p.add_argument("--sp", type=int, default=None, help="SP degree (default: --gpus)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="bf16: bf16 weights/grads + fp32 master weights and AdamW state; fp32")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per SP group per step")
    p.add_argument("--optimizer-sharding", choices=OPTIMIZER_SHARDING, default="dp",
                   help="ZeRO-1: shard optimizer state over dp, all GPUs, or not at all")
    p.add_argument("--seq-len", type=int, default=None,
                   help="report peak and breakdown at this S (default: longest S of "
                        "ulysses + sequence-aware)")
    p.add_argument("--seq-multiple", type=int, default=1024,
                   help="search S over multiples of this (and of sp)")
    p.add_argument("--max-seq", type=int, default=1 << 22, help="search no further than this")
    p.add_argument("--strategies", default=None,
                   help="comma-separated, e.g. 'ulysses+none,ulysses+sequence-aware'")
    p.add_argument("--plot", default=None,
                   help="PNG to write (default: autosp-plan-<model>.png)")
    p.add_argument("--no-plot", action="store_true", help="do not write a plot")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``autosp plan ...``; returns the exit status."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    strategies = args.strategies.split(",") if args.strategies else None
    plot_path = None
    if not args.no_plot:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(str(args.model)).stem.lower())
        plot_path = args.plot or f"autosp-plan-{stem}.png"
    try:
        result = plan(
            args.model, gpus=args.gpus, gpu_memory=args.gpu_memory, sp=args.sp,
            dtype=args.dtype, batch_size=args.batch_size,
            optimizer_sharding=args.optimizer_sharding, seq_len=args.seq_len,
            seq_multiple=args.seq_multiple, max_seq=args.max_seq, strategies=strategies,
            plot=plot_path,
        )
    except AutospError as e:
        print(f"autosp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.table())
        if result.plot:
            print(f"plot: {result.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
