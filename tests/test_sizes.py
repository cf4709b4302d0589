"""Sizes read from a sharded tensor are the single-device sizes.

A chunk reports its local sizes at run time, while the graph was traced with the global
ones. ``x.size(d)``, ``x.size()`` / ``x.shape`` (a torch.Size passed to reshape or a
factory) and ``x.numel()`` must all give what one device gives. Before the plan scaled a
whole ``x.size()``, ``ce.reshape(labels.shape)`` and ``y.view(saved_shape)`` crashed inside
autosp (the generated models and OPT / Aria in the zoo).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import assert_step_exact, run_ranks, step_against_reference


class _SizesLM(nn.Module):
    def __init__(self, form: str, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.form = form
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        logits = self.head(h)
        if self.form == "numel":  # a mean written by hand over a sharded tensor
            return logits.logsumexp(-1).sum() / logits.numel() + (h * h).sum() / h.numel()
        if self.form == "reshape_shape":  # masked mean from a per-token loss (generated-model crash)
            ce = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), reduction="none")
            ce = ce.reshape(labels.shape)
            valid = (labels != -100).to(ce.dtype)
            return (ce * valid).sum() / valid.sum()
        if self.form == "zeros_shape":  # a factory from a sharded tensor's shape
            bias = torch.zeros(h.shape, dtype=h.dtype) + 0.5
            return F.cross_entropy(self.head(h + bias).flatten(0, 1), labels.flatten())
        if self.form == "view_saved_shape":  # OPT, Aria: view(x.shape) after a flattened op
            shape = h.shape
            h = self.head.weight[:, :1].sum() + torch.tanh(h.view(-1, h.size(-1))).view(shape)
            return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        raise ValueError(self.form)


FORMS = ("numel", "reshape_shape", "zeros_shape", "view_saved_shape")


def _worker(rank: int, world: int) -> list[dict[str, Any]]:
    import autosp

    mesh = autosp.init_mesh(world)
    out = []
    for form in FORMS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _SizesLM(form)
        compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="default")
        for step, seq in enumerate((16, 24)):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 32, (2, seq), generator=gen)
            labels = torch.randint(0, 32, (2, seq), generator=gen)
            labels[0, 3:7] = -100
            out.append(dict(step_against_reference(model, compiled, ids, labels), form=form, seq=seq))
    return out


def test_sizes_of_sharded_tensors_are_global() -> None:
    for rank, results in enumerate(run_ranks(2, _worker)):
        assert len(results) == 2 * len(FORMS)
        for r in results:
            where = f"rank {rank} {r['form']} S={r['seq']}"
            assert_step_exact(r, where)
