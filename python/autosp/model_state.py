"""The model's state a compiled call depends on beyond its inputs: its parameters (which require
gradients, their dtypes) and its module hooks.

Ranks of an SP group run one plan whose collectives follow the parameters (a frozen parameter
has no gradient to all-reduce), and each rank computes its part of every layer, so a hook must
run on every rank alike. A rank that froze, converted or added parameters, or registered a hook,
the others did not would wait in a different collective (a hang, or Gloo aborting every rank) or
mix its result with theirs. :class:`ModelState` reads the model at each call (parameters and
modules replaced or added after the compile included: a checkpoint loaded with ``assign=True``,
LoRA adapters), walking it again only after a change, and gives

- a fingerprint that is equal across ranks holding the same model, which autosp.guard
  compares across the SP and data-parallel groups with the inputs;
- whether anything changed on this rank since the last call (hooks by identity, modules and
  parameters by identity), for the checks that Dynamo's guards do not make (autosp.sp_module);
- with data parallelism, the hooks that average each trainable parameter's gradient over "dp",
  for parameters that require gradients now (a parameter frozen at the compile, or added after
  it, had none and kept its own group's gradient, silently).
"""

from __future__ import annotations

import warnings
import zlib
from array import array
from itertools import chain
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.modules.module as module_globals
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from autosp.errors import AutospError, AutospHookWarning
from autosp.layer_alike import _HOOKS

_REQUIRES_GRAD = attrgetter("requires_grad")
_DTYPE = attrgetter("dtype")
# Parameters' dtypes, coded in one byte each for the fingerprint.
_DTYPE_CODE = {d: i for i, d in enumerate(sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str))}
# Hooks on every module (torch.nn.modules.module.register_module_forward_hook and the like).
_GLOBAL_HOOKS = tuple(name for name in vars(module_globals)
                      if name.startswith("_global_") and "hook" in name and "registration" not in name
                      and isinstance(vars(module_globals)[name], dict))


def _sizes(params: list[nn.Parameter]) -> bytes:
    """The parameters' element counts (a parameter of another shape on one rank), 0 for one not
    yet materialised."""
    try:
        return array("q", map(torch.Tensor.numel, params)).tobytes()
    except (ValueError, RuntimeError):  # an nn.LazyLinear's UninitializedParameter
        return array("q", (0 if is_lazy(p) else p.numel() for p in params)).tobytes()


class ModelState:
    """``model``'s parameters and hooks, per call; the gradients' averaging over ``dp_group``
    (None or one rank: no averaging)."""

    def __init__(self, model: nn.Module, dp_group: Any = None) -> None:
        self.model = model
        self.dp_group = dp_group if dp_group is not None and dist.get_world_size(dp_group) > 1 \
            else None
        self._local: tuple[int, int] | None = None
        self._trainable: bytes | None = None
        self._next_id = -1
        self._average = self._averaging()  # the hook on every trainable parameter, with dp
        self._lazy = False  # a parameter not yet materialised (nn.LazyLinear): hooked later
        self._params: list[nn.Parameter] = []
        self._param_dicts: list[dict] = []  # every module's _parameters, at the last walk
        self._module_dicts: list[dict] = []  # and _modules
        self._dicts: list[dict] = []  # every module's hook dicts, then the global ones
        self._seen = b""
        self._ids = 0
        self.global_hooks: frozenset[tuple[str, Any]] = frozenset()  # as at the first call

    @staticmethod
    def global_hook_keys() -> frozenset[tuple[str, Any]]:
        """The hooks registered on every module, by name of their dict and handle id."""
        return frozenset((name, k) for name in _GLOBAL_HOOKS
                         for k in vars(module_globals)[name])

    def state(self) -> tuple[tuple[int, int, int, int], bool]:
        """``((parameters requiring gradients, parameters, a crc32 of the parameters and hooks,
        whether a torch dispatch mode is active), changed)``: the first is equal across ranks
        holding the same model (the crc covers which parameters require gradients, their dtypes
        and sizes, and how many hooks of each kind every module and the global registry hold);
        ``changed`` is whether this rank's modules,
        parameters or hooks are other objects than at the last call. With data parallelism, a
        parameter that requires gradients gets its averaging hook here, before the call's
        backward.

        The model is walked again only where one of its modules holds other parameters or
        submodules than at the last walk (read from their dicts' values by identity, whichever
        way they were written: setattr, ``load_state_dict(assign=True)``, ``_parameters[name] =``,
        ``ModuleList.insert``), or after a hook was created anywhere in the process
        (``RemovableHandle.next_id``); otherwise a call reads those identities, the parameters'
        flags and dtypes and the hook dicts' sizes (a hook removed shrinks one), in C loops."""
        members = self._members()
        if members != self._seen or RemovableHandle.next_id != self._next_id:
            self._next_id = RemovableHandle.next_id
            modules, self._params = list(self.model.modules()), list(self.model.parameters())
            self._param_dicts = [vars(m).get("_parameters", {}) for m in modules]
            self._module_dicts = [vars(m).get("_modules", {}) for m in modules]
            self._dicts = [vars(m).get(h, {}) for m in modules for h in _HOOKS]
            self._dicts += [vars(module_globals)[name] for name in _GLOBAL_HOOKS]
            members = self._seen = self._members()
            # The hooks by identity: a hook replaced by another keeps its dict's size.
            keys = array("q", (hash(tuple(d)) if d else 0 for d in self._dicts))
            self._ids = zlib.crc32(members + keys.tobytes())
        params = self._params
        rg = bytes(map(_REQUIRES_GRAD, params))
        counts = array("q", map(len, self._dicts)).tobytes()
        shared = zlib.crc32(rg + bytes(map(_DTYPE_CODE.__getitem__, map(_DTYPE, params)))
                            + counts + _sizes(params))
        local = (self._ids, zlib.crc32(counts))
        if self._local is None:  # the first call, which Dynamo traces with them
            self.global_hooks = self.global_hook_keys()
        changed = self._local is not None and local != self._local
        if local != self._local or rg != self._trainable or self._lazy:
            self._local, self._trainable = local, rg
            self._hook_trainable(params)
        return (sum(rg), len(params), shared, int(bool(_user_modes()))), changed

    def _members(self) -> bytes:
        """The identities of what the walked modules hold (parameters, submodules)."""
        values = chain(chain.from_iterable(map(dict.values, self._param_dicts)),
                       chain.from_iterable(map(dict.values, self._module_dicts)))
        return array("q", map(id, values)).tobytes()

    def warn_new_global_hooks(self) -> None:
        """Hooks on every module (``register_module_forward_hook``) registered after the first
        call do not run in the graph compiled before them: Dynamo does not guard on them."""
        new = self.global_hook_keys() - self.global_hooks
        if new:
            self.global_hooks |= new
            warnings.warn(
                "[autosp:compile] found a global module hook (torch.nn.modules.module."
                f"register_module_*_hook: {', '.join(sorted({n for n, _ in new}))}) registered after "
                "the model was compiled; the compiled graph runs without it (Dynamo does not guard "
                "on global hooks), so a hook that changes a module's output has no effect on the loss "
                "and gradients. Expected global hooks registered before the first call, which are "
                "traced into the graph, or a per-module hook (module.register_forward_hook), which "
                "compiles again.", AutospHookWarning, stacklevel=4)

    def _averaging(self) -> Any:
        group = self.dp_group
        if group is None:
            return None
        size = dist.get_world_size(group)

        def average(p: torch.Tensor) -> None:
            # Data parallelism across SP groups: average each gradient over "dp" once it is
            # complete (the SP reduction already happened inside the compiled graph).
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(size)

        return average

    def _hook_trainable(self, params: list[nn.Parameter]) -> None:
        """Hook every parameter that requires gradients and does not hold this state's hook
        (read on the parameter itself, so a parameter copied or loaded from a pickle, which
        carries no hook, gets one)."""
        if self._average is None:
            return
        self._lazy = False
        for p in params:
            if not p.requires_grad:
                continue
            if is_lazy(p):  # hooked once materialised, at a later call
                self._lazy = True
                continue
            held = getattr(p, "_post_accumulate_grad_hooks", None) or {}
            if not any(h is self._average for h in held.values()):
                handle = p.register_post_accumulate_grad_hook(self._average)
                # First: a hook of the user's registered before (an optimizer step in
                # backward, clipping) reads the averaged gradient, as it would under DDP. The
                # engine runs them in the dict's insertion order (OrderedDict.move_to_end does
                # not change it): inserted again, in the same dict (handles remove by key).
                hooks = p._post_accumulate_grad_hooks
                others = [(k, h) for k, h in hooks.items() if k != handle.id]
                hooks.clear()
                hooks[handle.id] = self._average
                hooks.update(others)

    def after_call(self) -> None:
        """A lazy parameter materialised by the call just made gets its averaging hook now,
        before the call's backward."""
        if self._lazy:
            self._hook_trainable(self._params)


def _user_modes() -> list[str]:
    """The torch dispatch modes active now that torch.compile does not run under
    (``FlopCounterMode``, a user's ``TorchDispatchMode``), by class name."""
    from torch.utils import _python_dispatch as dispatch

    stack = getattr(dispatch, "_get_current_dispatch_mode_stack", lambda: [])()
    return [type(m).__name__ for m in stack
            if not getattr(m, "is_infra_mode", lambda: False)()
            and not getattr(m, "ignore_compile_internals", lambda: False)()]


def dispatch_mode_error() -> AutospError:
    """The error for a torch dispatch mode active around the call (Dynamo's own error was a
    raw RuntimeError). Raised after the input guard, which compared whether one is active
    across the mesh (ModelState.state; one rank alone under it would leave the others
    waiting)."""
    modes = _user_modes()
    return AutospError(
        f"[autosp:compile] found a torch dispatch mode active around the call ({', '.join(modes)}); "
        "expected none: torch.compile does not run a compiled graph under one. Count FLOPs or "
        "trace ops on the model outside autosp (on one device), or leave the mode before calling "
        "the compiled module.")


def top_level_hooks(model: nn.Module) -> str:
    """The forward hooks and pre-hooks registered on ``model`` itself, by name."""
    hooks = [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
    return ", ".join(getattr(h, "__qualname__", type(h).__qualname__) for h in hooks)


def state_text(trainable: int, total: int, code: int, mode: int = 0) -> str:
    """One rank's state, for messages."""
    return (f"{trainable} of {total} parameters require gradients (parameters and hooks: "
            f"{code & 0xFFFFFFFF:08x})" + (", under a torch dispatch mode" if mode else ""))
