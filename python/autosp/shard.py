"""Sharded model state over the whole dp x sp world: ``autosp.fully_shard``.

Every parameter is stored as a DTensor ``Shard(0)`` over the mesh's ranks flattened to one
axis (dp x sp), so parameters, gradients and optimizer state take about 1/world of their
unsharded bytes per rank. Reading the parameter inside the model's forward all-gathers it
(DTensor ``redistribute`` to ``Replicate``, traced by Dynamo into the compiled graph); the
backward of that read is a reduce-scatter of the gradient (``Partial("avg")`` to
``Shard(0)``). This is SimpleFSDP's design (Zhang et al., 2024): the collectives live in the
compiled graph, where autosp's remat partitioner places them, and nothing runs beside
torch.distributed. See docs/fsdp.md for why this and not FSDP2's hooks.

The state dict keeps the model's own names: the parameters stay registered under their names
(as DTensors), and a class-level property on each module returns the gathered tensor while
the model runs (traced by autosp.compile, or called eagerly) and the DTensor parameter
otherwise, so that initialisation, ``.grad`` and optimizer groups outside ``forward`` reach
the sharded parameter itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autosp.errors import AutospError

__all__ = ["MixedPrecisionPolicy", "fully_shard", "is_sharded", "shard_mesh"]

_SHARDED_CLASS = "_autosp_sharded_class"
_EAGER_FORWARDS = [0]  # sharded models' forward calls running eagerly (not traced), nested
_PARAMETER_GROUPS: set[str] = set()  # process group names parameters are sharded over


def parameter_groups() -> frozenset[str]:
    """Names of the process groups :func:`fully_shard` shards parameters over (the remat
    partitioner recomputes what is all-gathered over them)."""
    return frozenset(_PARAMETER_GROUPS)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh parameters are sharded over: the mesh's dims flattened (dp x sp)."""
    if mesh.ndim == 1:
        return mesh
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise AutospError(f"[autosp:fully_shard] found a {mesh.ndim}-D mesh without dim names; "
                          "expected autosp.init_mesh(...)'s ('dp', 'sp') mesh.")
    return mesh[names]._flatten("_".join(names))


class _Gather(nn.Module):
    """The all-gather of one sharded parameter, with FSDP2's mixed-precision semantics: the
    shard is cast to ``param_dtype`` before the gather, and the gradient to ``reduce_dtype``
    before the reduce-scatter (then stored in the parameter's dtype)."""

    def __init__(self, mesh: DeviceMesh, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.mesh = mesh
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype

    def forward(self, p: DTensor) -> torch.Tensor:
        full = p.redistribute(self.mesh, [Replicate()], forward_dtype=self.param_dtype,
                              backward_dtype=self.reduce_dtype)
        # Each rank's gradient is that of its own batch (autosp already summed it over the SP
        # group inside the compiled graph): the mean over the ranks is the mean over dp.
        return full.to_local(grad_placements=[Partial("avg")])


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    def getter(name: str) -> property:
        def get(self: nn.Module) -> torch.Tensor:
            p = self._parameters[name]
            if torch.compiler.is_compiling() or _EAGER_FORWARDS[0] > 0:
                return self._autosp_gathers[name](p)
            return p

        return property(get)

    attrs: dict[str, Any] = {n: getter(n) for n in names}
    attrs[_SHARDED_CLASS] = True
    return type(f"Sharded{cls.__name__}", (cls,), attrs)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds parameters sharded by :func:`fully_shard`."""
    return any(getattr(type(m), _SHARDED_CLASS, False) for m in model.modules())


def fully_shard(model: nn.Module, mesh: DeviceMesh, *,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard ``model``'s parameters over every rank of ``mesh`` (dp x sp), in place; returns
    ``model``. Call it before :func:`autosp.compile` and before building the optimizer:

        mesh = autosp.init_mesh(sp_size=4)
        autosp.fully_shard(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                        reduce_dtype=torch.float32))
        model = autosp.compile(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())

    Each parameter becomes a DTensor ``Shard(0)`` (dim 0 split over the ranks, unevenly when
    it does not divide), and so do its gradient and the optimizer's state. Inside the compiled
    model each use all-gathers it and its gradient is reduce-scattered; the gathered copy is
    recomputed for backward rather than saved (ZeRO-3). Gradients are averaged over the mesh's
    "dp" groups, as with ``autosp.compile`` alone.

    ``mp_policy`` (torch's ``MixedPrecisionPolicy``): ``param_dtype`` is the dtype parameters are
    gathered and computed in (master weights stay in their own dtype), ``reduce_dtype`` the
    dtype gradients are reduced in; ``output_dtype`` and ``cast_forward_inputs`` are not
    supported (the model's own code decides the dtype of its outputs and buffers). For pure
    bf16, convert the model with ``model.to(torch.bfloat16)`` first and pass no policy.

    Shared (tied) parameters stay shared. The model's ``state_dict`` has its usual names, with
    DTensor values: save and load it with ``torch.distributed.checkpoint``.
    """
    if not isinstance(model, nn.Module):
        raise AutospError(f"[autosp:fully_shard] found {type(model).__name__}; expected an nn.Module.")
    if not isinstance(mesh, DeviceMesh):
        raise AutospError(f"[autosp:fully_shard] found mesh={mesh!r}; expected a DeviceMesh from "
                          "autosp.init_mesh(...).")
    if is_sharded(model):
        raise AutospError("[autosp:fully_shard] found a model already sharded; expected to be "
                          "called once per model.")
    lazy = [name for name, p in model.named_parameters() if is_lazy(p)]
    if lazy:  # torch raised on them halfway, leaving the model part sharded (helper-71)
        raise AutospError(f"[autosp:fully_shard] found parameters not yet materialised ({', '.join(lazy[:3])}"
                          f"{', ...' if len(lazy) > 3 else ''}: lazy modules such as nn.LazyLinear); "
                          "expected every parameter's shape known: run one forward of the model "
                          "(on a dummy batch) before sharding it.")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if mp_policy.output_dtype is not None:
        raise AutospError(f"[autosp:fully_shard] found MixedPrecisionPolicy(output_dtype="
                          f"{mp_policy.output_dtype}); expected None (not supported).")
    flat = shard_mesh(mesh)
    _PARAMETER_GROUPS.add(flat.get_group().group_name)
    for p in model.parameters():
        if isinstance(p, DTensor):
            raise AutospError("[autosp:fully_shard] found a parameter that is already a DTensor "
                              "(FSDP2 or tensor parallelism applied); expected plain parameters.")
    seen: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        names = tuple(n for n, p in module._parameters.items() if p is not None)
        if not names:
            continue
        module._autosp_gathers = {}  # type: ignore[assignment]
        for name in names:
            p = module._parameters[name]
            assert p is not None
            if id(p) not in seen:
                placement = [Shard(0)] if p.dim() > 0 else [Replicate()]
                seen[id(p)] = nn.Parameter(distribute_tensor(p.detach(), flat, placement),
                                           requires_grad=p.requires_grad)
            module._parameters[name] = seen[id(p)]
            floating = p.is_floating_point()  # FSDP2 casts floating-point parameters only
            module._autosp_gathers[name] = _Gather(flat, mp_policy.param_dtype if floating else None,
                                                   mp_policy.reduce_dtype if floating else None)
        module.__class__ = _sharded_class(type(module), names)
    # An eager call of the model (outside autosp.compile: evaluation, generation) reads the
    # gathered parameters too; under the compiler the getters see is_compiling().
    model.register_forward_pre_hook(_enter_forward)
    model.register_forward_hook(_exit_forward, always_call=True)
    return model


def _enter_forward(module: nn.Module, args: Any) -> None:
    if not torch.compiler.is_compiling():
        _EAGER_FORWARDS[0] += 1


def _exit_forward(module: nn.Module, args: Any, output: Any) -> None:
    if not torch.compiler.is_compiling():
        _EAGER_FORWARDS[0] -= 1


def check_not_fsdp2(model: nn.Module) -> None:
    """Stops when ``model`` holds modules sharded by torch's FSDP2, whose hooks Dynamo cannot
    capture in one graph."""
    from torch.distributed.fsdp import FSDPModule

    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            raise AutospError(
                f"[autosp:compile] found {name or 'the model'!r} sharded by "
                "torch.distributed.fsdp.fully_shard (FSDP2), whose hooks torch.compile cannot "
                "capture in one graph; expected autosp.fully_shard(model, mesh) instead: the same "
                "sharding and MixedPrecisionPolicy, with the collectives inside the compiled graph.")


def check_compile_mesh(model: nn.Module, mesh: DeviceMesh) -> None:
    """Stops when ``model`` was sharded over other ranks than ``mesh`` holds."""
    ranks = mesh.mesh.flatten().tolist()
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and p.device_mesh.mesh.flatten().tolist() != ranks:
            raise AutospError(
                f"[autosp:compile] found parameter {name!r} sharded over ranks "
                f"{p.device_mesh.mesh.flatten().tolist()}; expected the ranks of the mesh passed "
                f"to autosp.compile, {ranks}: shard and compile with the same mesh.")
