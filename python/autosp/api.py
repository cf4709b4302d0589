"""Public API: init_mesh, compile, backend."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autosp.backend import BACKENDS, SequenceParallelBackend
from autosp.errors import AutospError

REMAT_POLICIES = ("none", "default", "sequence-aware")
OUTPUTS = ("full", "local")


def init_mesh(sp_size: int, dp_size: int | None = None, device_type: str | None = None) -> DeviceMesh:
    """A DeviceMesh with axes ("dp", "sp") over the default process group.

    ``dp_size`` defaults to world_size // sp_size. Initialise torch.distributed first
    (torchrun and ``dist.init_process_group()``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise AutospError(
            "[autosp:init_mesh] found torch.distributed not initialised; expected "
            "dist.init_process_group(...) (e.g. under torchrun) before autosp.init_mesh."
        )
    world = dist.get_world_size()
    if sp_size < 1:
        raise AutospError(f"[autosp:init_mesh] found sp_size={sp_size}; expected a positive integer.")
    if dp_size is None:
        if world % sp_size != 0:
            raise AutospError(
                f"[autosp:init_mesh] found world size {world} not divisible by sp_size {sp_size}; "
                f"expected world_size = dp_size * sp_size."
            )
        dp_size = world // sp_size
    if dp_size * sp_size != world:
        raise AutospError(
            f"[autosp:init_mesh] found dp_size * sp_size = {dp_size} * {sp_size} = {dp_size * sp_size}; "
            f"expected the world size {world}."
        )
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dp_size, sp_size), mesh_dim_names=("dp", "sp"))


def _sp_axis(mesh: DeviceMesh) -> tuple[int, int, str]:
    names = mesh.mesh_dim_names or ()
    if "sp" not in names:
        raise AutospError(
            f"[autosp:compile] found a mesh with axes {names}; expected an 'sp' axis (use autosp.init_mesh)."
        )
    group = mesh.get_group("sp")
    return mesh.get_local_rank("sp"), mesh.size(names.index("sp")), group.group_name


def _check_outputs(outputs: str) -> None:
    if outputs not in OUTPUTS:
        raise AutospError(f"[autosp:compile] found outputs={outputs!r}; expected one of {OUTPUTS}: "
                          "'full' returns what the single-device model returns, 'local' this "
                          "rank's chunk of outputs sharded along the sequence.")


def _make_backend(mesh: DeviceMesh, seq_dim: int, remat: Any, compiler: str,
                  remat_report: Any = None, outputs: str = "full") -> SequenceParallelBackend:
    rank, world, group = _sp_axis(mesh)
    return SequenceParallelBackend(rank=rank, world=world, group=group, seq_dim=seq_dim, remat=remat,
                                   backend=compiler, remat_report=remat_report,
                                   gather_outputs=outputs == "full")


def backend(mesh: DeviceMesh, *, seq_dim: int = 1, remat: Any = "sequence-aware",
            backend: str = "inductor", outputs: str = "full") -> SequenceParallelBackend:
    """The raw torch.compile backend, for ``torch.compile(model, backend=autosp.backend(mesh),
    fullgraph=True)``. Mark the sequence dim of the inputs dynamic yourself
    (``torch._dynamo.mark_dynamic(input_ids, seq_dim)``). ``outputs`` as in :func:`compile`."""
    _check_outputs(outputs)
    return _make_backend(mesh, seq_dim, remat, backend, outputs=outputs)


def _logging_functions() -> set:
    """Every method of logging.Logger, including ones libraries add to it (e.g.
    ``warning_once``): logging does not change what the model computes, so capture
    drops it, as torch.export does, instead of breaking the graph on it."""
    import logging

    found = set(getattr(torch._dynamo.config, "ignore_logging_functions", ()))
    for name, fn in vars(logging.Logger).items():
        if not name.startswith("_") and callable(fn):
            found.add(getattr(logging.Logger, name))
    return found


class SequenceParallelModule(nn.Module):
    """``model`` compiled for Ulysses SP. Call it with the same arguments as ``model``,
    full-length and identical on every rank of the SP group."""

    def __init__(self, model: nn.Module, sp_backend: SequenceParallelBackend, seq_dim: int,
                 dp_group: Any = None) -> None:
        super().__init__()
        self.module = model
        self.sp_backend = sp_backend
        self.seq_dim = seq_dim
        # Not registered as a submodule: the parameters and state_dict are the model's,
        # under "module." as with DistributedDataParallel.
        object.__setattr__(self, "_compiled",
                           torch.compile(model, backend=sp_backend, fullgraph=True, dynamic=False))
        self._dp_hooks = []
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            # Data parallelism across SP groups: average each gradient over "dp" once it is
            # complete (the SP reduction already happened inside the compiled graph).
            dp_size = dist.get_world_size(dp_group)

            def average(p: torch.Tensor) -> None:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(dp_size)

            for p in model.parameters():
                if p.requires_grad:
                    self._dp_hooks.append(p.register_post_accumulate_grad_hook(average))

    def _prepare(self, args: tuple, kwargs: dict) -> None:
        tensors = [t for t in list(args) + list(kwargs.values())
                   if isinstance(t, torch.Tensor) and t.dim() > self.seq_dim]
        if not tensors:
            raise AutospError(
                f"[autosp:compile] found no tensor argument with a dim {self.seq_dim}; expected "
                f"full-length inputs whose dim {self.seq_dim} is the sequence (seq_dim={self.seq_dim})."
            )
        seq = tensors[0].shape[self.seq_dim]
        world = self.sp_backend.ctx.world
        if seq % world != 0:
            raise AutospError(
                f"[autosp:compile] found sequence length {seq} not divisible by the SP degree {world}; "
                f"expected a multiple of {world}. Pad the batch to a multiple of {world} "
                f"(labels -100 on the padding) or choose another length."
            )
        if seq < 2:
            raise AutospError(f"[autosp:compile] found sequence length {seq}; expected at least 2.")
        for t in tensors:
            if t.shape[self.seq_dim] == seq:
                torch._dynamo.mark_dynamic(t, self.seq_dim)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._prepare(args, kwargs)
        try:
            if not hasattr(torch._dynamo.config, "ignore_logging_functions"):
                return self._compiled(*args, **kwargs)
            with torch._dynamo.config.patch(ignore_logging_functions=_logging_functions()):
                return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, AutospError):
                raise inner.with_traceback(None) from None
            raise
        except torch._dynamo.exc.Unsupported as e:
            raise AutospError(
                "[autosp:capture] found a graph break (Dynamo could not capture the model in one "
                f"graph): {str(e).splitlines()[0]}; expected a model that torch.compile(fullgraph=True) "
                "captures whole. The full Dynamo message follows.\n" + str(e)
            ) from None

    @property
    def last_compile(self) -> Any:
        """Stage-by-stage record of the last compilation (core IR, plan, FX graph)."""
        return self.sp_backend.last


def compile(model: nn.Module, mesh: DeviceMesh, *, seq_dim: int = 1, remat: Any = "sequence-aware",
            backend: str = "inductor", average_dp: bool = True,
            remat_report: Any = None, outputs: str = "full") -> SequenceParallelModule:
    """Compile ``model`` for exact Ulysses sequence parallelism over the mesh's "sp" axis.

    Every rank of an SP group must be called with the same full-length batch; the
    returned loss equals the single-device loss and, after ``backward()``, every
    parameter's ``.grad`` equals the single-device gradient of its SP group's batch,
    averaged over the mesh's "dp" axis when it has more than one group (set
    ``average_dp=False`` when FSDP/DDP already averages over "dp").

    ``remat`` picks what the forward saves for backward (see autosp.remat); pass an
    ``autosp.remat.RematReport()`` as ``remat_report`` to see, per layer, what was saved and
    what is recomputed, with bytes and FLOPs (``print(report)``).

    ``outputs``: ``"full"`` (default) returns exactly what the single-device model returns, so
    outputs sharded along the sequence (logits, hidden states, a KV cache) are all-gathered to
    full length on every rank. ``"local"`` returns this rank's chunk of those instead (its
    ``S/P`` tokens: positions ``r*S/P`` to ``(r+1)*S/P - 1`` of each sequence on rank r); the loss
    and other replicated outputs are unchanged. Use it when training needs only the loss: a
    model that returns ``[B, S, vocab]`` logits otherwise materialises them at full length on
    every rank, which defeats sequence parallelism's memory savings.
    """
    if backend not in BACKENDS:
        raise AutospError(f"[autosp:compile] found backend={backend!r}; expected one of {BACKENDS}.")
    if isinstance(remat, str) and remat not in REMAT_POLICIES:
        raise AutospError(f"[autosp:compile] found remat={remat!r}; expected one of {REMAT_POLICIES} "
                          "or an autosp.remat.MemoryBudget.")
    _check_outputs(outputs)
    sp_backend = _make_backend(mesh, seq_dim, remat, backend, remat_report, outputs)
    dp_group = mesh.get_group("dp") if "dp" in (mesh.mesh_dim_names or ()) else None
    return SequenceParallelModule(model, sp_backend, seq_dim, dp_group=dp_group if average_dp else None)
