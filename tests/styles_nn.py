"""Models built from torch.nn's own transformer modules, as tutorials and many hand-written
models are: nn.TransformerEncoder(Layer) and nn.MultiheadAttention called the common ways.
Their attention is F.multi_head_attention_forward, one call at the Torch level, which
autosp takes apart with PyTorch's own decomposition (autosp.decompose) to shard it like any
other attention. Registered in styles.ALL."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS = 64, 32, 4


class TorchEncoderLM(nn.Module):
    """nn.TransformerEncoder of pre-norm GELU layers (batch_first), causal by a
    generate_square_subsequent_mask mask and is_causal=True, tied embeddings."""

    def __init__(self, n_layers: int = 2, norm_first: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(64, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(HIDDEN),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S = input_ids.shape[1]
        pos = torch.arange(S, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(S, device=x.device)
        h = self.encoder(x, mask=mask, is_causal=True)
        logits = self.head(h)
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.reshape(-1, VOCAB), shift_labels.reshape(-1))


class TorchEncoderPaddedMLM(nn.Module):
    """A bidirectional sequence-first nn.TransformerEncoder (batch_first=False, post-norm)
    with a boolean src_key_padding_mask and a masked-mean loss."""

    def __init__(self, n_layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids).transpose(0, 1)  # [S, B, H]
        h = self.encoder(x, src_key_padding_mask=attention_mask == 0).transpose(0, 1)
        per_tok = F.cross_entropy(self.head(h).transpose(1, 2), input_ids, reduction="none")
        m = attention_mask.float()
        return (per_tok * m).sum() / m.sum()


class MHANeedWeightsLM(nn.Module):
    """nn.MultiheadAttention called with its defaults (need_weights=True: the attention
    probabilities are computed explicitly and averaged over heads) and a boolean causal mask;
    the weights are used, as in attention-visualising models."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mha = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S = input_ids.shape[1]
        x = self.embed(input_ids)
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
        a, w = self.mha(x, x, x, attn_mask=causal)
        logits = self.head(x + a)
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        ent = -(w.clamp_min(1e-9).log() * w).sum(-1).mean()  # attention entropy regulariser
        return F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1)) + 1e-3 * ent


class TorchSeq2SeqLM(nn.Module):
    """nn.Transformer over the same sequence as source and target (the target causal): the
    decoder's cross-attention reads the encoder's output, so MultiheadAttention splits its
    packed in_proj weight into q and kv parts (a path where autosp once lost the weights'
    gradient sync: wrong in_proj gradients with an exact loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.t = nn.Transformer(HIDDEN, HEADS, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=2 * HIDDEN, dropout=0.0, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S = input_ids.shape[1]
        x = self.embed(input_ids)
        causal = nn.Transformer.generate_square_subsequent_mask(S, device=x.device)
        h = self.t(x, x, tgt_mask=causal, tgt_is_causal=True)
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), shift_labels.reshape(-1))


class LearnedMemoryLM(nn.Module):
    """Perceiver-style cross-attention: the sequence's queries attend to a learned memory of
    5 slots (key = value, not the sequence), then causal self-attention."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.memory = nn.Parameter(torch.randn(5, HIDDEN) / HIDDEN**0.5)
        self.cross = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.self_attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S = input_ids.shape[1]
        x = self.embed(input_ids)
        mem = self.memory.unsqueeze(0).expand(x.shape[0], -1, -1)
        x = x + self.cross(x, mem, mem, need_weights=False)[0]
        causal = nn.Transformer.generate_square_subsequent_mask(S, device=x.device)
        x = x + self.self_attn(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), shift_labels.reshape(-1))


class KdimSeqFirstLM(nn.Module):
    """MultiheadAttention with kdim/vdim (separate q, k and v weights), sequence-first, with
    query, key and value made and transposed separately, and a float key-padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pk = nn.Linear(HIDDEN, 16, bias=False)  # a key bias has no gradient (softmax shift)
        self.pv = nn.Linear(HIDDEN, 24)
        self.mha = nn.MultiheadAttention(HIDDEN, HEADS, kdim=16, vdim=24)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        q, k, v = x.transpose(0, 1), self.pk(x).transpose(0, 1), self.pv(x).transpose(0, 1)
        kpm = (1.0 - attention_mask.float()) * -1e4
        a = self.mha(q, k, v, key_padding_mask=kpm, need_weights=False)[0].transpose(0, 1)
        per_tok = F.cross_entropy(self.head(x + a).transpose(1, 2), input_ids, reduction="none")
        m = attention_mask.float()
        return (per_tok * m).sum() / m.sum()


# ======================================================================================
# Packed documents as autosp train feeds them: position_ids that restart at 0 per document.


def packed_position_inputs(seed: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """(ids, labels, position_ids): 3 documents per row at random cuts (one crossing a
    rank's chunk boundary, almost surely), labels -100 at each document's first token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=g)
    pos = torch.empty(2, seq_len, dtype=torch.long)
    for b in range(2):
        cuts = sorted(torch.randperm(seq_len - 1, generator=g)[:2].add(1).tolist())
        start = 0
        for c in cuts + [seq_len]:
            pos[b, start:c] = torch.arange(c - start)
            start = c
    labels = ids.masked_fill(pos == 0, -100)
    return ids, labels, pos


def packed_llama() -> nn.Module:
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1,
                                        num_heads=HEADS, num_kv_heads=2))


class PackedHFQwen2(nn.Module):
    """A Hugging Face Qwen2 given packed position_ids (transformers' packed-sequence mask)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("qwen2", vocab_size=VOCAB, hidden_size=HIDDEN,
                                   intermediate_size=2 * HIDDEN, num_hidden_layers=1,
                                   num_attention_heads=HEADS, num_key_value_heads=2,
                                   attn_implementation="sdpa")
        self.m = AutoModelForCausalLM.from_config(cfg)

    def forward(self, input_ids, labels, position_ids):
        return self.m(input_ids=input_ids, labels=labels, position_ids=position_ids,
                      use_cache=False).loss
