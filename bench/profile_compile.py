"""Where autosp's first call spends its time (issue 12), against plain torch.compile.

One process, rank 0 of an SP group of ``--sp`` against a fake process group (the collectives
allocate and do not communicate: what is timed is this rank's compilation and one step). The
reference Llama with ``--layers`` decoder layers (hidden 64, tiny) at sequence length
``--seq``; the first call (forward + backward) of:

- ``autosp``: ``autosp.compile(model, mesh, backend=...)``;
- ``torch.compile``: the same model, the same backend, with no SP (``dynamic`` sequence dim
  marked, as autosp marks it).

Each runs twice: cold (a fresh ``TORCHINDUCTOR_CACHE_DIR``: no FX graph, AOTAutograd or
kernel cache) and warm (the same directory again, after ``torch._dynamo.reset()``: what a
second process with the same model and S would find).

Each first call runs under cProfile. Its time is split by the cumulative time of the
functions that are stages of the pipeline: Dynamo's capture, autosp's decompose, bridge,
plan (C++), apply, AOTAutograd's joint trace, the partitioner (autosp's or PyTorch's) and the
backend compiler (Inductor's compile_fx_inner). Stages nest: Dynamo's capture holds all that
the backend does, AOTAutograd's holds the partitioner and Inductor. cProfile adds overhead;
the ratios are what to read.

    .venv/bin/python bench/profile_compile.py --layers 2
    .venv/bin/python bench/profile_compile.py --layers 16 --backend aot_eager

Everything runs in one process, in the order of the table: a later row finds kernels, the
C++ precompiled header and Inductor's modules already in memory, so its cold seconds are low
(the ``--static`` rows showed 0.42x for torch.compile's static S this way; in a fresh process
it was 0.89x, 21.2 s against 23.7 s). Read this script for the stages of one configuration;
compare configurations with bench/compile_first_call.py, which runs each in a fresh process.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

# (label, module file suffix, function name): the cumulative time of that function.
STAGES: list[tuple[str, str | None, str | None]] = [
    ("dynamo capture", "torch/_dynamo/convert_frame.py", "_compile"),
    ("autosp decompose", "autosp/decompose.py", "decompose_composites"),
    ("autosp bridge", "autosp/bridge.py", "fx_to_core"),
    ("autosp plan (C++)", None, None),  # _core.plan_ulysses, timed around the call
    ("autosp apply", "autosp/apply.py", "apply_plan"),
    ("aot joint trace", "torch/_functorch/aot_autograd.py", "create_aot_state"),
    ("autosp partition", "autosp/remat_partition.py", "_partition"),
    ("torch partition", "torch/_functorch/partitioners.py", "min_cut_rematerialization_partition"),
    ("inductor compile", "torch/_inductor/compile_fx.py", "compile_fx_inner"),
]


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    total = 0.0
    for (file, _, func), (_, _, _, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        if func == name and file.replace("\\", "/").endswith(suffix):
            total = max(total, ct)  # recursive entries repeat the outermost time
    return total


def _calls(stats: pstats.Stats, suffix: str, name: str) -> int:
    return sum(cc for (file, _, func), (cc, _, _, _, _) in stats.stats.items()  # type: ignore[attr-defined]
               if func == name and file.replace("\\", "/").endswith(suffix))


def _profile(fn: Callable[[], Any]) -> tuple[float, pstats.Stats]:
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    return time.perf_counter() - start, pstats.Stats(prof)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--sp", type=int, default=2)
    from autosp.remat_policy import BACKENDS  # the backends' names, defined once

    ap.add_argument("--backend", default="inductor", choices=BACKENDS)
    ap.add_argument("--static", action="store_true",
                    help="also time torch.compile with S static (cold), and autosp.compile("
                         "dynamic=False) (cold and warm): planned on the symbolic trace, "
                         "compiled with S static")
    args = ap.parse_args()

    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp
    from autosp import _core
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.sp)
    mesh = autosp.init_mesh(args.sp)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172,
                      num_layers=args.layers, num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 256, (2, args.seq), generator=torch.Generator().manual_seed(0))

    plan_seconds = [0.0]
    real_plan = _core.plan_ulysses

    def timed_plan(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_plan(*a, **k)
        finally:
            plan_seconds[0] += time.perf_counter() - t

    _core.plan_ulysses = timed_plan

    def autosp_step(dynamic: bool = True) -> None:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        compiled = autosp.compile(model, mesh=mesh, backend=args.backend, check_inputs="never",
                                  dynamic=dynamic)
        compiled(ids, ids).backward()

    def autosp_static_step() -> None:
        autosp_step(dynamic=False)

    def torch_step() -> None:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        x = ids.clone()
        torch._dynamo.mark_dynamic(x, 1)
        compiled = torch.compile(model, backend=args.backend, fullgraph=True)
        compiled(x, x).backward()

    def torch_static_step() -> None:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        compiled = torch.compile(model, backend=args.backend, fullgraph=True, dynamic=False)
        compiled(ids, ids).backward()

    from torch._inductor import metrics

    results = {}
    runs = [(f"{name}, {phase}", step, phase == "cold")
            for name, step in (("torch.compile", torch_step), ("autosp", autosp_step))
            for phase in ("cold", "warm")]
    if args.static:
        runs.append(("torch.compile static S, cold", torch_static_step, True))
        runs += [(f"autosp dynamic=False, {phase}", autosp_static_step, phase == "cold")
                 for phase in ("cold", "warm")]
    for name, step, cold in runs:
        if cold:  # a fresh on-disk cache (Inductor's FX graph and AOTAutograd caches)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autosp-profile-")
        torch._dynamo.reset()
        plan_seconds[0] = 0.0
        metrics.reset()
        wall, stats = _profile(step)
        rows: dict[str, float] = {}
        for label, suffix, func in STAGES:
            rows[label] = plan_seconds[0] if suffix is None else _cumulative(stats, suffix, func or "")
        rows["graphs compiled"] = _calls(stats, "torch/_inductor/compile_fx.py", "compile_fx_inner")
        rows["kernels generated"] = metrics.generated_kernel_count
        results[name] = (wall, rows)

    print(f"first call (forward + backward), Llama {args.layers} layers, S {args.seq}, rank 0 of "
          f"sp {args.sp} (fake process group), backend {args.backend}; seconds under cProfile")
    names = list(results)
    print(f"{'stage':<20}" + "".join(f"{n:>22}" for n in names))
    for label in results[names[0]][1]:
        counts = label in ("graphs compiled", "kernels generated")
        print(f"{label:<20}" + "".join(
            f"{results[n][1][label]:>22.0f}" if counts else f"{results[n][1][label]:>22.2f}"
            for n in names))
    print(f"{'first call, total':<20}" + "".join(f"{results[n][0]:>22.2f}" for n in names))
    for phase in ("cold", "warm"):
        ratio = results[f"autosp, {phase}"][0] / results[f"torch.compile, {phase}"][0]
        print(f"autosp / torch.compile, {phase}: {ratio:.2f}x")
    if args.static:
        static = results["torch.compile static S, cold"][0]
        print(f"torch.compile static S / dynamic S, cold: "
              f"{static / results['torch.compile, cold'][0]:.2f}x")
        for phase in ("cold", "warm"):
            ours = results[f"autosp dynamic=False, {phase}"][0]
            print(f"autosp dynamic=False / torch.compile (dynamic S), {phase}: "
                  f"{ours / results[f'torch.compile, {phase}'][0]:.2f}x; / autosp dynamic: "
                  f"{ours / results[f'autosp, {phase}'][0]:.2f}x")
    print("Stages nest (the dynamo capture holds the backend's work); the total is wall time.")


if __name__ == "__main__":
    main()
