"""Training batches: synthetic token sequences with learnable structure, or packed
documents (autosp.train.documents); the same on every rank of an SP group.
"""

from __future__ import annotations

from typing import Any

import torch


def synthetic_batch(
    vocab_size: int, batch_size: int, seq_len: int, seed: int, step: int, dp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` for one micro-batch of one data-parallel group.

    Tokens follow a fixed random successor map (drawn from ``seed``) 90% of the
    time and are uniform otherwise, so the loss can fall well below log(vocab).
    The same arguments give the same batch on every rank of an SP group.
    """
    successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 1_009 + dp_rank) & 0x7FFFFFFF)
    tokens = torch.empty(batch_size, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=gen)
    noise = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    follow = torch.rand(batch_size, seq_len, generator=gen) < 0.9
    for i in range(1, seq_len):
        tokens[:, i] = torch.where(follow[:, i], successor[tokens[:, i - 1]], noise[:, i])
    return tokens, tokens.clone()


class Batches:
    """The micro-batches of a run, as the model's positional arguments: ``(input_ids,
    labels)`` for synthetic data, ``(input_ids, labels, position_ids)`` for packed documents.

    Micro-batch m of data-parallel rank r holds sequences ``(m * dp + r) * B + b`` of the
    packed stream (b < B): disjoint across dp ranks, and the same on every rank of an SP
    group (each rank computes it from the same files; autosp's input check compares them
    across the group at the first step and whenever shapes change). m = step * grad_accum +
    micro, so a resumed run draws the batches the uninterrupted one would have.
    """

    def __init__(self, data: Any, seq_len: int, batch_size: int, grad_accum: int, dp_size: int,
                 seed: int) -> None:
        self.seq_len, self.batch_size, self.grad_accum = seq_len, batch_size, grad_accum
        self.dp_size, self.seed = dp_size, seed
        self.docs = None
        self.vocab_size = 0  # synthetic: the model's
        if data.source != "synthetic":
            from autosp.train.documents import PackedDocuments, iter_texts, load_tokenizer

            tok = load_tokenizer(data.tokenizer)
            self.vocab_size = tok.vocab_size
            self.docs = PackedDocuments(lambda: iter_texts(data.source, data.text_field), tok,
                                        seq_len, data.streaming)

    def micro_batch(self, step: int, micro: int, dp_rank: int, vocab: int) -> tuple[torch.Tensor, ...]:
        m = step * self.grad_accum + micro
        if self.docs is None:
            return synthetic_batch(vocab, self.batch_size, self.seq_len, self.seed, m, dp_rank)
        first = (m * self.dp_size + dp_rank) * self.batch_size
        seqs = [self.docs.sequence(first + b) for b in range(self.batch_size)]
        ids, pos, labels = (torch.stack(x) for x in zip(*seqs))
        return ids, labels, pos


def target_count(args: tuple[torch.Tensor, ...]) -> int:
    """The number of target tokens of a micro-batch: labels after the first position (the
    model shifts them) that are not -100."""
    return int((args[1][:, 1:] != -100).sum())


def with_one_target(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A micro-batch without targets, given one (row 0, position 1) so that its mean loss is
    finite; the loop weights it 0. The same on every rank of an SP group."""
    labels = args[1].clone()
    labels[0, 1] = args[0][0, 1]
    return (args[0], labels, *args[2:])
