"""A small decoder layer (attention and a GELU MLP) for the regions breaker tests; a subclass
decides what multiplies the MLP's hidden values (``scale``), which is where those tests make
one layer compute differently from the others."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, H, HEADS = 64, 32, 4


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.o = nn.Linear(H, H)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def scale(self, u: torch.Tensor) -> torch.Tensor:
        return u

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, HEADS, H // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, H))
        return x + self.down(F.gelu(self.scale(self.up(self.n2(x)))))


class Model(nn.Module):
    """Embedding, three ``layer_cls`` layers, head, cross-entropy."""

    def __init__(self, layer_cls: type[Layer]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(layer_cls() for _ in range(3))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def step(compiled: Any, model: nn.Module, ref: nn.Module, seed: int) -> tuple:
    """One step of ``compiled`` (over ``model``) and of the one-device ``ref`` on the batch of
    ``seed``: (loss, reference loss, relative error of every parameter's gradient)."""
    from distributed import make_batch, relative_grad_errors

    ids, labels = make_batch(VOCAB, 2, 32, seed=seed)
    for m in (model, ref):
        m.zero_grad()
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    loss = compiled(ids, labels)
    loss.backward()
    return loss.item(), ref_loss.item(), relative_grad_errors(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in ref.named_parameters()})


def check_exact(per_rank: list[dict[str, Any]]) -> None:
    """Every rank's every case's every step (as :func:`step` returns it): the loss within 1e-5
    relative of one device's, and every gradient within 1e-4."""
    for rank, out in enumerate(per_rank):
        for case, steps in out.items():
            for i, (loss, ref, errors) in enumerate(steps):
                where = (rank, case, f"step {i}")
                assert abs(loss - ref) <= 1e-5 * abs(ref), (*where, loss, ref)
                worst = max(errors, key=errors.get)
                assert errors[worst] <= 1e-4, (*where, worst, errors[worst])
