"""First-call time (compile + forward + backward) of autosp against torch.compile of the
hand-written Ulysses model, each in a fresh process.

    .venv/bin/python bench/compile_first_call.py                 # 2 layers, about 6 minutes
    .venv/bin/python bench/compile_first_call.py --layers 16     # about 20 minutes
    python bench/compile_first_call.py --device cuda             # Triton kernels, on a GPU

Each configuration runs as rank 0 of an SP group of ``--sp`` against a fake process group
(collectives allocate, do not communicate), in a process of its own: PyTorch keeps compiled
kernels, the C++ precompiled header and imported Inductor modules in memory, so a second
compile in the same process is faster for reasons that have nothing to do with the graph
(bench/profile_compile.py runs everything in one process, so its later rows benefit from
its earlier ones). "cold" has a fresh ``TORCHINDUCTOR_CACHE_DIR``; "warm" is a second
process with the same directory (PyTorch's FX graph and AOTAutograd caches on disk).

Configurations: autosp.compile with ``dynamic=True`` (one graph for every S) and
``dynamic=False`` (planned on the symbolic trace, compiled for the call's static S); the
hand-written Ulysses model (bench/ulysses_handwritten.py) under plain ``torch.compile`` with S
static (torch.compile's default for an unmarked input) and with S marked dynamic. Ratios are
printed against the hand-written model in the same mode. ``handwritten-traced-static`` is the
hand-written model with its exchanges written in functional collectives, which
``torch.compile`` traces (``traced_collectives=True``): one graph holds the whole step, as
autosp's does, where the plain hand-written model runs its exchanges, their packing and the
loss's all-reduce eagerly between its graphs. The plain hand-written model's ``forward``
breaks its graph inside its loop over the layers, so Dynamo skips that frame: its embedding,
final ``lm_head`` and loss (and their backward) run eagerly too, where autosp compiles them.
``handwritten-decoder-frame-static`` loops over the layers in a method of its own, as Hugging
Face's ``LlamaModel`` does inside ``LlamaForCausalLM``: ``forward`` then breaks at that call, and
``torch.compile`` compiles the embedding, the head and the loss, the exchanges still eager.
``autosp-static-regions`` has Dynamo trace each class of
layers once (autosp.dynamo_regions, PyTorch 2.13 and later); ``autosp-static-regions-every-layer``
is ``regions="compile"``: the same outline, with Dynamo tracing every layer. ``floor`` is
``torch.compile`` of a one-op function (``sin``, forward and backward) in the same process set-up: the least any first call
of ``torch.compile`` costs on this machine (Dynamo, AOTAutograd and Inductor's start-up, cache
lookups, one kernel), against which the other rows' compile work is what lies above it.
``floor-precompile`` is the same function through PyTorch's precompile: cold,
``torch.compile(fn, fullgraph=True).aot_compile(...)`` and ``save_compiled_function`` into the
cache directory; warm, ``torch.compiler.load_compiled_function`` from it (PyTorch 2.13).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from autosp.remat_policy import BACKENDS, INDUCTOR

CONFIGS = ("autosp-dynamic", "autosp-static", "handwritten-dynamic", "handwritten-static",
           "handwritten-traced-static", "handwritten-decoder-frame-static",
           "autosp-static-regions", "autosp-static-regions-every-layer", "floor", "floor-precompile")


def _one_op(x: Any) -> Any:
    return x.sin()


def _child(which: str, layers: int, seq: int, sp: int, device: str, backend: str) -> None:
    import torch
    import torch.distributed as dist
    from torch._inductor import metrics
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ulysses_handwritten import UlyssesLlamaForCausalLM

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=layers,
                      num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0)).to(device)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    start = time.perf_counter()
    if which == "floor":
        x = torch.randn(4, 8, device=device, requires_grad=True)
        torch.compile(torch.sin, backend=backend)(x).sum().backward()
    elif which == "floor-precompile":
        x = torch.randn(4, 8, device=device, requires_grad=True)
        saved = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "floor_precompiled.pt")
        if os.path.exists(saved):
            with open(saved, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
        else:
            fn = torch.compile(_one_op, fullgraph=True, backend=backend).aot_compile(((x,), {}))
            fn.save_compiled_function(saved)
        fn(x).sum().backward()
    elif which.startswith("autosp"):
        mesh = autosp.init_mesh(sp)
        # "-every-layer": regions="compile", Dynamo traces every layer
        regions = ("compile" if which.endswith("-every-layer") else True) if "-regions" in which \
            else False
        compiled = autosp.compile(model, mesh=mesh, check_inputs="never", backend=backend,
                                  dynamic=which == "autosp-dynamic", regions=regions)
        compiled(ids, ids).backward()
    else:
        traced = which == "handwritten-traced-static"
        hand = UlyssesLlamaForCausalLM.from_model(
            model, traced_collectives=traced, decoder_frame=which.startswith("handwritten-decoder"))
        x = ids.clone()
        if which == "handwritten-dynamic":
            torch._dynamo.mark_dynamic(x, 1)
        torch.compile(hand, fullgraph=traced, backend=backend)(x, x).backward()  # as bench_sp.py compiles it
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"RESULT {time.perf_counter() - start:.3f} {metrics.generated_kernel_count}", flush=True)


def _run(which: str, layers: int, seq: int, sp: int, device: str, backend: str,
         cache: str) -> tuple[float, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", which,
                          "--layers", str(layers), "--seq", str(seq), "--sp", str(sp),
                          "--device", device, "--backend", backend],
                         env=env, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            seconds, kernels = line.split()[1:]
            return float(seconds), int(kernels)
    raise RuntimeError(f"{which} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the model runs (Inductor then generates C++ or Triton kernels)")
    ap.add_argument("--backend", default=INDUCTOR, choices=BACKENDS,
                    help="autosp's and torch.compile's backend (aot_eager: no kernels, the "
                         "trace and the partition alone)")
    ap.add_argument("--child", default=None, choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--only", default=None, help="comma-separated configurations to run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every configuration this many times, alternating them (this "
                         "machine's cold times vary by about 15%% from run to run): the table gives "
                         "medians, each ratio the median of the ratios of runs in the same round")
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.layers, args.seq, args.sp, args.device, args.backend)
        return
    runs: dict[str, list[Any]] = {}  # per round: ((cold s, kernels), (warm s, kernels)) or None
    for round_ in range(args.repeat):
        for which in (args.only.split(",") if args.only else CONFIGS):
            cache = tempfile.mkdtemp(prefix="autosp-first-call-")
            run = (which, args.layers, args.seq, args.sp, args.device, args.backend, cache)
            try:
                runs.setdefault(which, []).append(None)
                runs[which][-1] = (_run(*run), _run(*run))
                (cold, kernels), (warm, _) = runs[which][-1]
                print(f"round {round_ + 1}: {which}: cold {cold:.2f} s ({kernels} kernels), "
                      f"warm {warm:.2f} s", flush=True)
            except RuntimeError as err:  # one configuration failing leaves the others' rows
                print(err, flush=True)  # (its round stays None)
    runs = {w: r for w, r in runs.items() if any(r)}
    results = {w: ((statistics.median(x[0][0] for x in r if x), next(x for x in r if x)[0][1]),
                   (statistics.median(x[1][0] for x in r if x), 0)) for w, r in runs.items()}
    print(f"first call (compile + forward + backward), Llama {args.layers} layers, S {args.seq}, "
          f"rank 0 of sp {args.sp} (fake process group), {args.backend} on {args.device}, "
          f"each in a fresh process" + (f", median of {args.repeat} rounds" if args.repeat > 1 else ""),
          flush=True)
    print(f"{'':<28}{'cold s':>9}{'kernels':>9}{'warm s':>9}")
    for which, ((cold, kernels), (warm, _)) in results.items():
        print(f"{which:<28}{cold:>9.2f}{kernels:>9}{warm:>9.2f}")

    def ratio(a: str, b: str, label: str) -> None:
        if a not in runs or b not in runs:
            return
        pairs = [(x, y) for x, y in zip(runs[a], runs[b]) if x and y]  # rounds both completed
        cold = [x[0][0] / y[0][0] for x, y in pairs]
        warm = [x[1][0] / y[1][0] for x, y in pairs]
        spread = (f" (rounds: cold {', '.join(f'{c:.2f}' for c in cold)}; "
                  f"warm {', '.join(f'{w:.2f}' for w in warm)})" if len(pairs) > 1 else "")
        if not pairs:
            return
        print(f"{label}: cold {statistics.median(cold):.2f}x ({results[a][0][1]} kernels against "
              f"{results[b][0][1]}), warm {statistics.median(warm):.2f}x{spread}")

    ratio("autosp-static-regions", "autosp-static", "regions=True / flat, static S")
    ratio("autosp-static-regions", "autosp-static-regions-every-layer",
          "regions=True, Dynamo tracing a layer once / every layer")
    for mode in ("dynamic", "static"):
        ratio(f"autosp-{mode}", f"handwritten-{mode}", f"autosp / hand-written, S {mode}")
    ratio("autosp-static-regions", "handwritten-static", "autosp regions=True / hand-written, S static")
    ratio("autosp-static-regions", "handwritten-decoder-frame-static",
          "autosp regions=True / hand-written with its head compiled (decoder frame), S static")
    ratio("autosp-static-regions", "handwritten-traced-static",
          "autosp regions=True / hand-written with traced exchanges (one graph), S static")
    ratio("autosp-static", "handwritten-traced-static",
          "autosp flat / hand-written with traced exchanges (one graph), S static")
    ratio("autosp-static", "autosp-dynamic", "autosp dynamic=False / dynamic=True")
    for mode in ("static", "dynamic"):
        ratio(f"handwritten-{mode}", "floor", f"hand-written, S {mode} / floor (a one-op torch.compile)")
    ratio("autosp-static-regions", "floor", "autosp regions=True / floor")
    ratio("floor-precompile", "floor", "precompile (saved, then loaded) / floor")
    if "handwritten-static" in results and "floor" in results:
        goal, floor = 0.5 * results["handwritten-static"][1][0], results["floor"][1][0]
        print(f"issue 12's warm goal, 0.5x the hand-written model's warm call: {goal:.2f} s; "
              f"a one-op torch.compile's warm call here: {floor:.2f} s "
              f"({'below' if goal < floor else 'above'} what any torch.compile first call takes)")

if __name__ == "__main__":
    main()
