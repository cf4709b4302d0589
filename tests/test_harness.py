"""The multi-rank harness fails loudly and promptly instead of hanging."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from distributed import RankError, RemoteTraceback, run_ranks


def _sum_of_ranks(rank: int, world_size: int, scale: int) -> tuple[int, int, int]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, int(t.item()) * scale, torch.get_num_threads()


def test_returns_results_in_rank_order() -> None:
    results = run_ranks(3, _sum_of_ranks, 10)
    assert results == [(0, 30, 1), (1, 30, 1), (2, 30, 1)]


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("bad input on rank one: 17 != 18")
    # Rank 0 waits in a collective the failed rank never joins.
    dist.barrier()


def test_reraises_rank_exception_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="17 != 18") as info:
        run_ranks(2, _rank1_raises, timeout=60)
    assert time.monotonic() - start < 30, "the blocked rank was not torn down promptly"
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "rank 1 failed in _rank1_raises" in cause.text
    assert "_rank1_raises" in cause.text and "raise ValueError" in cause.text


class _Unpicklable(Exception):
    def __init__(self, lock: threading.Lock) -> None:
        super().__init__("holds a lock")
        self.lock = lock

    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise TypeError("cannot pickle")


def _raises_unpicklable(rank: int, world_size: int) -> None:
    raise _Unpicklable(threading.Lock())


def test_unpicklable_exception_becomes_rank_error() -> None:
    with pytest.raises(RankError, match="_Unpicklable: holds a lock"):
        run_ranks(2, _raises_unpicklable, timeout=60)


def _rank0_dies(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_dead_rank_is_reported() -> None:
    with pytest.raises(RankError, match="rank 0 exited with code 3"):
        run_ranks(2, _rank0_dies, timeout=60)


def _rank0_sleeps(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_timeout_kills_ranks() -> None:
    # Rank 1 normally reports in time (forked ranks start in a tenth of a second); spawned
    # (AUTOSP_TEST_START=spawn) or on a loaded machine its start-up alone may take longer than
    # the timeout, so it may be listed as well.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0(, 1)?\] of 2 did not finish within 4s"):
        run_ranks(2, _rank0_sleeps, timeout=4)
    assert time.monotonic() - start < 45, "ranks were not killed promptly after the timeout"


def _preloaded_worker(rank: int, world_size: int) -> tuple[set[str], dict]:
    import sys

    from torch._dynamo.utils import counters

    import distributed

    already = set(sys.modules)  # before this rank imports anything itself
    return {n for n in distributed.WARM_IMPORTS if n not in already}, \
        {k: dict(v) for k, v in counters.items() if v}


def test_ranks_start_with_a_first_compiles_imports() -> None:
    """Ranks forked from the fork server start with what a first compile imports
    (distributed.WARM_IMPORTS), and Dynamo has compiled nothing in them."""
    import distributed

    if distributed._context().get_start_method() != "forkserver":
        pytest.skip("ranks are spawned here, not forked from a fork server")
    ((missing, compiled),) = run_ranks(1, _preloaded_worker)
    assert not missing, f"not imported when the rank started: {sorted(missing)}"
    assert not compiled, compiled
