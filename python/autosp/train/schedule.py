"""The learning-rate schedule: linear warmup, then cosine decay (torch's LambdaLR)."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the peak learning rate for optimizer step ``step`` (0-based):
    ``(step + 1) / warmup_steps`` during warmup, then a cosine from 1 down to
    ``min_lr_ratio``, reached at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = steps - warmup_steps
    if decay_steps <= 1:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - 1))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, steps: int, warmup_steps: int,
                  min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor at step t is ``lr_factor(t, ...)``: call ``step()`` after
    each optimizer step. Its ``state_dict`` goes into checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: lr_factor(t, steps, warmup_steps, min_lr_ratio))
