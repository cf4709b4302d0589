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

To the code around it, it is an ordinary optimizer: ``param_groups`` hold the model's
parameters (so clipping through them, ``GradScaler.unscale_`` and LR schedulers act on the
device gradients and hyperparameters, which ``step()`` hands to the wrapped optimizer), and
``state[p]`` is ``p``'s state on the host. A parameter changed in place outside the optimizer
(``load_state_dict``, ``nn.init``, after the optimizer was built) is read back into its master
weight before the next step (its PyTorch version counter says so).

For Llama-3.1-8B in bf16 that moves 96 GB of master weights and AdamW state off each GPU
(``autosp plan --offload-optimizer`` predicts what it buys), at the cost of two copies of the
parameters over the host link and a CPU optimizer step per step. It is DeepSpeed's ZeRO-Offload
and torchao's ``CPUOffloadOptimizer`` without their overlap of the copies with the backward:
AOTAutograd's compiled backward returns every gradient at its end, so there is nothing to
overlap them with.

Refused, with an error: parameters sharded with ``autosp.fully_shard`` (DTensors: their
optimizer state is already 1/world per rank), parameters sharing memory, sparse gradients, and
optimizers whose ``step`` needs a closure (LBFGS).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from autosp.errors import AutospError

__all__ = ["OffloadOptimizer"]

_WHERE = "[autosp:OffloadOptimizer]"


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

    ``state_dict()`` holds the wrapped optimizer's state and the master weights;
    ``load_state_dict`` restores both (checking their shapes) and copies the master weights
    into the parameters."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer]
                 = torch.optim.AdamW, *, master_dtype: torch.dtype | None = None,
                 **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise AutospError(f"{_WHERE} found optimizer_class={optimizer_class!r}; expected a "
                              "torch.optim.Optimizer subclass such as torch.optim.AdamW")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise AutospError(f"{_WHERE} found optimizer_class={optimizer_class.__name__}, whose "
                              "step re-evaluates the model through its closure many times; "
                              "expected an optimizer that steps once per call (AdamW, SGD, ...)")
        groups = list(params)
        if not groups:
            raise AutospError(f"{_WHERE} found an empty parameter list; expected the model's "
                              "parameters")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": self._group_params(g)} for g in groups]  # generators once
        self._master_dtype = master_dtype
        self._masters: dict[torch.Tensor, torch.Tensor] = {}  # device param -> host master
        self._versions: dict[torch.Tensor, int] = {}  # the version the master was read at
        # The wrapped optimizer over the masters, one group per group (hyperparameters are
        # handed over at each step); then torch's own bookkeeping over the device parameters.
        host_groups = [self._host_group(g) for g in groups]
        self.optimizer = optimizer_class(host_groups, **defaults)
        self._building = True
        super().__init__(groups, self.optimizer.defaults)
        self._building = False
        self._share_state()

    # -- building --------------------------------------------------------------------------

    @staticmethod
    def _group_params(group: dict[str, Any]) -> list[torch.Tensor]:
        ps = group["params"]
        return [ps] if isinstance(ps, torch.Tensor) else list(ps)

    def _host_group(self, group: dict[str, Any]) -> dict[str, Any]:
        return {**group, "params": [self._master(p) for p in self._group_params(group)]}

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        if not isinstance(p, torch.Tensor):
            raise AutospError(f"{_WHERE} found a parameter of type {type(p).__name__}; expected "
                              "tensors")
        if type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
            raise AutospError(
                f"{_WHERE} found a DTensor parameter (autosp.fully_shard); expected plain "
                "tensors: a sharded model's optimizer state is already split over the ranks, "
                "use a plain torch optimizer with it")
        if p in self._masters:
            raise AutospError(f"{_WHERE} found a parameter given twice; expected each parameter "
                              "in one group")
        for q in self._masters:
            if q.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() and p.numel():
                raise AutospError(
                    f"{_WHERE} found two parameters sharing memory (shapes {tuple(q.shape)} and "
                    f"{tuple(p.shape)}); expected distinct parameters: each gets a master copy, "
                    "and one's update would overwrite the other's")
        pin = p.is_cuda and torch.cuda.is_available()
        master = torch.empty(p.shape, dtype=_master_dtype(p, self._master_dtype), device="cpu",
                             pin_memory=pin)
        with torch.no_grad():
            master.copy_(p.detach())
        self._masters[p] = master
        self._versions[p] = p._version
        return master

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_building", False):  # torch's __init__ adding the device groups
            super().add_param_group(param_group)
            return
        param_group = {**param_group, "params": self._group_params(param_group)}
        self.optimizer.add_param_group(self._host_group(param_group))
        super().add_param_group(param_group)
        self._share_state()

    def _share_state(self) -> None:
        """``state[p]`` is the wrapped optimizer's state dict of p's master (the same dict)."""
        for p, master in self._masters.items():
            if master in self.optimizer.state:
                self.state[p] = self.optimizer.state[master]

    def _hand_over_hyperparameters(self) -> None:
        for mine, theirs in zip(self.param_groups, self.optimizer.param_groups):
            for key, value in mine.items():
                if key != "params":
                    theirs[key] = value

    # -- stepping --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._read_changed_parameters()
        copies = False
        for p, master in self._masters.items():
            if p.grad is None:
                master.grad = None
                continue
            if p.grad.is_sparse:
                raise AutospError(f"{_WHERE} found a sparse gradient (shape {tuple(p.shape)}); "
                                  "expected dense gradients (nn.Embedding(sparse=False))")
            if master.grad is None:
                master.grad = torch.empty_like(master, pin_memory=master.is_pinned())
            master.grad.copy_(p.grad, non_blocking=master.is_pinned())
            copies = copies or master.is_pinned()
        if copies:
            torch.cuda.synchronize()
        self._hand_over_hyperparameters()
        self.optimizer.step()
        self._share_state()
        self._to_device(only_with_grad=True)
        return loss

    @torch.no_grad()
    def _read_changed_parameters(self) -> None:
        for p, master in self._masters.items():
            if p._version != self._versions[p]:
                master.copy_(p.detach())
                self._versions[p] = p._version

    @torch.no_grad()
    def _to_device(self, only_with_grad: bool) -> None:
        copies = False
        for p, master in self._masters.items():
            if only_with_grad and master.grad is None:
                continue
            p.copy_(master, non_blocking=master.is_pinned())
            copies = copies or master.is_pinned()
        if copies:
            torch.cuda.synchronize()
        for p in self._masters:
            self._versions[p] = p._version

    # -- state -----------------------------------------------------------------------------

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates the wrapped optimizer's state (as a step with zero gradients and a learning
        rate of 0 does: AdamW's step counter then reads 1) so that a checkpoint can be loaded
        into ``state_dict()``'s tensors. Only before loading one: it changes the next step."""
        if self.optimizer.state:
            return
        self._hand_over_hyperparameters()
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else g["lr"] * 0
        for master in self._masters.values():
            master.grad = torch.zeros_like(master)
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr
            for master in self._masters.values():
                master.grad = None
        self._share_state()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        self._read_changed_parameters()
        self._hand_over_hyperparameters()
        sd = self.optimizer.state_dict()
        return {"state": sd["state"], "param_groups": sd["param_groups"],
                "master_weights": {str(i): m for i, m in enumerate(self._masters.values())}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        masters = state_dict.get("master_weights") if isinstance(state_dict, dict) else None
        if not isinstance(masters, dict) or len(masters) != len(self._masters):
            found = len(masters) if isinstance(masters, dict) else "no"
            raise AutospError(f"{_WHERE} found a state dict with {found} master weights; "
                              f"expected {len(self._masters)}, from an OffloadOptimizer over the "
                              "same parameters")
        for i, (p, master) in enumerate(self._masters.items()):
            saved = masters.get(str(i))
            if not isinstance(saved, torch.Tensor) or saved.shape != master.shape:
                shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else saved
                raise AutospError(f"{_WHERE} found master weight {i} of shape {shape} in the "
                                  f"state dict; expected {tuple(master.shape)}, the shape of "
                                  "that parameter")
        self.optimizer.load_state_dict({"state": state_dict["state"],
                                        "param_groups": state_dict["param_groups"]})
        for mine, theirs in zip(self.param_groups, self.optimizer.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        for i, master in enumerate(self._masters.values()):
            saved = masters[str(i)]
            if saved is not master:
                master.copy_(saved)
        self._share_state()
        self._to_device(only_with_grad=False)

    def host_bytes(self) -> int:
        """Bytes of host memory the master weights, their gradients and the optimizer's state
        take (16 per parameter for AdamW over fp32 masters, as ``autosp plan`` counts)."""
        seen: set[int] = set()
        total = 0
        tensors = list(self._masters.values()) + [
            m.grad for m in self._masters.values() if m.grad is not None] + [
            v for s in self.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"OffloadOptimizer({self.optimizer!r})"
