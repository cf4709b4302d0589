"""The module ``autosp.compile`` returns (SequenceParallelModule): each call checks the SP
group is alive and the inputs agree across it, marks the sequence dims dynamic, resolves
``remat="auto"`` at the first call (autosp.remat_auto), and runs the compiled model; errors
from capture and compilation become AutospErrors. Re-exported by ``autosp.api``."""

from __future__ import annotations

import collections
import copy
import contextlib
import functools
import inspect
import numbers
import warnings
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autosp import call_errors, dynamo_regions, dynamo_reuse, guard, layer_alike, shard
from autosp.backend import CompileRefused, SequenceParallelBackend
from autosp.errors import AutospError, internal_error
from autosp.model_state import ModelState, dispatch_mode_error, top_level_hooks
from autosp.sp_records import CompileRecords


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_seq_dim(seq_dim: Any) -> None:
    if not _is_int(seq_dim) or seq_dim < 1:
        raise AutospError(
            f"[autosp:compile] found seq_dim={seq_dim!r}; expected an int >= 1, the index of the sequence "
            "dim in the batch-first inputs (dim 0 is the batch; negative indices are ambiguous across "
            "inputs of different rank): seq_dim=1 (the default) for [B, S] token ids."
        )


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


# Said by Dynamo where the user's torch.compile(fullgraph=True) meets the compiled module.
_DISABLE_REASON = {"reason": "autosp.compile's module runs its own compiled graph; call it outside "
                             "torch.compile(fullgraph=True), or compile without fullgraph (a graph "
                             "break at this call)"} \
    if "reason" in inspect.signature(torch.compiler.disable).parameters else {}

#: How many autosp.compile calls compiled each forward's code in this process: Dynamo's
#: recompile limit counts the graphs of a code object, whichever module they are for.
_COMPILES_OF_CODE: collections.Counter = collections.Counter()


class SequenceParallelModule(CompileRecords, nn.Module):
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
                 mesh_dp_group: Any = None, dynamic_after_one_length: bool = False) -> None:
        super().__init__()
        _check_seq_dim(seq_dim)
        self.module = model
        self.sp_backend = sp_backend
        self.seq_dim = seq_dim
        self.names = guard.positional_names(model.forward)
        self.sp_group = sp_group
        self._capture_data_dependent = False
        self.compile_kwargs: dict[str, Any] | None = None  # autosp.compile's arguments, for copies
        self.input_guard = guard.InputGuard(sp_group, check_inputs, self.names, dp_group=mesh_dp_group)
        self._signatures: dict[tuple, None] = {}  # distinct shapes (S aside), dtypes, train mode
        self._code = getattr(getattr(model.forward, "__func__", model.forward), "__code__", None)
        _COMPILES_OF_CODE[self._code] += 1
        # Not registered as a submodule: the parameters and state_dict are the model's,
        # under "module." as with DistributedDataParallel.
        object.__setattr__(self, "_compiled",
                           torch.compile(model, backend=sp_backend, fullgraph=True, dynamic=False))
        # autosp.compile(dynamic=None): static sizes for the first sequence length, one graph
        # for every length from the second on (what torch.compile does by default).
        self._dynamic_after_one_length = dynamic_after_one_length and not sp_backend.dynamic
        self._calls: set[tuple] = set()  # (length, signature, grad mode) before the switch
        self._static_calls: frozenset[tuple] = frozenset()  # the same, frozen at the switch
        self._static_graphs = 0  # Dynamo graphs compiled before the switch
        # regions=True: Dynamo traces each class of repeated layers once (autosp.dynamo_regions),
        # not FSDP2-sharded layers (DTensor operands). An earlier compile's marks are undone.
        dynamo_regions.unmark_layers(model)
        self.traced_once: list[str] = []
        if getattr(sp_backend, "regions", False) is True and not shard.is_sharded(model):
            self.traced_once = dynamo_regions.mark_layers(model)
        self._holders = dynamo_reuse.shared_modules(model, self.traced_once)
        if self.traced_once:
            sp_backend.layers_apart = functools.partial(dynamo_regions.marked_apart, model)
        # The marked layers' tensors and their attributes, and their modules' plain state.
        self._watched: tuple[list, tuple, layer_alike.PlainWatch] | None = None
        self._auto: Any = None  # remat="auto" until the first call (autosp.remat_auto)
        self.remat_choice: Any = None  # what remat="auto" chose (autosp.remat_auto.AutoChoice)
        # The parameters (which require gradients, their dtypes) and hooks, compared across the
        # mesh with the inputs; with data parallelism across SP groups, each trainable
        # parameter's gradient is averaged over "dp" (the SP reduction happens inside the
        # compiled graph).
        self.model_state = ModelState(model, dp_group)

    def _arg_name(self, key: int | str) -> str:
        if isinstance(key, str):
            return f"keyword argument {key!r}"
        return f"argument {key}" + (f" ({self.names[key]})" if key < len(self.names) else "")

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[int, tuple]:
        """Check the sequence length and mark the sequence dims dynamic: dim ``seq_dim`` of
        every top-level tensor argument of the sequence length S, and, for boolean or
        integer tensors (attention masks such as [B, 1, S, S]), every other dim >= 1 of size S.
        Returns S, and the tensors' shapes (marked dims as None) and dtypes with the train
        mode: what a new graph is compiled for. Records nothing about the call (forward does)."""
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
        return seq, (tuple(key), self.module.training)

    def _static_graph(self, call: tuple, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """After the switch, run ``call``, made as before it, on its static graph: (True, its
        result). (False, None) where none serves it any more: Dynamo's guards hold more
        than the call's record (which parameters require gradients, autocast, strides, values
        the model reads), and a graph compiled there would serve only the lengths from before
        the switch. Dynamo then traces the call, the backend refuses it before compiling or
        running anything, and the call is no longer taken for one made before the switch."""
        self.sp_backend.refuse_compiles = True
        try:
            return True, self._compiled_static(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if not isinstance(getattr(e, "inner_exception", None) or e.__cause__, CompileRefused):
                raise
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            pass  # the code's graphs (both compiles') fill the limit: one of the symbolic may serve
        finally:
            self.sp_backend.refuse_compiles = False
        self._static_calls = self._static_calls - {call}
        return False, None

    def _at_length(self, seq: int) -> None:
        """With ``dynamic=None``: at the first call with a second sequence length, compile one
        graph for every length. A new ``torch.compile`` of the model gives Dynamo a backend of
        another identity, so it traces the model again and the backend compiles that trace with
        the length symbolic, inside Dynamo's compile (so that the guards AOTAutograd and
        Inductor add are installed). Calls as made before the switch (length, shapes, dtypes,
        modes) go on through the first ``torch.compile`` to their static graphs, as
        ``torch.compile`` keeps its static graph for the first shape; every other call takes the
        new one, so that no signature has a graph in both."""
        seen = {call[0] for call in self._calls}
        # At a new length, and not at one token per rank: Dynamo would specialise the graph on
        # a chunk of size 1.
        if self._dynamic_after_one_length and seen and seq not in seen \
                and seq > self.sp_backend.ctx.world:
            self._dynamic_after_one_length = False
            self._static_calls = frozenset(self._calls)
            # The static graphs stay in Dynamo's cache of the forward's code, where they count
            # towards its recompile limit; forward raises the limit by as many.
            self._static_graphs = len(self.sp_backend.records)
            self.sp_backend.dynamic = True
            sp_backend = self.sp_backend

            def every_length(gm: Any, example_inputs: Any) -> Any:  # Dynamo keys by identity
                return sp_backend(gm, example_inputs)

            object.__setattr__(self, "_compiled_static", self._compiled)
            object.__setattr__(self, "_compiled", torch.compile(
                self.module, backend=every_length, fullgraph=True, dynamic=False))

    # Called inside the user's own torch.compile (a compiled training step), the call is a graph
    # break: this module runs its own compiled graph, as an island in theirs.
    @torch.compiler.disable(**_DISABLE_REASON)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        result = self._forward(*args, **kwargs)
        self.model_state.after_call()
        return result

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.sp_group is not None and not call_errors.group_alive(self.sp_backend.ctx.group):
            raise call_errors.dead_group("forward", self.sp_backend.ctx.group)
        leaves = guard.flatten_inputs(args, kwargs, self.names)
        sig = guard.signature(leaves)
        state, changed = self.model_state.state()
        # Before any local check: ranks decide alike.
        self.input_guard.check_call(leaves, sig, state)
        if state[3]:  # a torch dispatch mode around the call, on every rank (the guard compared)
            raise dispatch_mode_error()
        if changed:
            self.model_state.warn_new_global_hooks()
        if self.traced_once and (why := self._marked_apart(changed)):
            # A layer traced once no longer alike the first (a hook registered on one of its
            # submodules, an attribute set on one of its parameters, since the last call):
            # Dynamo's reuse guards do not check it.
            return self._trace_every_layer(why, args, kwargs)
        seq, prepared = self._prepare(args, kwargs)
        self._at_length(seq)
        self._signatures.setdefault(prepared, None)
        call = (seq, prepared, torch.is_grad_enabled())
        if self._dynamic_after_one_length:
            self._calls.add(call)
        # A hook added or removed after a compile recompiles, where Dynamo's default runs the
        # graph compiled without it: a loss and gradients without the hook's effect, silently.
        patch: dict[str, Any] = {"skip_nnmodule_hook_guards": False}
        if self._capture_data_dependent:
            # Data-dependent ops (torch.where(mask) in MoE routing) are captured into the graph,
            # where the core keeps them local to each rank's tokens (token-local regions). Only
            # for modules that need it: the capture makes every compile slower.
            patch["capture_dynamic_output_shape_ops"] = True
        if hasattr(torch._dynamo.config, "ignore_logging_functions"):
            patch["ignore_logging_functions"] = _logging_functions()
        if self._static_graphs:
            patch["recompile_limit"] = torch._dynamo.config.recompile_limit + self._static_graphs
        try:
            # Layers traced once: Dynamo's reuse refused where the forward writes outer state
            # (autosp.dynamo_reuse).
            reuse = (dynamo_reuse.gated(self._holders) if self.traced_once
                     else contextlib.nullcontext())
            with torch._dynamo.config.patch(**patch), reuse:
                if self._auto is not None:
                    from autosp.remat_auto import choose_for_call

                    if torch.is_grad_enabled():
                        self.remat_choice = choose_for_call(self, self._auto, args, kwargs)
                        self._auto = None
                    elif not isinstance(self.sp_backend.remat, str):
                        # No backward to remat for: compiled as it is, chosen at the first
                        # call with gradients (a new grad mode compiles anew).
                        self.sp_backend.remat = "none"
                if call in self._static_calls:
                    served, result = self._static_graph(call, args, kwargs)
                    if served:
                        return result
                return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None) or e.__cause__ or e
            if isinstance(inner, dynamo_regions.RegionReuseError) and self.traced_once:
                return self._trace_every_layer(str(inner), args, kwargs)
            if isinstance(inner, AutospError):
                if (hooks := top_level_hooks(self.module)) and "symbolic sequence length" in str(inner):
                    raise call_errors.hook_on_model(hooks, inner) from inner
                raise inner.with_traceback(None) from inner.__cause__
            raise internal_error("compile", inner) from inner
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise self._recompile_error(leaves) from e
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            text = str(e)
            if self.traced_once:
                return self._trace_every_layer(text.splitlines()[0] if text else type(e).__name__,
                                               args, kwargs)
            if not self._capture_data_dependent and "capture_dynamic_output_shape_ops" in text:
                # Dynamo stopped at a data-dependent op before anything ran (every rank alike):
                # capture it, once, and compile again.
                self._capture_data_dependent = True
                return self.forward(*args, **kwargs)
            raise call_errors.graph_break(text, type(e).__name__) from None
        except (torch._dynamo.exc.TorchDynamoException, GuardOnDataDependentSymNode) as e:
            if self.traced_once:
                # Dynamo failed on the layers traced once, e.g. a region traced with layer 0's
                # data-dependent size guarding on layer 1's (a mixture of experts' routing):
                # trace every layer instead. (A failure while running, such as a bad token id,
                # is the user's and is raised as without regions.)
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                return self._trace_every_layer(f"{type(e).__name__}: {first}", args, kwargs)
            raise

    def _marked_apart(self, changed: bool) -> str | None:
        """dynamo_regions.marked_apart, asked where the model's modules, parameters or hooks
        changed, or an attribute set on a marked layer's parameter or buffer did (compared at
        every call: 288 tensors' attributes at 32 layers); and where a marked layer's plain
        state changed alone (layer_alike.PlainWatch, also every call)."""
        if self._watched is None or changed:
            tensors = dynamo_regions.marked_tensors(self.module)
            attrs = layer_alike.tensor_attributes(tensors)
            plain = layer_alike.PlainWatch(dynamo_regions.marked_groups(self.module))
            why = self._watched[2].changed_alone() if self._watched is not None else None
            self._watched = (tensors, attrs, plain)
            return why or dynamo_regions.marked_apart(self.module)
        tensors, before, plain = self._watched
        if why := plain.changed_alone():
            return why
        attrs = layer_alike.tensor_attributes(tensors)
        if attrs == before:
            return None
        self._watched = (tensors, attrs, plain)
        return dynamo_regions.marked_apart(self.module)

    def _trace_every_layer(self, why: str, args: tuple, kwargs: dict) -> Any:
        """Dynamo could not trace the marked layers once per class (autosp.dynamo_regions):
        unmark them, say so, and compile again tracing every layer (autosp.outline still
        compiles alike layers once)."""
        dynamo_regions.unmark_layers(self.module)
        self.sp_backend.layers_apart = None
        warnings.warn(f"[autosp:capture] Dynamo could not trace the repeated layers "
                      f"({', '.join(self.traced_once[:3])}, ...) once per class: {why}; "
                      "tracing every layer instead.", stacklevel=3)
        self.traced_once = []
        return self.forward(*args, **kwargs)

    def _recompile_error(self, leaves: list) -> AutospError:
        call = ", ".join(f"{leaf.name} {guard.describe_tensor(leaf.value.shape, leaf.value.dtype)}"
                         for leaf in leaves if isinstance(leaf.value, torch.Tensor))
        return call_errors.recompile_limit(type(self.module).__qualname__, call, self.module.training,
                                           len(self._signatures), _COMPILES_OF_CODE[self._code])

    def __deepcopy__(self, memo: dict[int, Any]) -> "SequenceParallelModule":
        """A deep copy of the model, compiled as this one was (on the same mesh): compiled
        graphs and process groups are not copied. ``copy.deepcopy`` of a plain
        ``torch.compile``d module copies the model and compiles it again, too."""
        if self.compile_kwargs is None:
            raise AutospError("[autosp:compile] found a deep copy of a SequenceParallelModule made "
                              "without autosp.compile; expected the module autosp.compile "
                              "returns: copy the model and compile the copy.")
        from autosp.api import compile as compile_model

        return compile_model(copy.deepcopy(self.module, memo), **self.compile_kwargs)

    def __copy__(self) -> "SequenceParallelModule":
        raise AutospError("[autosp:compile] found copy.copy of the compiled module; expected "
                          "copy.deepcopy, which copies the model and compiles the copy (a shallow "
                          "copy would share the compiled graphs and their state).")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise AutospError(
            "[autosp:compile] found the compiled module pickled (pickle, torch.save); expected the "
            "model or its weights to be saved: the compiled module holds process groups and "
            "compiled graphs, which do not pickle. Save compiled.module (or its state_dict(); "
            "compiled.state_dict() holds the same under \"module.\") and compile it again after "
            "loading.")
