"""Writes the SP plan cannot see (breaker helper-40, 2026-12-04), at world 2 against one device.

- A result written through ``out=`` into a buffer, and a training ``F.batch_norm`` called only
  to update its running statistics, were dropped with their unused results: buffers never
  updated, loss and gradients off (68%), no warning, with or without regions. Now refused,
  naming the op and the source line.
- A training ``F.batch_norm`` whose result is used writes its running statistics in place:
  with ``regions=True`` its layer stays inline (autosp's regions write nothing).
- ``self.bits ^= 1`` (``operator.ixor``; also ``<<=``, ``>>=``, ``@=``) was not counted as in
  place: with ``regions=True`` the layer was outlined and the compile failed with an internal
  error. Now kept inline, exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import assert_step_exact, make_batch, run_ranks, step_against_reference

H, V = 16, 32


class _Block(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(H, H)
        self.register_buffer("buf", torch.zeros(H))
        self.register_buffer("rv", torch.ones(H))
        self.register_buffer("bits", torch.zeros(H, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "out":
            torch.mul(self.fc.bias.detach(), 2.0, out=self.buf)
            x = x + self.buf
        elif self.form == "batch_norm_stats":
            F.batch_norm(self.fc.weight.detach(), self.buf, self.rv, training=True, momentum=0.5)
            x = x + self.buf
        elif self.form == "batch_norm_used":  # its running statistics written in place
            w = F.batch_norm(self.fc.weight.detach(), self.buf, self.rv, training=True, momentum=0.5)
            x = x + w.sum(0)
        elif self.form == "ixor":
            self.bits ^= 1
            x = x + self.bits.to(x.dtype)
        return x + torch.tanh(self.fc(x))


class _LM(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList(_Block(form) for _ in range(2))
        self.head = nn.Linear(H, V)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), ignore_index=-100)


def _worker(rank: int, world: int) -> dict[str, Any]:
    import autosp

    mesh = autosp.init_mesh(world)
    ids, labels = make_batch(V, 2, 16, seed=1)
    out: dict[str, Any] = {}
    for form, regions in (("out", False), ("batch_norm_stats", False), ("ixor", True),
                          ("batch_norm_used", True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _LM(form)
        compiled = autosp.compile(model, mesh, backend="aot_eager", remat="none", regions=regions)
        try:
            out[form] = step_against_reference(model, compiled, ids, labels)
            out[form]["outlined"] = compiled.last_compile.outlined
            out[form]["buffers"] = [b.clone() for b in model.buffers()]
            torch.manual_seed(0)  # the same step on one device: the running statistics match
            ref = _LM(form)
            ref(ids, labels).backward()
            out[form]["ref_buffers"] = [b.clone() for b in ref.buffers()]
        except autosp.AutospError as e:
            out[form] = {"error": str(e)}
    return out


def test_hidden_writes_are_refused_and_in_place_xor_stays_inline() -> None:
    for rank, r in enumerate(run_ranks(2, _worker)):
        msg = r["out"].get("error", "")
        assert msg.startswith("[autosp:bridge] op 'torch.mul' at test_hidden_writes.py:"), r["out"]
        assert "found a result written through out=" in msg and "buf.copy_(" in msg, msg
        msg = r["batch_norm_stats"].get("error", "")
        assert msg.startswith("[autosp:bridge] op 'torch.nn.functional.batch_norm' at "
                              "test_hidden_writes.py:"), r["batch_norm_stats"]
        assert "whose result is unused (called for its running statistics)" in msg, msg
        assert_step_exact(r["ixor"], f"rank {rank}, ixor with regions")
        assert all("not outlined: it writes in place (ixor" in line
                   for line in r["ixor"]["outlined"]), r["ixor"]["outlined"]
        # A training batch_norm writes its statistics: the layer stays inline (autosp's regions
        # write nothing, which outline.regions_known_pure relies on), exact, statistics too.
        bn = r["batch_norm_used"]
        assert_step_exact(bn, f"rank {rank}, batch_norm with regions")
        assert all(line.endswith(": not outlined: it writes in place (w" + ("_1)" if i else ")"))
                   for i, line in enumerate(bn["outlined"])), bn["outlined"]
        for got, want in zip(bn["buffers"], bn["ref_buffers"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
