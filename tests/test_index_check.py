"""A bad token id fails on every rank alike, never in one rank while the others hang.

The embedding's ids are checked on the full-length input (which every rank of the SP group
holds) before they are sliced to the local chunk. Without the check, the rank whose chunk
holds the bad id fails in its embedding and the other ranks wait in the next collective.
"""

from __future__ import annotations

import pytest

from distributed import build_model, make_batch, run_ranks, tiny_config


def _worker(rank: int, world: int, remat: str) -> str:
    import autosp

    cfg = tiny_config()
    model = build_model(cfg)
    ids, labels = make_batch(cfg.vocab_size, 2, 32)
    compiled = autosp.compile(model, mesh=autosp.init_mesh(world), backend="aot_eager", remat=remat)
    compiled(ids, labels).backward()  # a good batch first: the check passes
    ids[1, 30] = cfg.vocab_size + 5  # in the last rank's chunk only
    try:
        compiled(ids, labels)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("remat", ["default", pytest.param("sequence-aware", marks=pytest.mark.slow)])
def test_out_of_range_id_fails_on_every_rank(remat: str) -> None:
    messages = run_ranks(2, _worker, remat, timeout=120)
    for rank, msg in enumerate(messages):
        assert "[autosp:inputs]" in msg and "x = self.embed_tokens(input_ids)" in msg, (rank, msg)
        assert "found an index outside [0, 128) in the full-length input" in msg, (rank, msg)
