"""What autosp's tiled custom ops share (autosp.tiled_attention, autosp.tiled_loss): a
registry of the per-graph functions ("recipes") their kernels replay on each tile, keyed by a
hash of what they compute, and autograd inside a custom op's kernel (their backwards recompute
each tile and back-propagate it)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


class Recipes:
    """Functions a custom op's kernel looks up by key (an int argument of the op)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._by_key: dict[int, Callable[..., torch.Tensor]] = {}

    def __setitem__(self, key: int, fn: Callable[..., torch.Tensor]) -> None:
        self._by_key[key] = fn

    def setdefault(self, key: int, fn: Callable[..., torch.Tensor]) -> None:
        self._by_key.setdefault(key, fn)

    def __getitem__(self, key: int) -> Callable[..., torch.Tensor]:
        try:
            return self._by_key[key]
        except KeyError:
            raise AssertionError(f"{self.what} {key} is not registered in this process") from None


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Autograd within a custom op's kernel, which the dispatcher runs below the autograd keys
    (excluded in the thread-local dispatch state): re-included for the block, restored after."""
    keys = [torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
            torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView]
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    for k in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
    try:
        yield
    finally:
        for k, b in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, b)


#: An autocast state: (device type, dtype) per device type with autocast enabled.
AutocastState = tuple[tuple[str, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """The torch.autocast state in force now (at compile time, the state the user's step runs
    under: Dynamo compiles inside the caller's autocast region)."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                 if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def replayed_autocast(state: AutocastState) -> Iterator[None]:
    """Runs the block under ``state``, as the step it was compiled from ran: a custom op's
    kernel runs with autocast off (AOTAutograd's graphs carry its casts explicitly, and run
    with the autocast keys excluded), so a recipe replaying the user's ops re-enters it,
    re-including the keys for the block."""
    if not state:
        yield
        return
    keys = [torch._C.DispatchKey.AutocastCPU, torch._C.DispatchKey.AutocastCUDA]
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    try:
        for k in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        with contextlib.ExitStack() as stack:
            for device, dtype in state:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield
    finally:
        for k, b in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, b)


def stable_name(target: Any) -> str:
    """An FX target's name, the same in every process (``str`` of a Python function holds its
    address, which would change a recipe's key, and with it the compile caches' keys, from
    one process to the next)."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if name:
        return f"{getattr(target, '__module__', None) or ''}.{name}"
    return f"{type(target).__module__}.{type(target).__qualname__}"
