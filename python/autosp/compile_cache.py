"""What makes autosp's graphs cacheable by PyTorch's compile caches across processes.

A second process that compiles the same model at the same shapes should reuse the first one's
work: AOTAutograd's cache (the joint trace, the partition, and the compiled forward and
backward) and Inductor's FX graph cache. Two things decide whether it can:

- **autosp's functions in the graph.** The apply stage inserts calls to the SP ops of
  :mod:`autosp.collectives` and :mod:`autosp.chunks` (``grad_sync``, ``local_chunk``, ...).
  AOTAutograd caches a graph only when it can trust every function it calls to behave as its
  name says; for functions outside torch it needs a key, through
  ``torch._inductor.config.unsafe_marked_cacheable_functions``. :func:`marked_cacheable` gives
  each of them :func:`source_hash`, which is part of every cache key, so an autosp of other
  code never reads entries this one wrote.
- **autosp's partitioner.** Its identity in the key (``AutospRematPartitioner.uuid``) is the
  policy and :func:`source_hash`.

Everything else in the key is the applied graph itself (the plan, the rank, the group) and
its example inputs, which AOTAutograd hashes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

_PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """A hash of autosp's code: every Python module of the package and the compiled core.
    Computed once per process (about 5 ms), when ``import autosp`` has loaded the package, and
    read from memory after: a file changed on disk later (an edit while a job or a test
    session runs) must not key the graphs this process makes from the code it loaded. The
    modules autosp imports on first use (the planner, the trainer) are hashed as their files
    were at ``import autosp``: one changed between then and its own import is not seen."""
    from autosp import _core

    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    h.update(Path(_core.__file__).read_bytes())
    return h.hexdigest()


def graph_functions() -> list[Callable]:
    """The public functions of :mod:`autosp.collectives` and :mod:`autosp.chunks`: what the
    apply stage may insert into a graph (the tiled ops are torch custom ops, which the caches
    accept by name)."""
    from autosp import chunks, collectives

    return [fn for module in (collectives, chunks)
            for name, fn in inspect.getmembers(module, inspect.isfunction)
            if fn.__module__ == module.__name__ and not name.startswith("_")]


def marked_cacheable() -> dict[str, str]:
    """``unsafe_marked_cacheable_functions`` with autosp's graph functions added, keyed by
    :func:`source_hash` (the entries already there are kept)."""
    from torch._inductor import config as inductor_config

    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    for fn in graph_functions():
        marked[f"{fn.__module__}.{fn.__name__}"] = source_hash()
    return marked


# -- remat reports across cache hits -----------------------------------------------------------
#
# A RematReport is filled by autosp's partitioner, which a cache hit skips. So that a report
# (and `autosp train`'s MFU, read from it) survives a hit, the report of each partition is kept
# beside PyTorch's caches, under a key of what the partition depends on: the partitioner's
# identity (policy and source_hash) and the graph with its inputs' types. Where no report is
# there, the graph is compiled with AOTAutograd's cache off, so that the partitioner runs
# (compile_joint).


# In the meta of a graph compiled for static sizes (autosp.specialize): its placeholders keep
# Dynamo's symbolic values, and the static inputs AOTAutograd is handed are what it is keyed by.
STATIC_INPUTS = "autosp_static_inputs"


def hash_graph_code(h: Any, gm: Any) -> None:
    """Adds ``gm``'s code to the hash ``h``, and its regions' subgraphs' (autosp.outline)."""
    h.update(gm.code.encode())
    for name, sub in gm.named_modules():
        if sub is not gm and isinstance(sub, torch.fx.GraphModule):
            h.update(name.encode())
            h.update(sub.code.encode())


def report_key(gm: Any, partitioner_uuid: str, example_inputs: Sequence[Any] | None = None) -> str:
    """The key of the reports of ``gm``'s partition: the partitioner's identity, the graph's
    code and its inputs' types with their sizes (as the AOTAutograd cache keys a graph
    compiled with a dynamic length: a hit at another length reads the report of the
    compilation that made the entry).

    The sizes are the placeholders' traced values: symbolic for a dynamic length. A graph
    compiled for static sizes (``gm.meta[STATIC_INPUTS]``, autosp.specialize) is keyed by
    ``example_inputs``, the static inputs AOTAutograd is handed, since its placeholders keep
    Dynamo's symbolic values: keyed by those, two lengths of a graph that takes no integer
    input shared one report (found by a breaker: the report of S = 64 read back at S = 32)."""
    h = hashlib.sha256(partitioner_uuid.encode())
    hash_graph_code(h, gm)
    values = (list(example_inputs) if example_inputs is not None and gm.meta.get(STATIC_INPUTS)
              else [n.meta.get("example_value", n.meta.get("val"))
                    for n in gm.graph.find_nodes(op="placeholder")])
    for x in values:
        if isinstance(x, torch.Tensor):
            h.update(repr((tuple(map(str, x.shape)), str(x.dtype), x.requires_grad)).encode())
        else:
            h.update(repr(type(x)).encode())
    return h.hexdigest()


def _report_path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "autosp_remat_reports" / f"{key}.json"


def save_reports(key: str, graphs: Sequence[Any]) -> None:
    """Writes the reports of one compilation (best effort: a read-only cache only costs a
    recompilation later)."""
    path = _report_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps([dataclasses.asdict(g) for g in graphs]))
        os.replace(tmp, path)
    except OSError:
        pass


def load_reports(key: str) -> list[Any] | None:
    """The reports :func:`save_reports` wrote under ``key``, or None."""
    from autosp.remat_policy import GraphRematReport, LayerRemat, NodeRemat

    try:
        raw = json.loads(_report_path(key).read_text())
        if not isinstance(raw, list) or not raw:
            return None  # a partition reports at least one graph
        return [GraphRematReport(**dict(g, layers=tuple(LayerRemat(**x) for x in g["layers"]),
                                        nodes=tuple(NodeRemat(**x) for x in g["nodes"])))
                for g in raw]
    except (OSError, ValueError, TypeError, KeyError):
        return None


# -- per-layer admissions across processes ----------------------------------------------------
#
# With regions and sequence-aware remat, a graph whose layers need other admissions than their
# region's is outlined again after its first partition (autosp.remat_regions). What each call
# needs is kept beside the caches under the first graph's report_key, so that a later process
# outlines by it at once and does not trace and partition the first graph again.


def _admissions_path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "autosp_region_admissions" / f"{key}.json"


def save_admissions(key: str, admissions: dict[str, Sequence[bool]]) -> None:
    """Writes the admissions each layer needs (best effort, as :func:`save_reports`)."""
    path = _admissions_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({layer: [bool(a) for a in v] for layer, v in admissions.items()}))
        os.replace(tmp, path)
    except OSError:
        pass


def load_admissions(key: str) -> dict[str, tuple[bool, ...]] | None:
    """What :func:`save_admissions` wrote under ``key``, or None. (Any admissions are exact;
    they decide only what is recomputed.)"""
    try:
        raw = json.loads(_admissions_path(key).read_text())
        if not isinstance(raw, dict) or not raw or not all(
                isinstance(v, list) and all(isinstance(a, bool) for a in v) for v in raw.values()):
            return None
        return {str(layer): tuple(v) for layer, v in raw.items()}
    except (OSError, ValueError):
        return None
