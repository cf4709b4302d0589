"""One compile for the ranks of a machine.

With static sizes (autosp.specialize), the graph each rank runs takes its rank as an input
(autosp.apply.RankContext.rank_input) that is compiled as a symbol, not as a constant. The
ranks of an SP group then compile the same graph (all but the last, where a sequence offset
makes the last rank's part longer), and PyTorch's FX graph and AOTAutograd caches can hand one
rank's compile to the others. They compile at the same moment, though, so each would miss. A
file lock per graph, in Inductor's cache directory, lets one rank compile while the others with
the same graph wait, then load what it wrote (a cache hit). Ranks with other graphs take other
locks and compile at once.

The lock cannot hang the job: autosp runs no collective while it is held, no rank waits when
one of PyTorch's options known to have the compile itself run collectives is on
(:func:`compile_collectives`), a compile that starts a collective through ``torch.distributed``
anyway (an option this list does not know) has the waiting ranks compile too and meet it there
(:func:`_tripwire`), and the operating system releases the lock when its holder dies. A rank
whose graph differs in some way the key does not see only compiles after the holder, as it
would have compiled anyway.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx as fx

from autosp.apply import RANK_INPUT as RANK_SOURCE  # the rank symbol's name, as its placeholder's

#: Set to 0 to have every rank compile at once (each then compiles its own graph).
ENV = "AUTOSP_SHARED_COMPILE"

#: Seconds a rank waits for another's compile of its graph before it compiles anyway.
WAIT_S = 1800.0

#: Seconds between a waiting rank's looks at whether the holder's compile started a collective.
POLL_S = 0.5

#: torch.distributed's collectives and point-to-point calls. One started by the process that
#: holds a compile's lock, while it compiles, means the compile itself talks to the other ranks.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
                "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
                "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")


def rank_symbol(shape_env: Any, rank: int) -> Any:
    """The rank as a symbolic int of ``shape_env``, never specialised to its value (PyTorch
    makes an integer input of 0 or 1 a constant), known to be >= 0."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(RANK_SOURCE)
    sym = shape_env.create_symbol(rank, source, dynamic_dim=DimDynamic.DYNAMIC, positive=None,
                                  do_not_specialize_zero_one=True)
    shape_env.constrain_symbol_range(sym, compiler_min=0, compiler_max=2**31 - 1)
    return shape_env.create_symintnode(sym, hint=rank, source=source)


def is_rank_symbol(value: Any) -> bool:
    """Whether the SymInt ``value`` is the rank of :func:`rank_symbol`, not a size (its symbol
    as created, ``_expr``: a guard may have made ``expr`` the rank's value)."""
    import sympy

    node = value.node
    sym = getattr(node, "_expr", None)
    if node.shape_env is None or not isinstance(sym, sympy.Symbol):
        return False
    return any(getattr(s, "source_name", None) == RANK_SOURCE
               for s in node.shape_env.var_to_sources.get(sym, ()))


def rank_guards(shape_env: Any, rank: Any) -> tuple[Any, list]:
    """The rank symbol of the SymInt ``rank`` and the guards a compile put on it (sympy
    expressions in it): a compile serves another rank only where each holds with that rank
    substituted (:func:`serves`). Every compile bounds the rank by its chunk's offset
    (``8*rank <= 24`` for a part of 8 in 32); where an offset makes the last rank's part differ,
    the last rank's compile guards ``Eq(rank, world - 1)`` and the others' ``Ne(rank, world - 1)``.
    (``rank.node.expr`` is the rank's value once a guard has made it equal to one, as
    ``rank == world - 1`` does on the last rank: the symbol is the one created.)"""
    sym = getattr(rank.node, "_expr", rank.node.expr)
    return sym, [g.expr for g in shape_env.guards if sym in g.expr.free_symbols]


def serves(guards: list, symbol: Any, other: int) -> bool:
    """Whether a compile with these :func:`rank_guards` on ``symbol`` is valid for the rank
    ``other`` (what PyTorch's caches check before they hand it over)."""
    return all(bool(g.subs(symbol, other)) for g in guards)


# PyTorch's options under which a compile itself runs collectives over the ranks: aligning
# the scheduler's runtime estimates, checking that every rank compiled the same graph, sharing
# max-autotune's work, agreeing on the partitioner's saved values. A rank waiting on the lock
# never joins them, so the holder waits for it until the wait times out (found by breaker
# helper-74: reorder_for_compute_comm_overlap with aligned estimates, 4 ranks, no progress in
# 300 s). With any of them on, no rank waits for another's compile.
_COLLECTIVE_OPTIONS = (
    ("torch._inductor.config_comms", "runtime_estimations_align_across_all_distributed_ranks"),
    ("torch._inductor.config_comms",
     "reorder_for_compute_comm_overlap_broadcast_runtime_estimations"),
    ("torch._inductor.config", "aten_distributed_optimizations.enable_overlap_scheduling"),
    ("torch._inductor.config", "aten_distributed_optimizations.spmd_check"),
    ("torch._inductor.config", "distributed_max_autotune_gemm"),
    ("torch._functorch.config", "_sync_decision_cross_ranks"),
)


def compile_collectives() -> list[str]:
    """The options of :data:`_COLLECTIVE_OPTIONS` that are on (an option this torch lacks is
    off)."""
    on = []
    for module, path in _COLLECTIVE_OPTIONS:
        try:
            value: Any = importlib.import_module(module)
        except ImportError:
            continue
        for part in path.split("."):
            value = getattr(value, part, None)
        if value:
            on.append(f"{module}.{path}")
    return on


def enabled() -> bool:
    """Whether a compile waits for another rank's compile of the same graph: only where
    PyTorch's caches can hand it over, and no option has the compile run collectives."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    return (os.environ.get(ENV, "1") != "0" and bool(inductor_config.fx_graph_cache)
            and bool(getattr(functorch_config, "enable_autograd_cache", False))
            and not compile_collectives())


def graph_key(gm: fx.GraphModule, key: tuple) -> str:
    """A name for the compile of ``gm`` (and its regions' subgraphs) for the shape key
    ``key`` by this autosp and torch: what the ranks that can share one compile have alike."""
    from autosp.compile_cache import hash_graph_code, source_hash

    h = hashlib.sha256(f"{source_hash()} {torch.__version__} {key!r}".encode())
    hash_graph_code(h, gm)
    return h.hexdigest()[:32]


def cacheable(gm: fx.GraphModule) -> bool:
    """Whether AOTAutograd's cache would take ``gm`` (with autosp's functions marked, as autosp's
    compile marks them): a graph it bypasses is compiled by every rank, so no rank waits for
    another's. True where this torch cannot tell."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import (BypassAOTAutogradCache,
                                                                   check_cacheable)
        from torch._inductor import config as inductor_config

        from autosp.compile_cache import marked_cacheable
    except ImportError:
        return True
    try:
        with inductor_config.patch(unsafe_marked_cacheable_functions=marked_cacheable()):
            check_cacheable(gm)
    except BypassAOTAutogradCache:
        return False
    except Exception:  # a check this torch makes differently: the compile will tell
        return True
    return True


@contextlib.contextmanager
def one_at_a_time(gm: fx.GraphModule, key: tuple, share: bool) -> Iterator[None]:
    """Around the compile of ``gm`` for the shape key ``key``: with ``share``, one process of
    this machine at a time per graph, and the backward compiled with the forward, so that the
    AOTAutograd cache entry (written once both are) is there for the next."""
    if not share or not enabled() or not cacheable(gm):
        yield
        return
    from filelock import FileLock, Timeout
    from torch._functorch import config as functorch_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = Path(cache_dir()) / "autosp_locks" / f"{graph_key(gm, key)}.lock"
    done = path.with_suffix(".done")  # written once a compile of this graph has finished
    join = path.with_suffix(".join")  # written when a compile of it started a collective
    start = time.perf_counter()
    lock = None
    if not done.exists() and not join.exists():
        lock = FileLock(str(path))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not _wait(lock, join, WAIT_S):  # the holder's compile runs a collective: meet it
                lock = None
        except Timeout:
            warnings.warn(f"[autosp:compile] waited {WAIT_S:.0f} s for another process's compile "
                          f"of this graph ({path}); compiling it here as well.", stacklevel=3)
            lock = None
        except OSError:  # a cache directory this process cannot write: no sharing
            lock = None
        if lock is not None and done.exists():  # compiled while this one waited: load it
            lock.release()  # (the loads of the waiting ranks run at once)
            lock = None
    LAST_WAIT[0] = time.perf_counter() - start
    patch = ({"force_non_lazy_backward_lowering": True}
             if hasattr(functorch_config, "force_non_lazy_backward_lowering") else {})
    try:
        with functorch_config.patch(patch), \
                (_tripwire(join) if lock is not None else contextlib.nullcontext()):
            yield
        if lock is not None:
            with contextlib.suppress(OSError):
                done.touch()
    finally:
        if lock is not None:
            lock.release()


def _wait(lock: Any, join: Path, wait_s: float) -> bool:
    """Takes ``lock``, looking every :data:`POLL_S` at whether its holder's compile started a
    collective (``join`` exists). True once held; False for ``join``; raises filelock's Timeout
    after ``wait_s``."""
    from filelock import Timeout

    deadline = time.monotonic() + wait_s
    while True:
        if join.exists():
            return False
        try:
            lock.acquire(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
            return True
        except Timeout:
            if time.monotonic() >= deadline:
                raise


@contextlib.contextmanager
def _tripwire(join: Path) -> Iterator[None]:
    """While this process compiles holding the lock: the first collective it starts through
    ``torch.distributed`` (:data:`_COLLECTIVES`, in both ``torch.distributed`` and
    ``distributed_c10d``, where PyTorch's compile calls them) writes ``join`` before it runs,
    so that the ranks waiting for this compile stop waiting, compile too and meet it there.
    :func:`compile_collectives` names the options known to do this, and no rank waits under
    them; this catches the others (helper-74's hang was one, with a 30-minute wait).

    A collective on another thread counts too (breaker helper-79: a compile pass that ran its
    collective on a thread pool of its own stalled every rank until the process group's
    timeout). It may be no part of the compile (an asynchronous checkpoint's): then the ranks
    waiting only compile for themselves, and its mark is removed when the compile ends, so that
    later compiles of the graph are shared again. The compiling thread's mark stays."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    compiling = threading.get_ident()
    marked: dict[str, bool] = {}  # "compile": the compiling thread's; "other": another's

    def tripped(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            ours = threading.get_ident() == compiling
            if ours and "compile" not in marked or not marked:
                marked["compile" if ours else "other"] = True
                if not join.exists():
                    with contextlib.suppress(OSError):
                        join.touch()
                    warnings.warn(
                        f"[autosp:compile] {'this compile' if ours else 'a thread of this process'} "
                        f"runs {fn.__name__} over the ranks while this process compiles a graph "
                        "other ranks wait for (an option of PyTorch's that "
                        "autosp.shared_compile does not list, or a collective of the model's "
                        "own thread): the ranks that waited for it compile it too"
                        + (", and it is not shared from now on" if ours else "")
                        + f" ({join}).", stacklevel=2)
            return fn(*args, **kwargs)
        return call

    saved = [(module, name, getattr(module, name)) for module in (dist, distributed_c10d)
             for name in _COLLECTIVES if callable(getattr(module, name, None))]
    for module, name, fn in saved:
        setattr(module, name, tripped(fn))
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)
        if "other" in marked and "compile" not in marked:
            with contextlib.suppress(OSError):
                join.unlink()


#: Seconds the last compile waited for another process's (a test reads it).
LAST_WAIT = [0.0]
