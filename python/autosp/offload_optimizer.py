"""The optimizer in host memory (ZeRO-Offload): ``autosp.OffloadOptimizer``.

    model = autosp.compile(model.to("cuda", torch.bfloat16), mesh=mesh)
    opt = autosp.OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

The device keeps the parameters and their gradients, in the model's dtype, and nothing else of
the training state. The optimizer's state (its master weights, fp32 for bf16 or fp16
parameters, and e.g. AdamW's two moments) lives in host memory, pinned when the parameters are
on CUDA, and ``step()`` runs the wrapped torch optimizer there:

1. each gradient is copied to its master weight's ``.grad`` on the host (upcast);
2. the wrapped optimizer steps the master weights (torch's own AdamW, on CPU tensors);
3. the updated master weights are copied back into the device parameters (downcast).

For Llama-3.1-8B in bf16 that moves 96 GB of master weights and AdamW state off each GPU
(``autosp plan --offload-optimizer`` predicts what it buys), at the cost of two copies of the
parameters over the host link and a CPU optimizer step per step. It is DeepSpeed's ZeRO-Offload
and torchao's ``CPUOffloadOptimizer`` without their overlap of the copies with the backward:
AOTAutograd's compiled backward returns every gradient at its end, so there is nothing to
overlap them with.

Parameters sharded with ``autosp.fully_shard`` (DTensors) are refused: their optimizer state is
already 1/world per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from autosp.errors import AutospError

__all__ = ["OffloadOptimizer"]


def _master_dtype(p: torch.Tensor, master_dtype: torch.dtype | None) -> torch.dtype:
    if master_dtype is not None:
        return master_dtype
    # fp32 master weights for bf16/fp16 parameters; fp32 and fp64 keep their own.
    return torch.float32 if p.is_floating_point() and p.element_size() < 4 else p.dtype


class OffloadOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_class`` (default ``torch.optim.AdamW``, built with ``**defaults``) so
    that it steps fp32 master copies of ``params`` in host memory (see the module's text).
    ``params``: tensors or parameter groups, as for any torch optimizer. ``master_dtype``:
    the master weights' dtype (default: fp32 for parameters of fewer than 4 bytes, the
    parameter's own otherwise).

    ``param_groups`` are the wrapped optimizer's, so LR schedulers work. ``state_dict()``
    holds the wrapped optimizer's state and the master weights; ``load_state_dict`` restores
    both and copies the master weights into the parameters."""

    # Like torchao's CPUOffloadOptimizer, this subclasses Optimizer (LR schedulers check it)
    # without calling its __init__: the state is the wrapped optimizer's.
    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer]
                 = torch.optim.AdamW, *, master_dtype: torch.dtype | None = None,
                 **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise AutospError(f"[autosp:OffloadOptimizer] found optimizer_class="
                              f"{optimizer_class!r}; expected a torch.optim.Optimizer subclass "
                              "such as torch.optim.AdamW")
        self._master_dtype = master_dtype
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device param, master)
        groups = list(params)
        if not groups:
            raise AutospError("[autosp:OffloadOptimizer] found an empty parameter list; "
                              "expected the model's parameters")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.optimizer = optimizer_class([self._host_group(g) for g in groups], **defaults)
        self.defaults = self.optimizer.defaults

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    def _host_group(self, group: dict[str, Any]) -> dict[str, Any]:
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        return {**group, "params": [self._master(p) for p in ps]}

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        if not isinstance(p, torch.Tensor):
            raise AutospError(f"[autosp:OffloadOptimizer] found a parameter of type "
                              f"{type(p).__name__}; expected tensors")
        if type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
            raise AutospError(
                "[autosp:OffloadOptimizer] found a DTensor parameter (autosp.fully_shard); "
                "expected plain tensors: a sharded model's optimizer state is already split over "
                "the ranks, use a plain torch optimizer with it")
        if any(p is q for q, _ in self._pairs):
            raise AutospError("[autosp:OffloadOptimizer] found a parameter given twice; "
                              "expected each parameter in one group")
        pin = p.is_cuda and torch.cuda.is_available()
        master = torch.empty(p.shape, dtype=_master_dtype(p, self._master_dtype), device="cpu",
                             pin_memory=pin)
        with torch.no_grad():
            master.copy_(p.detach())
        self._pairs.append((p, master))
        return master

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(self._host_group(param_group))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copies = False
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master, pin_memory=master.is_pinned())
            master.grad.copy_(p.grad, non_blocking=master.is_pinned())
            copies = copies or master.is_pinned()
        if copies:
            torch.cuda.synchronize()
        self.optimizer.step()
        self._to_device(only_with_grad=True)
        return loss

    @torch.no_grad()
    def _to_device(self, only_with_grad: bool) -> None:
        copies = False
        for p, master in self._pairs:
            if only_with_grad and master.grad is None:
                continue
            p.copy_(master, non_blocking=master.is_pinned())
            copies = copies or master.is_pinned()
        if copies:
            torch.cuda.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self._pairs:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates the wrapped optimizer's state (as a step with zero gradients and a learning
        rate of 0 does), so that a checkpoint can be loaded into ``state_dict()``'s tensors."""
        if self.optimizer.state:
            return
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else g["lr"] * 0
        for _, master in self._pairs:
            master.grad = torch.zeros_like(master)
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = lr
            for _, master in self._pairs:
                master.grad = None

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        sd = self.optimizer.state_dict()
        return {"state": sd["state"], "param_groups": sd["param_groups"],
                "master_weights": {str(i): m for i, (_, m) in enumerate(self._pairs)}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        masters = state_dict.get("master_weights")
        if not isinstance(masters, dict) or len(masters) != len(self._pairs):
            found = len(masters) if isinstance(masters, dict) else "no"
            raise AutospError(f"[autosp:OffloadOptimizer] found a state dict with {found} master "
                              f"weights; expected {len(self._pairs)}, from an OffloadOptimizer "
                              "over the same parameters")
        self.optimizer.load_state_dict({"state": state_dict["state"],
                                        "param_groups": state_dict["param_groups"]})
        for i, (_, master) in enumerate(self._pairs):
            saved = masters[str(i)]
            if saved is not master:
                master.copy_(saved)
        self._to_device(only_with_grad=False)

    def host_bytes(self) -> int:
        """Bytes of host memory the master weights, their gradients and the optimizer's state
        take (16 per parameter for AdamW over fp32 masters, as ``autosp plan`` counts)."""
        seen: set[int] = set()
        total = 0
        tensors = [m for _, m in self._pairs] + [
            m.grad for _, m in self._pairs if m.grad is not None] + [
            v for s in self.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def __repr__(self) -> str:
        return f"OffloadOptimizer({self.optimizer!r})"
