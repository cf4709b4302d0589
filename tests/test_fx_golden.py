"""Golden tests of the FX import (Dynamo's graph -> the core graph), the placements the plan
gives it, and the FX export (the plan applied to the FX graph), in one process: no ranks are
spawned; the collectives are traced against a fake process group of 2 ranks and nothing runs.

Each model below writes tests/golden/fx_<name>.txt: the core graph, ``print_placements``, and
the applied graph's code. Source lines are written relative to the model's ``forward``, so
editing this file elsewhere does not change them. The files are for the pinned torch
(``GOLDEN_TORCH``); with another torch version the comparison is skipped, since Dynamo's
graphs differ between versions. After an intended change, rerun with AUTOSP_UPDATE_GOLDEN=1
and review the diff.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autosp import _core
from autosp.apply import RankContext, apply_plan
from autosp.bridge import fx_to_core
from autosp.plan_trace import _fake_sp_group

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_TORCH = "2.13"
WORLD = 2


class NanoGpt(nn.Module):
    """nanoGPT's shape: learned positions, fused c_attn split three ways, causal SDPA, GELU MLP,
    a tied head and the loss on logits.view(-1, V) with ignore_index=-1."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(64, dim)
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long))
        q, k, v = self.c_attn(self.ln_1(x)).split(x.size(-1), dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, -1))
        x = x + self.proj(F.gelu(self.fc(self.ln_2(x))))
        logits = self.lm_head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class ScratchLlama(nn.Module):
    """A from-scratch Llama: RMSNorm, RoPE from arange, GQA by repeat_interleave, an explicit
    boolean causal mask (computed in tiles), SwiGLU, and the shift inside the model."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.Parameter(torch.ones(dim))
        self.wq, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[2]
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        ang = torch.outer(torch.arange(t).float(), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.embed(ids)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        q = self.wq(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.wkv(h).view(b, t, 2 * self.kv_heads, self.hd).transpose(1, 2).chunk(2, dim=1)
        rep = self.heads // self.kv_heads
        k, v = self.rope(k).repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        o = F.scaled_dot_product_attention(self.rope(q), k, v, attn_mask=mask)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
        x = x + self.down(F.silu(self.gate(x)) * self.up(x))
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


MODELS = {"nanogpt": NanoGpt, "scratch_llama": ScratchLlama}


class _Done(Exception):
    """Raised by the test backend once the graphs are recorded: nothing compiles or runs."""


def _relative_lines(text: str, model: type) -> str:
    """'test_fx_golden.py:123' -> 'forward+7' (lines relative to the model's forward or, for
    code above it, its class)."""
    forward = inspect.getsourcelines(model.forward)[1]
    first = inspect.getsourcelines(model)[1]
    name = Path(__file__).name

    def rel(m: re.Match) -> str:
        n = int(m.group(1))
        return f"forward+{n - forward}" if n >= forward else f"{model.__name__}+{n - first}"

    text = re.sub(rf"[\w/.\-]*{re.escape(name)}:(\d+)", rel, text)
    return re.sub(r"[\w/.\-]*/(torch|transformers)/[\w/.\-]*:\d+", r"<\1>", text)


def _trace(name: str) -> dict[str, str]:
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = torch.randint(0, 64, (2, 16))
    labels = torch.randint(0, 64, (2, 16))
    for t in (ids, labels):
        torch._dynamo.mark_dynamic(t, 1)
    out: dict[str, str] = {}

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        bridge = fx_to_core(gm, list(example_inputs), 1)
        cfg = _core.SpConfig()
        cfg.sp_size = WORLD
        plan = _core.plan_ulysses(bridge.graph, cfg)
        applied = apply_plan(gm, bridge, plan, RankContext(rank=0, world=WORLD,
                                                           group=_fake_sp_group(WORLD)))
        out["import"] = str(bridge.graph)
        out["placements"] = _core.print_placements(bridge.graph, plan)
        out["export"] = "\n".join(line for line in applied.code.splitlines()
                                  if line.strip() and not line.strip().startswith("#"))
        raise _Done()

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failed:
        torch.compile(model, backend=backend, fullgraph=True)(ids, labels)
    if not isinstance(getattr(failed.value, "inner_exception", None), _Done):
        raise failed.value
    return {k: _relative_lines(v, MODELS[name]) for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fx_import_placements_and_export_golden(name: str) -> None:
    got = _trace(name)
    # What the golden must show whatever the version: the plan's collectives in the export,
    # and the model's source lines in the import.
    assert "all_to_all" in got["export"] and "forward+" in got["import"]
    text = (f"# torch {GOLDEN_TORCH}; world {WORLD}\n\n## FX import: the core graph\n{got['import']}\n"
            f"## placements\n{got['placements']}\n## FX export: the applied graph (rank 0)\n"
            f"{got['export']}\n")
    path = GOLDEN_DIR / f"fx_{name}.txt"
    if os.environ.get("AUTOSP_UPDATE_GOLDEN") == "1":
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if ".".join(torch.__version__.split(".")[:2]) != GOLDEN_TORCH:
        pytest.skip(f"golden files are for torch {GOLDEN_TORCH}, this is {torch.__version__}")
    expected = path.read_text()
    if text != expected:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            "golden", "now", n=2))
        pytest.fail(f"{path.name} differs (AUTOSP_UPDATE_GOLDEN=1 rewrites it):\n{diff}")
