"""The parameters' state a compiled call depends on beyond its inputs: which require gradients
and their dtypes.

Ranks of an SP group run one plan whose collectives follow that state (a frozen parameter has no
gradient to all-reduce). A rank that froze or converted parameters the others did not would wait
in a different collective: a hang, or Gloo aborting every rank. :class:`ParamState` gives a
fingerprint of the state, which autosp.guard compares across the group with the inputs, and, with
data parallelism, averages every trainable parameter's gradient over "dp", including a parameter
unfrozen after the compile (one frozen at the compile had no hook and kept its own group's
gradient, silently).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Parameters' dtypes, coded in one byte each for the fingerprint.
_DTYPE_CODE = {d: i for i, d in enumerate(sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str))}


class ParamState:
    """The parameters ``model`` had when it was compiled, their fingerprint per call, and the
    gradient averaging over ``dp_group`` (None or one rank: no averaging)."""

    def __init__(self, model: nn.Module, dp_group: Any = None) -> None:
        self.params = list(model.parameters())
        self.dp_group = dp_group if dp_group is not None and dist.get_world_size(dp_group) > 1 \
            else None
        self._hooked: set[int] = set()  # indices into self.params
        self._hooks: list[Any] = []
        self._last: tuple[int, int] | None = None
        self.state()

    def state(self) -> tuple[int, int]:
        """(how many parameters require gradients, a crc32 of which do and of every dtype).
        With data parallelism, a parameter that requires gradients gets the hook that averages
        its gradient over "dp" here, before the call's backward."""
        rg = bytes(p.requires_grad for p in self.params)
        code = zlib.crc32(rg + bytes(_DTYPE_CODE.get(p.dtype, 255) for p in self.params))
        now = (sum(rg), code)
        if now != self._last:
            self._last = now
            self._hook_trainable()
        return now

    def _hook_trainable(self) -> None:
        if self.dp_group is None:
            return
        group = self.dp_group
        size = dist.get_world_size(group)

        def average(p: torch.Tensor) -> None:
            # Data parallelism across SP groups: average each gradient over "dp" once it is
            # complete (the SP reduction already happened inside the compiled graph).
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(size)

        for i, p in enumerate(self.params):
            if p.requires_grad and i not in self._hooked:
                self._hooked.add(i)
                self._hooks.append(p.register_post_accumulate_grad_hook(average))


def state_text(trainable: int, code: int, total: int) -> str:
    """One rank's state, for messages."""
    return f"{trainable} of {total} parameters require gradients (state {code & 0xFFFFFFFF:08x})"
