"""Training batches. ``synthetic_batch``: token sequences with learnable structure, the
same on every rank of an SP group (they depend on the step and the data-parallel rank only).
"""

from __future__ import annotations

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
