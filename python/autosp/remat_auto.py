"""``autosp.compile(remat="auto")``: the remat policy, tiled loss, tiled MLP and activation
offload chosen for the user's own model by autosp's memory model.

At the first call of the compiled module, the model's training step is traced (fake tensors,
nothing runs) through the pipeline ``autosp.compile`` uses, once per combination of the tiled
loss and the tiled MLP, up to AOTAutograd's joint graph (``autosp.plan_trace.capture_joint``,
the planner's own trace). The C++ core predicts each combination's peak memory per rank at
that call's sequence length with each remat policy and offload (``simulate_peak_memory``), and
picks the one with the least predicted step-time overhead whose peak fits the device and whose
offload fits the host (``cheapest_fit``, csrc/plan/choose.h): what ``autosp plan`` picks for
its presets, for any model. The backend then compiles that combination.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from autosp import _core
from autosp.errors import AutospError
from autosp.plan_inputs import format_bytes as _size
from autosp.plan_result import LOSS_CHUNKS_HEADROOM, MemoryPrediction
from autosp.remat_policy import Auto, Offload

def host_memory_per_rank(world: int) -> int:
    """80% of this machine's physical memory over the ranks it runs (torchrun's
    LOCAL_WORLD_SIZE, else ``world``): the host memory ``remat="auto"`` lets offload take by
    default. 0 where the OS does not say."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return int(0.8 * total / max(local, 1))


def budgets(auto: Auto, device: torch.device, world: int) -> tuple[int, int]:
    """(device bytes, host bytes) per rank that ``auto`` asks the step to fit; the device's
    default is a CUDA device's total memory. AutospError on a CPU without ``memory``."""
    from autosp.plan_inputs import parse_bytes

    if auto.memory is not None:
        budget = parse_bytes(auto.memory, "memory")
    elif device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    else:
        raise AutospError(
            f"[autosp:compile] found remat='auto' for a model on {device.type}; expected the "
            "memory per rank to fit, remat=autosp.remat.Auto(memory='16GB') (only a CUDA "
            "device reports its own)")
    host = (parse_bytes(auto.host_memory, "host memory") if auto.host_memory is not None
            else host_memory_per_rank(world))
    return budget, host


@dataclass(frozen=True)
class Candidate:
    """One combination ``remat="auto"`` weighed, with its prediction at the call's S."""

    name: str  # as autosp plan names it: "ulysses + sequence-aware + tiled loss"
    remat: Any  # the policy it compiles with: a name or an Offload
    tile_loss: bool
    tile_mlp: bool
    prediction: MemoryPrediction


@dataclass(frozen=True)
class AutoChoice:
    """What ``remat="auto"`` chose (``SequenceParallelModule.remat_choice``), and why."""

    chosen: Candidate
    loss_chunks: int | None  # with the tiled loss: the fewest chunks predicted to fit
    seq_len: int
    budget: int  # device bytes per rank
    host_budget: int  # host bytes per rank (0: no limit)
    candidates: tuple[Candidate, ...]
    seconds: float

    def __str__(self) -> str:
        p = self.chosen.prediction
        chunks = f" with {self.loss_chunks} loss chunks" if self.loss_chunks else ""
        return (f"autosp remat auto chose {self.chosen.name}{chunks} at S = {self.seq_len}: "
                f"predicted peak {_size(p.peak)} of {_size(self.budget)} per rank, "
                f"{_size(p.host_bytes)} on the host, +{100 * p.overhead:.0f}% predicted "
                f"step time ({len(self.candidates)} combinations in {self.seconds:.1f} s)")

    def table(self) -> str:
        """Every combination weighed: predicted peak, host bytes and overhead."""
        width = max(len(c.name) for c in self.candidates)
        lines = [f"{'combination':<{width}}  {'peak':>10} {'host':>10} {'overhead':>9}"]
        for c in self.candidates:
            p = c.prediction
            mark = "  <- chosen" if c is self.chosen else (
                "  (over the budget)" if p.peak > self.budget else "")
            lines.append(f"{c.name:<{width}}  {_size(p.peak):>10} {_size(p.host_bytes):>10} "
                         f"{100 * p.overhead:>8.1f}%{mark}")
        return "\n".join(lines)


def _policy(remat: str, offload: bool, offload_all: bool) -> Any:
    if not offload:
        return remat
    return Offload(remat, saved="all" if offload_all else "layer outputs")


def choose(model: torch.nn.Module, args: tuple, kwargs: dict, *, auto: Auto, budget: int,
           host_budget: int, sp_size: int, seq_dim: int, seq_len: int, param_shards: int = 1,
           tile_loss: bool = False, tile_mlp: bool = False, loss_chunks: int | None = None,
           sp_options: dict[str, Any] | None = None) -> AutoChoice:
    """The cheapest combination for ``model(*args, **kwargs)`` (inputs marked dynamic along
    the sequence) on one rank of ``sp_size`` at sequence length ``seq_len``. ``tile_loss`` /
    ``tile_mlp`` True keep only combinations with them. AutospError when none fits."""
    from autosp.plan_memory_graph import _memory_graph
    from autosp.plan_trace import capture_joints
    from autosp.plan_strategies import combinations, core_plan_options, parse_strategies

    start = time.perf_counter()
    choices = [c for c in parse_strategies(combinations("ulysses"))
               if c.tile_loss >= tile_loss and c.tile_mlp >= tile_mlp]
    # The optimizer's state is for the parameters that are trained (a frozen base model's
    # weights are in the graph as parameters, with no gradient and no state).
    trained = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    num_params = sum(p.numel() for p in trained)
    dtype = "bf16" if any(p.dtype == torch.bfloat16 for p in trained) else "fp32"
    keys = sorted({(c.tile_loss, c.tile_mlp) for c in choices})
    captured = capture_joints(model, args, kwargs=kwargs, sp_size=sp_size, seq_dim=seq_dim,
                              variants=keys, sp_options=sp_options)
    graphs: dict[tuple[bool, bool], Any] = {}
    for key, joint in zip(keys, captured):
        try:
            graphs[key] = _memory_graph(*joint)
        except Exception as e:  # noqa: BLE001 - a model the memory model does not cover
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise AutospError(
                f"[autosp:compile] remat='auto' could not predict this model's memory "
                f"({type(e).__name__}: {first}); expected sizes that depend on the sequence "
                "length alone (sizes that depend on the data, such as MoE routing with "
                "torch.where, are not modelled): pass a remat policy instead, e.g. "
                "remat='sequence-aware'") from e
    candidates, chunks_of = [], []
    for c in choices:
        graph = graphs[(c.tile_loss, c.tile_mlp)]
        o = core_plan_options(c.remat, dtype, num_params, 1, param_shards=param_shards,
                          offload=c.offload, offload_all=c.offload_all,
                          loss_chunks=loss_chunks or 0, offload_optimizer=auto.offload_optimizer)
        chunks = loss_chunks
        try:
            rule = max((n.chunks for n in graph.nodes), default=0) if c.tile_loss else 0
            if rule and loss_chunks is None:
                # Weighed as it would compile: with the fewest chunks predicted to fit (the
                # fastest), else the rule's (the least memory).
                fit = _core.fewest_loss_chunks(graph, seq_len, o,
                                               int(budget * LOSS_CHUNKS_HEADROOM), rule)
                chunks = fit or None
                o.loss_chunks = fit
            b = _core.simulate_peak_memory(graph, seq_len, o)
        except ValueError as e:
            raise AutospError(f"[autosp:compile] remat='auto': {e}") from None
        candidates.append(Candidate(c.name, _policy(c.remat, c.offload, c.offload_all),
                                    c.tile_loss, c.tile_mlp, MemoryPrediction.from_core(b)))
        chunks_of.append(chunks)
    i = _core.cheapest_fit([c.prediction.to_core() for c in candidates], budget, host_budget)
    seconds = time.perf_counter() - start
    if i < 0:
        low = min(candidates, key=lambda c: c.prediction.peak)
        raise AutospError(
            f"[autosp:compile] remat='auto': found no combination of remat, tiled loss, tiled "
            f"MLP and offload predicted to fit {_size(budget)} per rank at S = {seq_len}"
            + (f" with {_size(host_budget)} of host memory" if host_budget else "")
            + f" (the lowest: {low.name}, {_size(low.prediction.peak)}, "
            f"{_size(low.prediction.host_bytes)} on the host); expected a shorter "
            "sequence, more ranks in the SP group, or more memory (Auto(memory=..., "
            "host_memory=...))")
    chosen, chunks = candidates[i], chunks_of[i]
    return AutoChoice(chosen, chunks if chosen.tile_loss else None, seq_len, budget, host_budget,
                      tuple(candidates), seconds)


@dataclass(frozen=True)
class AutoRequest:
    """``remat="auto"`` as ``autosp.compile`` resolved it, until the first call chooses."""

    auto: Auto
    budget: int
    host_budget: int
    param_shards: int = 1  # autosp.fully_shard-ed model: its world
    tile_loss: bool = False  # the user's tile_loss=True: only combinations with it
    tile_mlp: bool = False
    loss_chunks: int | None = None


def choose_for_call(module: Any, request: AutoRequest, args: tuple, kwargs: dict) -> AutoChoice:
    """Chooses for the first call of ``module`` (a SequenceParallelModule) and sets its
    backend's remat policy, tiled loss, tiled MLP and loss chunks to the choice. Every rank of
    the SP group must choose alike (their collectives must match): AutospError on all of them
    when they do not (different memory budgets)."""
    import torch.distributed as dist

    backend = module.sp_backend
    seq_dim = module.seq_dim
    seq = next(t.shape[seq_dim] for t in list(args) + list(kwargs.values())
               if isinstance(t, torch.Tensor) and t.dim() > seq_dim)
    failure: Exception | None = None
    try:
        choice = choose(
            module.module, args, kwargs, auto=request.auto, budget=request.budget,
            host_budget=request.host_budget, sp_size=backend.ctx.world, seq_dim=seq_dim,
            seq_len=int(seq), param_shards=request.param_shards, tile_loss=request.tile_loss,
            tile_mlp=request.tile_mlp, loss_chunks=request.loss_chunks,
            sp_options={"fuse_qkv": backend.fuse_qkv, "gather_outputs": backend.gather_outputs,
                        "gather_unsupported": backend.gather_unsupported})
        mine = f"{choice.chosen.name}, {choice.loss_chunks or 'default'} loss chunks"
    except Exception as e:  # said to the other ranks first: they must not wait for this one
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        failure, mine = e, f"no choice ({first})"
    group = module.sp_group
    if group is not None and dist.get_world_size(group) > 1:
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        if failure is None and len(set(every)) > 1:
            raise AutospError(
                f"[autosp:compile] remat='auto': found the ranks of an SP group choosing "
                f"differently ({'; '.join(f'rank {r}: {c}' for r, c in enumerate(every))}); "
                "expected one choice (their collectives must match): give every rank the same "
                "Auto(memory=..., host_memory=...)")
    if failure is not None:
        raise failure
    backend.remat = choice.chosen.remat
    backend.tile_loss = choice.chosen.tile_loss
    backend.tile_mlp = choice.chosen.tile_mlp
    backend.loss_chunks = choice.loss_chunks or 0
    return choice
