"""A hand-written Ulysses sequence-parallel Llama: the baseline autosp is measured against.

``UlyssesLlamaForCausalLM`` has exactly the parameters of
``autosp.models.llama.LlamaForCausalLM`` (it inherits them), so one state_dict
loads into both. Like the compiled model it takes the full-length batch on every
rank of the SP group; by hand it

- slices its sequence chunk right after the embedding (chunk ``rank`` of ``P``),
- offsets the RoPE positions by ``rank * S / P``,
- exchanges q/k/v with one fused all-to-all (scatter heads, gather sequence) before
  ``scaled_dot_product_attention`` and the output with another (gather heads,
  scatter sequence) after it; KV heads are repeated first when there are fewer than
  P of them,
- returns ``sum over the group of (local CE sum / global valid-token count)``,
- and, after ``backward()``, ``sync_sp_grads(model)`` all-reduces (sums) every
  parameter's gradient over the group in one flat bucket.

    model = UlyssesLlamaForCausalLM.from_model(reference_model)   # copies the weights
    loss = model(input_ids, labels)        # same full batch on every SP rank
    loss.backward()
    sync_sp_grads(model)                   # now .grad == single-device .grad

By default its collectives are eager ``torch.distributed`` calls that ``torch.compile`` does
not trace (graph breaks around them, as DeepSpeed-Ulysses runs them): the compute between them
is compiled, the exchanges and their packing run eagerly. ``traced_collectives=True`` writes
the same exchanges with functional collectives (``all_to_all_single_autograd``, ``all_reduce``)
that ``torch.compile`` traces, so one graph holds the whole step, the exchanges' packing and
the loss's reduction included, as autosp's does.

With eager collectives, ``forward`` breaks its graph inside its loop over the layers, and
Dynamo skips a frame that breaks inside a loop: under ``torch.compile`` the layers' pieces are
compiled (their own frames), but the embedding, the final ``lm_head`` and the loss run eagerly.
``decoder_frame=True`` loops over the layers in ``_decoder``, a method of its own, as Hugging
Face's ``LlamaForCausalLM`` calls ``LlamaModel``: ``forward`` breaks at that call instead, and
its embedding, head and loss are compiled.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from autosp.models.llama import (
    Attention,
    DecoderLayer,
    LlamaConfig,
    LlamaForCausalLM,
    apply_rotary,
)

IGNORE_INDEX = -100


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _eager_exchange(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _traced_exchange(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    # A functional all-to-all, which torch.compile traces (its backward is the inverse exchange).
    return funcol.all_to_all_single_autograd(send, None, None, _traced_group(group))


def _traced_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _all_to_all_seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None,
                             exchange: Callable = _eager_exchange) -> torch.Tensor:
    # [B, H, S/P, D] (all heads, my chunk) -> [B, H/P, S, D] (my heads, all chunks).
    p = _group_size(group)
    b, h, s, d = x.shape
    recv = exchange(x.reshape(b, p, h // p, s, d).permute(1, 0, 2, 3, 4).contiguous(), group)
    # recv[i] is chunk i of the sequence for my heads.
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def _all_to_all_heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None,
                             exchange: Callable = _eager_exchange) -> torch.Tensor:
    # [B, H/P, S, D] (my heads, all chunks) -> [B, H, S/P, D] (all heads, my chunk).
    p = _group_size(group)
    b, h, s_full, d = y.shape
    s = s_full // p
    recv = exchange(y.reshape(b, h, p, s, d).permute(2, 0, 1, 3, 4).contiguous(), group)
    # recv[i] is head block i (rank i's heads) for my chunk.
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * h, s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_to_all_seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_to_all_heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_to_all_heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_to_all_seq_to_heads(grad.contiguous(), ctx.group), None


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce sum of per-rank partial losses. Backward: identity, since
    d(sum_r partial_r)/d(partial_r) = 1 and every rank back-propagates the same
    replicated total."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


# Collectives stay eager when the model is wrapped in torch.compile (graph breaks
# around them); the compute between them is compiled.
@torch.compiler.disable
def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _SeqToHeads.apply(x, group)


@torch.compiler.disable
def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _HeadsToSeq.apply(y, group)


@torch.compiler.disable
def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _SumOverGroup.apply(x, group)


@torch.compiler.disable
def global_count(mask: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    count = mask.sum()
    dist.all_reduce(count, group=group)
    return count


def traced_seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``seq_to_heads`` with a functional all-to-all, which torch.compile traces."""
    return _all_to_all_seq_to_heads(x, group, _traced_exchange)


def traced_heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``heads_to_seq`` with a functional all-to-all."""
    return _all_to_all_heads_to_seq(y, group, _traced_exchange)


def traced_sum_over_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``sum_over_group`` with a functional all-reduce: the forward is the sum over the
    group (``x - x.detach()`` is exactly 0), the backward the identity."""
    total = funcol.all_reduce(x.detach(), "sum", _traced_group(group))
    return x - x.detach() + total


def traced_global_count(mask: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return funcol.all_reduce(mask.sum(), "sum", _traced_group(group))


def kv_repeat_factor(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head is repeated before the all-to-all so that the KV
    heads split evenly over ``sp_size`` ranks and every rank's query heads find
    their KV heads locally.

    E.g. heads 4, kv 1, P 4 -> 4 (plain MHA); heads 8, kv 2, P 4 -> 2; kv 4, P 2 -> 1.
    """
    if num_heads % sp_size != 0:
        raise ValueError(
            f"Ulysses needs num_heads divisible by the SP size: got {num_heads} heads, "
            f"SP size {sp_size}"
        )
    if num_kv_heads % sp_size == 0:
        return 1
    factor = sp_size // math.gcd(num_kv_heads, sp_size)
    # Each query group (num_heads // num_kv_heads heads) must split into whole copies.
    if (num_heads // num_kv_heads) % factor != 0:
        return num_heads // num_kv_heads
    return factor


class UlyssesLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with a hand-written Ulysses forward over ``group``."""

    def __init__(
        self,
        cfg: LlamaConfig,
        group: dist.ProcessGroup | None = None,
        fuse_qkv: bool = True,
        traced_collectives: bool = False,
        decoder_frame: bool = False,
    ) -> None:
        super().__init__(cfg)
        self.group = group
        self.fuse_qkv = fuse_qkv
        self.decoder_frame = decoder_frame
        if traced_collectives:
            self._seq_to_heads, self._heads_to_seq = traced_seq_to_heads, traced_heads_to_seq
            self._sum_over_group, self._global_count = traced_sum_over_group, traced_global_count
        else:
            self._seq_to_heads, self._heads_to_seq = seq_to_heads, heads_to_seq
            self._sum_over_group, self._global_count = sum_over_group, global_count
        self.sp_size = dist.get_world_size(group)
        self.sp_rank = dist.get_rank(group)
        self.kv_repeat = kv_repeat_factor(cfg.num_heads, cfg.num_kv_heads, self.sp_size)

    @classmethod
    def from_model(
        cls,
        model: LlamaForCausalLM,
        group: dist.ProcessGroup | None = None,
        fuse_qkv: bool = True,
        traced_collectives: bool = False,
        decoder_frame: bool = False,
    ) -> UlyssesLlamaForCausalLM:
        """A copy of ``model`` (same config and weights) that runs Ulysses over ``group``."""
        sp_model = cls(model.config, group, fuse_qkv, traced_collectives, decoder_frame)
        sp_model.load_state_dict(model.state_dict())
        # The same device as model (load_state_dict copies into this CPU model; the rotary
        # table is a buffer outside the state dict).
        return sp_model.to(next(model.parameters()).device)

    def _exchange_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.fuse_qkv:
            return (
                self._seq_to_heads(q, self.group),
                self._seq_to_heads(k, self.group),
                self._seq_to_heads(v, self.group),
            )
        # One all-to-all for q, k and v: per destination rank, its q, k and v heads.
        p = self.sp_size
        b, hq, s, d = q.shape
        hk = k.shape[1]
        packed = torch.cat(
            [
                q.reshape(b, p, hq // p, s, d),
                k.reshape(b, p, hk // p, s, d),
                v.reshape(b, p, hk // p, s, d),
            ],
            dim=2,
        ).reshape(b, hq + 2 * hk, s, d)
        local = self._seq_to_heads(packed, self.group)
        return local.split([hq // p, hk // p, hk // p], dim=1)

    def _attention(
        self, attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        bsz, chunk, _ = x.shape
        q = attn.q_proj(x).view(bsz, chunk, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, chunk, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, chunk, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=1)
            v = v.repeat_interleave(self.kv_repeat, dim=1)
        q, k, v = self._exchange_qkv(q, k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
        )
        out = self._heads_to_seq(out, self.group)
        out = out.transpose(1, 2).reshape(bsz, chunk, -1)
        return attn.o_proj(out)

    def _layer(
        self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _decoder(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self._layer(layer, x, cos, sin)
        return x

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        if labels is None:
            raise ValueError("UlyssesLlamaForCausalLM needs labels: it returns the loss")
        bsz, seq_len = input_ids.shape
        if seq_len % self.sp_size != 0:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by the SP size {self.sp_size}"
            )
        chunk = seq_len // self.sp_size
        start = self.sp_rank * chunk
        position_ids = (
            torch.arange(start, start + chunk, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        )
        cos, sin = self.rotary(position_ids)
        x = self.embed_tokens(input_ids[:, start : start + chunk])
        if self.decoder_frame:
            x = self._decoder(x, cos, sin)
        else:
            for layer in self.layers:
                x = self._layer(layer, x, cos, sin)
        logits = self.lm_head(self.norm(x)).float()
        # Shift on the full sequence, then take this rank's chunk of targets.
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:][:, start : start + chunk]
        local_sum = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            shift_labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        count = self._global_count(shift_labels != IGNORE_INDEX, self.group)
        return self._sum_over_group(local_sum / count, self.group)


def sync_sp_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sums every parameter's gradient over the SP group (one flat all-reduce).

    Each rank's backward produced the gradient of its own partial loss; the
    single-device gradient is their sum. A parameter without a gradient on this
    rank contributes zeros (and then gets the summed gradient).
    """
    if group is None and isinstance(model, UlyssesLlamaForCausalLM):
        group = model.group
    params = [p for p in model.parameters() if p.requires_grad]
    # Tied weights appear once in parameters(); dedupe by identity anyway.
    unique = list({id(p): p for p in params}.values())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in unique]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in unique:
        summed = flat[offset : offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = summed.clone()
        else:
            p.grad.copy_(summed)
        offset += p.numel()
