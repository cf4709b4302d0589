"""Imported once by the test harness's fork server (distributed._context), after its other
preloads: picks Inductor's CPU vector instruction set, so that every rank forked from the
server inherits the answer.

Inductor picks it at a rank's first C++ kernel by compiling a probe program for each
candidate set into the cache directory and loading it in a subprocess. Into a fresh
TORCHINDUCTOR_CACHE_DIR, as many tests use one, that takes 7-8 s per rank on a quiet 2-core
machine, and 1 s into a warm one. The answer depends on the CPU and the compiler, never on
the cache directory, and PyTorch keeps it per process (functools.cache), so one probe in the
server is the probe every rank would make. Nothing else is compiled here: Dynamo's counters
and caches still start empty in every rank.
"""

from __future__ import annotations

try:  # the server dies of any error but ImportError in a preload
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    VEC_ISA = str(pick_vec_isa())
except Exception:  # noqa: BLE001 - no C++ compiler, or another torch: each rank probes itself
    VEC_ISA = None
