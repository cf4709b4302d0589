"""In-place writes through views, as Hugging Face code writes them.

- MLA's key buffer (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite): ``k = k_pass.new_empty(...)``,
  then ``k[..., :n].copy_(k_nope)`` and ``k[..., n:].copy_(k_rope)``. The buffer is allocated
  sharded like ``k_pass`` (its values do not depend on the position) and the copies stay on
  the rank: exact.
- The same into ``torch.empty(...)`` (replicated, full length): refused with a clear error,
  since a write into a rank's slice of a replicated tensor would miss the tensor itself.
- A replicated mask finished in place through a view (``m[:, :k].fill_(...)``): the write is
  never dropped as dead code, although nothing reads the view afterwards.
Each against one device at world 2: loss atol 1e-5, gradients 1e-4.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import assert_step_exact, run_ranks, step_against_reference


class _Writes(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.embed = nn.Embedding(32, 16)
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        a, b = self.a(x), self.b(x)
        if self.form == "new_empty":
            k = a.new_empty(*a.shape[:-1], 16)
            k[..., :8].copy_(a)
            k[..., 8:].copy_(b)
        elif self.form == "empty":
            k = torch.empty(a.shape[0], a.shape[1], 16)
            k[..., :8].copy_(a)
            k[..., 8:].copy_(b)
        else:  # a replicated [S, 16] scale built in place through a view
            scale = torch.ones(ids.shape[1], 16)
            scale[:, 8:].fill_(0.5)
            k = torch.cat([a, b], dim=-1) * scale
        return F.cross_entropy(self.head(k + x).flatten(0, 1), labels.flatten())


FORMS = ("new_empty", "empty", "view_fill")


def _worker(rank: int, world: int) -> list:
    import autosp

    out = []
    for form in FORMS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Writes(form)
        ids = torch.randint(0, 32, (2, 16))
        labels = torch.randint(0, 32, (2, 16))
        compiled = autosp.compile(model, mesh=autosp.init_mesh(world), backend="aot_eager", remat="default")
        try:
            out.append(step_against_reference(model, compiled, ids, labels))
        except autosp.AutospError as e:
            out.append(str(e))
    return out


def test_in_place_writes_through_views() -> None:
    for rank, (new_empty, empty, view_fill) in enumerate(run_ranks(2, _worker)):
        assert_step_exact(new_empty, f"rank {rank} new_empty + copy_")
        assert_step_exact(view_fill, f"rank {rank} fill_ through a view")
        assert isinstance(empty, str) and empty.startswith("[autosp:ulysses] op 'copy' (Tensor.copy_)"), empty
        assert "found an in-place 'copy' into a replicated [2, S, 8] from sequence-sharded values" in empty
