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
``state[p]`` is ``p``'s state on the host.

For Llama-3.1-8B in bf16 that moves 96 GB of master weights and AdamW state off each GPU
(``autosp plan --offload-optimizer`` predicts what it buys), at the cost of two copies of the
parameters over the host link and a CPU optimizer step per step. It is DeepSpeed's ZeRO-Offload
and torchao's ``CPUOffloadOptimizer`` without their overlap of the copies with the backward:
AOTAutograd's compiled backward returns every gradient at its end, so there is nothing to
overlap them with.

A parameter changed outside the optimizer after it was built is read back into its master
weight before the next step when PyTorch can tell: an in-place write on the parameter itself
under ``torch.no_grad()`` (``model.load_state_dict``, ``nn.init``, ``p.copy_``: its version
counter moves) or a new tensor of the same shape put in it (``p.data = t``, ``model.to``: its
storage changes). Only the elements that differ from the master rounded to the parameter's
dtype are read, so writing a bf16 parameter's own values back (``model.load_state_dict(
model.state_dict())``) keeps the fp32 master's low bits. An in-place write through ``.data``
(``p.data.fill_(7)``, ``p.data.normal_()``) moves no counter and is lost at the next step,
which copies the master back: make such writes under ``torch.no_grad()`` on the parameter
itself, or load them with ``load_state_dict``. A parameter replaced by one of another shape is
refused at the next step (build a new optimizer), and so is a parameter added to
``param_groups[i]["params"]`` directly (use ``add_param_group``, which gives it a master).

Refused, with an error: parameters sharded with ``autosp.fully_shard`` (DTensors: their
optimizer state is already 1/world per rank), parameters sharing memory (even disjoint slices
of one tensor are not supported), sparse gradients, and optimizers whose ``step`` needs a
closure (LBFGS). Hooks registered with ``register_state_dict_pre_hook`` and the other
state-dict hooks are not supported: ``state_dict`` and ``load_state_dict`` do not call them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from autosp import offload_state
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
    ``params``: an iterable of tensors or parameter groups, as for any torch optimizer.
    ``master_dtype``: the master weights' dtype (default: fp32 for parameters of fewer than 4
    bytes, the parameter's own otherwise).

    ``state_dict()`` holds the wrapped optimizer's state and the master weights: a master whose
    dtype differs from its parameter's (the fp32 master of a bf16 parameter) is
    ``state[i]["master_weight"]``, where ``torch.distributed.checkpoint.state_dict``'s
    ``get_state_dict`` (which keeps only ``state`` and ``param_groups``) carries it, and
    ``master_weights[str(i)]`` says ``"state"``; any other master (equal to its parameter) is
    ``master_weights[str(i)]``. ``load_state_dict`` restores them (checking their shapes; also
    from the older format, every master in ``master_weights``), reads a master the dict lacks
    from its parameter if that parameter is not low precision or has no saved state, and copies
    the master weights into the parameters."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer]
                 = torch.optim.AdamW, *, master_dtype: torch.dtype | None = None,
                 **defaults: Any) -> None:
        if isinstance(params, torch.Tensor):
            # torch's own check and text (iterating a tensor would optimize its rows).
            raise TypeError(f"{_WHERE} found a single tensor of shape {tuple(params.shape)} as "
                            "params; params argument given to the optimizer should be an "
                            "iterable of Tensors or dicts, e.g. [tensor]")
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
        # What each master was read at: the parameter's version counter and its storage
        # (``p.data = t`` replaces the storage and leaves the counter as it was).
        self._versions: dict[torch.Tensor, int] = {}
        self._data_ptrs: dict[torch.Tensor, int] = {}
        self._check_new_parameters([p for g in groups for p in g["params"]], differentiable=
                                   bool(defaults.get("differentiable")))
        # The wrapped optimizer over the masters, one group per group (hyperparameters are
        # handed over at each step); then torch's own bookkeeping over the device parameters.
        host_groups = [self._host_group(g) for g in groups]
        self.optimizer = optimizer_class(host_groups, **defaults)
        self._building = True
        super().__init__(groups, self.optimizer.defaults)
        self._building = False
        # The parameters of each group as built: one put into param_groups directly has no
        # master, and would never be stepped.
        self._built_groups = [list(g["params"]) for g in self.param_groups]
        self._share_state()

    # -- building --------------------------------------------------------------------------

    @staticmethod
    def _group_params(group: dict[str, Any]) -> list[torch.Tensor]:
        ps = group["params"]
        return [ps] if isinstance(ps, torch.Tensor) else list(ps)

    def _check_new_parameters(self, params: list[Any], differentiable: bool) -> None:
        """Raises, changing nothing, if ``params`` cannot be added to this optimizer."""
        seen: list[torch.Tensor] = list(self._masters)
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise AutospError(f"{_WHERE} found a parameter of type {type(p).__name__}; "
                                  "expected tensors")
            if type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
                raise AutospError(
                    f"{_WHERE} found a DTensor parameter (autosp.fully_shard); expected plain "
                    "tensors: a sharded model's optimizer state is already split over the "
                    "ranks, use a plain torch optimizer with it")
            if not (differentiable or p.is_leaf or p.retains_grad):
                raise AutospError(f"{_WHERE} found a non-leaf tensor of shape {tuple(p.shape)}; "
                                  "expected leaf tensors (torch: can't optimize a non-leaf "
                                  "Tensor)")
            if any(q is p for q in seen):
                raise AutospError(f"{_WHERE} found a parameter given twice; expected each "
                                  "parameter in one group")
            for q in seen:
                if (q.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                        and p.numel()):
                    raise AutospError(
                        f"{_WHERE} found two parameters sharing memory (shapes "
                        f"{tuple(q.shape)} and {tuple(p.shape)}); expected distinct parameters: "
                        "each gets a master copy, and one's update would overwrite the other's")
            seen.append(p)

    def _host_group(self, group: dict[str, Any]) -> dict[str, Any]:
        return {**group, "params": [self._master(p) for p in self._group_params(group)]}

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        pin = p.is_cuda and torch.cuda.is_available()
        master = torch.empty(p.shape, dtype=_master_dtype(p, self._master_dtype), device="cpu",
                             pin_memory=pin)
        with torch.no_grad():
            master.copy_(p.detach())
        self._masters[p] = master
        self._versions[p] = p._version
        self._data_ptrs[p] = p.data_ptr()
        return master

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_building", False):  # torch's __init__ adding the device groups
            super().add_param_group(param_group)
            return
        if not isinstance(param_group, dict):
            raise TypeError(f"{_WHERE} found a param_group of type "
                            f"{type(param_group).__name__}; expected a dict")
        param_group = {**param_group, "params": self._group_params(param_group)}
        self._check_new_parameters(param_group["params"], differentiable=bool(
            param_group.get("differentiable", self.defaults.get("differentiable"))))
        # torch's own checks (e.g. a hyperparameter a group must set) can still fail: undo.
        before = (dict(self._masters), dict(self._versions), dict(self._data_ptrs),
                  len(self.optimizer.param_groups), len(self.param_groups))
        try:
            self.optimizer.add_param_group(self._host_group(param_group))
            super().add_param_group(param_group)
        except BaseException:
            self._masters, self._versions, self._data_ptrs = before[0], before[1], before[2]
            del self.optimizer.param_groups[before[3]:]
            del self.param_groups[before[4]:]
            raise
        self._built_groups.append(list(param_group["params"]))
        self._share_state()

    def _share_state(self) -> None:
        """``state[p]`` is the wrapped optimizer's state dict of p's master (the same dict), and
        p has no state where its master has none."""
        for p, master in self._masters.items():
            if master in self.optimizer.state:
                self.state[p] = self.optimizer.state[master]
            else:
                self.state.pop(p, None)

    def _hand_over_hyperparameters(self) -> None:
        for mine, theirs in zip(self.param_groups, self.optimizer.param_groups):
            for key, value in mine.items():
                if key != "params":
                    theirs[key] = value

    def _check_parameters(self) -> None:
        """Raises, changing nothing, if the groups or a parameter's shape changed since the
        optimizer was built."""
        if len(self.param_groups) != len(self._built_groups):
            raise AutospError(
                f"{_WHERE} found {len(self.param_groups)} parameter groups; expected the "
                f"{len(self._built_groups)} it was built with: add a group with "
                "add_param_group(...), which gives its parameters master weights on the host")
        for i, (group, built) in enumerate(zip(self.param_groups, self._built_groups)):
            now = group["params"]
            if len(now) != len(built) or any(a is not b for a, b in zip(now, built)):
                raise AutospError(
                    f"{_WHERE} found parameter group {i} with {len(now)} parameters, not the "
                    f"{len(built)} it was built with (param_groups[{i}]['params'] was changed "
                    "directly); expected the parameters as built: add parameters with "
                    "add_param_group({'params': [...]}), which gives them master weights on the "
                    "host")
        for i, (p, master) in enumerate(self._masters.items()):
            if p.shape != master.shape:
                raise AutospError(
                    f"{_WHERE} found parameter {i} (in param_groups' order) of shape "
                    f"{tuple(p.shape)}, built with shape {tuple(master.shape)}: it was replaced "
                    "(p.data = t) by a tensor of another shape; expected the shape it had when "
                    "the optimizer was built: build a new OffloadOptimizer over the new "
                    "parameters")

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

    @staticmethod
    @torch.no_grad()
    def _read_into_master(p: torch.Tensor, master: torch.Tensor) -> None:
        """Reads p into its master where p differs from the master rounded to p's dtype: a
        write of the values p already has (a bf16 parameter's own) keeps the master's low
        bits."""
        value = p.detach()
        if value.dtype == master.dtype:
            master.copy_(value)
            return
        value = value.to("cpu")
        kept = value == master.to(value.dtype)
        master.copy_(torch.where(kept, master, value.to(master.dtype)))

    @torch.no_grad()
    def _read_changed_parameters(self) -> None:
        self._check_parameters()
        for p, master in self._masters.items():
            if p._version != self._versions[p] or p.data_ptr() != self._data_ptrs[p]:
                self._read_into_master(p, master)
                self._versions[p] = p._version
                self._data_ptrs[p] = p.data_ptr()

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
            self._data_ptrs[p] = p.data_ptr()

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
        state = dict(sd["state"])  # its entries are the host state's own dicts: not changed
        masters: dict[str, Any] = {}
        for i, (p, master) in enumerate(self._masters.items()):
            if master.dtype != p.dtype:
                state[i] = {**state.get(i, {}), "master_weight": master}
                masters[str(i)] = "state"
            else:
                masters[str(i)] = master
        return {"state": state, "param_groups": sd["param_groups"], "master_weights": masters}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self._check_parameters()
        saved_masters = offload_state.saved_masters(state_dict, list(self._masters.items()))
        host_state = offload_state.host_state(state_dict["state"])
        self.optimizer.load_state_dict({"state": host_state,
                                        "param_groups": state_dict["param_groups"]})
        for mine, theirs in zip(self.param_groups, self.optimizer.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        for saved, (p, master) in zip(saved_masters, self._masters.items()):
            if saved is None:  # e.g. DCP's get_state_dict of full-precision parameters
                self._read_into_master(p, master)
            elif saved is not master:
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
        # A copy's parameters are new tensors: its masters were read from their values.
        self._data_ptrs = {p: p.data_ptr() for p in self._masters}

    def __repr__(self) -> str:
        return f"OffloadOptimizer({self.optimizer!r})"
