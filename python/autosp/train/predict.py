"""``autosp plan``'s prediction for the run being trained: the peak memory per rank the
planner predicts for this model, mesh, dtype, batch, sequence length and remat policy,
printed at start and beside the measured peak at the end."""

from __future__ import annotations

import time
from typing import Any

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


def predicted_peak(cfg: TrainConfig, world: int, sp: int, vocab_size: int) -> tuple[int | None, str]:
    """(predicted peak bytes per rank, a line saying so), or (None, why there is none)."""
    import autosp

    t = cfg.training
    strategy = (f"ulysses+{t.remat}" + ("+tiled-loss" if t.tile_loss else "")
                + ("+tiled-mlp" if t.tile_mlp else "") + ("+offload" if t.offload else ""))
    start = time.perf_counter()
    try:
        result = autosp.plan(planner_model(cfg, vocab_size), gpus=world, sp=sp,
                             dtype="bf16" if cfg.model.dtype == "bfloat16" else "fp32",
                             batch_size=t.batch_size, optimizer_sharding="none",
                             fsdp=cfg.parallel.fsdp, seq_len=t.seq_len, strategies=[strategy],
                             seq_multiple=t.seq_len, max_seq=t.seq_len, curve_points=2)
    except Exception as e:  # a model the planner does not model: the run goes on without
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"autosp plan: no prediction for this model ({first})"
    at = result.strategies[0].at_seq
    if at is None:
        return None, "autosp plan: no prediction at this sequence length"
    gib = float(1 << 30)
    return at.peak, (f"autosp plan: predicted peak {at.peak / gib:.3f} GiB per rank at S = "
                     f"{t.seq_len} ({result.strategies[0].name}, during {at.phase}; "
                     f"{time.perf_counter() - start:.1f} s to plan)")
