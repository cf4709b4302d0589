"""What a training run reports: a line per logged step on rank 0, ``metrics.jsonl`` in the
run's folder (always), and TensorBoard events when tensorboard is installed.

Every record holds ``step``, ``loss`` (mean over data-parallel groups), ``lr``,
``grad_norm`` (before clipping), ``tokens`` (trained this step, all groups), ``step_ms``,
``tokens_per_s`` and ``tokens_per_s_per_device``, and ``peak_mem_bytes`` (the largest over
ranks: CUDA's peak allocated memory, or on CPU the process's peak resident set).
``model_flops`` is the step's model FLOPs over all ranks: the forward and backward nodes of
the compiled graph, counted by the same formulas the remat solver uses (PyTorch's FLOP
formulas, attention by its own), recomputation not included; ``tflops_per_device`` divides
it by the step time and the number of devices, ``mfu`` by the device's peak as well (null
when the peak is not known: on CPU, or an unlisted GPU without ``metrics.peak_tflops``). All
three are null when some rank has no count of its graph's FLOPs: its compiled graph came from
PyTorch's cache without the report autosp keeps beside it.
Step times on CUDA are read after ``torch.cuda.synchronize``, so they cover the GPU's work,
not only the launches.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

import torch

from autosp.plan_inputs import format_bytes as human_bytes  # noqa: F401 - one definition

FIELDS = ("step", "loss", "lr", "grad_norm", "tokens", "step_ms", "tokens_per_s",
          "tokens_per_s_per_device", "peak_mem_bytes", "model_flops", "tflops_per_device", "mfu")

# Peak dense bf16 TFLOP/s per GPU (SXM parts), for MFU when metrics.peak_tflops is 0.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}


class StepTimer:
    """Wall time of a step, the device's queued work included."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.t0 = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self.t0


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: CUDA's peak allocated bytes, or the process's peak
    resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_tflops(device: torch.device, configured: float) -> float | None:
    """The peak TFLOP/s MFU is measured against: the configured one, else the table's for
    this GPU, else None."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_TFLOPS.items():
            if key in name:
                return value
    return None


def _human_rate(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def progress_line(rec: dict[str, Any], steps: int) -> str:
    return (f"step {rec['step']:4d}/{steps}  loss {rec['loss']:.6f}  lr {rec['lr']:.2e}  "
            f"grad_norm {rec['grad_norm']:.3f}  {_human_rate(rec['tokens_per_s'])} tok/s "
            f"({_human_rate(rec['tokens_per_s_per_device'])}/device)"
            + (f"  {rec['tflops_per_device']:.3g} TFLOP/s/device"
               if rec["tflops_per_device"] is not None else "")
            + (f" (MFU {100 * rec['mfu']:.1f}%)" if rec["mfu"] is not None else "")
            + f"  time {rec['step_ms']:.1f} ms  peak {human_bytes(rec['peak_mem_bytes'])}")


class MetricsLog:
    """Rank 0's metrics: ``<folder>/metrics.jsonl`` (appended, one JSON object per logged
    step) and TensorBoard events in ``<folder>/tensorboard`` when asked and installed."""

    def __init__(self, folder: str, *, tensorboard: bool, start: int = 0) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "metrics.jsonl")
        if start > 0 and os.path.exists(self.path):
            # A resumed run records steps from `start` again: drop the old records of those
            # steps (written after the checkpoint, before the run stopped).
            with open(self.path) as fh:
                kept = [x for x in fh if x.strip() and json.loads(x).get("step", 0) < start]
            with open(self.path, "w") as fh:
                fh.writelines(kept)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL only
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(os.path.join(folder, "tensorboard"))

    def write(self, rec: dict[str, Any]) -> None:
        missing = [f for f in FIELDS if f not in rec]
        if missing:
            raise AssertionError(f"metrics record without {missing}")
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def regions_line(outlined: list[str] | None) -> str | None:
    """One line on what ``training.regions`` did in the first compile, from
    ``SequenceParallelModule.last_compile.outlined`` (a line per layer, or one reason for the
    whole graph): how many layers call a shared compiled subgraph, and why the first of the
    others stays inline. None without regions (or without a record)."""
    if not outlined:
        return None
    if len(outlined) == 1 and outlined[0].startswith("no layer outlined"):
        return f"regions: {outlined[0]}"
    calls = [line for line in outlined if ": calls " in line]
    inline = [line for line in outlined if ": not outlined: " in line]
    names = {line.split(": calls ", 1)[1].split(" ", 1)[0] for line in calls}
    line = (f"regions: {len(calls)} of {len(calls) + len(inline)} layers call "
            f"{len(names)} shared compiled subgraph{'s' if len(names) != 1 else ''}")
    if inline:
        line += f"; {len(inline)} stay inline (first: {inline[0]})"
    return line
