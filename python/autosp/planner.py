"""``autosp plan``: predicted peak memory per rank and the longest trainable sequence.

    result = autosp.planner.plan("llama-3.1-8b", gpus=8, gpu_memory="80GB", sp=8)
    print(result.table())

How it works. The model is built under ``FakeTensorMode`` (no weights, no GPU) and traced
once, with the sequence length S dynamic, through the same pipeline ``autosp.compile`` uses:
Dynamo -> the bridge -> ``plan_ulysses`` -> the plan applied to the FX graph (collectives
traced against a fake process group of size P) -> AOTAutograd's joint forward+backward graph.
Every value of that joint graph has a shape symbolic in S, so its bytes per rank are a closed
form ``sum(coef * S^power / shard)``; the remat solver's facts (bytes, FLOPs, forward/backward
membership) are gathered exactly as autosp's partition function gathers them. A model deeper
than three decoder layers is traced with three and the core builds the rest
(``csrc/plan/layers.h``: copies of the middle layer, node for node what a full trace gives),
so planning takes seconds whatever the depth. The C++ core
(``csrc/plan/memory.h``) then evaluates that graph at any S: it decides the saved set with the
remat solver for the strategy, walks the schedule's liveness, and returns the peak with its
breakdown; the longest trainable S is a search in the core. See docs/plan.md for the model's
assumptions and what it leaves out.

Strategies: ``no-sp`` (P = 1, each GPU trains whole sequences; the GPUs are data parallel) and
``ulysses`` (P = sp), each with remat ``none`` / ``default`` / ``sequence-aware`` / ``full``
(checkpoint every decoder layer: save only its input), and with the tiled loss
(``+ tiled loss``: ``autosp.compile(tile_loss=True)``, the [tokens, vocab] logits computed a
chunk at a time; by default planned with sequence-aware remat, and with full checkpointing
under Ulysses).

Modules, by stage: ``autosp.plan_inputs`` (presets, model configs, byte sizes),
``autosp.plan_trace`` (the trace), ``autosp.plan_memory_graph`` (the joint graph as the core's
MemoryGraph), ``autosp.plan_result`` (the result and its table), and this one (planning over
strategies, the plot, the CLI).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from autosp import _core
from autosp.errors import AutospError
from autosp.models.llama import LlamaConfig
from autosp.plan_inputs import (DTYPES, OPTIMIZER_SHARDING, PRESETS, REMAT_STRATEGIES, SP_MODES,
                                load_model_config, parse_bytes)
from autosp.plan_result import MemoryPrediction, PlanResult, StrategyPlan
from autosp.plan_trace import TracedStep, trace_step

__all__ = [
    "PRESETS",
    "REMAT_STRATEGIES",
    "MemoryPrediction",
    "PlanResult",
    "StrategyPlan",
    "TracedStep",
    "load_model_config",
    "main",
    "parse_bytes",
    "plan",
    "trace_step",
]
_STRATEGY_ENUM = {
    "none": "NONE",
    "default": "DEFAULT",
    "sequence-aware": "SEQUENCE_AWARE",
    "full": "FULL_CHECKPOINT",
}

# --------------------------------------------------------------------------------------------
# Planning


def _core_options(remat: str, dtype: str, num_params: int, shards: int,
                  param_shards: int = 1, offload: bool = False) -> Any:
    options = _core.MemoryOptions()
    options.strategy = getattr(_core.RematStrategy, _STRATEGY_ENUM[remat])
    options.offload_layer_outputs = offload
    from autosp.remat import DEFAULT_RECOMPUTE_FLOPS_RATIO

    options.recompute_flops_ratio = DEFAULT_RECOMPUTE_FLOPS_RATIO
    training = _core.TrainingConfig()
    training.num_params = num_params
    training.dtype = _core.DtypePolicy.BF16_MIXED if dtype == "bf16" else _core.DtypePolicy.FP32
    training.optimizer_shards = shards
    training.param_shards = param_shards
    options.training = training
    return options


#: The strategies planned by default beyond every (mode, remat): these with the tiled loss,
#: and these with activation offload (remat=autosp.remat.Offload(...)), with and without it.
TILED_DEFAULTS = (("no-sp", "sequence-aware"), ("ulysses", "sequence-aware"), ("ulysses", "full"))
OFFLOAD_DEFAULTS = (("ulysses", "sequence-aware", False), ("ulysses", "sequence-aware", True))
TILED = "tiled-loss"
OFFLOAD = "offload"


def _parse_strategies(strategies: Sequence[str] | None) -> list[tuple[str, str, bool, bool]]:
    """(mode, remat, tiled loss, offload) per strategy."""
    if strategies is None:
        return ([(mode, r, False, False) for mode in SP_MODES for r in REMAT_STRATEGIES]
                + [(mode, r, True, False) for mode, r in TILED_DEFAULTS]
                + [(mode, r, tile, True) for mode, r, tile in OFFLOAD_DEFAULTS])
    out = []
    for s in strategies:
        parts = s.replace(" ", "").replace("tiledloss", TILED).split("+")
        extras = parts[2:]
        ok = (len(parts) >= 2 and parts[0] in SP_MODES and parts[1] in REMAT_STRATEGIES
              and extras in ([], [TILED], [OFFLOAD], [TILED, OFFLOAD])
              and not (OFFLOAD in extras and parts[1] == "full"))
        if not ok:
            raise AutospError(
                f"[plan] unknown strategy {s!r}; expected '<{'|'.join(SP_MODES)}>+"
                f"<{'|'.join(REMAT_STRATEGIES)}>[+{TILED}][+{OFFLOAD}]', e.g. "
                f"'ulysses+sequence-aware' or 'ulysses+sequence-aware+{TILED}+{OFFLOAD}' "
                f"({OFFLOAD} goes with the solver's policies, not 'full')"
            )
        out.append((parts[0], parts[1], TILED in extras, OFFLOAD in extras))
    return out


def _raise_core(e: Exception) -> None:
    raise AutospError(str(e)) from None


def plan(
    model: str | LlamaConfig,
    *,
    gpus: int = 8,
    gpu_memory: str | int = "80GB",
    sp: int | None = None,
    dtype: str = "bf16",
    batch_size: int = 1,
    optimizer_sharding: str = "dp",
    fsdp: bool = False,
    seq_len: int | None = None,
    seq_multiple: int = 1024,
    max_seq: int = 1 << 22,
    strategies: Sequence[str] | None = None,
    curve_points: int = 24,
    plot: str | Path | None = None,
) -> PlanResult:
    """Predicted peak memory per rank and the longest trainable sequence for each strategy.

    ``model``: a preset (:data:`PRESETS`), a path to a Hugging Face config.json, or a
    LlamaConfig. The mesh is ``gpus = dp x sp``; strategy ``no-sp`` uses all GPUs for data
    parallelism. ``dtype``: ``"bf16"`` (bf16 weights and gradients, fp32 master weights and
    AdamW state) or ``"fp32"``. ``optimizer_sharding``: ZeRO-1 over ``"dp"``, ``"world"`` (all
    GPUs) or ``"none"``. ``fsdp``: parameters, gradients and optimizer state sharded over all
    GPUs (``autosp.fully_shard``, ZeRO-3; ``optimizer_sharding`` is then moot): each layer's
    parameters are gathered where they are used. ``seq_len``: where to report the peak and breakdown (default: the
    longest S of ``ulysses + sequence-aware``). With ``plot``, writes a PNG of predicted peak
    against S per strategy with the budget line.
    """
    name, config = load_model_config(model)
    for label, v in (("gpus", gpus), ("batch_size", batch_size), ("seq_multiple", seq_multiple)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise AutospError(f"[plan] found {label}={v!r}; expected a positive integer")
    sp = gpus if sp is None else sp
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise AutospError(f"[plan] found sp={sp!r}; expected a positive integer")
    if gpus % sp != 0:
        raise AutospError(
            f"[plan] found {gpus} GPUs not divisible by sp={sp}; expected gpus = dp x sp "
            f"(e.g. --gpus {sp * max(1, gpus // sp)})"
        )
    if dtype not in DTYPES:
        raise AutospError(f"[plan] found dtype={dtype!r}; expected one of {DTYPES}")
    if optimizer_sharding not in OPTIMIZER_SHARDING:
        raise AutospError(
            f"[plan] found optimizer_sharding={optimizer_sharding!r}; expected one of "
            f"{OPTIMIZER_SHARDING}"
        )
    budget = parse_bytes(gpu_memory)
    chosen = _parse_strategies(strategies)
    if plot is not None:
        _matplotlib()  # before the trace: a missing plotting library fails in a second
    multiple = seq_multiple * sp // math.gcd(seq_multiple, sp)
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise AutospError(f"[plan] found seq_len={seq_len!r}; expected a positive integer")

    results: list[tuple[str, str, bool, bool, int, int, Any, Any]] = []
    traces: dict[tuple[int, bool], TracedStep] = {}
    num_params = 0
    for mode, remat, tile, offload in chosen:
        p = sp if mode == "ulysses" else 1
        dp = gpus // p
        if (p, tile) not in traces:
            traces[(p, tile)] = trace_step(config, sp_size=p, dtype=dtype, batch_size=batch_size,
                                           tile_loss=tile)
        traced = traces[(p, tile)]
        num_params = traced.num_params
        shards = {"none": 1, "dp": dp, "world": gpus}[optimizer_sharding]
        options = _core_options(remat, dtype, traced.num_params, shards,
                                param_shards=gpus if fsdp else 1, offload=offload)
        query = _core.TrainabilityQuery()
        query.budget_bytes = budget
        query.seq_multiple = multiple
        query.max_seq = max(max_seq, multiple)
        try:
            found = _core.longest_trainable_seq(traced.graph, options, query)
        except ValueError as e:
            _raise_core(e)
        results.append((mode, remat, tile, offload, p, dp, found, (traced, options)))

    if seq_len is None:
        pick = [r for r in results
                if r[0] == "ulysses" and r[1] == "sequence-aware" and not r[2] and not r[3]] \
            or results
        seq_len = max(r[6].longest_seq for r in pick) or multiple
    top = max([r[6].longest_seq for r in results] + [seq_len, multiple])
    grid = sorted({max(multiple, (top * 5 // 4 * k // curve_points) // multiple * multiple)
                   for k in range(1, curve_points + 1)})

    plans = []
    for mode, remat, tile, offload, p, dp, found, (traced, options) in results:
        at_seq = None
        if seq_len % p == 0:
            at_seq = MemoryPrediction.from_core(
                _core.simulate_peak_memory(traced.graph, seq_len, options))
        curve = tuple(
            (s, _core.simulate_peak_memory(traced.graph, s, options).peak) for s in grid
        )
        plans.append(StrategyPlan(
            name=f"{mode} + {remat}" + (" + tiled loss" if tile else "")
            + (" + offload" if offload else ""), sp_mode=mode,
            remat=remat, tile_loss=tile, offload=offload, sp_size=p, dp_size=dp,
            longest_seq=found.longest_seq, capped=found.capped,
            at_longest=MemoryPrediction.from_core(found.at_longest) if found.longest_seq else None,
            at_seq=at_seq, curve=curve,
        ))
    result = PlanResult(
        model=name, config=config, gpus=gpus, sp=sp, gpu_memory=budget, dtype=dtype,
        batch_size=batch_size, optimizer_sharding=optimizer_sharding, seq_multiple=multiple,
        seq_len=seq_len, strategies=tuple(plans), num_params=num_params,
        trace_seconds=sum(t.seconds for t in traces.values()), plot=None, fsdp=fsdp,
    )
    if plot is not None:
        write_plot(result, plot)
        result = PlanResult(**{**result.__dict__, "plot": str(plot)})
    return result


def _matplotlib() -> Any:
    """matplotlib.pyplot on the Agg backend, or an AutospError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AutospError(
            "[plan] writing a plot needs matplotlib, an autosp dependency; expected it "
            "installed (pip install matplotlib), or pass --no-plot"
        ) from None
    return plt


def write_plot(result: PlanResult, path: str | Path) -> None:
    """A PNG of predicted peak memory per rank against S, one line per strategy, with the
    budget line."""
    plt = _matplotlib()
    gib = float(1 << 30)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for s in result.strategies:
        xs = [x / 1024 for x, _ in s.curve]
        ys = [y / gib for _, y in s.curve]
        style = "-" if s.sp_mode == "ulysses" else "--"
        ax.plot(xs, ys, style, marker=".", label=f"{s.name} (longest {s.longest_seq // 1024}k)")
    ax.axhline(result.gpu_memory / gib, color="black", linewidth=1.5,
               label=f"budget {result.gpu_memory / gib:.0f} GiB")
    ax.set_xlabel("sequence length S (k tokens)")
    ax.set_ylabel("predicted peak memory per rank (GiB)")
    ax.set_title(f"{result.model}: {result.gpus} GPUs, sp={result.sp}, {result.dtype} "
                 f"(prediction)")
    top = max(result.gpu_memory / gib * 1.6, 1.0)
    ax.set_ylim(0, top)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autosp plan",
        description=("Predict peak memory per rank and the longest trainable sequence length for "
                     "each strategy (no SP / Ulysses SP x remat none / default / sequence-aware / "
                     "full checkpointing). Traces the model on fake tensors: no weights, no GPU."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(PRESETS)}) or path to a Hugging Face config.json")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the mesh (dp x sp)")
    p.add_argument("--gpu-memory", default="80GB", help="memory per GPU (GB = GiB)")
    p.add_argument("--sp", type=int, default=None, help="SP degree (default: --gpus)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="bf16: bf16 weights/grads + fp32 master weights and AdamW state; fp32")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per SP group per step")
    p.add_argument("--optimizer-sharding", choices=OPTIMIZER_SHARDING, default="dp",
                   help="ZeRO-1: shard optimizer state over dp, all GPUs, or not at all")
    p.add_argument("--fsdp", action="store_true",
                   help="ZeRO-3 (autosp.fully_shard): parameters, gradients and optimizer state "
                        "sharded over all GPUs")
    p.add_argument("--seq-len", type=int, default=None,
                   help="report peak and breakdown at this S (default: longest S of "
                        "ulysses + sequence-aware)")
    p.add_argument("--seq-multiple", type=int, default=1024,
                   help="search S over multiples of this (and of sp)")
    p.add_argument("--max-seq", type=int, default=1 << 22, help="search no further than this")
    p.add_argument("--strategies", default=None,
                   help="comma-separated, e.g. 'ulysses+none,ulysses+sequence-aware,"
                        "ulysses+full+tiled-loss' (+tiled-loss: autosp.compile(tile_loss=True))")
    p.add_argument("--plot", default=None,
                   help="PNG to write (default: autosp-plan-<model>.png)")
    p.add_argument("--no-plot", action="store_true", help="do not write a plot")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``autosp plan ...``; returns the exit status."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    strategies = args.strategies.split(",") if args.strategies else None
    plot_path = None
    if not args.no_plot:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(str(args.model)).stem.lower())
        plot_path = args.plot or f"autosp-plan-{stem}.png"
    try:
        result = plan(
            args.model, gpus=args.gpus, gpu_memory=args.gpu_memory, sp=args.sp,
            dtype=args.dtype, batch_size=args.batch_size,
            optimizer_sharding=args.optimizer_sharding, fsdp=args.fsdp, seq_len=args.seq_len,
            seq_multiple=args.seq_multiple, max_seq=args.max_seq, strategies=strategies,
            plot=plot_path,
        )
    except AutospError as e:
        print(f"autosp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.table())
        if result.plot:
            print(f"plot: {result.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
