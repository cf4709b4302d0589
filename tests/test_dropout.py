"""Dropout and rand_like inside the sharded region.

The ranks of an SP group share the random seed (they must, to build identical weights), so
a dropout drawn for each rank's chunk would give every rank the same mask: position j and
j + S/P dropped together. autosp draws the mask at full length and keeps the rank's chunk:

- with aot_eager the masks are bitwise the single-device masks, so training with dropout is
  exact against one device (loss atol 1e-5, gradients 1e-4);
- with Inductor (whose random numbers differ from eager's on one device too) the masks are
  statistically a single-device draw: keep rate 1 - p within 5 sigma, and the chunks of
  different ranks agree on about half the positions (independent), not all of them.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import assert_grads_close, grads_of, run_ranks


class _Dropped(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 64)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(64, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.drop(self.embed(ids))
        h = h + 1e-3 * torch.rand_like(h)  # a second random op in the sharded region
        if labels is None:
            return h
        return F.cross_entropy(self.head(F.dropout(h, 0.1, self.training)).flatten(0, 1), labels.flatten())


def _masks_worker(rank: int, world: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    import autosp

    torch.manual_seed(0)
    model = _Dropped(0.5)
    ids = torch.randint(0, 16, (2, 64), generator=torch.Generator().manual_seed(1))
    compiled = autosp.compile(model, mesh=autosp.init_mesh(world), backend=backend, remat="default",
                              outputs="local")
    torch.manual_seed(5)
    out = compiled(ids)
    torch.manual_seed(5)
    ref = model(ids)
    return out.detach(), ref.detach()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_each_rank_draws_its_chunk_of_a_full_length_mask(backend: str) -> None:
    (out0, ref), (out1, _) = run_ranks(2, _masks_worker, backend)
    kept0, kept1 = (out0.abs() > 0.01), (out1.abs() > 0.01)
    n = kept0.numel() + kept1.numel()
    rate = torch.cat([kept0, kept1], 1).float().mean().item()
    assert abs(rate - 0.5) <= 5 * math.sqrt(0.25 / n), rate
    agree = (kept0 == kept1).float().mean().item()
    assert abs(agree - 0.5) <= 5 * math.sqrt(0.25 / kept0.numel()), f"chunks agree on {agree:.3f}"
    if backend == "aot_eager":
        torch.testing.assert_close(torch.cat([out0, out1], 1), ref, rtol=0, atol=0)


class _TransposedDropped(_Dropped):
    """Dropout on transposed views (found by a breaker review): one device draws in the view's
    memory order, so the full-length draw must have that layout too."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = F.dropout(self.embed(ids).transpose(1, 2), 0.3, self.training).transpose(1, 2)
        h = h + 1e-3 * torch.rand_like(h.transpose(1, 2)).transpose(1, 2)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _attention_dropped(layers: int = 1) -> nn.Module:
    """nanoGPT with attention written by hand and dropout on the attention probabilities,
    which autosp computes split by heads (the mask: this rank's heads of the full draw)."""
    import styles

    model = styles.NanoGPT(n_layer=layers, flash=False, vocab_size=16)
    for block in model.transformer.h:
        block.attn.attn_dropout.p = 0.2
    return model


def _training_worker(rank: int, world: int) -> dict[str, list[dict[str, Any]]]:
    import autosp

    mesh = autosp.init_mesh(world)
    out = {}
    for name, build in (("residual", lambda: _Dropped(0.2)), ("attention-probs", _attention_dropped),
                        ("transposed", lambda: _TransposedDropped(0.0))):
        torch.manual_seed(0)
        model = build()
        compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="default")
        out[name] = _train_two_steps(model, compiled)
        out[name + ":gathered"] = list(compiled.gathered)
    return out


def _train_two_steps(model: nn.Module, compiled: Any) -> list[dict[str, Any]]:
    results = []
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 16, (2, 32), generator=gen)
        labels = torch.randint(0, 16, (2, 32), generator=gen)
        ref = copy.deepcopy(model)
        torch.manual_seed(100 + step)
        ref_loss = ref(ids, labels)
        ref_loss.backward()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        loss = compiled(ids, labels)
        loss.backward()
        results.append({"loss": loss.item(), "ref_loss": ref_loss.item(), "grads": grads_of(model),
                        "ref_grads": grads_of(ref)})
    return results


def test_training_with_dropout_is_exact_with_aot_eager() -> None:
    for rank, per_model in enumerate(run_ranks(2, _training_worker)):
        assert per_model["attention-probs:gathered"] == [], per_model["attention-probs:gathered"]
        for model, (step, r) in ((m, s) for m in ("residual", "attention-probs", "transposed")
                                 for s in enumerate(per_model[m])):
            where = f"{model} rank {rank} step {step}"
            assert abs(r["loss"] - r["ref_loss"]) <= 1e-5, (where, r["loss"], r["ref_loss"])
            assert_grads_close(r["grads"], r["ref_grads"], rtol=1e-4, context=where)
