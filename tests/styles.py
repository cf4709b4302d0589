"""Small language models written the way people really write them, for tests/test_styles.py.

Each style is an ordinary single-device ``nn.Module`` whose ``forward`` takes the batch
(``(input_ids, labels)`` or ``(input_ids, labels, mask)``) and returns the scalar loss,
plus a function that makes that batch from a seed. Nothing here knows about autosp:
the test compiles each model for sequence parallelism and compares it with itself on
one device.

Shared sizes keep every model tiny (two CPU cores, up to four ranks): hidden 32, 4 query
heads of dim 8, vocabulary 64, one or two layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import styles_nn
from distributed import make_batch

VOCAB = 64
HIDDEN = 32
HEADS = 4
BATCH = 2


@dataclass(frozen=True)
class Style:
    """A model style: ``build()`` makes the model (weights from the caller's seed),
    ``inputs(seed, seq_len)`` the positional arguments of its forward."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int], tuple[torch.Tensor, ...]]
    loss_atol: float = 1e-5
    grad_rtol: float = 1e-4
    # Runs ops without a sequence-parallel form on the gathered sequence (unsupported="gather");
    # every other style must compile with nothing gathered.
    gathers: bool = False


def ids_labels(seed: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels (= ids, -100 at awkward places: see make_batch); the model shifts."""
    return make_batch(VOCAB, BATCH, seq_len, seed)


def padding_mask(seq_len: int) -> torch.Tensor:
    """[B, S] long, 1 on real tokens, 0 on right padding: row 0 pads its last 3 tokens,
    row 1 everything after S//2 + 1 (so the padding crosses a chunk boundary)."""
    mask = torch.ones(BATCH, seq_len, dtype=torch.long)
    mask[0, seq_len - 3 :] = 0
    if BATCH > 1:
        mask[1, seq_len // 2 + 1 :] = 0
    return mask


# ======================================================================================
# 1. nanoGPT (Karpathy): fused c_attn split, view/transpose, SDPA is_causal, learned wpe
# from torch.arange, tied wte/lm_head, CE over logits.view(-1, V) with ignore_index=-1.
# flash=False: nanoGPT's attention by hand (q @ k^T, the tril buffer sliced to [:T, :T],
# softmax, dropout, @ v), which autosp splits by heads like SDPA.
# The data loader shifts the targets (y = x[1:]); ignored targets are -1.


class NanoCausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, flash: bool = True, block_size: int = 64,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=True)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=True)
        self.n_head = n_head
        self.n_embd = n_embd
        self.flash = flash
        self.attn_dropout = nn.Dropout(dropout)
        if not flash:  # nanoGPT's path without flash attention: the causal mask as a buffer
            self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                                 .view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, **attn: object) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = NanoCausalSelfAttention(n_embd, n_head, **attn)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = NanoMLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int = VOCAB, block_size: int = 64, n_layer: int = 2,
                 n_head: int = HEADS, n_embd: int = HIDDEN, flash: bool = True) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([NanoBlock(n_embd, n_head, flash=flash, block_size=block_size)
                             for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return loss


def nanogpt_inputs(seed: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, labels = ids_labels(seed, seq_len)
    # y = x shifted left, as nanoGPT's get_batch makes it; ignored targets are -1.
    y = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    y = torch.where(y == -100, torch.full_like(y, -1), y)
    return x, y


# ======================================================================================
# 2. Llama from scratch (Meta reference style): RMSNorm and RoPE by hand (complex
# freqs_cis), GQA via repeat_interleave, an explicit boolean causal mask built in forward
# and passed as attn_mask, SwiGLU; labels shifted with F.pad.


class ScratchRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb_complex(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    # xq: [B, S, H, D]; freqs_cis: [S, D/2]
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[None, :, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def rope_cos_sin(seq_len: int, dim: int, device: torch.device, theta: float = 10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
    t = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class ScratchAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, rope: str) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.rope = rope
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: object, mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.rope == "complex":
            xq, xk = apply_rotary_emb_complex(xq, xk, freqs)
        else:
            cos, sin = freqs  # [S, D]
            cos, sin = cos[None, :, None, :], sin[None, :, None, :]
            xq = xq * cos + rotate_half(xq) * sin
            xk = xk * cos + rotate_half(xk) * sin
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


class ScratchFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ScratchBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, rope: str) -> None:
        super().__init__()
        self.attention_norm = ScratchRMSNorm(dim)
        self.attention = ScratchAttention(dim, n_heads, n_kv_heads, rope)
        self.ffn_norm = ScratchRMSNorm(dim)
        self.feed_forward = ScratchFeedForward(dim, 2 * dim)

    def forward(self, x, freqs, mask):
        h = x + self.attention(self.attention_norm(x), freqs, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class ScratchLlama(nn.Module):
    def __init__(self, n_layers: int = 2, dim: int = HIDDEN, n_heads: int = HEADS,
                 n_kv_heads: int = 1, vocab_size: int = VOCAB, max_seq_len: int = 64,
                 rope: str = "complex") -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            [ScratchBlock(dim, n_heads, n_kv_heads, rope) for _ in range(n_layers)]
        )
        self.norm = ScratchRMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.rope = rope
        self.head_dim = dim // n_heads
        if rope == "complex":
            self.register_buffer(
                "freqs_cis", precompute_freqs_cis(self.head_dim, max_seq_len), persistent=False
            )

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        if self.rope == "complex":
            freqs = self.freqs_cis[:seqlen]
        else:
            freqs = rope_cos_sin(seqlen, self.head_dim, tokens.device)
        mask = torch.tril(torch.ones(seqlen, seqlen, dtype=torch.bool, device=tokens.device))
        for layer in self.layers:
            h = layer(h, freqs, mask)
        logits = self.output(self.norm(h)).float()
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), shift_labels.reshape(-1))


# ======================================================================================
# A generic pre-norm decoder the remaining styles vary one piece of.


class SimpleAttention(nn.Module):
    """q/k/v projections, [B, H, S, D] layout, SDPA; ``mode`` picks how q/k/v are made."""

    def __init__(self, dim: int = HIDDEN, n_heads: int = HEADS, n_kv_heads: int | None = None,
                 mode: str = "separate", causal: bool = True) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = dim // n_heads
        self.mode = mode
        self.causal = causal
        kv_dim = self.n_kv_heads * self.head_dim
        if mode in ("chunk", "split_sizes", "enable_gqa_fused"):
            self.qkv = nn.Linear(dim, dim + 2 * kv_dim)
        elif mode == "einsum":
            self.wq = nn.Parameter(torch.randn(dim, n_heads, self.head_dim) / math.sqrt(dim))
            self.wk = nn.Parameter(torch.randn(dim, n_heads, self.head_dim) / math.sqrt(dim))
            self.wv = nn.Parameter(torch.randn(dim, n_heads, self.head_dim) / math.sqrt(dim))
            self.wo = nn.Parameter(torch.randn(n_heads, self.head_dim, dim) / math.sqrt(dim))
        else:
            self.q_proj = nn.Linear(dim, dim)
            # No key bias: its gradient is exactly zero in softmax attention (a shift of
            # every score of a query), so any comparison of it would compare rounding noise.
            self.k_proj = nn.Linear(dim, kv_dim, bias=False)
            self.v_proj = nn.Linear(dim, kv_dim)
        if mode != "einsum":
            self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, S, C = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        is_causal = self.causal and attn_mask is None
        if self.mode == "einsum":
            q = torch.einsum("bsd,dhe->bhse", x, self.wq)
            k = torch.einsum("bsd,dhe->bhse", x, self.wk)
            v = torch.einsum("bsd,dhe->bhse", x, self.wv)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
            return torch.einsum("bhse,hed->bsd", o, self.wo)
        if self.mode == "chunk":
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        elif self.mode in ("split_sizes", "enable_gqa_fused"):
            q, k, v = torch.split(self.qkv(x), [H * D, KV * D, KV * D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, S, H, D).transpose(1, 2)
        k = k.reshape(B, S, KV, D).transpose(1, 2)
        v = v.reshape(B, S, KV, D).transpose(1, 2)
        if self.mode == "enable_gqa_fused" or (KV != H and self.mode == "enable_gqa"):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                               enable_gqa=True)
        else:
            if KV != H:
                k = k.repeat_interleave(H // KV, dim=1)
                v = v.repeat_interleave(H // KV, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, C))


class GeluMLP(nn.Module):
    def __init__(self, dim: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class PreNormBlock(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, dim: int = HIDDEN,
                 post_norm: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = attn
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = mlp
        self.post_norm = post_norm

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.post_norm:  # original Transformer / BERT: normalise after the residual add
            x = self.ln1(x + self.attn(x, attn_mask))
            return self.ln2(x + self.mlp(x))
        x = x + self.attn(self.ln1(x), attn_mask)
        return x + self.mlp(self.ln2(x))


class DecoderLM(nn.Module):
    """Embedding, blocks, final norm, head; CE with labels shifted by F.pad (the form
    autosp documents). Subclasses change one piece."""

    def __init__(self, n_layers: int = 1, attn_kwargs: dict | None = None,
                 post_norm: bool = False, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([
            PreNormBlock(SimpleAttention(**(attn_kwargs or {})), GeluMLP(), post_norm=post_norm)
            for _ in range(n_layers)
        ])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def body(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.embed(input_ids)))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))


# ======================================================================================
# 3. Shift inside (older Hugging Face): logits[:, :-1] against labels[:, 1:].


class ShiftInsideLM(DecoderLM):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.embed(input_ids)))
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss_fct = nn.CrossEntropyLoss()
        return loss_fct(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


class MultiTokenShiftLM(DecoderLM):
    """Shifts inside, three ways at once: next-token CE on logits[:, :-1] (the mean counted
    by hand from shift_logits.size(1)), a second head predicting two tokens ahead
    (logits2[:, :-2] against labels[:, 2:]), and a smoothness penalty on neighbouring hidden
    states (h[:, 1:] - h[:, :-1], which needs the next rank's first position)."""

    def __init__(self) -> None:
        super().__init__(n_layers=1)
        self.head2 = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(input_ids))
        logits = self.head(h)
        shift_logits = logits[:, :-1, :]
        B, n = shift_logits.size(0), shift_logits.size(1)
        ce = F.cross_entropy(shift_logits.reshape(B * n, -1), labels[:, 1:].reshape(-1),
                             reduction="sum", ignore_index=-100) / (B * n)
        logits2 = self.head2(h)[:, :-2]
        ce2 = F.cross_entropy(logits2.flatten(0, 1), labels[:, 2:].flatten())
        smooth = (h[:, 1:] - h[:, :-1]).pow(2).mean()
        return ce + 0.5 * ce2 + 0.1 * smooth


class ShiftedAttentionLM(DecoderLM):
    """Attention over h[:, 1:] (S - 1 positions): refused, since Ulysses needs the sequence
    split evenly."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)[:, 1:]
        logits = self.head(self.body(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


# ======================================================================================
# 4. Bidirectional encoder (BERT-like, post-norm): [B, S] padding mask turned into a
# [B, 1, 1, S] boolean key mask; masked-mean loss over the non-pad tokens.


class BertLikeEncoder(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(64, HIDDEN)
        self.emb_ln = nn.LayerNorm(HIDDEN)
        self.layers = nn.ModuleList([
            PreNormBlock(SimpleAttention(causal=False), GeluMLP(), post_norm=True)
            for _ in range(n_layers)
        ])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        B, S = input_ids.shape
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, -1)
        x = self.emb_ln(self.word_embeddings(input_ids) + self.position_embeddings(position_ids))
        ext_mask = attention_mask[:, None, None, :].bool()  # [B, 1, 1, S]: attend to real keys
        for layer in self.layers:
            x = layer(x, ext_mask)
        logits = self.head(x)
        per_tok = F.cross_entropy(logits.transpose(1, 2), input_ids, reduction="none")  # [B, S]
        m = attention_mask.float()
        return (per_tok * m).sum() / m.sum()


class BertMSEEncoder(BertLikeEncoder):
    """As BertLikeEncoder, with a masked-mean MSE against a target embedding."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__(n_layers)
        del self.head  # unused: the loss is on the hidden states

    def forward(self, input_ids, labels, attention_mask):
        B, S = input_ids.shape
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, -1)
        x = self.emb_ln(self.word_embeddings(input_ids) + self.position_embeddings(position_ids))
        ext_mask = attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            x = layer(x, ext_mask)
        target = torch.sin(labels.clamp(min=0).float())[..., None] * torch.ones_like(x)
        sq = ((x - target) ** 2).mean(-1)
        m = attention_mask.to(sq.dtype)
        return (sq * m).sum() / m.sum().clamp(min=1)


def bert_inputs(seed: int, seq_len: int):
    ids, labels = ids_labels(seed, seq_len)
    return ids, labels, padding_mask(seq_len)


# ======================================================================================
# 5. Cumulative-sum token mixer: x + cumsum(x, dim=1) / positions inside every block.


class CumsumMixerLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(n_layers=1)
        self.mix = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        S = x.shape[1]
        positions = torch.arange(1, S + 1, device=x.device, dtype=x.dtype)[None, :, None]
        x = x + self.mix(torch.cumsum(x, dim=1) / positions)
        logits = self.head(self.body(x))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))


# A Mamba-2-style hybrid, written as the reference "SSD minimal" code is: the sequence is
# padded to a multiple of the chunk size, each chunk is scanned in closed form, and a state
# is carried across chunks (segment sums over the chunk dim). Its F.pad of the sequence has no
# sequence-parallel form: autosp gathers the mixer's inputs and runs the scan on the whole
# sequence on every rank (unsupported="gather"); the attention blocks stay sharded.


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[..., i, j] = x[..., j+1] + ... + x[..., i], -inf above."""
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)
    x = x.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), -1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device)), -torch.inf)


class ChunkedSSD(nn.Module):
    def __init__(self, dim: int = HIDDEN, heads: int = HEADS, state: int = 4, chunk: int = 6) -> None:
        super().__init__()
        self.heads, self.head_dim, self.state, self.chunk = heads, dim // heads, state, chunk
        self.in_proj = nn.Linear(dim, dim + 2 * state + heads)
        self.A_log = nn.Parameter(torch.linspace(0.0, 1.0, heads))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, u: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, S, D = u.shape
        H, P, N, L = self.heads, self.head_dim, self.state, self.chunk
        x, Bm, Cm, dt = torch.split(self.in_proj(u), [D, N, N, H], dim=-1)
        dt = F.softplus(dt)
        A = -torch.exp(self.A_log) * dt                                   # [B, S, H]
        x = (x * dt.repeat_interleave(P, dim=-1)).view(B, S, H, P)
        pad = (L - S % L) % L
        x, A, Bm, Cm = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, A, Bm, Cm))
        x = x.reshape(B, -1, L, H, P)
        A = A.reshape(B, -1, L, H).permute(0, 3, 1, 2)                   # [B, H, C, L]
        Bm, Cm = Bm.reshape(B, -1, L, N), Cm.reshape(B, -1, L, N)
        A_cum = torch.cumsum(A, dim=-1)
        Ld = torch.exp(segment_sum(A))                                      # within chunks
        y_diag = torch.einsum("bcln,bcsn,bhcls,bcshp->bclhp", Cm, Bm, Ld, x)
        decay = torch.exp(A_cum[..., -1:] - A_cum)
        states = torch.einsum("bcln,bhcl,bclhp->bchpn", Bm, decay, x)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
        chunk_decay = torch.exp(segment_sum(F.pad(A_cum[..., -1], (1, 0))))  # across chunks
        states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]
        y_off = torch.einsum("bcln,bchpn,bhcl->bclhp", Cm, states, torch.exp(A_cum))
        y = (y_diag + y_off).reshape(B, -1, H * P)[:, :S]
        return self.out_proj(y)


class MambaHybridLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(n_layers=1)
        self.blocks.insert(0, PreNormBlock(ChunkedSSD(), GeluMLP()))


# ======================================================================================
# 6. Small MoE (Mixtral-like): router, softmax, top-k, per-expert gather by index,
# index_add back, Switch-style load-balancing auxiliary loss added to CE.


class Expert(nn.Module):
    def __init__(self, dim: int = HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, dim, bias=False)
        self.w2 = nn.Linear(dim, dim, bias=False)
        self.w3 = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, dim: int = HIDDEN, n_experts: int = 4, top_k: int = 2,
                 dense: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(dim) for _ in range(n_experts)])
        self.n_experts = n_experts
        self.top_k = top_k
        self.dense = dense

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, C = x.shape
        flat = x.view(-1, C)
        router_logits = self.gate(flat)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
        topk_w, topk_idx = torch.topk(probs, self.top_k, dim=-1)
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        if self.dense:
            # Every expert on every token, weighted by a (mostly zero) gate: no data-dependent shapes.
            gates = torch.zeros_like(probs).scatter(1, topk_idx, topk_w)
            for e, expert in enumerate(self.experts):
                out = out + gates[:, e : e + 1] * expert(flat)
        else:
            expert_mask = F.one_hot(topk_idx, self.n_experts).permute(2, 1, 0)  # [E, k, T]
            for e, expert in enumerate(self.experts):
                idx, top = torch.where(expert_mask[e])
                y = expert(flat[top]) * topk_w[top, idx, None]
                out.index_add_(0, top, y.to(flat.dtype))
        # Switch Transformer load balancing: E * sum_e(frac_tokens_e * mean_prob_e).
        one_hot = F.one_hot(topk_idx[:, 0], self.n_experts).float()
        frac = one_hot.mean(dim=0)
        mean_prob = probs.mean(dim=0)
        aux = self.n_experts * (frac * mean_prob).sum()
        return out.view(B, S, C), aux


class MoELM(nn.Module):
    def __init__(self, dense: bool = False, aux_coef: float = 0.01) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = SimpleAttention()
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.moe = SparseMoE(dense=dense)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.aux_coef = aux_coef

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = x + self.attn(self.ln1(x))
        m, aux = self.moe(self.ln2(x))
        x = x + m
        logits = self.head(self.norm(x))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        ce = F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))
        return ce + self.aux_coef * aux


# ======================================================================================
# 7. Flex attention over packed documents: document ids from the token ids (token 0 is
# the end-of-document marker), a BlockMask from create_block_mask.

EOS = 0


class FlexDocLM(nn.Module):
    def __init__(self, n_layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            [nn.ModuleDict(dict(ln1=nn.LayerNorm(HIDDEN), qkv=nn.Linear(HIDDEN, 3 * HIDDEN),
                                proj=nn.Linear(HIDDEN, HIDDEN), ln2=nn.LayerNorm(HIDDEN),
                                mlp=GeluMLP()))
             for _ in range(n_layers)]
        )
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        B, S = input_ids.shape
        # Document id of each token: the number of EOS tokens strictly before it.
        doc_ids = torch.cumsum((input_ids == EOS).long(), dim=1) - (input_ids == EOS).long()

        def document_causal(b, h, q_idx, kv_idx):
            return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(document_causal, B, None, S, S, device=input_ids.device)
        x = self.embed(input_ids)
        for layer in self.layers:
            h = layer["ln1"](x)
            q, k, v = layer["qkv"](h).view(B, S, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
            o = flex_attention(q, k, v, block_mask=block_mask)
            x = x + layer["proj"](o.transpose(1, 2).reshape(B, S, HIDDEN))
            x = x + layer["mlp"](layer["ln2"](x))
        logits = self.head(self.norm(x))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))


def packed_inputs(seed: int, seq_len: int):
    ids, labels = ids_labels(seed, seq_len)
    ids = ids.clamp(min=1)
    # Document ends: one per row near a chunk boundary, one early in row 0.
    ids[:, seq_len // 2 - 1] = EOS
    ids[0, 3] = EOS
    labels = torch.where(labels == -100, labels, ids)
    return ids, labels


# ======================================================================================
# Further styles people write.


class AlibiLM(DecoderLM):
    """ALiBi: a float [1, H, S, S] bias (slope * distance, -inf above the diagonal) from
    torch.arange, passed to SDPA as attn_mask; no position embeddings."""

    def forward(self, input_ids, labels):
        S = input_ids.shape[1]
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)])
        pos = torch.arange(S, device=input_ids.device)
        dist = (pos[None, :] - pos[:, None]).float()  # kv - q, <= 0 below the diagonal
        bias = slopes[:, None, None] * dist[None]
        bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))[None]
        logits = self.head(self.body(self.embed(input_ids), bias))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))


class PaddedCausalLM(DecoderLM):
    """HF-style 2D attention_mask [B, S] combined with a causal mask into a 4D boolean mask
    (left... here right padding); pad labels are -100."""

    def forward(self, input_ids, labels, attention_mask):
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).tril()
        mask4d = causal[None, None] & attention_mask[:, None, None, :].bool()
        # Queries that are padding attend to themselves so no row of the mask is empty.
        mask4d = mask4d | torch.eye(S, dtype=torch.bool, device=input_ids.device)[None, None]
        logits = self.head(self.body(self.embed(input_ids), mask4d))
        labels = labels.masked_fill(attention_mask == 0, -100)
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))


def padded_inputs(seed: int, seq_len: int):
    ids, labels = ids_labels(seed, seq_len)
    return ids, labels, padding_mask(seq_len)


class SinusoidalTransposedCELM(DecoderLM):
    """Sinusoidal absolute positions computed in forward, CE in the [B, V, S] form
    (logits.transpose(1, 2)), label smoothing, mean of reduction='none' over valid tokens."""

    def forward(self, input_ids, labels):
        S = input_ids.shape[1]
        pos = torch.arange(S, device=input_ids.device, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, HIDDEN, 2, dtype=torch.float32) * (-math.log(10000.0) / HIDDEN))
        pe = torch.zeros(S, HIDDEN)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        x = self.embed(input_ids) * math.sqrt(HIDDEN) + pe
        logits = self.head(self.body(x))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        per_tok = F.cross_entropy(logits.transpose(1, 2), shift_labels, reduction="none",
                                  label_smoothing=0.1)
        valid = (shift_labels != -100).float()
        return (per_tok * valid).sum() / valid.sum()


class ZLossSoftcapLM(DecoderLM):
    """Gemma/PaLM extras: tanh logit soft-capping and a z-loss (logsumexp over the vocab)."""

    def forward(self, input_ids, labels):
        logits = self.head(self.body(self.embed(input_ids)))
        logits = torch.tanh(logits / 30.0) * 30.0
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        ce = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten())
        z = torch.logsumexp(logits, dim=-1)
        valid = shift_labels != -100
        z_loss = ((z**2) * valid).sum() / valid.sum()
        return ce + 1e-4 * z_loss


class MHAModuleLM(nn.Module):
    """nn.MultiheadAttention(batch_first=True) with a causal attn_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.mha = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        S = input_ids.shape[1]
        x = self.embed(input_ids)
        mask = nn.Transformer.generate_square_subsequent_mask(S, device=x.device)
        h = self.ln(x)
        a, _ = self.mha(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        logits = self.head(x + a)
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))


class Bf16AutocastLM(DecoderLM):
    """The whole forward under torch.autocast('cpu', dtype=torch.bfloat16)."""

    def forward(self, input_ids, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.head(self.body(self.embed(input_ids)))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.float().view(-1, VOCAB), shift_labels.reshape(-1))


class CausalConvLM(DecoderLM):
    """A depthwise causal Conv1d token mixer (Mamba/Hyena-like short conv) before attention."""

    def __init__(self) -> None:
        super().__init__(n_layers=1)
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, kernel_size=3, groups=HIDDEN, padding=2)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        S = x.shape[1]
        x = x + self.conv(x.transpose(1, 2))[..., :S].transpose(1, 2)
        logits = self.head(self.body(x))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))


class SameConvLM(DecoderLM):
    """A dilated, non-causal depthwise conv with padding='same' (2 positions each side):
    every rank reads both neighbours' edges."""

    def __init__(self) -> None:
        super().__init__(n_layers=1)
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, kernel_size=3, dilation=2, groups=HIDDEN,
                              padding="same")

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = x + F.silu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        logits = self.head(self.body(x))
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1))


def _llama(**kw):
    return lambda: ScratchLlama(**kw)


def _decoder(**kw):
    return lambda: DecoderLM(**kw)


# The seven listed styles (tested at world 2 and 4).
LISTED: list[Style] = [
    Style("nanogpt", lambda: NanoGPT(), nanogpt_inputs),
    Style("llama-scratch-complex-rope", _llama(rope="complex"), ids_labels),
    Style("shift-inside", lambda: ShiftInsideLM(n_layers=1), ids_labels),
    Style("bert-masked-mean-ce", lambda: BertLikeEncoder(), bert_inputs),
    Style("cumsum-mixer", lambda: CumsumMixerLM(), ids_labels),
    Style("moe-index-add-aux", lambda: MoELM(dense=False), ids_labels),
    Style("flex-doc-mask", lambda: FlexDocLM(), packed_inputs),
]

# Further styles (world 2).
EXTRA: list[Style] = [
    Style("nanogpt-attention-by-hand", lambda: NanoGPT(n_layer=1, flash=False), nanogpt_inputs),
    Style("llama-scratch-cos-sin-kv2", _llama(rope="cos_sin", n_kv_heads=2, n_layers=1), ids_labels),
    Style("llama-scratch-cos-sin-mha", _llama(rope="cos_sin", n_kv_heads=HEADS, n_layers=1),
          ids_labels),
    Style("bert-masked-mean-mse", lambda: BertMSEEncoder(n_layers=1), bert_inputs),
    Style("moe-dense-gates-aux", lambda: MoELM(dense=True), ids_labels),
    Style("einsum-projections", _decoder(attn_kwargs=dict(mode="einsum")), ids_labels),
    Style("qkv-chunk3-post-norm-tied", _decoder(attn_kwargs=dict(mode="chunk"), post_norm=True,
                                                tie=True), ids_labels),
    Style("split-sizes-gqa-kv1", _decoder(attn_kwargs=dict(mode="split_sizes", n_kv_heads=1)),
          ids_labels),
    Style("sdpa-enable-gqa-kv2", _decoder(attn_kwargs=dict(mode="enable_gqa", n_kv_heads=2)),
          ids_labels),
    Style("alibi-bias", lambda: AlibiLM(n_layers=1), ids_labels),
    Style("padded-causal-4d-mask", lambda: PaddedCausalLM(n_layers=1), padded_inputs),
    Style("sinusoidal-transposed-ce-smoothing", lambda: SinusoidalTransposedCELM(n_layers=1),
          ids_labels),
    Style("softcap-zloss", lambda: ZLossSoftcapLM(n_layers=1), ids_labels),
    Style("nn-multihead-attention", lambda: MHAModuleLM(), ids_labels),
    Style("nn-transformer-encoder", lambda: styles_nn.TorchEncoderLM(), ids_labels),
    Style("nn-transformer-encoder-padded-seq-first", lambda: styles_nn.TorchEncoderPaddedMLM(),
          bert_inputs),
    Style("nn-mha-need-weights", lambda: styles_nn.MHANeedWeightsLM(), ids_labels, gathers=True),
    Style("nn-transformer-seq2seq", lambda: styles_nn.TorchSeq2SeqLM(), ids_labels),
    Style("nn-mha-learned-memory", lambda: styles_nn.LearnedMemoryLM(), ids_labels),
    Style("nn-mha-kdim-seq-first", lambda: styles_nn.KdimSeqFirstLM(), bert_inputs),
    Style("packed-docs-llama", styles_nn.packed_llama, styles_nn.packed_position_inputs),
    Style("packed-docs-hf-qwen2", lambda: styles_nn.PackedHFQwen2(), styles_nn.packed_position_inputs),
    Style("mamba2-chunked-ssd-hybrid", lambda: MambaHybridLM(), ids_labels, gathers=True),
    Style("causal-conv1d-mixer", lambda: CausalConvLM(), ids_labels),
    Style("conv1d-same-dilated", lambda: SameConvLM(), ids_labels),
    Style("shift-inside-multi-token", lambda: MultiTokenShiftLM(), ids_labels),
    Style("shift-before-attention", lambda: ShiftedAttentionLM(), ids_labels),
    Style("bf16-autocast", lambda: Bf16AutocastLM(n_layers=1), ids_labels,
          loss_atol=2e-2, grad_rtol=5e-2),
]

ALL: dict[str, Style] = {s.name: s for s in LISTED + EXTRA}


# ======================================================================================
# Running one model SP vs one device, inside a rank of run_ranks.

EXACT, AUTOSP_ERROR, MISMATCH, CRASH = "exact", "autosp_error", "mismatch", "crash"


def raise_worst_outcome(per_rank: Sequence[dict[str, dict]], name: str, where: str) -> None:
    """Re-raises what the worst rank saw for case ``name`` (``per_rank``: one {name: result}
    per rank): AutospError, RuntimeError (crash), AssertionError (mismatch); returns when every
    rank was exact. ``where`` names the run (e.g. "world 2")."""
    import autosp

    order = {EXACT: 0, AUTOSP_ERROR: 1, CRASH: 2, MISMATCH: 3}
    rank, r = max(enumerate(res[name] for res in per_rank), key=lambda ir: order[ir[1]["outcome"]])
    where = f"{name} at {where}, rank {rank}"
    if r["outcome"] == AUTOSP_ERROR:
        raise autosp.AutospError(f"{where}: {r['detail']}")
    if r["outcome"] == CRASH:
        raise RuntimeError(f"{where}: crashed (not an AutospError): {r['detail']}")
    if r["outcome"] == MISMATCH:
        raise AssertionError(f"{where}: SILENT MISMATCH: {r['detail']}")


def allow_flex_backward_on_cpu() -> None:
    """PyTorch refuses flex_attention with inputs that require grad on CPU (a device check
    in front of a dense math implementation that computes the backward correctly: checked
    against the compiled model). The tests run on CPU, so they lift the check."""
    import torch.nn.attention.flex_attention as fa

    fa._validate_device = lambda query, key, value: None


def _ref_loss_and_grads(model: nn.Module, args: tuple) -> tuple[float, dict[str, torch.Tensor]]:
    import copy

    from distributed import grads_of

    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss = ref(*args)
    loss.backward()
    return loss.item(), grads_of(ref)


def run_case(name: str, build: Callable[[], nn.Module],
             inputs: Callable[[int, int], tuple], world_size: int, seq_len: int, *,
             model_seed: int = 1234, batch_seeds: tuple[int, ...] = (11, 12),
             loss_atol: float = 1e-5, grad_rtol: float = 1e-4, mesh=None,
             backend: str = "aot_eager", remat: str = "none", unsupported: str = "gather",
             regions: bool | str | None = None, dynamic: bool | None = None) -> dict:
    """Builds the model (same weights on every rank), compiles it for SP (aot_eager, no
    remat, ``regions`` as autosp.compile's default when None, unless told otherwise) and runs
    ``len(batch_seeds)`` steps against the single-device model.

    Returns ``{"name", "outcome", "detail", ...}``: outcome ``exact``; ``autosp_error``
    (an AutospError, message in detail); ``mismatch`` (ran, but the loss or a gradient
    differs: the worst bug); ``crash`` (any other exception, type and message in detail).
    ``gathered``: the ops run on the gathered sequence (see autosp.compile's ``unsupported``).
    The loss bound is ``loss_atol`` up to |loss| = 1 and relative above it, as in the other
    exactness tests: fp32 holds a loss of 60 to about 4e-6, and a sum over ranks in another
    order moves it by a few of those (a generated model with a loss of 60.5 differed by
    1.1e-5, 3 ulps, with every gradient within 1e-4, and equalled one device exactly in
    float64).
    """
    import traceback
    import warnings

    import autosp
    from distributed import grads_of, relative_grad_errors

    allow_flex_backward_on_cpu()
    torch._dynamo.reset()
    result: dict = {"name": name, "outcome": EXACT, "detail": "", "steps": [], "gathered": [],
                    "gather_warnings": [], "tiled_masks": []}
    try:
        if mesh is None:
            mesh = autosp.init_mesh(world_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model_seed)
            model = build()
        ref_model = __import__("copy").deepcopy(model)
        given = {} if regions is None else {"regions": regions}
        compiled = autosp.compile(model, mesh=mesh, seq_dim=1, remat=remat, backend=backend,
                                  unsupported=unsupported, dynamic=dynamic, **given)
        for step, seed in enumerate(batch_seeds):
            args = inputs(seed, seq_len)
            ref_loss, ref_grads = _ref_loss_and_grads(ref_model, args)
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always", autosp.AutospGatherWarning)
                loss = compiled(*args)
            result["gather_warnings"] = result.get("gather_warnings", []) + [
                str(w.message) for w in seen if issubclass(w.category, autosp.AutospGatherWarning)]
            loss.backward()
            result["gathered"] = compiled.gathered
            result["tiled_masks"] = compiled.tiled_masks
            if regions is not False and compiled.last_compile is not None:  # regions, per step
                result.setdefault("outlined", []).append(list(compiled.last_compile.outlined))
                result.setdefault("traced_once", []).append(compiled.last_compile.traced_once)
            errs = relative_grad_errors(grads_of(model), ref_grads)
            bad = {k: v for k, v in errs.items() if not v <= grad_rtol}
            loss_diff = abs(loss.item() - ref_loss)
            result["steps"].append({"loss": loss.item(), "ref_loss": ref_loss,
                                    "max_grad_err": max(errs.values(), default=0.0)})
            if not loss_diff <= loss_atol * max(1.0, abs(ref_loss)) or bad or tuple(loss.shape) != ():
                worst = sorted(bad.items(), key=lambda kv: -kv[1])[:4]
                result["outcome"] = MISMATCH
                result["detail"] = (
                    f"step {step}: loss {loss.item()!r} vs single-device {ref_loss!r} "
                    f"(|diff| {loss_diff:.3e}); loss shape {tuple(loss.shape)}; "
                    f"{len(bad)}/{len(errs)} grads over {grad_rtol:.0e}, worst "
                    + ", ".join(f"{k} {v:.3e}" for k, v in worst)
                )
                break
    except autosp.AutospError as exc:
        # An internal error wrapped as AutospError ("This is a bug in autosp") is no
        # clear refusal: it is a crash.
        internal = "internal error" in str(exc).split(":", 1)[0] + str(exc)[:60]
        result["outcome"] = CRASH if internal else AUTOSP_ERROR
        result["detail"] = str(exc)[:3000]
        if internal:  # where it went wrong inside autosp
            result["detail"] += "\n..." + traceback.format_exc()[-4000:]
    except AssertionError as exc:  # e.g. a gradient that is None: the compiler dropped it
        result["outcome"] = MISMATCH
        result["detail"] = f"AssertionError: {str(exc)[:2000]}"
    except Exception as exc:  # noqa: BLE001 - classified and reported by the caller
        result["outcome"] = CRASH
        tb = traceback.format_exc()
        result["detail"] = f"{type(exc).__name__}: {str(exc)[:2000]}\n...{tb[-2500:]}"
    torch._dynamo.reset()
    return result
