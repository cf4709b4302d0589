"""``autosp plan``'s prediction for the run being trained: the peak memory per rank the
planner predicts for this model, mesh, dtype, batch, sequence length and remat policy,
printed at start and beside the measured peak at the end."""

from __future__ import annotations

import time
from typing import Any

import torch

from autosp.errors import AutospError
from autosp.plan_inputs import format_bytes
from autosp.remat_auto import host_memory_per_rank
from autosp.train.config import TrainConfig


def planner_model(cfg: TrainConfig, vocab_size: int) -> Any:
    """What autosp.plan takes for this run's model: a config path, or the preset's config."""
    m = cfg.model
    if m.hf_config or m.hf_checkpoint:
        return m.hf_config or m.hf_checkpoint
    from autosp.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=m.hidden_size,
                       intermediate_size=m.intermediate_size, num_layers=m.layers,
                       num_heads=m.heads, num_kv_heads=m.kv_heads or m.heads)


def predicted_peak(cfg: TrainConfig, world: int, sp: int, vocab_size: int,
                   device: str = "cpu") -> tuple[int | None, str]:
    """(predicted peak bytes per rank on ``device``'s type, a line saying so), or (None, why
    there is none)."""
    import autosp

    t = cfg.training
    strategy = (f"ulysses+{t.remat}" + ("+tiled-loss" if t.tile_loss else "")
                + ("+tiled-mlp" if t.tile_mlp else "")
                + ("+offload-all" if t.offload_all else "+offload" if t.offload else ""))
    start = time.perf_counter()
    try:
        result = autosp.plan(planner_model(cfg, vocab_size), gpus=world, sp=sp,
                             dtype="bf16" if cfg.model.dtype == "bfloat16" else "fp32",
                             batch_size=t.batch_size, optimizer_sharding="none",
                             fsdp=cfg.parallel.fsdp, offload_optimizer=t.offload_optimizer,
                             seq_len=t.seq_len, strategies=[strategy],
                             seq_multiple=t.seq_len, max_seq=t.seq_len, curve_points=2,
                             loss_chunks=t.loss_chunks if t.tile_loss else 0,
                             device=device)
    except Exception as e:  # a model the planner does not model: the run goes on without
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"autosp plan: no prediction for this model ({first})"
    at = result.strategies[0].at_seq
    if at is None:
        return None, "autosp plan: no prediction at this sequence length"
    return at.peak, (f"autosp plan: predicted peak {format_bytes(at.peak)} per rank at S = "
                     f"{t.seq_len} ({result.strategies[0].name}, during {at.phase}; "
                     f"{time.perf_counter() - start:.1f} s to plan)")


def choose_strategy(cfg: TrainConfig, world: int, sp: int, vocab_size: int,
                    device: torch.device) -> str:
    """With ``training.remat = "auto"``: sets remat, tile_loss, tile_mlp and offload of
    ``cfg.training`` to the combination ``autosp plan`` predicts cheapest (least recomputation
    and host-link time) among those whose peak at ``seq_len`` fits ``memory_gib`` (the GPU's
    memory when 0); returns a line saying what it chose. AutospError when none fits or the
    model is not one the planner models."""
    import autosp
    from autosp.plan_strategies import combinations

    t = cfg.training
    gib = float(1 << 30)
    budget = int(t.memory_gib * gib)
    if budget <= 0 and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    if budget <= 0:
        raise AutospError("[autosp:train] found training.remat = 'auto' with training.memory_gib "
                          "= 0 on a CPU; expected the memory per rank to fit "
                          "(--memory-gib), which only a GPU reports itself")
    if t.remat_budget_gib > 0:
        raise AutospError("[autosp:train] found training.remat = 'auto' with "
                          "training.remat_budget_gib; expected one of them (auto picks the remat "
                          "policy itself)")
    host = int(t.host_memory_gib * gib) or host_memory_per_rank(world)
    start = time.perf_counter()
    try:
        result = autosp.plan(planner_model(cfg, vocab_size), gpus=world, sp=sp,
                             dtype="bf16" if cfg.model.dtype == "bfloat16" else "fp32",
                             batch_size=t.batch_size, optimizer_sharding="none",
                             fsdp=cfg.parallel.fsdp, offload_optimizer=t.offload_optimizer,
                             seq_len=t.seq_len, gpu_memory=budget, host_memory=host or None,
                             strategies=combinations("ulysses"), seq_multiple=t.seq_len,
                             max_seq=t.seq_len, curve_points=2,
                             loss_chunks=t.loss_chunks,  # auto may turn the tiled loss on
                             device=device.type)
    except AutospError as e:
        raise AutospError(f"[autosp:train] training.remat = 'auto' needs autosp plan's "
                          f"prediction for this model, which failed: {e}") from None
    best = result.cheapest()
    if best is None:
        low = min((s for s in result.strategies if s.at_seq is not None),
                  key=lambda s: s.at_seq.peak)
        raise AutospError(
            f"[autosp:train] training.remat = 'auto': found no combination of remat, tiled "
            f"loss, tiled MLP and offload predicted to fit {format_bytes(budget)} per rank at "
            f"S = {t.seq_len} with {format_bytes(host)} of host memory per rank (the lowest: "
            f"{low.name}, {format_bytes(low.at_seq.peak)}, {format_bytes(low.at_seq.host_bytes)} "
            "on the host); expected a shorter seq_len, more ranks in the SP group, or more "
            "memory (training.memory_gib, training.host_memory_gib)")
    t.remat, t.tile_loss, t.tile_mlp = best.remat, best.tile_loss, best.tile_mlp
    t.offload, t.offload_all = best.offload, best.offload_all
    chunks = ""
    if best.tile_loss and best.fit_loss_chunks and not t.loss_chunks:
        t.loss_chunks = best.fit_loss_chunks  # the fewest that fit: the fastest
        chunks = (f" with {t.loss_chunks} loss chunks, the fewest predicted to fit (with the "
                  f"rule's {best.loss_chunks} chunks, the least memory)")
    return (f"autosp plan: remat auto chose {best.name}{chunks}: predicted peak "
            f"{format_bytes(best.at_seq.peak)} of {format_bytes(budget)}, "
            f"{format_bytes(best.at_seq.host_bytes)} on the host of {format_bytes(host)}, "
            f"+{100 * best.at_seq.overhead:.0f}% predicted step time "
            f"({time.perf_counter() - start:.1f} s to plan {len(result.strategies)} combinations)")
