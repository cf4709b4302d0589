"""The state dict of ``autosp.OffloadOptimizer`` (autosp.offload_optimizer): reading the
master weights back from what ``state_dict()`` wrote, and DCP's ``get_state_dict`` form of it.

A low-precision parameter's fp32 master is ``state[i]["master_weight"]`` (so DCP's helpers,
which keep only ``state`` and ``param_groups``, carry it); ``master_weights`` holds, per
parameter, the master itself when it is the parameter's dtype, or ``"state"``. Dicts written
before masters moved into ``state`` (every master in ``master_weights``) still load."""

from __future__ import annotations

from typing import Any

import torch

from autosp.errors import AutospError

_WHERE = "[autosp:OffloadOptimizer]"


def saved_masters(state_dict: Any, params: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> list[torch.Tensor | None]:
    """For each (parameter, its master) of ``params``, the master ``state_dict`` holds for it,
    or None where it holds none and the parameter's own values are its master (full
    precision). AutospError for a dict that does not come from an OffloadOptimizer over the
    same parameters, or that would lose a low-precision parameter's master."""
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list)):
        found = (f"keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict)
                 else f"a {type(state_dict).__name__}")
        raise AutospError(f"{_WHERE} found a state dict with {found}; expected a dict with "
                          "'state' and 'param_groups' (and 'master_weights'), as "
                          "OffloadOptimizer.state_dict() returns")
    state, masters = state_dict["state"], state_dict.get("master_weights")
    if masters is not None and (not isinstance(masters, dict)
                                or len(masters) != len(params)):
        found = len(masters) if isinstance(masters, dict) else type(masters).__name__
        raise AutospError(f"{_WHERE} found a state dict with {found} master weights; "
                          f"expected {len(params)}, from an OffloadOptimizer over the "
                          "same parameters")
    # state's keys are the saved groups' "params" (indices; DCP's set_state_dict: names).
    keys = [k for g in state_dict["param_groups"]
            for k in (g.get("params", []) if isinstance(g, dict) else [])]
    if len(keys) != len(params):
        raise AutospError(f"{_WHERE} found a state dict with {len(keys)} parameters in its "
                          f"param_groups; expected {len(params)}, from an "
                          "OffloadOptimizer over the same parameters")
    saved_masters_list: list[torch.Tensor | None] = []
    for i, (p, master) in enumerate(params):
        entry = state.get(keys[i])
        saved = entry.get("master_weight") if isinstance(entry, dict) else None
        if saved is None and masters is not None:
            saved = masters.get(str(i))
            if not isinstance(saved, torch.Tensor):  # "state", with no state[i]
                found = "nothing" if saved is None else repr(saved)
                raise AutospError(f"{_WHERE} found {found} as master weight {i} in the "
                                  f"state dict and no state[{i}]['master_weight']; expected "
                                  "a tensor, as OffloadOptimizer.state_dict() writes")
        if saved is None and master.dtype != p.dtype and isinstance(entry, dict) and entry:
            raise AutospError(
                f"{_WHERE} found the state of parameter {i} ({p.dtype}, shape "
                f"{tuple(p.shape)}) without its {master.dtype} master weight; expected "
                f"state[{keys[i]!r}]['master_weight'], as OffloadOptimizer.state_dict() "
                "writes (reading it from the parameter would lose its low bits)")
        if saved is not None and (not isinstance(saved, torch.Tensor)
                                  or saved.shape != master.shape):
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else saved
            raise AutospError(f"{_WHERE} found master weight {i} of shape {shape} in the "
                              f"state dict; expected {tuple(master.shape)}, the shape of "
                              "that parameter")
        saved_masters_list.append(saved)
    return saved_masters_list


def host_state(state: dict[Any, Any]) -> dict[Any, Any]:
    """``state`` without the master weights: what the host optimizer loads."""
    host_state = {}
    for key, entry in state.items():
        if isinstance(entry, dict) and "master_weight" in entry:
            entry = {k: v for k, v in entry.items() if k != "master_weight"}
            if not entry:
                continue
        host_state[key] = entry
    return host_state
