"""Public API: init_mesh, compile, backend."""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autosp import guard, shard
from autosp.backend import BACKENDS, SequenceParallelBackend
from autosp.errors import AutospError, internal_error
from autosp.remat import POLICIES as REMAT_POLICIES

OUTPUTS = ("full", "local")
UNSUPPORTED = ("gather", "error")


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
    for name, value in (("sp_size", sp_size), ("dp_size", dp_size)):
        if value is None and name == "dp_size":
            continue
        if not _is_int(value) or value < 1:
            raise AutospError(f"[autosp:init_mesh] found {name}={value!r} ({type(value).__name__}); "
                              f"expected a positive int (a number of ranks).")
    sp_size = int(sp_size)
    dp_size = None if dp_size is None else int(dp_size)
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


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise AutospError(
            f"[autosp:compile] found mesh={mesh!r} ({type(mesh).__name__}); expected a DeviceMesh with "
            "an 'sp' axis: mesh = autosp.init_mesh(sp_size=...) after dist.init_process_group(...)."
        )
    names = mesh.mesh_dim_names or ()
    if "sp" not in names:
        raise AutospError(
            f"[autosp:compile] found a mesh with axes {names}; expected an 'sp' axis (use autosp.init_mesh)."
        )


def _check_seq_dim(seq_dim: Any) -> None:
    if not _is_int(seq_dim) or seq_dim < 1:
        raise AutospError(
            f"[autosp:compile] found seq_dim={seq_dim!r}; expected an int >= 1, the index of the sequence "
            "dim in the batch-first inputs (dim 0 is the batch; negative indices are ambiguous across "
            "inputs of different rank): seq_dim=1 (the default) for [B, S] token ids."
        )


def _group_alive(group_name: str | None) -> bool:
    if not dist.is_available() or not dist.is_initialized():
        return False
    resolve = getattr(torch.distributed.distributed_c10d, "_resolve_process_group", None)
    if group_name is None or resolve is None:
        return True
    try:
        resolve(group_name)
    except (RuntimeError, ValueError, KeyError):
        return False
    return True


def _dead_group_error(where: str, group_name: str | None) -> AutospError:
    return AutospError(
        f"[autosp:{where}] found the SP process group{f' {group_name!r}' if group_name else ''} gone "
        "(torch.distributed not initialised, or the group destroyed); expected the process group "
        "autosp.init_mesh was built on to stay alive while the model is compiled and called: call "
        "dist.destroy_process_group() only after the last step, and after a new "
        "dist.init_process_group(...) build a new mesh and compile again."
    )


def _sp_axis(mesh: DeviceMesh) -> tuple[int, int, str]:
    _check_mesh(mesh)
    names = mesh.mesh_dim_names or ()
    if not _group_alive(None):
        raise _dead_group_error("compile", None)
    try:
        group = mesh.get_group("sp")
        name = group.group_name
    except (RuntimeError, ValueError, KeyError) as e:
        raise _dead_group_error("compile", None) from e
    if not _group_alive(name):
        raise _dead_group_error("compile", name)
    return mesh.get_local_rank("sp"), mesh.size(names.index("sp")), name


def _check_outputs(outputs: str) -> None:
    if outputs not in OUTPUTS:
        raise AutospError(f"[autosp:compile] found outputs={outputs!r}; expected one of {OUTPUTS}: "
                          "'full' returns what the single-device model returns, 'local' this "
                          "rank's chunk of outputs sharded along the sequence.")


def _check_flags(loss_chunks: int | None = None, **flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise AutospError(f"[autosp:compile] found {name}={value!r}; expected True or False.")
    if loss_chunks is None:
        return
    from autosp.tiled_loss import MAX_CHUNKS

    if not isinstance(loss_chunks, int) or isinstance(loss_chunks, bool) \
            or not 1 <= loss_chunks <= MAX_CHUNKS:
        raise AutospError(f"[autosp:compile] found loss_chunks={loss_chunks!r}; expected a "
                          f"positive int up to {MAX_CHUNKS} (chunks of each rank's tokens per "
                          "tiled loss), or None for ceil(vocab / hidden).")
    if not flags.get("tile_loss"):
        raise AutospError(f"[autosp:compile] found loss_chunks={loss_chunks} with "
                          "tile_loss=False; expected tile_loss=True (the chunks are the tiled "
                          "loss's).")


def _check_unsupported(unsupported: str) -> None:
    if unsupported not in UNSUPPORTED:
        raise AutospError(f"[autosp:compile] found unsupported={unsupported!r}; expected one of "
                          f"{UNSUPPORTED}: 'gather' runs an op that has no sequence-parallel form "
                          "on the all-gathered full sequence, 'error' stops at it.")


def _make_backend(mesh: DeviceMesh, seq_dim: int, remat: Any, compiler: str,
                  remat_report: Any = None, outputs: str = "full",
                  unsupported: str = "gather", tile_loss: bool = False,
                  tile_mlp: bool = False, loss_chunks: int | None = None,
                  dynamic: bool = True) -> SequenceParallelBackend:
    rank, world, group = _sp_axis(mesh)
    return SequenceParallelBackend(rank=rank, world=world, group=group, seq_dim=seq_dim, remat=remat,
                                   backend=compiler, remat_report=remat_report,
                                   gather_outputs=outputs == "full",
                                   gather_unsupported=unsupported == "gather",
                                   tile_loss=tile_loss, tile_mlp=tile_mlp,
                                   loss_chunks=loss_chunks or 0, dynamic=dynamic)


def backend(mesh: DeviceMesh, *, seq_dim: int = 1, remat: Any = "sequence-aware",
            backend: str = "inductor", outputs: str = "full",
            unsupported: str = "gather", tile_loss: bool = False,
            tile_mlp: bool = False, loss_chunks: int | None = None,
            dynamic: bool = True) -> SequenceParallelBackend:
    """The raw torch.compile backend, for ``torch.compile(model, backend=autosp.backend(mesh),
    fullgraph=True)``. Mark the sequence dim of the inputs dynamic yourself
    (``torch._dynamo.mark_dynamic(input_ids, seq_dim)``). ``outputs`` as in :func:`compile`.
    The raw backend does not compare inputs across the SP group (see ``check_inputs``), and
    does not turn on ``torch._dynamo.config.capture_dynamic_output_shape_ops`` for models that
    route tokens with ``torch.where(mask)`` (autosp.compile does, for modules that need it)."""
    _check_seq_dim(seq_dim)
    _check_outputs(outputs)
    _check_unsupported(unsupported)
    _check_flags(loss_chunks, tile_loss=tile_loss, tile_mlp=tile_mlp, dynamic=dynamic)
    return _make_backend(mesh, seq_dim, remat, backend, outputs=outputs, unsupported=unsupported,
                         tile_loss=tile_loss, tile_mlp=tile_mlp, loss_chunks=loss_chunks,
                         dynamic=dynamic)


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
    full-length and identical on every rank of the SP group.

    ``sp_group``: the SP process group; when given, each call first checks that it is
    still alive and compares the inputs across it as ``check_inputs`` says (see
    :class:`autosp.guard.InputGuard`; ``mesh_dp_group``, the mesh's "dp" group, spreads
    the outcome to every SP group). :func:`compile` passes the mesh's groups.
    ``dp_group``: gradients are averaged over it after backward.
    """

    def __init__(self, model: nn.Module, sp_backend: SequenceParallelBackend, seq_dim: int,
                 dp_group: Any = None, sp_group: Any = None, check_inputs: str = "on_change",
                 mesh_dp_group: Any = None) -> None:
        super().__init__()
        _check_seq_dim(seq_dim)
        self.module = model
        self.sp_backend = sp_backend
        self.seq_dim = seq_dim
        self.names = guard.positional_names(model.forward)
        self.sp_group = sp_group
        self._capture_data_dependent = False
        self.input_guard = guard.InputGuard(sp_group, check_inputs, self.names, dp_group=mesh_dp_group)
        self._signatures: dict[tuple, None] = {}  # distinct shapes (S aside), dtypes, train mode
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

    def _arg_name(self, key: int | str) -> str:
        if isinstance(key, str):
            return f"keyword argument {key!r}"
        return f"argument {key}" + (f" ({self.names[key]})" if key < len(self.names) else "")

    def _prepare(self, args: tuple, kwargs: dict) -> tuple:
        """Check the sequence length and mark the sequence dims dynamic: dim ``seq_dim`` of
        every top-level tensor argument of the sequence length S, and, for boolean or
        integer tensors (attention masks such as [B, 1, S, S]), every other dim >= 1 of size S.
        Returns the tensors' shapes (marked dims as None) and dtypes, and the train mode:
        what a new graph is compiled for."""
        named = [(self._arg_name(k), t) for k, t in list(enumerate(args)) + list(kwargs.items())
                 if isinstance(t, torch.Tensor)]
        tensors = [(n, t) for n, t in named if t.dim() > self.seq_dim]
        if not tensors:
            raise AutospError(
                f"[autosp:compile] found no tensor argument with a dim {self.seq_dim}; expected "
                f"full-length inputs whose dim {self.seq_dim} is the sequence (seq_dim={self.seq_dim})."
            )
        seq = tensors[0][1].shape[self.seq_dim]
        world = self.sp_backend.ctx.world
        if seq % world != 0:
            raise AutospError(
                f"[autosp:compile] found sequence length {seq} not divisible by the SP degree {world}; "
                f"expected a multiple of {world}. Pad the batch to a multiple of {world} "
                f"(labels -100 on the padding) or choose another length."
            )
        if seq < 2:
            raise AutospError(f"[autosp:compile] found sequence length {seq}; expected at least 2.")
        key = []
        for name, t in named:
            mask_like = t.dim() >= 4 and t.shape[-1] == seq and (
                t.dim() <= self.seq_dim or t.shape[self.seq_dim] != seq)
            dims = [self.seq_dim] if t.dim() > self.seq_dim and t.shape[self.seq_dim] == seq else []
            if not (t.is_floating_point() or t.is_complex()):
                dims += [d for d in range(1, t.dim()) if t.shape[d] == seq and d not in dims]
            elif mask_like:
                # An additive [B, 1, S, S] mask: its query and key dims are the sequence (a
                # float activation's feature dim that happens to equal S is not marked).
                dims += [d for d in (t.dim() - 2, t.dim() - 1) if t.shape[d] == seq and d not in dims]
            for d in dims:
                torch._dynamo.mark_dynamic(t, d)
            key.append((name, tuple(None if d in dims else n for d, n in enumerate(t.shape)), t.dtype))
        return tuple(key), self.module.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.sp_group is not None and not _group_alive(self.sp_backend.ctx.group):
            raise _dead_group_error("forward", self.sp_backend.ctx.group)
        leaves = guard.flatten_inputs(args, kwargs, self.names)
        sig = guard.signature(leaves)
        self.input_guard.check_call(leaves, sig)  # before any local check: ranks decide alike
        self._signatures.setdefault(self._prepare(args, kwargs), None)
        patch: dict[str, Any] = {}
        if self._capture_data_dependent:
            # Data-dependent ops (torch.where(mask) in MoE routing) are captured into the graph,
            # where the core keeps them local to each rank's tokens (token-local regions). Only
            # for modules that need it: the capture makes every compile slower.
            patch["capture_dynamic_output_shape_ops"] = True
        if hasattr(torch._dynamo.config, "ignore_logging_functions"):
            patch["ignore_logging_functions"] = _logging_functions()
        try:
            with torch._dynamo.config.patch(**patch):
                return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None) or e.__cause__ or e
            if isinstance(inner, AutospError):
                raise inner.with_traceback(None) from inner.__cause__
            raise internal_error("compile", inner) from inner
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise self._recompile_error(leaves) from e
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            text = str(e)
            if not self._capture_data_dependent and "capture_dynamic_output_shape_ops" in text:
                # Dynamo stopped at a data-dependent op before anything ran (every rank alike):
                # capture it, once, and compile again.
                self._capture_data_dependent = True
                return self.forward(*args, **kwargs)
            hint = ""
            if "data-dependent" in text:
                hint = (" The model's control flow or shapes depend on tensor values (e.g. looping "
                        "over the experts a batch hits, or torch.where(mask) in MoE routing); write it "
                        "with shapes that do not depend on data (for Hugging Face MoE models, "
                        "experts_implementation=\"batched_mm\" in the config or from_config).")
            raise AutospError(
                "[autosp:capture] found a graph break (Dynamo could not capture the model in one "
                f"graph): {text.splitlines()[0] if text else type(e).__name__}; expected a model that "
                f"torch.compile(fullgraph=True) captures whole.{hint} The full Dynamo message "
                "follows.\n" + text
            ) from None

    def _recompile_error(self, leaves: list) -> AutospError:
        limit = getattr(torch._dynamo.config, "recompile_limit", None)
        call = ", ".join(f"{leaf.name} {guard.describe_tensor(leaf.value.shape, leaf.value.dtype)}"
                         for leaf in leaves if isinstance(leaf.value, torch.Tensor))
        return AutospError(
            "[autosp:recompile] found one input signature too many for the model's forward (this "
            f"call: {call}, training={self.module.training}; this module has been called with "
            f"{len(self._signatures)} distinct batch shapes, dtypes and train modes): Dynamo compiles "
            "one graph per batch size, dtype, non-tensor argument value and train/eval mode (for a "
            "model that reads self.training; a new sequence length does not recompile) and stops at "
            f"torch._dynamo.config.recompile_limit = {limit} per function. Expected at most {limit}: "
            "pad the batch to a few fixed sizes (padding rows whose labels are all -100 add nothing "
            "to a cross-entropy with ignore_index=-100), or raise torch._dynamo.config.recompile_limit "
            "(each new signature compiles the model again)."
        )

    @property
    def last_compile(self) -> Any:
        """Stage-by-stage record of the last compilation (core IR, plan, FX graph)."""
        return self.sp_backend.last

    @property
    def gathered(self) -> list[str]:
        """The ops of every compiled graph that run on the all-gathered full sequence
        (``unsupported="gather"``), each as the error autosp would have stopped with."""
        return [reason for rec in self.sp_backend.records for reason in rec.gathered]

    @property
    def loss_tiling(self) -> list[str]:
        """With ``tile_loss=True``: per cross-entropy of every compiled graph, "tiled: ..." or
        "not tiled: <why>", with its source line."""
        return [line for rec in self.sp_backend.records for line in rec.loss_tiling]

    @property
    def mlp_tiling(self) -> list[str]:
        """With ``tile_mlp=True``: per row-wise block (MLP) of every compiled graph, "tiled:
        ..." or "not tiled: <why>", with its source line."""
        return [line for rec in self.sp_backend.records for line in rec.mlp_tiling]

    @property
    def decomposed(self) -> list[str]:
        """Composite Torch functions (``multi_head_attention_forward``) taken apart into ATen
        ops and planned op by op (autosp.decompose), by name, over every compiled graph."""
        return [name for rec in self.sp_backend.records for name in rec.decomposed]

    @property
    def tiled_masks(self) -> list[str]:
        """The attention calls of every compiled graph whose ``[S, S]`` mask autosp never
        materialises: it is computed from its O(S) operands one tile of query rows at a time
        (see docs/sp.md, "Attention masks"). Each as its source location."""
        return [loc for rec in self.sp_backend.records for loc in rec.tiled_masks]


def compile(model: nn.Module, mesh: DeviceMesh, *, seq_dim: int = 1, remat: Any = "sequence-aware",
            backend: str = "inductor", average_dp: bool = True,
            remat_report: Any = None, outputs: str = "full",
            check_inputs: str = "on_change", unsupported: str = "gather",
            tile_loss: bool = False, tile_mlp: bool = False,
            loss_chunks: int | None = None, dynamic: bool = True) -> SequenceParallelModule:
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

    ``check_inputs``: before running, the inputs are compared across the SP group (shapes and
    dtypes, then a checksum of every tensor's values), and ranks fed different data all raise
    the same AutospError instead of training on garbage or hanging. ``"on_change"`` (default)
    compares on the first call and whenever some rank's input shapes or dtypes change (two
    small all-gathers then; otherwise one one-element all-reduce over "sp" and one over "dp"
    per call, so that all ranks agree to check), ``"always"`` on every call, ``"never"`` not
    at all. ``seq_dim`` is the sequence dim of the batch-first inputs (>= 1).

    ``unsupported``: what to do with an op that has no sequence-parallel form for its
    sequence-sharded inputs (``F.pad`` of the sequence to a chunk multiple in a Mamba-style
    scan, a sort along it, a slice inside it). ``"gather"`` (default) all-gathers those inputs
    and runs the op, and whatever is computed from its result alone, on the full sequence on
    every rank: exact, but those activations are not split and that work is not divided. A
    warning names each such op (``AutospGatherWarning``) and the compile record lists them
    (``SequenceParallelModule.gathered``). ``"error"`` stops at the first such op with an
    AutospError instead.

    ``tile_loss``: compute a cross-entropy over a projection to the vocabulary (``lm_head``,
    then casts, pointwise ops with constant operands and reshapes that keep the vocabulary dim)
    a chunk of tokens at a time, so that this rank's ``[tokens, vocab]`` logits never exist
    whole (autosp.tiled_loss). A mean or sum loss back-propagates each chunk in the forward and
    keeps the gradients of the hidden states and the weight (fp32) for the backward: nothing is
    recomputed. A loss per token (reduction "none") recomputes each chunk's logits in the
    backward. Exact up to the order of the sum over tokens. A loss whose
    logits are also returned or read elsewhere is left as written;
    ``SequenceParallelModule.loss_tiling`` says, per loss, whether it was tiled and why not.
    ``loss_chunks``: how many chunks of each rank's tokens (default ``ceil(vocab / hidden)``,
    whose logits are the size of the hidden states). Fewer are faster, since each chunk reads
    the whole weight, and hold more; ``autosp plan --gpu-memory`` reports the fewest that fit.

    ``dynamic``: ``True`` (default) compiles one graph for every sequence length. ``False``
    plans on the same symbolic trace but has AOTAutograd and Inductor compile the graph for
    the shapes of each call, at its first call with them (autosp.specialize): 0.85x the first
    call's time at 2 layers and 0.64x at 16 (docs/compile_time.md), but a full compile per
    distinct length, so for training at a fixed length (``autosp train`` does).

    ``tile_mlp``: run each row-wise block (an MLP or SwiGLU: linears and elementwise ops whose
    intermediates nothing else reads) a chunk of tokens at a time, recomputing each chunk in
    backward, so that one chunk's ``[tokens, ffn]`` intermediates exist at a time
    (autosp.tiled_rows). Exact up to the order of the weights' gradient sums; costs a second
    forward of the block. ``SequenceParallelModule.mlp_tiling`` lists the blocks.
    """
    if backend not in BACKENDS:
        raise AutospError(f"[autosp:compile] found backend={backend!r}; expected one of {BACKENDS}.")
    if isinstance(remat, str) and remat not in REMAT_POLICIES:
        raise AutospError(f"[autosp:compile] found remat={remat!r}; expected one of {REMAT_POLICIES} "
                          "or an autosp.remat.MemoryBudget or autosp.remat.Offload.")
    _check_outputs(outputs)
    _check_unsupported(unsupported)
    _check_flags(loss_chunks, tile_loss=tile_loss, tile_mlp=tile_mlp, dynamic=dynamic)
    guard.check_mode(check_inputs)
    _check_seq_dim(seq_dim)
    sp_backend = _make_backend(mesh, seq_dim, remat, backend, remat_report, outputs, unsupported,
                               tile_loss, tile_mlp, loss_chunks, dynamic)
    dp_group = mesh.get_group("dp") if "dp" in (mesh.mesh_dim_names or ()) else None
    shard.check_not_fsdp2(model)
    if shard.is_sharded(model):
        shard.check_compile_mesh(model, mesh)
        average_dp = False  # the gradients' reduce-scatter already averages over dp
    return SequenceParallelModule(model, sp_backend, seq_dim, dp_group=dp_group if average_dp else None,
                                  sp_group=mesh.get_group("sp"), check_inputs=check_inputs,
                                  mesh_dp_group=dp_group)
