"""Memory of a real training step on CPU, measured (for the tests that check the planner's
predictions, and for bench/).

``train_step_memory(model, compiled, *args)`` runs two training steps of ``compiled`` (which
returns the loss) with AdamW: the first compiles and creates the optimizer state, the second is
measured:

- the peak: bytes live before the step (parameters and AdamW state; a DTensor parameter
  counts its own shard) plus the maximum of the running sum of the CPU allocations and frees
  ``torch.profiler`` records with ``profile_memory=True`` during ``zero_grad``, forward,
  backward and ``AdamW(foreach=True).step()``;
- the saved activations: the distinct storages the compiled forward hands to
  ``ctx.save_for_backward`` (``torch.autograd.graph.saved_tensors_hooks``), parameters
  excluded.

Compile with the ``aot_eager`` backend for numbers the planner's model compares with: its
graphs run op by op and free each value after its last use.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class StepMemory(NamedTuple):
    saved_bytes: int
    peak_bytes: int


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _saving(model: torch.nn.Module) -> tuple[dict[int, int], Any]:
    """A pack hook for ``saved_tensors_hooks`` that records, by storage, the bytes of every
    distinct storage saved for backward (parameters excluded), and the dict it fills."""
    param_storages = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    return saved, pack


def saved_bytes(model: torch.nn.Module, compiled: Any, *args: Any) -> int:
    """The distinct storages one forward of ``compiled`` (which returns the loss) hands to
    ``ctx.save_for_backward``, parameters excluded; runs the backward too."""
    saved, pack = _saving(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(*args)
    loss.backward()
    return sum(saved.values())


def train_step_memory(model: torch.nn.Module, compiled: Any, *args: Any) -> StepMemory:
    """Saved-activation bytes and peak bytes of the second training step (see the module)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    saved, pack = _saving(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compiled(*args)
        loss.backward()
        optimizer.step()

    step()  # compiles, creates the AdamW state
    saved.clear()
    live_before = sum(_local(p).untyped_storage().nbytes() for p in model.parameters())
    live_before += sum(_local(t).untyped_storage().nbytes() for state in optimizer.state.values()
                       for t in state.values() if isinstance(t, torch.Tensor))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return StepMemory(sum(saved.values()), live_before + peak)
