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


@pytest.mark.slow  # the default suite shares at world 3: tests/test_compile_cache.py
def test_inner_ranks_share_one_compile_and_the_last_rank_compiles_its_own(tmp_path: Any) -> None:
    """World 4, a model that shifts inside its forward (logits[:, :-1] against labels[:, 1:],
    and h[:, 1:] - h[:, :-1]): the last rank's part is one position shorter, so its graph
    differs from the others' by a guard on the rank symbol. Ranks 0-2 run one graph: one of them
    compiles it and the other two wait and load it, so two of the three run a compile made for
    another rank, exactly. The last rank takes a lock of its own and compiles at once. In all,
    2 misses and 2 hits, every rank exact."""
    per_rank = run_ranks(4, _case, str(tmp_path / "b"), "shift-inside-multi-token", 32, True,
                         timeout=900)
    assert _check(per_rank, "shift-inside-multi-token") == (2, 2)
    inner = [o for o in per_rank[:3] if o["aot"].get("autograd_cache_hit")]
    assert len(inner) == 2 and all(o["waited"] > 1.0 for o in inner), [o["waited"] for o in per_rank]
    assert per_rank[3]["aot"].get("autograd_cache_miss") == 1 and per_rank[3]["waited"] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shift-inside-multi-token", "cumsum-mixer", "causal-conv1d-mixer",
                                  "llama-scratch-complex-rope", "packed-docs-llama"])
def test_four_ranks_share_what_they_can_and_stay_exact(tmp_path: Any, name: str) -> None:
    """World 4, one cache directory, the styles whose inserted ops take the rank (shifts,
    scans, halos, rotary tables, packed documents): every rank exact, and ranks 0-2 share one
    compile whichever of them takes the lock (a rank's slot of a stack is taken with
    ``select``: indexing with the rank symbol guarded on its value, and each rank compiled its
    own, found by breaker helper-73)."""
    per_rank = run_ranks(4, _case, str(tmp_path / "c"), name, 32, True, timeout=1200)
    assert _check(per_rank, name) == (2, 2)


@pytest.mark.slow
def test_sharing_off_compiles_on_every_rank(tmp_path: Any) -> None:
    """AUTOSP_SHARED_COMPILE=0: no rank waits and every rank misses (what the caches do when
    ranks compile at once); on, the inner ranks share one compile."""
    per_rank = run_ranks(4, _case, str(tmp_path / "d"), "nanogpt", 16, False, timeout=900)
    assert _check(per_rank, "nanogpt") == (4, 0)
    assert all(o["waited"] == 0.0 for o in per_rank)
    alike = run_ranks(4, _case, str(tmp_path / "e"), "nanogpt", 16, True, timeout=900)
    assert _check(alike, "nanogpt") == (2, 2)


def test_rank_symbol_is_never_a_constant() -> None:
    """PyTorch makes an integer input of 0 or 1 a constant; the rank stays a symbol for both."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from autosp.shared_compile import rank_symbol

    for r in (0, 1, 3):
        env = FakeTensorMode(shape_env=ShapeEnv()).shape_env
        s = rank_symbol(env, r)
        assert isinstance(s, torch.SymInt) and not s.node.is_constant() and s.node.hint == r


def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x * 2


torch.fx.wrap("_opaque")


def test_a_graph_the_caches_bypass_is_compiled_by_every_rank_at_once() -> None:
    """No rank waits for another's compile of a graph AOTAutograd's cache would not take (a
    call of an arbitrary Python function): each would compile it anyway, one after another."""
    from autosp.shared_compile import cacheable

    class Plain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(x) + torch.sum(x)

    class Opaque(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _opaque(x) + 1

    assert cacheable(torch.fx.symbolic_trace(Plain()))
    assert not cacheable(torch.fx.symbolic_trace(Opaque()))


# The styles whose inserted ops take the rank, and nanoGPT (only the chunk's bounds). Where an
# offset makes the last rank's part differ (a shift, a convolution's halo), its compile must be
# told apart from the others' by a guard on the rank; everywhere else no guard may tell them apart.
_OFFSET = {"shift-inside-multi-token", "causal-conv1d-mixer"}
_FEW = ["shift-inside-multi-token", "causal-conv1d-mixer", "cumsum-mixer"]
_ALL = _FEW + ["llama-scratch-complex-rope", "packed-docs-llama", "nanogpt"]


def _rank_guards(gloo_rank: int, gloo_world: int, names: list[str], ranks: list[int],
                 world: int) -> dict:
    """Each (style, rank of ``world``) this process takes, compiled static under aot_eager on a
    fake process group of ``world``: the guards its compile put on the rank symbol, and the
    ranks of the group it serves (autosp.shared_compile.serves)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp
    from autosp.shared_compile import serves

    dist.destroy_process_group()
    out = {}
    pairs = [(n, r) for n in names for r in ranks]
    for name, rank in pairs[gloo_rank::gloo_world]:
        style = styles.ALL[name]
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            torch._dynamo.reset()
            torch.manual_seed(0)
            compiled = autosp.compile(style.build(), mesh=autosp.init_mesh(world), seq_dim=1,
                                      backend="aot_eager", dynamic=False, check_inputs="never")
            compiled(*style.inputs(11, 32)).backward()
            [(symbol, guards)] = compiled.sp_backend.records[-1].per_shape.rank_guards
            out[name, rank] = ([str(g) for g in guards],
                               [o for o in range(world) if serves(guards, symbol, o)])
        finally:
            dist.destroy_process_group()
    return out


@pytest.mark.parametrize("names, ranks", [
    (_FEW, [0, 3]),  # (rank 0's guards, evaluated at ranks 1 and 2, say whether they share)
    pytest.param(_ALL, [0, 1, 2, 3], marks=pytest.mark.slow),
], ids=["few", "all"])
def test_a_compile_serves_every_rank_whose_part_is_alike(names: list[str],
                                                         ranks: list[int]) -> None:
    """World 4, static sizes, the guards each rank's compile puts on the rank symbol (what
    PyTorch's caches check before they hand a compile to another rank; one process per rank
    on a fake process group, aot_eager): ranks 0-2's compiles each serve ranks 0-2, so one
    compile is shared. Where the last rank's part differs, its compile serves it alone
    (``Eq(rank, 3)``) and theirs never serves it (``Ne(rank, 3)``); elsewhere every compile
    serves every rank. Found by breaker helper-73: a rank's slot taken with ``stack[rank]``, or
    a scan's ``totals[:rank]``, guarded the rank's value, and each rank compiled its own."""
    found: dict = {}
    for part in run_ranks(2, _rank_guards, names, ranks, 4, timeout=900):
        found.update(part)
    assert sorted(found) == sorted((n, r) for n in names for r in ranks)
    for (name, rank), (guards, served) in sorted(found.items()):
        if name in _OFFSET:
            assert served == ([3] if rank == 3 else [0, 1, 2]), (name, rank, guards)
        else:
            assert served == [0, 1, 2, 3], (name, rank, guards)


def _set(module: str, path: str, value: Any) -> Any:
    """Sets the option ``path`` of the config ``module``; returns its old value."""
    import importlib

    obj = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    old = getattr(obj, name)
    setattr(obj, name, value)
    return old


def test_no_rank_waits_when_the_compile_itself_runs_collectives(tmp_path: Any,
                                                                monkeypatch: Any) -> None:
    """Each of PyTorch's options that has a compile run collectives over the ranks (here: every
    one this torch has) turns sharing off: no lock is taken. A rank waiting on the lock would
    never join the holder's collective (breaker helper-74: a hang)."""
    from autosp import shared_compile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(shared_compile.ENV, "1")
    gm = torch.fx.symbolic_trace(torch.nn.GELU())
    with shared_compile.one_at_a_time(gm, ("key",), share=True):
        pass
    assert (tmp_path / "autosp_locks").is_dir()  # the control: sharing takes a lock
    tried = []
    for module, path in shared_compile._COLLECTIVE_OPTIONS:
        try:
            old = _set(module, path, True)
        except AttributeError:  # an option this torch does not have
            continue
        try:
            assert not shared_compile.enabled(), path
            with shared_compile.one_at_a_time(gm, (path,), share=True):
                pass
            assert not any(tmp_path.glob(f"autosp_locks/{shared_compile.graph_key(gm, (path,))}*"))
        finally:
            _set(module, path, old)
        tried.append(path)
    assert "runtime_estimations_align_across_all_distributed_ranks" in tried, tried
    assert shared_compile.enabled()


def _aligned_case(rank: int, world: int, cache_dir: str) -> dict:
    """The shared-compile case with Inductor aligning its runtime estimates over the ranks while
    it compiles (an all_gather_object inside the compile)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.config_comms as config_comms

    inductor_config.reorder_for_compute_comm_overlap = True
    config_comms.runtime_estimations_align_across_all_distributed_ranks = True
    return _case(rank, world, cache_dir, "nanogpt", 12, True)


@pytest.mark.slow  # about a minute; the default suite checks that no lock is taken
def test_a_compile_that_runs_collectives_does_not_hang(tmp_path: Any) -> None:
    """World 3, Inductor with reorder_for_compute_comm_overlap and runtime estimates aligned
    over the ranks: every rank compiles at once (3 misses) and is exact. With sharing, rank 0
    held the lock inside the compile's all_gather_object while rank 1 waited on the lock: no
    progress until the 30-minute wait ran out (breaker helper-74)."""
    per_rank = run_ranks(3, _aligned_case, str(tmp_path / "a"), timeout=600)
    assert _check(per_rank, "nanogpt") == (3, 0)
    assert all(o["waited"] < 1.0 for o in per_rank), [o["waited"] for o in per_rank]


def test_a_waiting_rank_stops_waiting_when_the_holders_compile_starts_a_collective(
        tmp_path: Any, monkeypatch: Any) -> None:
    """Another process holds a graph's lock. This one waits for it until the holder's compile
    calls a torch.distributed collective (the tripwire writes the graph's ``.join``), then stops
    waiting and compiles itself, so that it meets that collective; without the mark it would
    wait for the lock (30 minutes by default). The tripwire is on in the holder only while it
    compiles, and puts torch.distributed's functions back afterwards."""
    import contextlib
    import subprocess
    import sys
    import threading
    import time
    import warnings

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from autosp import shared_compile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(shared_compile.ENV, "1")
    gm = torch.fx.symbolic_trace(torch.nn.GELU())
    path = tmp_path / "autosp_locks" / f"{shared_compile.graph_key(gm, ('k',))}.lock"
    path.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, filelock; l = filelock.FileLock(sys.argv[1]); "
         "l.acquire(); print('held', flush=True); time.sleep(120)", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        join = path.with_suffix(".join")
        threading.Timer(2.0, join.touch).start()  # the holder's compile reaches a collective
        start = time.monotonic()
        with shared_compile.one_at_a_time(gm, ("k",), share=True):
            waited = time.monotonic() - start
            assert dist.all_gather_object is distributed_c10d.all_gather_object  # no tripwire
        assert 1.5 < waited < 30.0, waited
        assert shared_compile.LAST_WAIT[0] == pytest.approx(waited, abs=0.5)
    finally:
        holder.kill()
        holder.wait()

    # The holder's side: the first collective of its compile writes the mark, then runs.
    originals = {n: getattr(dist, n) for n in shared_compile._COLLECTIVES if hasattr(dist, n)}
    assert "all_gather_object" in originals and "barrier" in originals
    # Another thread's collective counts as well (a compile pass may run one on a thread pool:
    # breaker helper-79), but its mark goes when the compile ends: it may be no part of the
    # compile (an asynchronous checkpoint's), and later compiles are then shared again.
    side_join = tmp_path / "autosp_locks" / f"{shared_compile.graph_key(gm, ('s',))}.join"
    with shared_compile.one_at_a_time(gm, ("s",), share=True):
        called = []

        def side_barrier() -> None:
            with contextlib.suppress(Exception), warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                called.append("barrier")
                dist.barrier()
            called.extend(str(w.message) for w in seen)

        side = threading.Thread(target=side_barrier)
        side.start()
        side.join()
        assert called[0] == "barrier" and side_join.exists(), called
        assert "a thread of this process runs barrier" in called[1], called
    assert not side_join.exists()
    with shared_compile.one_at_a_time(gm, ("h",), share=True):
        assert dist.all_gather_object is not originals["all_gather_object"]
        other = shared_compile.graph_key(gm, ("h",))
        join = tmp_path / "autosp_locks" / f"{other}.join"
        assert not join.exists()
        with pytest.warns(UserWarning, match=r"\[autosp:compile\] this compile runs barrier"), \
                pytest.raises(Exception):  # no process group here: the call itself still runs
            dist.barrier()
        assert join.exists()
    assert join.exists()  # the compiling thread's mark stays
    assert {n: getattr(dist, n) for n in originals} == originals
    assert all(getattr(distributed_c10d, n) is f for n, f in originals.items())
    # From then on no rank waits for a compile of that graph: each compiles at once.
    start = time.monotonic()
    with shared_compile.one_at_a_time(gm, ("h",), share=True):
        assert dist.all_gather_object is originals["all_gather_object"]
    assert time.monotonic() - start < 1.0


class _GatherPass:
    """An Inductor post-grad pass that runs a collective over the ranks, as an option of
    PyTorch's that autosp.shared_compile does not list would (spmd_check and the aligned
    runtime estimates call all_gather_object the same way)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        import torch.distributed as dist

        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, len(graph.nodes))

    def uuid(self) -> str:
        return "autosp-test-gather-pass"


def _unlisted_collective_case(rank: int, world: int, cache_dir: str) -> dict:
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class GatherPass(_GatherPass, CustomGraphPass):
        pass

    inductor_config.post_grad_custom_pre_pass = GatherPass()
    out = _case(rank, world, cache_dir, "nanogpt", 12, True)
    from autosp import shared_compile
    out["listed"] = shared_compile.compile_collectives()
    return out


@pytest.mark.slow  # about a minute; the default suite checks the waiting rank and the tripwire
def test_a_compile_running_a_collective_no_option_names_does_not_hang(tmp_path: Any) -> None:
    """World 3, Inductor with a post-grad pass that calls all_gather_object while it compiles,
    no option of the list on: rank 0 or 1 takes the lock, its compile trips the wire, the other
    stops waiting and compiles too, and all three meet in the collective; every rank exact.
    Without the tripwire the waiting rank never joined and the holder's collective timed out."""
    per_rank = run_ranks(3, _unlisted_collective_case, str(tmp_path / "u"), timeout=300)
    assert all(not o["listed"] for o in per_rank)
    misses, hits = _check(per_rank, "nanogpt")
    assert (misses, hits) == (3, 0), (misses, hits)
    assert list((tmp_path / "u" / "autosp_locks").glob("*.join")), "the tripwire left no mark"
