"""autosp.collectives.all_to_all against its definition, eager, on a real Gloo group: chunk
p of each tensor's scatter dim goes to rank p, and what a rank receives is laid out along
the gather dim in rank order; its backward is the exchange the other way. Every SP test
checks it end to end; this pins it down op by op, for layouts a model may hand it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distributed import run_ranks

# (shapes of the tensors exchanged together, scatter dim, gather dim, transposed input)
CASES = [
    ([(2, 6, 4, 3)], 2, 1, False),  # [B, S/P, H, D]: heads scattered, sequence gathered
    ([(2, 4, 6, 3)], 2, 1, False),  # [B, H, S, D] back: sequence scattered, heads gathered
    ([(2, 4, 6, 3), (2, 2, 6, 3), (2, 2, 6, 3)], 1, 2, True),  # q, k, v fused, strided
    ([(3, 6, 2, 4, 5)], 3, 1, False),  # 5-D
    ([(2, 6, 4)], -1, -2, False),  # negative dims
    ([(2, 6, 4), (3, 2, 6, 4)], -1, -2, False),  # negative dims, tensors of different ranks
    ([(4, 6)], 0, 1, False),  # the scatter dim first
]


def _inputs(rank: int, shapes: list[tuple[int, ...]], transposed: bool,
            dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    xs = []
    for shape in shapes:
        if transposed:  # laid out as [B, S, H, D] and transposed, as attention hands q on
            shape = (shape[0], shape[2], shape[1], *shape[3:])
        x = torch.randn(shape, generator=g).to(dtype)
        xs.append(x.transpose(1, 2) if transposed else x)
    return xs


def _expected(world: int, rank: int, per_rank: list[list[torch.Tensor]], i: int, scatter: int,
              gather: int) -> torch.Tensor:
    return torch.cat([xs[i].chunk(world, scatter)[rank] for xs in per_rank], dim=gather)


def _worker(rank: int, world: int, dtype: torch.dtype) -> list[str]:
    import torch.distributed as dist

    from autosp import collectives

    group = dist.group.WORLD.group_name
    bad = []
    for n, (shapes, scatter, gather, transposed) in enumerate(CASES):
        per_rank = [_inputs(r, shapes, transposed, dtype) for r in range(world)]
        xs = [x.clone().requires_grad_(True) for x in per_rank[rank]]
        outs = collectives.all_to_all(xs, scatter, gather, group, world)
        weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + i))
                   .to(dtype) for i, o in enumerate(outs)]
        sum((o * w).sum() for o, w in zip(outs, weights)).backward()
        for i, out in enumerate(outs):
            want = _expected(world, rank, per_rank, i, scatter, gather)
            if out.shape != want.shape or not torch.equal(out, want):
                bad.append(f"case {n} tensor {i}: {tuple(out.shape)} against {tuple(want.shape)}")
            if not out.is_contiguous():
                bad.append(f"case {n} tensor {i}: not contiguous")
            # d/dx of sum(out_r * w): chunk r of rank p's scatter dim met rank r's weights at
            # slot p of rank r's gather dim, with the same weights on every rank (same seed).
            w_slot = weights[i].chunk(world, gather)
            grad_want = torch.cat([w_slot[rank]] * world, dim=scatter)
            if not torch.equal(xs[i].grad, grad_want):
                bad.append(f"case {n} tensor {i}: gradient")
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_to_all_matches_its_definition_and_its_backward(dtype: torch.dtype) -> None:
    for rank, bad in enumerate(run_ranks(2, _worker, dtype)):
        assert not bad, f"rank {rank}: {bad}"
