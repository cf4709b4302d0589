"""A random model generator for sequence-parallel exactness tests.

``specs(world_size)`` is a hypothesis strategy drawing a ``ModelSpec`` (norm, positions,
attention, GQA ratio, MLP, loss form, shift, ignore index, reduction, tying, batch and
sequence sizes); ``build(spec)`` makes the ``nn.Module`` and ``make_inputs(spec, seed)`` its
batch. ``run_spec`` (inside a rank of ``distributed.run_ranks``) compiles the model for
Ulysses SP and classifies it against the single-device model: ``exact``, ``autosp_error``
(a clear refusal), ``mismatch`` (ran but differs: the worst bug), ``crash`` (any other
exception) or ``invalid`` (the single-device model itself failed: a generator bug).

Everything is tiny (hidden 32, vocab 64/128, S <= 32) so dozens of models fit in one spawn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

MAX_LEN = 64
HEAD_DIM = 8

NORMS = ("layernorm", "rmsnorm", "none")
POSITIONS = ("learned", "rope", "alibi", "none")
ATTENTIONS = ("sdpa_causal", "sdpa_mask", "flex")
KV_REPEATS = ("expand", "repeat_interleave", "enable_gqa")
MLPS = ("gelu", "swiglu", "moe")
MOE_IMPLS = ("threshold", "scatter", "index")
LOSS_VIEWS = ("view", "reshape", "flatten", "transpose")
SHIFTS = ("outside", "pad", "logits")
IGNORES = (-100, -1, None)  # None: no ignored labels at all
REDUCTIONS = ("mean", "masked_mean", "sum_over_count")


@dataclass(frozen=True)
class ModelSpec:
    world_size: int = 2
    batch: int = 2
    seq_len: int = 16
    vocab: int = 64
    layers: int = 1
    heads: int = 4
    kv_heads: int = 4
    norm: str = "layernorm"
    positions: str = "learned"
    attention: str = "sdpa_causal"
    kv_repeat: str = "expand"
    mlp: str = "gelu"
    moe_impl: str = "threshold"
    moe_aux: bool = False
    loss_view: str = "view"
    shift: str = "pad"
    ignore_index: int | None = -100
    reduction: str = "mean"
    pad_mask: bool = False  # a [B, S] padding mask is the third input
    tied: bool = False
    bias: bool = False

    @property
    def hidden(self) -> int:
        return self.heads * HEAD_DIM

    def short(self) -> str:
        """The fields that differ from the defaults (the simplest model), as a repr."""
        base = ModelSpec()
        diff = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}
        return "ModelSpec(" + ", ".join(f"{k}={v!r}" for k, v in diff.items()) + ")"


# Fields in the order hypothesis draws them. Patterns that are slow to compile (flex
# attention) or refused today (index-style MoE) are drawn less often so most models
# exercise what is meant to be exact.
ATTENTION_DRAW = ("sdpa_causal", "sdpa_mask", "sdpa_causal", "sdpa_mask", "flex")
SHIFT_DRAW = ("pad", "outside", "logits")
KV_REPEAT_DRAW = ("expand", "enable_gqa", "expand", "enable_gqa", "repeat_interleave")
MOE_DRAW = ("threshold", "threshold", "scatter", "index")
@st.composite
def specs(draw, world_size: int | None = None) -> ModelSpec:
    P = world_size if world_size is not None else draw(st.sampled_from((2, 4)))
    heads = draw(st.sampled_from((4, 8, 2)))
    kv_heads = draw(st.sampled_from([h for h in (heads, 2, 1, 4, 8) if heads % h == 0 and h <= heads]))
    attention = draw(st.sampled_from(ATTENTION_DRAW))
    pad_mask = draw(st.booleans())
    mlp = draw(st.sampled_from(MLPS))
    return ModelSpec(
        world_size=P,
        batch=draw(st.sampled_from((2, 1))),
        seq_len=draw(st.sampled_from([s for s in (16, 8, 32) if s % P == 0 and s // P >= 2])),
        vocab=draw(st.sampled_from((64, 128))),
        layers=draw(st.sampled_from((1, 2))),
        heads=heads,
        kv_heads=kv_heads,
        norm=draw(st.sampled_from(NORMS)),
        positions=draw(st.sampled_from(POSITIONS)),
        attention=attention,
        kv_repeat=draw(st.sampled_from(KV_REPEAT_DRAW)),
        mlp=mlp,
        moe_impl=draw(st.sampled_from(MOE_DRAW)) if mlp == "moe" else "threshold",
        moe_aux=draw(st.booleans()) if mlp == "moe" else False,
        loss_view=draw(st.sampled_from(LOSS_VIEWS)),
        shift=draw(st.sampled_from(SHIFT_DRAW)),
        ignore_index=draw(st.sampled_from(IGNORES)),
        reduction=draw(st.sampled_from(REDUCTIONS)),
        pad_mask=pad_mask,
        tied=draw(st.booleans()),
        bias=draw(st.booleans()),
    )


# --------------------------------------------------------------------------------------
# The model.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "layernorm":
        return nn.LayerNorm(spec.hidden)
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden)
    return nn.Identity()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        H, KV, D = spec.heads, spec.kv_heads, HEAD_DIM
        self.q_proj = nn.Linear(spec.hidden, H * D, bias=spec.bias)
        # Never a key bias: its gradient is exactly zero (softmax shift invariance), so a
        # comparison of it compares rounding noise.
        self.k_proj = nn.Linear(spec.hidden, KV * D, bias=False)
        self.v_proj = nn.Linear(spec.hidden, KV * D, bias=spec.bias)
        self.o_proj = nn.Linear(H * D, spec.hidden, bias=spec.bias)

    def forward(self, x, rope, attn_mask, block_mask, alibi_slopes):
        spec = self.spec
        B, S, _ = x.shape
        H, KV, D = spec.heads, spec.kv_heads, HEAD_DIM
        q = self.q_proj(x).view(B, S, H, D).transpose(1, 2)
        k = self.k_proj(x).view(B, S, KV, D).transpose(1, 2)
        v = self.v_proj(x).view(B, S, KV, D).transpose(1, 2)
        if rope is not None:
            cos, sin = rope  # [S, D] -> [1, 1, S, D]
            cos, sin = cos[None, None], sin[None, None]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        gqa = KV != H
        if gqa and spec.kv_repeat == "expand":  # Hugging Face repeat_kv
            n_rep = H // KV
            k = k[:, :, None].expand(B, KV, n_rep, S, D).reshape(B, H, S, D)
            v = v[:, :, None].expand(B, KV, n_rep, S, D).reshape(B, H, S, D)
        elif gqa and spec.kv_repeat == "repeat_interleave":
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
        enable_gqa = gqa and spec.kv_repeat == "enable_gqa"
        if spec.attention == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            score_mod = None
            if alibi_slopes is not None:
                slopes = alibi_slopes

                def score_mod(score, b, h, q_idx, kv_idx):
                    return score + slopes[h] * (kv_idx - q_idx)

            o = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                               enable_gqa=enable_gqa)
        elif attn_mask is not None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H * D))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, swiglu: bool) -> None:
        super().__init__()
        self.swiglu = swiglu
        d, f = spec.hidden, 2 * spec.hidden
        self.up = nn.Linear(d, f, bias=spec.bias)
        self.down = nn.Linear(f, d, bias=spec.bias)
        if swiglu:
            self.gate = nn.Linear(d, f, bias=spec.bias)

    def forward(self, x):
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    N_EXPERTS = 4
    TOP_K = 2

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.router = nn.Linear(spec.hidden, self.N_EXPERTS, bias=False)
        self.experts = nn.ModuleList([MLP(spec, swiglu=True) for _ in range(self.N_EXPERTS)])

    def forward(self, x):
        B, S, C = x.shape
        E, K = self.N_EXPERTS, self.TOP_K
        flat = x.reshape(-1, C)
        probs = F.softmax(self.router(flat), dim=-1)
        topw, topi = torch.topk(probs, K, dim=-1)
        impl = self.spec.moe_impl
        out = torch.zeros_like(flat)
        if impl == "threshold":  # gates from the k-th largest probability: elementwise only
            gates = torch.where(probs >= topw[:, -1:], probs, torch.zeros_like(probs))
            gates = gates / gates.sum(-1, keepdim=True)
            for e, expert in enumerate(self.experts):
                out = out + gates[:, e : e + 1] * expert(flat)
        elif impl == "scatter":
            gates = torch.zeros_like(probs).scatter(1, topi, topw / topw.sum(-1, keepdim=True))
            for e, expert in enumerate(self.experts):
                out = out + gates[:, e : e + 1] * expert(flat)
        else:  # "index": Mixtral-style gather by index, index_add back
            topw = topw / topw.sum(-1, keepdim=True)
            mask = F.one_hot(topi, E).permute(2, 1, 0)
            for e, expert in enumerate(self.experts):
                idx, tok = torch.where(mask[e])
                out = out.index_add(0, tok, expert(flat[tok]) * topw[tok, idx, None])
        aux = None
        if self.spec.moe_aux:  # Switch load balancing: E * sum_e frac_e * mean_prob_e
            frac = (probs >= topw[:, :1]).float().mean(0) if impl == "threshold" else \
                F.one_hot(topi[:, 0], E).float().mean(0)
            aux = E * (frac * probs.mean(0)).sum()
        return out.view(B, S, C), aux


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm1 = _norm(spec)
        self.attn = Attention(spec)
        self.norm2 = _norm(spec)
        self.mlp = MoE(spec) if spec.mlp == "moe" else MLP(spec, swiglu=spec.mlp == "swiglu")

    def forward(self, x, rope, attn_mask, block_mask, alibi_slopes):
        x = x + self.attn(self.norm1(x), rope, attn_mask, block_mask, alibi_slopes)
        m = self.mlp(self.norm2(x))
        aux = None
        if isinstance(m, tuple):
            m, aux = m
        return x + m, aux


class GeneratedLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        if spec.positions == "learned":
            self.pos = nn.Embedding(MAX_LEN, spec.hidden)
        self.blocks = nn.ModuleList([Block(spec) for _ in range(spec.layers)])
        self.norm = _norm(spec)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight

    def forward(self, input_ids, labels, mask=None):
        spec = self.spec
        B, S = input_ids.shape
        dev = input_ids.device
        x = self.embed(input_ids)
        pos = torch.arange(S, device=dev)
        if spec.positions == "learned":
            x = x + self.pos(pos)[None]
        rope = None
        if spec.positions == "rope":
            inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))
            freqs = torch.outer(pos.float(), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            rope = (emb.cos(), emb.sin())
        alibi = _alibi_slopes(spec.heads) if spec.positions == "alibi" else None
        attn_mask = block_mask = None
        if spec.attention == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            if mask is not None:
                keep = mask.bool()

                def mask_mod(b, h, q_idx, kv_idx):
                    return (q_idx >= kv_idx) & keep[b, kv_idx]

                block_mask = create_block_mask(mask_mod, B, None, S, S, device=dev)
            else:

                def causal(b, h, q_idx, kv_idx):
                    return q_idx >= kv_idx

                block_mask = create_block_mask(causal, None, None, S, S, device=dev)
        elif spec.attention == "sdpa_mask" or alibi is not None:
            causal = torch.tril(torch.ones(S, S, dtype=torch.bool, device=dev))[None, None]
            allowed = causal
            if mask is not None and spec.attention == "sdpa_mask":
                allowed = causal & mask.bool()[:, None, None, :]
            if alibi is not None:
                dist = (pos[None, :] - pos[:, None]).float()
                attn_mask = (alibi[:, None, None] * dist[None])[None]  # [1, H, S, S]
                attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
            else:
                attn_mask = allowed
        aux_total = None
        for block in self.blocks:
            x, aux = block(x, rope, attn_mask, block_mask, alibi)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        logits = self.head(self.norm(x))
        loss = self._loss(logits, labels, mask)
        if aux_total is not None:
            loss = loss + 0.01 * aux_total
        return loss

    def _loss(self, logits, labels, mask):
        spec = self.spec
        ig = -100 if spec.ignore_index is None else spec.ignore_index
        if mask is not None:
            labels = labels.masked_fill(mask == 0, ig)
        if spec.shift == "pad":
            labels = F.pad(labels, (0, 1), value=ig)[:, 1:]
        elif spec.shift == "logits":
            logits = logits[:, :-1, :]
            labels = labels[:, 1:]
        V = logits.size(-1)
        reduction = "mean" if spec.reduction == "mean" else (
            "sum" if spec.reduction == "sum_over_count" else "none")
        if spec.loss_view == "transpose":
            ce = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=ig, reduction=reduction)
        else:
            if spec.loss_view == "view":
                lg, lb = logits.contiguous().view(-1, V), labels.contiguous().view(-1)
            elif spec.loss_view == "reshape":
                lg, lb = logits.reshape(-1, V), labels.reshape(-1)
            else:
                lg, lb = logits.flatten(0, 1), labels.flatten()
            ce = F.cross_entropy(lg, lb, ignore_index=ig, reduction=reduction)
        if spec.reduction == "mean":
            return ce
        valid = labels != ig
        if spec.reduction == "sum_over_count":
            return ce / valid.sum()
        ce = ce.reshape(labels.shape)
        v = valid.to(ce.dtype)
        return (ce * v).sum() / v.sum()


def build(spec: ModelSpec) -> nn.Module:
    return GeneratedLM(spec)


def make_inputs(spec: ModelSpec, seed: int) -> tuple[torch.Tensor, ...]:
    """The batch: token ids and labels (= ids; the model shifts unless shift == 'outside',
    where they are shifted here), ignored labels at awkward places (see make_batch) unless
    ignore_index is None, and a right-padding mask when pad_mask."""
    from distributed import make_batch

    B, S = spec.batch, spec.seq_len
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab, (B, S), generator=gen)
    if spec.ignore_index is None:
        labels = ids.clone()
    else:
        _, pattern = make_batch(spec.vocab, B, S, seed)
        labels = torch.where(pattern == -100, torch.full_like(ids, spec.ignore_index), ids)
    if spec.shift == "outside":
        fill = -100 if spec.ignore_index is None else spec.ignore_index
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], fill)], dim=1)
    if not spec.pad_mask:
        return ids, labels
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, S - 3 :] = 0
    if B > 1:
        mask[1, S // 2 + 1 :] = 0
    return ids, labels, mask


# --------------------------------------------------------------------------------------
# Running specs inside ranks.


def run_spec(spec: ModelSpec, mesh=None, regions: bool | str | None = None) -> dict:
    """Classifies one spec (call inside a rank of run_ranks with world_size == spec.world_size),
    compiled with ``autosp.compile(..., regions=regions)`` (None: autosp.compile's default)."""
    import styles

    # The single-device model must run at all, or the generator made a bad model.
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            m = build(spec)
        styles.allow_flex_backward_on_cpu()
        m(*make_inputs(spec, 1)).backward()
    except Exception as exc:  # noqa: BLE001
        return {"name": spec.short(), "spec": spec, "outcome": "invalid",
                "detail": f"{type(exc).__name__}: {exc}"[:2000], "steps": []}
    r = styles.run_case(spec.short(), lambda: build(spec), lambda seed, _s: make_inputs(spec, seed),
                        spec.world_size, spec.seq_len, batch_seeds=(11, 12), mesh=mesh,
                        regions=regions)
    r["spec"] = spec
    return r


def run_specs_worker(rank: int, world_size: int, spec_list: list[ModelSpec],
                     regions: bool | str | None = None) -> list[dict]:
    """run_ranks target: every spec in one spawn (one mesh); results in order."""
    import time
    import warnings

    import autosp

    warnings.filterwarnings("ignore")
    mesh = autosp.init_mesh(world_size)
    out = []
    for spec in spec_list:
        assert spec.world_size == world_size, (spec, world_size)
        t0 = time.time()
        r = run_spec(spec, mesh, regions)
        r["time"] = time.time() - t0
        out.append(r)
    return out


SIMPLEST = ModelSpec()


def simplifications(spec: ModelSpec) -> list[ModelSpec]:
    """Specs one field simpler than ``spec`` (towards the defaults), for a greedy shrink."""
    out = []
    for f in dataclasses.fields(spec):
        if f.name in ("world_size",):
            continue
        cur, simple = getattr(spec, f.name), getattr(SIMPLEST, f.name)
        if cur == simple:
            continue
        cand = dataclasses.replace(spec, **{f.name: simple})
        if f.name == "heads" and cand.heads % cand.kv_heads:
            cand = dataclasses.replace(cand, kv_heads=cand.heads)
        if f.name == "mlp":
            cand = dataclasses.replace(cand, moe_impl="threshold", moe_aux=False)
        out.append(cand)
    return out


def shrink_worker(rank: int, world_size: int, spec: ModelSpec, budget: int = 40) -> dict:
    """Greedy shrink of a failing spec (outcome 'mismatch' or 'crash', or any outcome
    given): tries each one-field simplification and keeps it while the outcome (and, for
    an error, its first line's op) stays the same. All ranks take the same decisions (the
    outcome is agreed with an all-reduce)."""
    import warnings

    import torch.distributed as dist

    import autosp

    warnings.filterwarnings("ignore")
    mesh = autosp.init_mesh(world_size)

    def key(r):
        first = r["detail"].split(":")[0:2] if r["outcome"] in ("autosp_error", "crash") else []
        return (r["outcome"], tuple(first))

    def agreed(r) -> bool:
        flag = torch.tensor([1.0 if key(r) == target else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return flag.item() == 1.0

    base = run_spec(spec, mesh)
    target = key(base)
    best, tried = spec, 0
    progress = True
    while progress and tried < budget:
        progress = False
        for cand in simplifications(best):
            tried += 1
            r = run_spec(cand, mesh)
            if agreed(r):
                best, base, progress = cand, r, True
                break
            if tried >= budget:
                break
    return {"spec": best, "short": best.short(), "outcome": base["outcome"],
            "detail": base["detail"], "tried": tried}


def outcome_counts(results: list[dict]) -> dict[str, int]:
    counts = {k: 0 for k in ("exact", "autosp_error", "mismatch", "crash", "invalid")}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return counts
