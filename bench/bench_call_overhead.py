"""Benchmark: what autosp's per-call bookkeeping costs, beside the compiled graph.

    python bench/bench_call_overhead.py [--layers 32]

Two parts, each against a baseline measured in the same run:

1. **Dynamo's guards on module hooks.** autosp turns off
   ``torch._dynamo.config.skip_nnmodule_hook_guards`` during its calls, so a hook registered
   after a compile recompiles (where Dynamo's default runs the graph compiled without it). The
   guards then check every module's hook dicts at each call. Measured on the reference Llama
   under plain ``torch.compile`` with a backend that returns constants (so that only Dynamo's
   guards and frame entry are timed), each setting in a fresh process: microseconds per call
   with the guards skipped (Dynamo's default) and checked, and the difference.
2. **The model state** (autosp.model_state.ModelState.state: a walk of the modules and
   parameters, which require gradients, their dtypes and the hooks, compared across ranks by
   the input guard) per call, against a forward of the same model in eager mode.

Nothing is asserted; the numbers are per call, best of 7 rounds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def _model(layers: int):  # noqa: ANN202 - torch imported late, in the child
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=layers,
                      num_heads=2, num_kv_heads=1)
    return LlamaForCausalLM(cfg)


def _best_us(fn, calls: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def _child_guards(layers: int, skip: bool) -> None:
    import torch

    torch._dynamo.config.skip_nnmodule_hook_guards = skip
    model = _model(layers)
    ids = torch.randint(0, 64, (1, 8))

    def constants(gm, example_inputs):  # noqa: ANN001, ANN202 - Dynamo's backend signature
        outs = [torch.zeros(()) for _ in gm.graph.output_node().args[0]]
        return lambda *args: outs

    compiled = torch.compile(model, backend=constants, fullgraph=True)
    with torch.no_grad():
        for _ in range(5):
            compiled(ids, ids)
        us = _best_us(lambda: compiled(ids, ids), 2000)
    print(f"RESULT {us:.1f} {sum(1 for _ in model.modules())}")


def _guards(layers: int, skip: bool) -> tuple[float, int]:
    out = subprocess.run([sys.executable, __file__, "--layers", str(layers), "--child",
                          "skip" if skip else "guard"], capture_output=True, text=True, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    us, modules = line.split()[1:]
    return float(us), int(modules)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--child", choices=("skip", "guard"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child_guards(args.layers, args.child == "skip")
        return
    skip, modules = _guards(args.layers, True)
    checked, _ = _guards(args.layers, False)
    print(f"Dynamo frame entry and guards, {args.layers} layers ({modules} modules): "
          f"{skip:.1f} us per call with hook guards skipped (Dynamo's default), {checked:.1f} us "
          f"checked (autosp): +{checked - skip:.1f} us, {checked / skip:.2f}x")

    import torch

    from autosp.model_state import ModelState

    model = _model(args.layers)
    state = ModelState(model)
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        eager = _best_us(lambda: model(ids, ids), 50)
    per_call = _best_us(state.state, 2000)
    print(f"model state, {sum(1 for _ in model.parameters())} parameters, {modules} modules: "
          f"{per_call:.1f} us per call, "
          f"{per_call / eager:.4f}x an eager forward of this model at 8 tokens ({eager:.0f} us)")


if __name__ == "__main__":
    main()
