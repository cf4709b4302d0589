"""The ranks of a machine share one compile (autosp.shared_compile).

With static sizes the graph takes the rank as a symbolic input, so ranks whose graphs are alike
compile one graph: one rank compiles under a file lock while the others wait, then they load
it from PyTorch's caches. A rank whose graph differs by the rank (the last rank's part is
longer where a shift makes an offset; a halo's last rank pads) must never run another rank's
compile: PyTorch's caches check the guards on the rank symbol. Each test counts the cache
hits and misses of every rank and checks every rank's loss and gradients against one device.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import styles
from distributed import run_ranks


def _case(rank: int, world: int, cache_dir: str, name: str, seq_len: int, share: bool) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ["AUTOSP_SHARED_COMPILE"] = "1" if share else "0"
    from torch._dynamo.utils import counters

    from autosp import shared_compile

    style = styles.ALL[name]
    counters.clear()
    out = styles.run_case(name, style.build, style.inputs, world, seq_len, backend="inductor",
                          loss_atol=style.loss_atol, grad_rtol=style.grad_rtol)
    out["aot"] = dict(counters["aot_autograd"])
    out["waited"] = shared_compile.LAST_WAIT[0]
    return out


def _check(per_rank: list[dict], name: str) -> tuple[int, int]:
    """Every rank exact and no graph bypassing the cache; (misses, hits) over the ranks."""
    styles.raise_worst_outcome([{name: o} for o in per_rank], name, "shared compile, inductor")
    for rank, out in enumerate(per_rank):
        assert not out["aot"].get("autograd_cache_bypass"), (rank, out["aot"])
    misses = sum(o["aot"].get("autograd_cache_miss", 0) for o in per_rank)
    hits = sum(o["aot"].get("autograd_cache_hit", 0) for o in per_rank)
    return misses, hits


def test_a_last_rank_whose_part_is_shorter_never_loads_another_ranks_compile(tmp_path: Any) -> None:
    """World 2, a model that shifts inside its forward (logits[:, :-1] against labels[:, 1:],
    and h[:, 1:] - h[:, :-1]): the last rank's part is one position shorter, so the graphs of
    the two ranks differ by a guard on the rank symbol. They take one lock and one cache
    directory, and each compiles its own (2 misses). With PyTorch's guard check on cache entries
    switched off, rank 1 loads rank 0's compile and both ranks' losses and all 20 gradients are
    wrong (loss 4.5031 against 4.6110), so this test catches a rank run with another's graph.
    Ranks whose graphs are alike share one compile: tests/test_compile_cache.py (1 miss, 1 hit)."""
    shifted = run_ranks(2, _case, str(tmp_path / "b"), "shift-inside-multi-token", 16, True,
                        timeout=900)
    assert _check(shifted, "shift-inside-multi-token") == (2, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shift-inside-multi-token", "cumsum-mixer", "causal-conv1d-mixer",
                                  "llama-scratch-complex-rope", "packed-docs-llama"])
def test_four_ranks_share_what_they_can_and_stay_exact(tmp_path: Any, name: str) -> None:
    """World 4, one cache directory, the styles whose inserted ops take the rank (shifts,
    scans, halos, rotary tables, packed documents): every rank exact, and at least as many
    graphs loaded as compiled when sharing is off would compile (4 misses)."""
    per_rank = run_ranks(4, _case, str(tmp_path / "c"), name, 32, True, timeout=1200)
    misses, hits = _check(per_rank, name)
    assert misses + hits == 4 and misses < 4, (misses, hits)


@pytest.mark.slow
def test_sharing_off_compiles_on_every_rank(tmp_path: Any) -> None:
    """AUTOSP_SHARED_COMPILE=0: no rank waits and every rank misses (what the caches do when
    ranks compile at once); on, one compiles and the other loads."""
    per_rank = run_ranks(2, _case, str(tmp_path / "d"), "nanogpt", 16, False, timeout=900)
    assert _check(per_rank, "nanogpt") == (2, 0)
    alike = run_ranks(2, _case, str(tmp_path / "e"), "nanogpt", 16, True, timeout=900)
    assert _check(alike, "nanogpt") == (1, 1)
    assert all(o["waited"] == 0.0 for o in per_rank)


def test_rank_symbol_is_never_a_constant() -> None:
    """PyTorch makes an integer input of 0 or 1 a constant; the rank stays a symbol for both."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from autosp.shared_compile import rank_symbol

    for r in (0, 1, 3):
        env = FakeTensorMode(shape_env=ShapeEnv()).shape_env
        s = rank_symbol(env, r)
        assert isinstance(s, torch.SymInt) and not s.node.is_constant() and s.node.hint == r
