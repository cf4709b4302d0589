"""Public API: init_mesh, compile, backend."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autosp import guard, shard
from autosp.backend import BACKENDS, SequenceParallelBackend
from autosp.errors import AutospError
from autosp.remat import AUTO, Auto
from autosp.remat import POLICIES as REMAT_POLICIES
from autosp.call_errors import dead_group, group_alive
from autosp.sp_module import SequenceParallelModule, _check_seq_dim, _is_int

OUTPUTS = ("full", "local")
UNSUPPORTED = ("gather", "error")
#: ``regions``: False compiles every layer in one flat graph; "compile" compiles each class of
#: alike decoder layers once (autosp.outline), with Dynamo tracing every layer; True also has
#: Dynamo trace each class of repeated layers once (autosp.dynamo_regions).
REGIONS = (False, "compile", True)


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


def _sp_axis(mesh: DeviceMesh) -> tuple[int, int, str]:
    _check_mesh(mesh)
    names = mesh.mesh_dim_names or ()
    if not group_alive(None):
        raise dead_group("compile", None)
    try:
        group = mesh.get_group("sp")
        name = group.group_name
    except (RuntimeError, ValueError, KeyError) as e:
        raise dead_group("compile", None) from e
    if not group_alive(name):
        raise dead_group("compile", name)
    return mesh.get_local_rank("sp"), mesh.size(names.index("sp")), name


def _check_outputs(outputs: str) -> None:
    if outputs not in OUTPUTS:
        raise AutospError(f"[autosp:compile] found outputs={outputs!r}; expected one of {OUTPUTS}: "
                          "'full' returns what the single-device model returns, 'local' this "
                          "rank's chunk of outputs sharded along the sequence.")


def _check_regions(regions: Any) -> None:
    if not any(regions is mode or (isinstance(regions, str) and regions == mode) for mode in REGIONS):
        raise AutospError(f"[autosp:compile] found regions={regions!r}; expected one of {REGIONS}: "
                          "False compiles every layer in one graph, 'compile' compiles each class "
                          "of alike decoder layers once, True also has Dynamo trace it once.")


def _check_flags(loss_chunks: int | None = None, **flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            allowed = "True, False or None (automatic)" if name == "dynamic" else "True or False"
            raise AutospError(f"[autosp:compile] found {name}={value!r}; expected {allowed}.")
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
                  dynamic: bool = True, regions: bool | str = False) -> SequenceParallelBackend:
    rank, world, group = _sp_axis(mesh)
    return SequenceParallelBackend(rank=rank, world=world, group=group, seq_dim=seq_dim, remat=remat,
                                   backend=compiler, remat_report=remat_report,
                                   gather_outputs=outputs == "full",
                                   gather_unsupported=unsupported == "gather",
                                   tile_loss=tile_loss, tile_mlp=tile_mlp,
                                   loss_chunks=loss_chunks or 0, dynamic=dynamic,
                                   regions=regions)


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
    if isinstance(remat, Auto) or remat == AUTO:
        raise AutospError("[autosp:backend] found remat='auto'; expected a policy name, a "
                          "MemoryBudget or an Offload: 'auto' is chosen by autosp.compile at "
                          "the first call, from the model itself, which the raw backend lacks.")
    return _make_backend(mesh, seq_dim, remat, backend, outputs=outputs, unsupported=unsupported,
                         tile_loss=tile_loss, tile_mlp=tile_mlp, loss_chunks=loss_chunks,
                         dynamic=dynamic)


def compile(model: nn.Module, mesh: DeviceMesh, *, seq_dim: int = 1, remat: Any = "sequence-aware",
            backend: str = "inductor", average_dp: bool = True,
            remat_report: Any = None, outputs: str = "full",
            check_inputs: str = "on_change", unsupported: str = "gather",
            tile_loss: bool = False, tile_mlp: bool = False,
            loss_chunks: int | None = None, dynamic: bool | None = None,
            regions: bool | str = "compile") -> SequenceParallelModule:
    """Compile ``model`` for exact Ulysses sequence parallelism over the mesh's "sp" axis.

    Every rank of an SP group must be called with the same full-length batch; the
    returned loss equals the single-device loss and, after ``backward()``, every
    parameter's ``.grad`` equals the single-device gradient of its SP group's batch,
    averaged over the mesh's "dp" axis when it has more than one group (set
    ``average_dp=False`` when FSDP/DDP already averages over "dp").

    ``remat`` picks what the forward saves for backward (see autosp.remat); pass an
    ``autosp.remat.RematReport()`` as ``remat_report`` to see, per layer, what was saved and
    what is recomputed, with bytes and FLOPs (``print(report)``). ``remat="auto"`` (or
    ``autosp.remat.Auto(memory=..., host_memory=...)``) chooses at the first call: the
    combination of remat policy, ``tile_loss``, ``tile_mlp`` and activation offload with the
    least predicted step-time overhead whose predicted peak per rank at that call's sequence
    length fits the device (``SequenceParallelModule.remat_choice`` says which, and why). It
    traces the model's step once per tiling combination first (seconds to minutes); call it
    first with the longest sequence you will train. ``tile_loss=True`` or ``tile_mlp=True``
    with it keeps only combinations that tile.

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

    ``dynamic``: ``None`` (default) does what ``torch.compile`` does by default: the first
    sequence length is compiled with static sizes, and the first call with a second length
    compiles one graph for every length from then on. ``True`` compiles that one graph from the
    start. ``False`` has AOTAutograd and Inductor compile the graph for the shapes of each call,
    at its first call with them (autosp.specialize), for every length. autosp plans on a trace
    with the length symbolic in all three. A static compile takes 0.85x the first call's time
    at 2 layers and 0.64x at 16 under Inductor, and about a third under aot_eager
    (docs/compile_time.md), but each distinct length compiles in full.

    ``regions``: ``"compile"`` (the default) compiles each class of alike decoder layers once
    (autosp.outline: after the SP rewrite, layers whose nodes are alike, the same ops,
    constants, wiring, and operands of the same kinds, shapes, strides and dtypes, each call
    PyTorch's ``invoke_subgraph`` on one shared subgraph), so that the work of AOTAutograd and
    Inductor stops growing with depth; each layer recomputes what it recomputes flat. Dynamo
    still traces every layer. A layer that writes in place, holds a complex tensor or makes a
    data-dependent size stays inline (below); one that reads the rank (dropout's full-length
    draws, a mask sliced from a buffer) takes it as an operand of the shared subgraph.
    ``False`` compiles every layer in one flat graph (what ``autosp plan`` predicts; regions
    hold up to about 2% more).
    ``True`` (experimental; docs/compile_time.md) also has Dynamo trace each class once: on
    PyTorch 2.13 and later, each numbered layer
    (``layers.3``) whose class has two or more instances is given a subclass of its class with
    a ``nested_compile_region`` forward (autosp.dynamo_regions; ``.traced_once`` lists them).
    Where the forward writes state between layer calls (a module's attribute, a global), each
    call is traced instead (autosp.dynamo_reuse); a layer holding a reference to the model or
    to another layer is not marked, nor one holding a list, dict, deque or plain object of data (a
    number, string or tensor) that no other layer holds. A hook, a submodule or an attribute of
    a parameter changed on one layer after a compile, or a plain value (a flag, a norm's ``eps``,
    ``training``) changed on one layer and not on the first layer of its class after the first
    call, makes autosp trace every layer.
    ``SequenceParallelModule.last_compile.outlined`` says which layers call which subgraph,
    or why one stays inline (with ``remat=Offload(...)`` or a ``MemoryBudget`` all do: offloading
    and a budget are decided over the whole graph; autosp.outline.whole_graph_policy).

    ``tile_mlp``: run each row-wise block (an MLP or SwiGLU: linears and elementwise ops whose
    intermediates nothing else reads) a chunk of tokens at a time, recomputing each chunk in
    backward, so that one chunk's ``[tokens, ffn]`` intermediates exist at a time
    (autosp.tiled_rows). Exact up to the order of the weights' gradient sums; costs a second
    forward of the block. ``SequenceParallelModule.mlp_tiling`` lists the blocks.
    """
    compile_kwargs = {k: v for k, v in locals().items() if k != "model"}  # for copies
    if backend not in BACKENDS:
        raise AutospError(f"[autosp:compile] found backend={backend!r}; expected one of {BACKENDS}.")
    auto = Auto() if isinstance(remat, str) and remat == AUTO else remat
    auto = auto if isinstance(auto, Auto) else None
    if isinstance(remat, str) and remat not in REMAT_POLICIES and auto is None:
        raise AutospError(f"[autosp:compile] found remat={remat!r}; expected one of {REMAT_POLICIES}, "
                          "'auto', or an autosp.remat.MemoryBudget, Offload or Auto.")
    _check_outputs(outputs)
    _check_unsupported(unsupported)
    # With remat='auto' the chunks are the tiled loss's if auto turns it on.
    _check_flags(loss_chunks, tile_loss=tile_loss or auto is not None, tile_mlp=tile_mlp,
                 **({} if dynamic is None else {"dynamic": dynamic}))
    _check_regions(regions)
    guard.check_mode(check_inputs)
    _check_seq_dim(seq_dim)
    sp_backend = _make_backend(mesh, seq_dim, auto or remat, backend, remat_report, outputs, unsupported,
                               tile_loss, tile_mlp, loss_chunks, bool(dynamic), regions)
    dp_group = mesh.get_group("dp") if "dp" in (mesh.mesh_dim_names or ()) else None
    shard.check_not_fsdp2(model)
    if shard.is_sharded(model):
        shard.check_compile_mesh(model, mesh)
        average_dp = False  # the gradients' reduce-scatter already averages over dp
    module = SequenceParallelModule(model, sp_backend, seq_dim, dp_group=dp_group if average_dp else None,
                                    sp_group=mesh.get_group("sp"), check_inputs=check_inputs,
                                    mesh_dp_group=dp_group, dynamic_after_one_length=dynamic is None)
    module.compile_kwargs = compile_kwargs
    if auto is not None:
        from autosp import remat_auto

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        budget, host = remat_auto.budgets(auto, device, mesh.size())
        module._auto = remat_auto.AutoRequest(
            auto, budget, host, param_shards=mesh.size() if shard.is_sharded(model) else 1,
            tile_loss=tile_loss, tile_mlp=tile_mlp, loss_chunks=loss_chunks)
    return module
