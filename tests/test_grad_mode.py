"""A layer first used under torch.no_grad() still gets its gradient (HRM-style cycles).

Before the fix, the gradient all-reduce of the layer's parameters was placed where they were
first used, inside the no_grad region, and every later use went through its output, which
carries no gradient: the layer's .grad stayed None, silently.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import assert_step_exact, run_ranks, step_against_reference


class _Cycles(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.LayerNorm(16)])
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        z = torch.zeros_like(x)
        with torch.no_grad():
            for _ in range(2):
                z = self.layers[1](self.layers[0](z + x))
        z = self.layers[1](self.layers[0](z + x))
        return F.cross_entropy(self.head(z).flatten(0, 1), labels.flatten())


def _worker(rank: int, world: int) -> dict:
    import autosp

    torch.manual_seed(0)
    model = _Cycles()
    ids = torch.randint(0, 32, (2, 16))
    labels = torch.randint(0, 32, (2, 16))
    compiled = autosp.compile(model, mesh=autosp.init_mesh(world), backend="aot_eager", remat="default")
    return step_against_reference(model, compiled, ids, labels)


def test_parameters_first_used_under_no_grad_get_gradients() -> None:
    for rank, r in enumerate(run_ranks(2, _worker)):
        assert_step_exact(r, f"rank {rank}")
