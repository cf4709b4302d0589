"""Op coverage: the pointwise set is torch's own, aliasing and random ops are read from torch's
schemas and tags (each checked against what the op does), and hand-written GQA and MQA forms
are exact.

The pointwise tests need no process group. The exactness test spawns one Gloo group of 2
ranks and runs several small models in it, each against the single-device model (loss
atol 1e-5, every gradient max|g-g_ref|/max|g_ref| <= 1e-4).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autosp.ops import UNTAGGED_POINTWISE, aten_pointwise_ops, is_pointwise, is_random, may_alias
from distributed import assert_step_exact, run_ranks, step_against_reference


def test_pointwise_set_is_torchs() -> None:
    ops = aten_pointwise_ops()
    # Every op torch tags pointwise (and is not seeded-random) is covered: the list is
    # derived, so this checks the derivation against the tags directly.
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if name.startswith("_") or not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        tags = [set(getattr(packet, o).tags) for o in packet.overloads()]
        tagged = any(torch.Tag.pointwise in t for t in tags)
        seeded = any(torch.Tag.nondeterministic_seeded in t for t in tags)
        assert (name in ops) == (tagged and not seeded) or name in UNTAGGED_POINTWISE, name
    assert len(ops) > 200
    for name in ("expm1", "exp", "silu", "gelu", "where", "masked_fill", "logaddexp", "erfinv"):
        assert is_pointwise(name), name
    # Not pointwise: reductions, matmuls, views, and random ops (each rank would draw the
    # same numbers for its own chunk).
    for name in ("sum", "matmul", "view", "softmax", "rrelu", "bernoulli", "dropout"):
        assert not is_pointwise(name), name


def test_where_of_a_condition_alone_is_nonzero_not_pointwise() -> None:
    """torch.where(cond) returns data-dependent indices (nonzero): it must not take the
    pointwise rule that where(cond, a, b) takes, though both are overloads of one tagged op."""
    from autosp.canon import canonicalize

    gm = torch.fx.symbolic_trace(lambda c, a, b: (torch.where(c), torch.where(c, a, b)))
    example = {"c": torch.ones(2, 4, dtype=torch.bool), "a": torch.ones(2, 4), "b": torch.zeros(2, 4)}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["example_value"] = example[n.name]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    calls[0].meta["example_value"] = (torch.zeros(8, dtype=torch.long),) * 2
    calls[1].meta["example_value"] = torch.ones(2, 4)
    assert canonicalize(calls[0])[0] == "nonzero"
    op, _, attrs = canonicalize(calls[1])
    assert op == "where" and is_pointwise(op)


def test_masked_reductions_are_not_their_plain_namesakes() -> None:
    """torch.masked.mean(x, mask=m) averages over the mask, not over x: it must not take
    mean's rule (which rewrote it into a sum with a mask keyword that torch.sum rejects)."""
    from autosp.canon import canonicalize

    g = torch.fx.Graph()
    x, m = g.placeholder("x"), g.placeholder("m")
    x.meta["example_value"] = torch.ones(2, 4)
    m.meta["example_value"] = torch.ones(2, 4, dtype=torch.bool)
    calls = [g.call_function(torch.masked.mean, (x,), {"mask": m}), g.call_function(torch.mean, (x,))]
    for n in calls:
        n.meta["example_value"] = torch.ones(())
    ops = [canonicalize(n)[0] for n in calls]
    assert ops == ["masked_mean", "mean"], ops


@pytest.mark.parametrize("name", sorted(UNTAGGED_POINTWISE))
def test_untagged_pointwise_functions_are_elementwise(name: str) -> None:
    # Each entry of the hand-kept supplement computes every element from the same element
    # of its inputs: f(x)[i] == f(x[i]) on a permuted input.
    fn = {"floor_divide": lambda t: torch.floor_divide(t, 0.7), "hardswish": F.hardswish,
          "log_sigmoid": F.logsigmoid, "fix": torch.fix}[name]
    x = torch.randn(64) * 4
    perm = torch.randperm(64)
    torch.testing.assert_close(fn(x)[perm], fn(x[perm]), rtol=0, atol=0)


class _Attention(nn.Module):
    """One decoder block with GQA written the ways people write it."""

    def __init__(self, form: str, kv: int, mask: bool, act: str, d: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h, self.kv, self.hd, self.form, self.mask, self.act = h, kv, d // h, form, mask, act
        self.q = nn.Linear(d, d)
        # No key bias: its gradient is zero in exact arithmetic (softmax is invariant to it),
        # so a relative comparison would measure rounding noise.
        self.k = nn.Linear(d, kv * self.hd, bias=False)
        self.v = nn.Linear(d, kv * self.hd)
        self.o = nn.Linear(d, d)
        self.fc = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q = self.q(x).view(B, S, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(B, S, self.kv, self.hd).transpose(1, 2)
        v = self.v(x).view(B, S, self.kv, self.hd).transpose(1, 2)
        r = self.h // self.kv
        if self.form == "repeat_interleave":
            k = k.repeat_interleave(r, dim=1)
            v = torch.repeat_interleave(v, r, dim=1)
        elif self.form == "expand":
            k = k[:, :, None].expand(B, self.kv, r, S, self.hd).reshape(B, self.h, S, self.hd)
            v = v[:, :, None].expand(B, self.kv, r, S, self.hd).reshape(B, self.h, S, self.hd)
        elif self.form == "repeat":
            k = k.repeat(1, r, 1, 1)
            v = v.repeat(1, r, 1, 1)
        # "broadcast": one key/value head that SDPA broadcasts (multi-query attention, Falcon)
        if self.mask:
            causal = torch.tril(torch.ones(S, S, dtype=torch.bool, device=x.device))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, S, D))
        h = self.fc(x)
        h = torch.expm1(h.clamp(max=3)) if self.act == "expm1" else F.hardswish(h)
        return x + self.fc2(h)


class _Model(nn.Module):
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.block = _Attention(**kw)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.block(self.embed(ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


GQA_CASES = [
    dict(form="repeat_interleave", kv=1, mask=False, act="expm1"),  # kv heads < P
    dict(form="repeat_interleave", kv=2, mask=True, act="hardswish"),  # explicit bool mask
    dict(form="expand", kv=1, mask=False, act="expm1"),
    dict(form="repeat", kv=2, mask=False, act="expm1"),
    dict(form="broadcast", kv=1, mask=False, act="expm1"),
]


def _gqa_worker(rank: int, world: int) -> list[dict[str, Any]]:
    import autosp

    mesh = autosp.init_mesh(world)
    out = []
    for kw in GQA_CASES:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Model(**kw)
        ids = torch.randint(0, 64, (2, 32))
        labels = torch.randint(0, 64, (2, 32))
        labels[0, 5:9] = -100
        compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="default")
        out.append(dict(step_against_reference(model, compiled, ids, labels), case=kw))
    return out


def test_hand_written_gqa_forms_are_exact() -> None:
    for rank, results in enumerate(run_ranks(2, _gqa_worker)):
        for r in results:
            assert_step_exact(r, f"rank {rank} {r['case']}")


# may_alias and is_random (autosp.ops): what autosp.outline refuses to hand on from a region,
# and what it refuses to move, read from PyTorch's schemas and tags; each answer checked here
# against what the op does.
_X = torch.randn(4, 6)
_ALIASING_CALLS = {
    "reshape": lambda x: x.reshape(6, 4), "swapaxes": lambda x: x.swapaxes(0, 1),
    "expand_as": lambda x: x.expand_as(x), "contiguous": lambda x: x.contiguous(),
    "detach": lambda x: x.detach(), "to": lambda x: x.to(torch.float32),
    "float": lambda x: x.float(), "type_as": lambda x: x.type_as(x),
    "moveaxis": lambda x: x.moveaxis(0, 1), "ravel": lambda x: x.ravel(),
    "flatten": lambda x: x.flatten(), "unflatten": lambda x: x.unflatten(1, (2, 3)),
    "narrow": lambda x: x.narrow(0, 0, 2), "view_as": lambda x: x.view_as(x),
}
_FRESH_CALLS = {
    "add": lambda x: x + 1, "clone": lambda x: x.clone(), "matmul": lambda x: x @ x.T,
    "exp": lambda x: x.exp(), "linear": lambda x: F.linear(x, x), "cat": lambda x: torch.cat([x, x]),
    "softmax": lambda x: x.softmax(-1), "index_select": lambda x: x.index_select(0, torch.tensor([0])),
}


@pytest.mark.parametrize("name", sorted(_ALIASING_CALLS))
def test_may_alias_says_so_for_a_view(name: str) -> None:
    out = _ALIASING_CALLS[name](_X)
    assert out.untyped_storage().data_ptr() == _X.untyped_storage().data_ptr()
    assert may_alias(name)


@pytest.mark.parametrize("name", sorted(_FRESH_CALLS))
def test_may_alias_is_false_for_a_fresh_result(name: str) -> None:
    out = _FRESH_CALLS[name](_X)
    assert out.untyped_storage().data_ptr() != _X.untyped_storage().data_ptr()
    assert not may_alias(name)


@pytest.mark.parametrize("name", ["dropout", "alpha_dropout", "feature_alpha_dropout",
                                  "dropout1d", "dropout2d", "dropout3d", "rrelu"])
def test_is_random_for_functions_that_draw(name: str) -> None:
    fn = getattr(F, name)
    # Channels enough that two draws agree with probability 2**-128 at most.
    x = torch.ones({"dropout1d": (8, 16, 4), "dropout3d": (8, 16, 2, 2, 2)}.get(name, (8, 16, 2, 2)))
    kw = {"training": True} if name != "rrelu" else {"training": True, "lower": 0.1, "upper": 0.9}
    draws = [fn(x if name != "rrelu" else -x, **kw) for _ in range(2)]
    assert not torch.equal(*draws)
    assert is_random(name)


@pytest.mark.parametrize("name", ["exp", "add", "linear", "softmax", "reshape"])
def test_is_random_is_false_for_deterministic_ops(name: str) -> None:
    assert not is_random(name)


@pytest.mark.parametrize("name,args,kwargs,aliases", [
    ("dropout", (None, 0.1, True), {}, False),       # on: a fresh tensor
    ("dropout", (None, 0.0, True), {}, True),        # p = 0: the input itself
    ("dropout", (None, 0.1, False), {}, True),       # not training: the input itself
    ("dropout", (None,), {"p": 0.2}, False),         # F.dropout's default: training
    ("alpha_dropout", (None, 0.2), {}, True),        # F.alpha_dropout's default: not training
    ("sharded_dropout", (None, 0.0, True, 1, 1, 1, 0, 2), {}, True),
    ("reshape", (None, (2, 3)), {}, True), ("add", (None, 1), {}, False)])
def test_may_alias_call_reads_a_dropouts_arguments(name: str, args: tuple, kwargs: dict,
                                                   aliases: bool) -> None:
    from autosp.ops import may_alias_call

    assert may_alias_call(name, args, kwargs) is aliases
    if name in ("dropout", "alpha_dropout"):  # and that is what the function does
        x = torch.ones(64)
        fn = getattr(F, name)
        out = fn(x, *args[1:], **kwargs)
        assert (out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) is aliases
