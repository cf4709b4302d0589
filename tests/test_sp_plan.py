"""What the compiled graph holds: the collectives the plan promises, no full-length
activations per rank, and clear errors (pass, op, source line, found/expected) for
models autosp cannot make exact. Real Gloo groups at world 2."""

from __future__ import annotations

import copy
import operator
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import build_model, make_batch, run_ranks, tiny_config

SEQ = 24  # distinct from every model width below, so a dim == SEQ is the sequence
BATCH = 3  # so that BATCH * SEQ / P (a merged local dim) is not SEQ either


class _ShapeRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), tuple(t.shape), t.dtype))
        return out


def _collectives_worker(rank: int, world: int, layers: int) -> dict[str, Any]:
    import autosp
    from autosp import collectives

    cfg = tiny_config(num_heads=4, num_kv_heads=2, num_layers=layers)
    model = build_model(cfg)
    ids, labels = make_batch(cfg.vocab_size, BATCH, SEQ)
    # Flat: the recorder below is a TorchDispatchMode, which PyTorch's invoke_subgraph (a
    # layer's region, regions="compile") refuses without a rule for it.
    cm = autosp.compile(model, mesh=autosp.init_mesh(world), backend="aot_eager", remat="none",
                        regions=False)
    loss = cm(ids, labels)
    loss.backward()
    rec = cm.last_compile
    # Run this rank's planned graph eagerly and record every tensor it makes.
    recorder = _ShapeRecorder()
    with recorder, torch.no_grad():
        (planned_loss,) = rec.graph_module(*rec.example_inputs)
    assert torch.allclose(planned_loss, loss.detach())
    fx_counts: dict[str, int] = {}
    names = {collectives.all_to_all: "sp.all_to_all", collectives.grad_sync_many: "sp.grad_sync",
             collectives.reduce_partial: "sp.reduce_partial", collectives.count_valid: "sp.count_valid",
             collectives.all_gather_seq: "sp.all_gather"}
    for node in rec.graph_module.graph.nodes:
        if node.op == "call_function" and node.target in names:
            fx_counts[names[node.target]] = fx_counts.get(names[node.target], 0) + 1
    from autosp.fx_source import module_path

    params = [name for name, _ in model.named_parameters()]
    synced = [n for n in rec.graph_module.graph.nodes if n.target is collectives.grad_sync_many]
    buckets = [[module_path(a) for a in n.args[0]] for n in synced]
    return {"plan": rec.collective_counts, "fx": fx_counts, "params": params, "buckets": buckets,
            "shapes": recorder.seen, "heads": (cfg.num_heads, cfg.num_kv_heads)}


def test_collectives_and_local_activations() -> None:
    layers, world = 2, 2
    results = run_ranks(world, _collectives_worker, layers)
    for r in results:
        # One fused q/k/v exchange into each attention and one back out of it.
        expected = {
            "sp.all_to_all": 2 * layers,
            "sp.grad_sync": layers + 1,  # one gradient bucket per layer, one for the rest
            "sp.reduce_partial": 1,  # the loss
            "sp.count_valid": 1,  # the global number of valid labels
        }
        assert r["plan"] == expected
        assert r["fx"] == expected
        # Every parameter is synced once, in its layer's bucket; the parameters outside layers
        # (embedding, final norm, head) share the first bucket (the embedding is used first).
        assert sorted(p for b in r["buckets"] for p in b) == sorted(r["params"])
        assert r["buckets"][0] == ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
        for k, bucket in enumerate(r["buckets"][1:]):
            assert bucket == [p for p in r["params"] if p.startswith(f"layers.{k}.")], bucket
        # Per rank, no floating-point tensor is full-length in S, except attention's own
        # inputs/outputs after the exchange, which hold H/P heads over the whole sequence.
        local_heads = {h // world for h in r["heads"]}
        offenders = []
        for op, shape, dtype in r["shapes"]:
            if not dtype.is_floating_point:
                continue
            full = [d for d, n in enumerate(shape) if n in (SEQ, BATCH * SEQ)]
            if not full:
                continue
            is_attention = len(shape) in (3, 4) and shape[1] in local_heads and shape[2] == SEQ
            if not is_attention:
                offenders.append((op, shape))
        assert not offenders, f"full-length activations on a rank: {offenders[:5]}"
        # And the local chunk is what the activations hold.
        assert any(len(s) == 3 and s[1] == SEQ // world and s[2] == 64 for _, s, _ in r["shapes"])


# -- errors ------------------------------------------------------------------------------


class HandWrittenAttention(nn.Module):
    """Attention by hand over [B, S, D] with no heads: split by the batch when it divides the
    SP degree; with batch 1 (as run here) there is nothing to split, so it is refused or run
    on the gathered sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1)  # ATTN_LINE
        return (scores.softmax(-1) @ v).sum()


class SoftmaxOverSequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.emb(ids).softmax(dim=1) * self.emb(ids)).sum()  # ALONG_S_LINE


class ShiftedLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        shift = logits[:, ::2, :]  # SHIFT_LINE (every other position: not a shift at the ends)
        return F.cross_entropy(shift.reshape(-1, 32), labels[:, ::2].reshape(-1))


class GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        torch._dynamo.graph_break()
        return x.sum()


class InPlaceOnPositions(nn.Module):
    """Mutates a replicated value in place between two reads: the slice taken for the
    first read must not be reused for the second."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        before = (pos * 2).float().unsqueeze(-1)
        pos.add_(1)
        x = self.emb(ids) + before + pos.float().unsqueeze(-1) * 3
        return x.pow(2).mean()


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, start=1):
            if marker in line and "def " not in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


def _errors_worker(rank: int, world: int) -> dict[str, str]:
    import autosp

    mesh = autosp.init_mesh(world)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))  # same on every rank
    out: dict[str, str] = {}
    cases = {
        "attention": (HandWrittenAttention(), (ids[:1],)),
        "along_s": (SoftmaxOverSequence(), (ids,)),
        "shift": (ShiftedLogits(), (ids, ids.clone())),
        "graph_break": (GraphBreak(), (ids,)),
    }
    for name, (model, args) in cases.items():
        try:
            autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none",
                           unsupported="error")(*args)
            out[name] = "no error"
        except autosp.AutospError as e:
            out[name] = f"AutospError: {e}"
        except Exception as e:  # noqa: BLE001 - the test reports what was raised instead
            out[name] = f"{type(e).__name__}: {e}"
    # By default the hand-written attention runs on the gathered sequence: exact, and said.
    torch.manual_seed(0)
    model = HandWrittenAttention()
    ref_loss = copy.deepcopy(model)(ids[:1])
    compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = compiled(ids[:1])
    warned = [str(w.message) for w in seen if issubclass(w.category, autosp.AutospGatherWarning)]
    out["attention_gathered"] = (f"{loss.item():.6f} vs {ref_loss.item():.6f}; "
                                 f"{len(compiled.gathered)} gathered; {len(warned)} warnings")
    torch.manual_seed(0)
    model = InPlaceOnPositions()
    ref = InPlaceOnPositions()
    ref.load_state_dict(model.state_dict())
    ref_loss = ref(ids)
    loss = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none")(ids)
    out["inplace"] = f"{loss.item():.6f} vs {ref_loss.item():.6f}"
    try:
        autosp.init_mesh(world + 1)
        out["mesh"] = "no error"
    except autosp.AutospError as e:
        out["mesh"] = f"AutospError: {e}"
    return out


def test_errors_name_pass_op_line_and_numbers() -> None:
    world = 2
    out = run_ranks(world, _errors_worker)[0]
    here = "test_sp_plan.py"

    msg = out["attention"]
    assert msg.startswith("AutospError: [autosp:placement] op 'matmul'"), msg
    assert f"{here}:{_line_of('# ATTN_LINE')}" in msg, msg
    assert "splits it by heads" in msg and "found" in msg and "expected" in msg, msg

    losses, gathered, warned = out["attention_gathered"].split("; ")
    got, want = losses.split(" vs ")
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), out["attention_gathered"]
    assert gathered != "0 gathered" and warned == "1 warnings", out["attention_gathered"]

    msg = out["along_s"]  # (a cumsum along S is exact now: tests/test_cross_rank.py)
    assert msg.startswith("AutospError: [autosp:placement] op 'softmax'"), msg
    assert f"{here}:{_line_of('# ALONG_S_LINE')}" in msg, msg
    assert "dim 1" in msg, msg

    msg = out["shift"]
    assert msg.startswith("AutospError: [autosp:placement] op 'index'"), msg
    assert f"{here}:{_line_of('# SHIFT_LINE')}" in msg, msg
    assert "a step-1 slice of S positions that drops a few at its ends" in msg, msg
    assert "Index or slice the sequence before it is sharded" in msg, msg

    msg = out["graph_break"]
    assert msg.startswith("AutospError: [autosp:capture]"), msg
    assert "graph break" in msg, msg

    got, want = out["inplace"].split(" vs ")
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), out["inplace"]

    msg = out["mesh"]
    assert msg.startswith("AutospError: [autosp:init_mesh]"), msg
    assert f"world size {world} not divisible by sp_size {world + 1}" in msg, msg
