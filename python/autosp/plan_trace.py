"""Tracing for ``autosp plan``: one joint forward+backward graph per (model, P, dtype, batch),
sizes symbolic in S, built under FakeTensorMode through the pipeline ``autosp.compile`` uses
(see ``autosp.planner``'s docstring)."""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from autosp import _core
from autosp.errors import AutospError
from autosp.models.llama import LlamaConfig
from autosp.plan_memory_graph import _memory_graph

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
    model: Any, args: Sequence[Any], *, sp_size: int, group: str | None = None,
    tile_loss: bool = False, tile_mlp: bool = False, kwargs: dict[str, Any] | None = None,
    seq_dim: int = 1, sp_options: dict[str, Any] | None = None,
) -> tuple[Any, Any, int, Any, set[int]]:
    """Traces `model(*args)` as autosp.compile would (Ulysses plan for `sp_size` ranks when
    sp_size > 1 or with ``tile_loss`` / ``tile_mlp``, as ``autosp.compile(tile_loss=...,
    tile_mlp=...)``) up to AOTAutograd's prepared joint graph, and returns
    ``(joint_module, node_info, num_fwd_outputs, shape_env, param_primals)`` (the indices of
    the primal inputs that are parameters, with their names) without compiling or running it.
    Mark the inputs' sequence dim (``seq_dim``) dynamic first. ``sp_options``: other
    ``_core.SpConfig`` fields to plan with, by name (as the compiling backend sets them)."""
    return capture_joints(model, args, sp_size=sp_size, group=group,
                          variants=[(tile_loss, tile_mlp)], kwargs=kwargs, seq_dim=seq_dim,
                          sp_options=sp_options)[0]


def capture_joints(
    model: Any, args: Sequence[Any], *, sp_size: int, variants: Sequence[tuple[bool, bool]],
    group: str | None = None, kwargs: dict[str, Any] | None = None, seq_dim: int = 1,
    sp_options: dict[str, Any] | None = None,
) -> list[tuple[Any, Any, int, Any, set[int]]]:
    """:func:`capture_joint` for each ``(tile_loss, tile_mlp)`` of ``variants``, from one
    Dynamo trace of the model (each variant plans and applies its own copy of the graph)."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch import partitioners

    from autosp import remat
    from autosp.apply import RankContext, apply_plan
    from autosp.bridge import fx_to_core
    from autosp.decompose import decompose_composites
    from autosp.dynamo_regions import inline_regions

    results: list[tuple[Any, Any, int, Any, set[int]]] = []
    captured: dict[str, Any] = {}

    def partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        # autosp's own partition function prepares the joint graph (DCE, CSE, forced saves)
        # in place; the facts are then gathered from exactly what it solved on.
        remat.make_partition_fn("none")(joint, joint_inputs, **kwargs)
        static = kwargs.get("static_lifetime_input_indices") or []
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode(joint_inputs)
        captured["joint"] = (joint, partitioners.classify_nodes(
            joint, static, kwargs["num_fwd_outputs"]), kwargs["num_fwd_outputs"],
            fake_mode.shape_env if fake_mode is not None else None)
        raise _Captured()

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        names = {id(p): name for name, p in model.named_parameters()}
        param_primals = {
            i: names.get(id(x), "")
            for i, x in enumerate(example_inputs)
            if isinstance(x, torch.nn.Parameter)
        }
        inline_regions(gm)  # as the backend does before its plan
        decompose_composites(gm)
        for tile_loss, tile_mlp in variants:
            applied = gm
            if sp_size > 1 or tile_loss or tile_mlp:
                bridge = fx_to_core(gm, list(example_inputs), seq_dim)
                cfg = _core.SpConfig()
                for name, value in (sp_options or {}).items():
                    setattr(cfg, name, value)
                cfg.sp_size = sp_size
                cfg.tile_loss = tile_loss
                cfg.tile_mlp = tile_mlp
                try:
                    sp_plan = _core.plan_ulysses(bridge.graph, cfg)
                except _core.PlanError as e:
                    raise AutospError(str(e)) from None
                ctx = RankContext(rank=0, world=sp_size, group=group or _fake_sp_group(sp_size))
                applied = apply_plan(gm, bridge, sp_plan, ctx)  # a new graph: gm is kept
            captured.pop("joint", None)
            try:
                with remat.symbolic_trace_uncached(example_inputs):
                    aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                 partition_fn=partition,
                                 keep_inference_input_mutations=True)(applied, example_inputs)
            except _Captured:
                pass
            if "joint" not in captured:
                raise AutospError("[plan] the model's training step did not reach AOTAutograd")
            results.append((*captured["joint"], param_primals))
        raise _Captured()

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    try:
        compiled(*args, **(kwargs or {}))
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, AutospError):
            raise inner.with_traceback(None) from None
        if not isinstance(inner, _Captured):
            raise
    if len(results) != len(variants):
        raise AutospError("[plan] the model's training step did not reach AOTAutograd")
    return results


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
    tile_loss: bool = False,
    tile_mlp: bool = False,
    device: str = "cpu",
) -> TracedStep:
    """Traces one training step of `config` for one rank of an SP group of `sp_size` on fake
    tensors (no memory) and returns its MemoryGraph. Cached per process.

    ``device``: where the step will run, ``"cpu"`` or ``"cuda"``. The trace is on CPU fake
    tensors either way; for ``"cuda"`` the attention is traced as the kernel a GPU runs
    (``autosp.cuda_kernels.sdpa_kernel``: the math kernel for an fp32 model with grouped-query
    attention) and CUDA kernels' scratch tensors are counted.

    With ``replicate`` (the default), a model of more than :data:`TRACED_LAYERS` decoder layers
    is traced with that many and the core inserts copies of a middle layer up to
    ``config.num_layers``: the same graph a full trace gives (tests/test_planner.py checks the
    predictions are equal), in seconds instead of minutes. If the trace does not have the
    structure replication needs, all layers are traced (``TracedStep.replicated`` says which).
    ``tile_loss``: the loss computed as ``autosp.compile(tile_loss=True)`` computes it;
    ``tile_mlp``: the MLPs as ``autosp.compile(tile_mlp=True)`` computes them.
    """
    from autosp import cuda_kernels, tiled_loss, tiled_rows

    # The tiled loss's chunks (autosp.tiled_loss.chunk_rows) decide its workspace.
    if device not in ("cpu", "cuda"):
        raise AutospError(f"[plan] found device={device!r}; expected 'cpu' or 'cuda'")
    key = (config, sp_size, dtype, batch_size, replicate, tile_loss,
           tiled_loss.env_rows() if tile_loss else None, tile_mlp,
           tiled_rows.env_rows() if tile_mlp else None, device)
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
    captured = capture_joint(model, (ids, labels), sp_size=sp_size, tile_loss=tile_loss,
                             tile_mlp=tile_mlp)
    if device == "cuda" and cuda_kernels.math_attention_on_cuda(captured[0].graph):
        # A GPU runs this attention in the math kernel: trace that one instead.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            captured = capture_joint(model, (ids, labels), sp_size=sp_size,
                                     tile_loss=tile_loss, tile_mlp=tile_mlp)
    graph = _memory_graph(*captured, device=device)
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
                            replicate=False, tile_loss=tile_loss, tile_mlp=tile_mlp,
                            device=device)
    else:
        traced = TracedStep(graph, num_params, sp_size, trace_seq, time.perf_counter() - start,
                            traced_layers=traced_config.num_layers,
                            replicated=traced_config is not config)
    _TRACE_CACHE[key] = traced
    return traced
