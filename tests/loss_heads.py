"""Small language models whose losses are written the ways people write them, for the tiled
loss (autosp.compile(tile_loss=True), tests/test_tiled_loss.py). Each ``forward(ids, labels)``
returns the loss, or ``(logits, loss)`` where the model also returns its logits.

Every model has one causal attention (so that SP exchanges something) and an lm_head; they
differ in what lies between the lm_head and F.cross_entropy and in the loss's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 97  # not a multiple of any tile size used in the tests


class Trunk(nn.Module):
    """Embedding, one causal self-attention (4 heads) and an MLP, pre-norm."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm_f = nn.LayerNorm(d)
        self.heads = heads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.mlp(self.norm2(x))
        return self.norm_f(x)


class Head(nn.Module):
    def __init__(self, loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], object], *,
                 bias: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.trunk = Trunk()
        self.lm_head = nn.Linear(32, VOCAB, bias=bias)
        if tied:
            self.lm_head.weight = self.trunk.embed.weight
        self.loss = loss

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> object:
        return self.loss(self, self.trunk(ids), labels)


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def view_float(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = m.lm_head(h).float()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), _shifted(labels).reshape(-1))


def softcap_smoothing_sum(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Gemma-style soft-capping, label smoothing, a sum over tokens divided by hand.
    logits = torch.tanh(m.lm_head(h) / 3.0) * 3.0
    t = _shifted(labels).flatten()
    loss = F.cross_entropy(logits.flatten(0, 1), t, label_smoothing=0.1, reduction="sum")
    return loss / (t != -100).sum()


def per_token_masked_mean(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # reduction="none", then a weighted mean with a mask built from the labels.
    t = _shifted(labels)
    logits = m.lm_head(h)
    per = F.cross_entropy(logits.reshape(-1, VOCAB), t.reshape(-1).clamp(min=0), reduction="none")
    w = (t.reshape(-1) != -100).float()
    return (per * w).sum() / w.sum()


def nanogpt_returns_logits(m: Head, h: torch.Tensor, labels: torch.Tensor) -> object:
    # nanoGPT: ignore_index=-1, the logits returned too (they stay; the loss is still tiled).
    logits = m.lm_head(h)
    t = _shifted(labels).masked_fill(_shifted(labels) == -100, -1)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=-1)
    return logits, loss


def sizes_from_the_logits(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # reshape(b * s, v) with sizes read from the logits (the targets' reshape(b * s) was an
    # internal error in apply once, tiled or not).
    logits = m.lm_head(h)
    b, s, v = logits.shape
    t = _shifted(labels)
    return F.cross_entropy(logits.reshape(b * s, v), t.reshape(b * s), reduction="sum") / (t != -100).sum()


def z_loss(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # The float logits read twice (cross-entropy and a z-loss): made for the z-loss, the loss
    # still tiled.
    logits = m.lm_head(h).float().view(-1, VOCAB)
    ce = F.cross_entropy(logits, _shifted(labels).reshape(-1))
    return ce + 1e-3 * torch.logsumexp(logits, dim=-1).pow(2).mean()


# Forms a breaker found (each silently wrong or a raw error once): tiling must refuse them with
# the reason given, or (legacy reduce=False) tile them exactly.


def write_through_alias(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = m.lm_head(h)
    flat = logits.view(-1, VOCAB)
    logits.mul_(0.5)  # reaches flat too
    return F.cross_entropy(flat, _shifted(labels).reshape(-1))


def head_without_grad(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        metric = F.cross_entropy(m.lm_head(h).view(-1, VOCAB), _shifted(labels).reshape(-1))
    return view_float(m, h, labels) + metric


def detached_logits(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    extra = F.cross_entropy(m.lm_head(h).detach().view(-1, VOCAB), _shifted(labels).reshape(-1))
    return view_float(m, h, labels) + extra


def autocast_head(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m.lm_head(h)
    return F.cross_entropy(logits.float().view(-1, VOCAB), _shifted(labels).reshape(-1))


def soft_targets(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    probs = F.one_hot(labels.clamp(min=0).reshape(-1), VOCAB).float() * 0.9 + 0.1 / VOCAB
    return F.cross_entropy(m.lm_head(h).reshape(-1, VOCAB), probs)


def soft_targets_3d(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # [B, V, S] logits and probabilities (the class dim 1): the probabilities' sharded dim is
    # the logits', not the one class indices would have (an internal error at world 2 once).
    probs = F.one_hot(labels.clamp(min=0), VOCAB).float().transpose(1, 2)
    return F.cross_entropy(m.lm_head(h).transpose(1, 2), probs, label_smoothing=0.05)


def legacy_reduce(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    t = _shifted(labels).reshape(-1)
    per = F.cross_entropy(m.lm_head(h).view(-1, VOCAB), t, reduce=False)  # = reduction="none"
    return per.sum() / (t != -100).sum()


def legacy_size_average(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # size_average=True: a mean, which SP plans as a sum over the group's count (the
    # deprecated argument must be cleared for that, or it overrides the sum).
    return F.cross_entropy(m.lm_head(h).view(-1, VOCAB), _shifted(labels).reshape(-1),
                           size_average=True)


def divide_by_a_size(m: Head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = m.lm_head(h) / labels.shape[1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), _shifted(labels).reshape(-1))


@dataclass(frozen=True)
class LossModel:
    name: str
    loss: Callable[[Head, torch.Tensor, torch.Tensor], object]
    tiled: bool  # whether autosp tiles it (its only loss)
    bias: bool = False
    tied: bool = False
    # Several losses, or a reason: for each cross-entropy in order, TILED or what its "not
    # tiled: " line of loss_tiling contains.
    expect: tuple[str, ...] = ()

    def build(self, seed: int = 0) -> Head:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return Head(self.loss, bias=self.bias, tied=self.tied)


MODELS = [
    LossModel("view-float", view_float, tiled=True),
    LossModel("softcap-smoothing-sum-bias", softcap_smoothing_sum, tiled=True, bias=True),
    LossModel("per-token-masked-mean-tied", per_token_masked_mean, tiled=True, tied=True),
    LossModel("nanogpt-returns-logits", nanogpt_returns_logits, tiled=True),
    LossModel("sizes-from-the-logits", sizes_from_the_logits, tiled=True),
    LossModel("z-loss", z_loss, tiled=True),
]

TILED = "tiled: cross_entropy"  # in expect: this loss is tiled
REGRESSIONS = [
    LossModel("write-through-alias", write_through_alias, tiled=False,
              expect=("the in-place 'mul'",)),
    LossModel("head-without-grad", head_without_grad, tiled=False,
              expect=("gradients stop", TILED)),
    LossModel("detached-logits", detached_logits, tiled=False, expect=("gradients stop", TILED)),
    LossModel("autocast-head", autocast_head, tiled=False, expect=("runs under torch.autocast",)),
    LossModel("soft-targets", soft_targets, tiled=False, expect=("class probabilities",)),
    LossModel("soft-targets-3d", soft_targets_3d, tiled=False, expect=("class probabilities",)),
    LossModel("legacy-reduce-false", legacy_reduce, tiled=True),
    LossModel("legacy-size-average", legacy_size_average, tiled=True),
    LossModel("divide-by-a-size", divide_by_a_size, tiled=False,
              expect=("not a row-wise op of the logits alone",)),
]
