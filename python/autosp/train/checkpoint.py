"""Checkpoints of a training run: ``torch.distributed.checkpoint`` (DCP), sharded per rank.

A checkpoint is the folder ``<dir>/step-<N>`` after N optimizer steps, holding the model's
and AdamW's state (``get_state_dict``: plain tensors, or the DTensor shards of a
``fully_shard``-ed model; with ``autosp.OffloadOptimizer``, its own state dict with the master
weights), the learning-rate schedule and N, which is also the data position
(batches are drawn by step). It is written to ``step-<N>.tmp`` and renamed when every rank has
finished, so a run killed while saving leaves the previous checkpoint as the latest.
``resume`` loads one into a run of the same model: training continues exactly where it
stopped (on CPU in fp32 the resumed losses equal the uninterrupted run's).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from autosp.errors import AutospError
from autosp.offload_optimizer import OffloadOptimizer

_STEP_DIR = re.compile(r"^step-(\d+)$")


def latest(folder: str) -> str | None:
    """The complete checkpoint with the most steps in ``folder``, or None."""
    if not os.path.isdir(folder):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(folder)
             if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(folder, name))]
    return os.path.join(folder, max(found)[1]) if found else None


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: Any, step: int, layout: dict[str, Any]) -> dict[str, Any]:
    if isinstance(optimizer, OffloadOptimizer):  # its own state dict: master weights included
        optimizer.init_state()  # DCP loads into existing tensors
        msd, osd = get_model_state_dict(model), optimizer.state_dict()
    else:
        msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd,
            "train": {"step": step, "scheduler": scheduler.state_dict(), "layout": dict(layout)}}


def save(folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
         step: int, layout: dict[str, Any]) -> str:
    """Saves the state after ``step`` optimizer steps as ``<folder>/step-<step>``; every rank
    calls it. ``layout``: what decides which data step N draws (dp, batch, accumulation, S,
    the data), checked on resume."""
    final = os.path.join(folder, f"step-{step}")
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    dcp.save(_state(model, optimizer, scheduler, step, layout), checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    return final


def resolve(resume: str, folder: str) -> str | None:
    """The checkpoint ``resume`` names: "" none, "latest" the newest in ``folder`` (None when
    there is none yet: a fresh start), or a path."""
    if not resume:
        return None
    if resume == "latest":
        return latest(folder)
    if not os.path.isfile(os.path.join(resume, ".metadata")):
        raise AutospError(f"[autosp:train] checkpoint.resume = {resume!r}: found no DCP checkpoint "
                          "there (no .metadata); expected a step-<N> folder written by autosp "
                          "train, or \"latest\"")
    return resume


def _saved_keys(path: str) -> set[str] | None:
    """The flattened keys of the checkpoint at ``path`` ("train.layout.seq_len", ...), or
    None when its metadata cannot be read."""
    try:
        return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 - unreadable: DCP's own load reports it
        return None


def _check_optimizer_kind(path: str, keys: set[str] | None,
                          optimizer: torch.optim.Optimizer) -> None:
    """An OffloadOptimizer's state (with its master weights) and AdamW's are stored differently:
    say which setting wrote the checkpoint rather than DCP's missing keys. ``keys``: the
    checkpoint's (``_saved_keys``)."""
    if keys is None:  # unreadable: DCP's own load reports it
        return
    saved = any(k.startswith("optim.master_weights") for k in keys)
    now = isinstance(optimizer, OffloadOptimizer)
    if saved != now:
        raise AutospError(f"[autosp:train] checkpoint.resume = {path!r}: found a checkpoint "
                          f"written with training.offload_optimizer = {str(saved).lower()}; "
                          f"expected this run's setting ({str(now).lower()}), since the "
                          "optimizer's state is stored differently. Resume with "
                          f"--offload-optimizer {str(saved).lower()}.")


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
         layout: dict[str, Any]) -> int:
    """Loads ``path`` into the model, optimizer and schedule; returns the steps it had done.
    Raises AutospError when the checkpoint is another model's, or was written with another
    data layout (a resumed run draws its batches by step: another layout would train on other
    data than the uninterrupted run)."""
    keys = _saved_keys(path)
    _check_optimizer_kind(path, keys, optimizer)
    # DCP loads the keys asked for: ask for the saved layout's keys (one this run lacks is
    # still compared), not this run's (one a checkpoint from before it lacks is not an error)
    prefix = "train.layout."
    asked = dict(layout) if keys is None else \
        {k[len(prefix):]: None for k in keys if k.startswith(prefix)}
    state = _state(model, optimizer, scheduler, 0, asked)
    try:
        dcp.load(state, checkpoint_id=path)
        if isinstance(optimizer, OffloadOptimizer):
            set_model_state_dict(model, state["model"])
            optimizer.load_state_dict(state["optim"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
    except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
        text = str(e).strip()
        # the message's own line, not a source line of PyTorch's quoted in a traceback
        # ("{fqn}", found by breaker helper-90)
        found = [m for m in re.findall(r"(Size mismatch[^\n]*|Missing key[^\n]*|Unexpected key[^\n]*)",
                                       text) if "{" not in m]
        first = (found[0] if found else text.splitlines()[0] if text else type(e).__name__)[:300]
        raise AutospError(f"[autosp:train] checkpoint.resume = {path!r}: found a checkpoint that "
                          f"does not fit this run's model ({first}); expected one written by "
                          "autosp train with the same [model]") from None
    saved = {**{k: v for k, v in layout.items() if k not in asked}, **state["train"]["layout"]}
    if saved != layout:
        diff = ", ".join(f"{k} {saved.get(k)!r} (now {layout.get(k)!r})"
                         for k in [*layout, *(k for k in saved if k not in layout)]
                         if saved.get(k) != layout.get(k))
        raise AutospError(f"[autosp:train] checkpoint.resume = {path!r}: found a checkpoint written "
                          f"with {diff}; expected the same data layout, since a resumed run draws "
                          "the batches of step N as the uninterrupted run would. Resume with "
                          "those values.")
    scheduler.load_state_dict(state["train"]["scheduler"])
    return int(state["train"]["step"])
