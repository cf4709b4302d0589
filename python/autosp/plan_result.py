"""What ``autosp plan`` returns (autosp.planner): the predicted memory of one step at one S, a
strategy's plan (longest S, the curve), and the whole result with its table."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from autosp.models.llama import LlamaConfig

from autosp import _core

#: Host <-> device bandwidth ``autosp plan`` states offload's transfer time at (bytes per
#: second each way) and the device throughput (FLOPs per second) it weighs those seconds
#: against: the core's cost model (csrc/plan/choose.h).
HOST_BANDWIDTH = _core.CostModel().host_bandwidth
DEVICE_FLOPS = _core.CostModel().device_flops
#: The share of the budget the fewest loss chunks must fit (StrategyPlan.fit_loss_chunks),
#: defined by the core (csrc/plan/choose.h).
LOSS_CHUNKS_HEADROOM = _core.LOSS_CHUNKS_HEADROOM


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes per rank at the peak of one training step at ``seq_len``."""

    seq_len: int
    peak: int
    parameters: int
    gradients: int
    optimizer_state: int
    saved_activations: int
    transient: int
    communication: int
    inputs: int
    phase: str
    peak_node: str
    saved_bytes: int  # the whole saved set (distinct storages), parameters excluded
    # FLOPs per rank of one step: each op once, and what the strategy computes again (remat's
    # recomputed ops, the tiled loss's logits). recompute_overhead is their ratio.
    step_flops: float = 0.0
    recompute_flops: float = 0.0
    # With offload: the saved bytes kept in host memory, copied there and back once per step.
    offloaded_bytes: int = 0
    # Host memory per rank: offloaded_bytes and the offloaded optimizer's state.
    host_bytes: int = 0

    @property
    def recompute_overhead(self) -> float:
        """Recomputed FLOPs over the step's: the step-time cost of the strategy's
        recomputation where compute bounds the step (0.25: about 1.25x the step time)."""
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @staticmethod
    def from_core(b: Any) -> "MemoryPrediction":
        return MemoryPrediction(
            seq_len=b.seq_len, peak=b.peak, parameters=b.parameters, gradients=b.gradients,
            optimizer_state=b.optimizer_state, saved_activations=b.saved_activations,
            transient=b.transient, communication=b.communication, inputs=b.inputs,
            phase=b.phase, peak_node=b.peak_node, saved_bytes=b.saved_bytes,
            step_flops=b.step_flops, recompute_flops=b.recompute_flops,
            offloaded_bytes=b.offloaded_bytes, host_bytes=b.host_bytes,
        )

    def to_core(self) -> Any:
        """This prediction as the core's MemoryBreakdown."""
        b = _core.MemoryBreakdown()
        for name, value in asdict(self).items():
            setattr(b, name, value)
        return b

    @property
    def overhead(self) -> float:
        """Predicted step-time overhead (the core's step_overhead): the recomputed FLOPs over
        the step's, plus the offloaded bytes' time on the host link (HOST_BANDWIDTH) over the
        step's compute time (its FLOPs at DEVICE_FLOPS), counted as if the copies did not
        overlap compute."""
        return _core.step_overhead(self.to_core())

    def offload_seconds(self, bandwidth: float = HOST_BANDWIDTH) -> float:
        """Seconds per step the offloaded bytes spend on the host link at ``bandwidth`` bytes
        per second (to the host and back; on CUDA the copies overlap compute)."""
        cost = _core.CostModel()
        cost.host_bandwidth = bandwidth
        return _core.offload_seconds(self.to_core(), cost)


@dataclass(frozen=True)
class StrategyPlan:
    name: str  # "ulysses + sequence-aware", "ulysses + sequence-aware + tiled loss"
    sp_mode: str  # "no-sp" | "ulysses"
    remat: str
    sp_size: int
    dp_size: int
    longest_seq: int  # 0: does not fit at the smallest S searched
    capped: bool  # the search reached max_seq
    at_longest: MemoryPrediction | None
    at_seq: MemoryPrediction | None  # at PlanResult.seq_len
    curve: tuple[tuple[int, int], ...]  # (S, predicted peak)
    tile_loss: bool = False  # autosp.compile(tile_loss=True)
    tile_mlp: bool = False  # autosp.compile(tile_mlp=True)
    offload: bool = False  # remat=autosp.remat.Offload(...)
    offload_all: bool = False  # remat=autosp.remat.Offload(..., saved="all") (with offload)
    # With the tiled loss: its chunks in the prediction (plan(loss_chunks=...), else the rule
    # ceil(vocab / hidden)), and the fewest whose predicted peak at seq_len fits
    # LOSS_CHUNKS_HEADROOM of gpu_memory (0: none does), the fastest choice for
    # autosp.compile(loss_chunks=...).
    loss_chunks: int = 0
    fit_loss_chunks: int = 0


@dataclass(frozen=True)
class PlanResult:
    model: str
    config: LlamaConfig
    gpus: int
    sp: int
    gpu_memory: int
    dtype: str
    batch_size: int
    optimizer_sharding: str
    seq_multiple: int
    seq_len: int
    strategies: tuple[StrategyPlan, ...]
    num_params: int
    trace_seconds: float
    plot: str | None = None
    fsdp: bool = False
    host_optimizer_bytes: int = 0  # per rank, with offload_optimizer (autosp.OffloadOptimizer)
    host_memory: int = 0  # host memory per rank a strategy may take (plan(host_memory=...)); 0: any

    def strategy(self, name: str) -> StrategyPlan:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(f"no strategy {name!r}; have {[s.name for s in self.strategies]}")

    def cheapest(self) -> StrategyPlan | None:
        """The strategy with the least predicted step-time overhead (MemoryPrediction.overhead)
        whose predicted peak at ``seq_len`` fits ``gpu_memory`` (and its host memory
        ``host_memory``, when set); None when none fits."""
        known = [s for s in self.strategies if s.at_seq is not None]
        i = _core.cheapest_fit([s.at_seq.to_core() for s in known], self.gpu_memory,
                               self.host_memory)
        return known[i] if i >= 0 else None

    def table(self) -> str:
        gib = float(1 << 30)
        width = max([46] + [len(s.name) for s in self.strategies])
        lines = [
            f"autosp plan (prediction): {self.model}, {self.num_params / 1e9:.2f}B parameters, "
            f"{self.gpus} GPUs x {self.gpu_memory / gib:.0f} GiB, dtype {self.dtype}, "
            f"batch {self.batch_size}, " + (
                "parameters, gradients and optimizer state sharded over all GPUs (fsdp)"
                if self.fsdp else
                f"optimizer state in host memory ({self.host_optimizer_bytes / gib:.1f} GiB per "
                "rank, autosp.OffloadOptimizer)" if self.host_optimizer_bytes else
                f"optimizer state sharded over {self.optimizer_sharding}")
            + (f", host memory {self.host_memory / gib:.1f} GiB per rank" if self.host_memory
               else ""),
            f"peak and breakdown at S = {self.seq_len} (GiB per rank): params, grads, optimizer "
            "state, saved activations, transient, communication; recomp: FLOPs computed again "
            "(remat, tiled loss) over the step's; host: GiB offloaded, moved to the host and back "
            f"each step ({HOST_BANDWIDTH / 1e9:.0f} GB/s: seconds on the link)",
            f"{'strategy':<{width}} {'mesh dp x sp':>12} {'longest S':>10} {'peak':>8} "
            f"{'params':>7} {'grads':>7} {'optim':>7} {'saved':>7} {'trans':>7} {'comm':>6} "
            f"{'recomp':>7} {'host':>13}  peak during",
        ]
        for s in self.strategies:
            longest = "none" if s.longest_seq == 0 else (
                f">={s.longest_seq}" if s.capped else str(s.longest_seq))
            b = s.at_seq
            if b is None:
                detail = "   (S not a multiple of this strategy's SP degree)"
            else:
                oom = "*" if b.peak > self.gpu_memory else " "
                host_oom = "*" if self.host_memory and b.host_bytes > self.host_memory else " "
                detail = (
                    f"{b.peak / gib:>7.2f}{oom} {b.parameters / gib:>6.2f} {b.gradients / gib:>7.2f} "
                    f"{b.optimizer_state / gib:>7.2f} {b.saved_activations / gib:>7.2f} "
                    f"{b.transient / gib:>7.2f} {b.communication / gib:>6.2f} "
                    f"{f'+{100 * b.recompute_overhead:.0f}%':>7} "
                    f"{(f'{b.offloaded_bytes / gib:.2f} ({b.offload_seconds(HOST_BANDWIDTH):.2f}s)' if b.offloaded_bytes else '-'):>13}{host_oom}"
                    f"  {b.phase} ({b.peak_node})"
                )
            lines.append(
                f"{s.name:<{width}} {f'{s.dp_size} x {s.sp_size}':>12} {longest:>10} {detail}"
            )
        lines.append("* over the budget (after host: over the host memory, offloaded activations "
                     "and optimizer together). Longest S is searched over multiples of "
                     f"{self.seq_multiple}" + (", and fits both." if self.host_memory else "."))
        best = self.cheapest()
        lines.append(
            f"cheapest that fits at S = {self.seq_len}: " + (
                f"{best.name} (+{100 * best.at_seq.overhead:.0f}% predicted step time: "
                f"recomputation, and offload's copies at {DEVICE_FLOPS / 1e12:.0f} TFLOP/s "
                "if they did not overlap)" if best else "none"))
        if best is not None and best.fit_loss_chunks:
            lines.append(
                f"  its tiled loss fits in {best.fit_loss_chunks} chunks of each rank's tokens "
                f"(predicted above with {best.loss_chunks}): autosp.compile(tile_loss=True, "
                f"loss_chunks={best.fit_loss_chunks}); fewer chunks read the weight fewer times")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = asdict(self.config)
        return d
