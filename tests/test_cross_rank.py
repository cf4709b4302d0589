"""Scans and reductions along the sharded sequence are exact (sp.scan, sp.combine).

A cumsum token mixer, a logcumsumexp mixer, a cumprod gate, and amax / logsumexp / max
poolings over the sequence, each against the single-device model at world 2 and 4 (one
spawn per world): loss atol 1e-5, every gradient max|g-g_ref|/max|g_ref| <= 1e-4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import assert_step_exact, run_ranks, step_against_reference


class _Mixer(nn.Module):
    def __init__(self, kind: str, d: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = self.proj(x)
        if self.kind == "cumsum":
            pos = torch.arange(1, ids.size(1) + 1, device=ids.device, dtype=x.dtype)
            x = x + h.cumsum(dim=1) / pos[None, :, None]
        elif self.kind == "logcumsumexp":
            x = x + torch.logcumsumexp(h, dim=1)
        elif self.kind == "cumprod":
            x = x * torch.cumprod(torch.sigmoid(h) + 0.5, dim=-2)
        logits = self.head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        if self.kind == "pool":
            # Poolings over the whole sequence added to the loss.
            loss = loss + h.amax(dim=1).mean() + torch.logsumexp(h, dim=1).mean() * 0.1 + h.max() * 0.01
        return loss


KINDS = ("cumsum", "logcumsumexp", "cumprod", "pool")


def _worker(rank: int, world: int) -> list[dict[str, Any]]:
    import autosp

    mesh = autosp.init_mesh(world)
    out = []
    for kind in KINDS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Mixer(kind)
        compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="default")
        for step, seq in enumerate((16, 32)):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 64, (2, seq), generator=gen)
            labels = torch.randint(0, 64, (2, seq), generator=gen)
            r = step_against_reference(model, compiled, ids, labels)
            out.append(dict(r, kind=kind, seq=seq, counts=dict(compiled.last_compile.collective_counts)))
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_scans_and_poolings_over_the_sequence_are_exact(world: int) -> None:
    for rank, results in enumerate(run_ranks(world, _worker)):
        assert [r["kind"] for r in results[::2]] == list(KINDS)
        for r in results:
            where = f"rank {rank} of {world}, {r['kind']} S={r['seq']}"
            assert_step_exact(r, where)
            # The cross-rank step is really there (not a replicated fallback).
            op = "sp.combine" if r["kind"] == "pool" else "sp.scan"
            assert r["counts"].get(op, 0) >= 1, (where, r["counts"])
