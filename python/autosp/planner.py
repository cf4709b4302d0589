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
under Ulysses), the tiled MLP (``+ tiled mlp``: ``tile_mlp=True``) and activation offload
(``+ offload``: ``remat=autosp.remat.Offload(...)``).

Modules, by stage: ``autosp.plan_inputs`` (presets, model configs, byte sizes),
``autosp.plan_trace`` (the trace), ``autosp.plan_memory_graph`` (the joint graph as the core's
MemoryGraph), ``autosp.plan_strategies`` (the strategies' names and core options),
``autosp.plan_result`` (the result and its table), and this one (planning over strategies, the
plot, the CLI).
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
from autosp.plan_inputs import (DTYPES, OPTIMIZER_SHARDING, PRESETS, REMAT_STRATEGIES,
                                load_model_config, parse_bytes)
from autosp.plan_result import LOSS_CHUNKS_HEADROOM, MemoryPrediction, PlanResult, StrategyPlan
from autosp.plan_strategies import TILED, Choice, core_plan_options, parse_strategies
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
# --------------------------------------------------------------------------------------------
# Planning


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
    loss_chunks: int = 0,
    offload_optimizer: bool = False,
    host_memory: str | int | None = None,
    device: str = "cuda",
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
    against S per strategy with the budget line. ``loss_chunks``: chunks per tiled loss, as
    ``autosp.compile(loss_chunks=...)`` (0: ``ceil(vocab / hidden)``); each tiled-loss strategy
    also reports the fewest chunks that fit ``gpu_memory`` at ``seq_len``
    (``StrategyPlan.fit_loss_chunks``: fewer chunks read the weight fewer times).
    ``offload_optimizer``: the master weights and optimizer state in host memory
    (``autosp.OffloadOptimizer``, ZeRO-Offload): each GPU keeps the parameters and gradients.
    ``host_memory``: the host memory per GPU (e.g. "250GB") that offloaded activations and the
    offloaded optimizer may take; the longest S must fit it too (default: no limit).
    ``device``: ``"cuda"`` (GPUs: the attention kernel and scratch a GPU runs, see
    autosp.cuda_kernels) or ``"cpu"`` (``autosp train`` on a CPU).
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
    if not isinstance(offload_optimizer, bool):
        raise AutospError(f"[plan] found offload_optimizer={offload_optimizer!r}; expected True "
                          "or False")
    if offload_optimizer and fsdp:
        raise AutospError("[plan] found offload_optimizer and fsdp together; expected one: "
                          "autosp.OffloadOptimizer keeps the whole optimizer state of one rank in "
                          "host memory, fsdp splits it over the ranks (their combination is not "
                          "built)")
    budget = parse_bytes(gpu_memory)
    host_budget = parse_bytes(host_memory, "host memory") if host_memory is not None else 0
    chosen = parse_strategies(strategies)
    if plot is not None:
        _matplotlib()  # before the trace: a missing plotting library fails in a second
    multiple = seq_multiple * sp // math.gcd(seq_multiple, sp)
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise AutospError(f"[plan] found seq_len={seq_len!r}; expected a positive integer")
    from autosp.tiled_loss import MAX_CHUNKS

    if not isinstance(loss_chunks, int) or isinstance(loss_chunks, bool) \
            or not 0 <= loss_chunks <= MAX_CHUNKS:
        raise AutospError(f"[plan] found loss_chunks={loss_chunks!r}; expected a positive "
                          f"integer up to {MAX_CHUNKS}, or 0 for ceil(vocab / hidden)")
    if loss_chunks and not any(c.tile_loss for c in chosen):
        raise AutospError(f"[plan] found loss_chunks={loss_chunks} and no strategy with the "
                          f"tiled loss; expected a strategy with +{TILED} (the chunks are its)")

    results: list[tuple[Choice, int, int, Any, Any]] = []
    traces: dict[tuple[int, bool, bool], TracedStep] = {}
    num_params = 0
    for c in chosen:
        p = sp if c.mode == "ulysses" else 1
        dp = gpus // p
        if (p, c.tile_loss, c.tile_mlp) not in traces:
            traces[(p, c.tile_loss, c.tile_mlp)] = trace_step(
                config, sp_size=p, dtype=dtype, batch_size=batch_size, tile_loss=c.tile_loss,
                tile_mlp=c.tile_mlp, device=device)
        traced = traces[(p, c.tile_loss, c.tile_mlp)]
        num_params = traced.num_params
        # OffloadOptimizer keeps a rank's whole state on its host: no ZeRO-1 sharding.
        shards = 1 if offload_optimizer else {"none": 1, "dp": dp, "world": gpus}[optimizer_sharding]
        options = core_plan_options(c.remat, dtype, traced.num_params, shards,
                                param_shards=gpus if fsdp else 1, offload=c.offload,
                                offload_all=c.offload_all, loss_chunks=loss_chunks,
                                offload_optimizer=offload_optimizer)
        query = _core.TrainabilityQuery()
        query.budget_bytes = budget
        query.seq_multiple = multiple
        query.max_seq = max(max_seq, multiple)
        query.host_budget_bytes = host_budget
        try:
            found = _core.longest_trainable_seq(traced.graph, options, query)
        except ValueError as e:
            _raise_core(e)
        results.append((c, p, dp, found, (traced, options)))

    if seq_len is None:
        pick = [r for r in results if r[0] == Choice("ulysses", "sequence-aware")] or results
        seq_len = max(r[3].longest_seq for r in pick) or multiple
    top = max([r[3].longest_seq for r in results] + [seq_len, multiple])
    grid = sorted({max(multiple, (top * 5 // 4 * k // curve_points) // multiple * multiple)
                   for k in range(1, curve_points + 1)})

    plans = []
    for c, p, dp, found, (traced, options) in results:
        at_seq, chunks, fit_chunks = None, 0, 0
        if c.tile_loss:
            chunks = loss_chunks or max((n.chunks for n in traced.graph.nodes), default=0)
        if seq_len % p == 0:
            at_seq = MemoryPrediction.from_core(
                _core.simulate_peak_memory(traced.graph, seq_len, options))
            if chunks:
                fit_chunks = _core.fewest_loss_chunks(
                    traced.graph, seq_len, options, int(budget * LOSS_CHUNKS_HEADROOM), chunks)
        curve = tuple(
            (s, _core.simulate_peak_memory(traced.graph, s, options).peak) for s in grid
        )
        plans.append(StrategyPlan(
            name=c.name, sp_mode=c.mode, remat=c.remat, tile_loss=c.tile_loss,
            tile_mlp=c.tile_mlp, offload=c.offload, offload_all=c.offload_all, sp_size=p, dp_size=dp,
            longest_seq=found.longest_seq, capped=found.capped,
            at_longest=MemoryPrediction.from_core(found.at_longest) if found.longest_seq else None,
            at_seq=at_seq, curve=curve, loss_chunks=chunks, fit_loss_chunks=fit_chunks,
        ))
    result = PlanResult(
        model=name, config=config, gpus=gpus, sp=sp, gpu_memory=budget, dtype=dtype,
        batch_size=batch_size, optimizer_sharding=optimizer_sharding, seq_multiple=multiple,
        seq_len=seq_len, strategies=tuple(plans), num_params=num_params,
        trace_seconds=sum(t.seconds for t in traces.values()), plot=None, fsdp=fsdp,
        host_optimizer_bytes=_core.host_optimizer_bytes(options.training) if results else 0,
        host_memory=host_budget,
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
    p.add_argument("--offload-optimizer", action="store_true",
                   help="master weights and optimizer state in host memory, step() on the host "
                        "(autosp.OffloadOptimizer, ZeRO-Offload)")
    p.add_argument("--host-memory", default=None,
                   help="host memory per GPU that offloaded activations and an offloaded "
                        "optimizer may take, e.g. 250GB (default: no limit)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="report peak and breakdown at this S (default: longest S of "
                        "ulysses + sequence-aware)")
    p.add_argument("--seq-multiple", type=int, default=1024,
                   help="search S over multiples of this (and of sp)")
    p.add_argument("--max-seq", type=int, default=1 << 22, help="search no further than this")
    p.add_argument("--strategies", default=None,
                   help="comma-separated, e.g. 'ulysses+none,ulysses+sequence-aware,"
                        "ulysses+full+tiled-loss' (+tiled-loss: autosp.compile(tile_loss=True); "
                        "+tiled-mlp: tile_mlp=True; +offload: remat=Offload(...)), or 'all' "
                        "(every combination)")
    p.add_argument("--loss-chunks", type=int, default=0,
                   help="chunks per tiled loss (autosp.compile(loss_chunks=...); 0: "
                        "ceil(vocab / hidden)); the report also gives the fewest that fit")
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
            plot=plot_path, loss_chunks=args.loss_chunks,
            offload_optimizer=args.offload_optimizer, host_memory=args.host_memory,
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
