"""What autosp's tiled custom ops share (autosp.tiled_attention, autosp.tiled_loss): a
registry of the per-graph functions ("recipes") their kernels replay on each tile, keyed by a
hash of what they compute, and autograd inside a custom op's kernel (their backwards recompute
each tile and back-propagate it)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

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
