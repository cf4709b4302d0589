"""Sequence-aware activation checkpointing: autosp's AOTAutograd partitioner.

AOTAutograd traces one training step into a joint forward+backward graph and asks a
*partition function* to split it into a forward graph (which also returns the values the
backward needs, the "saved" activations) and a backward graph (which may recompute forward
values from what was saved). This module is that partition function. It gathers the facts of
the joint graph -- every value's size in bytes at the actual sequence length, each op's FLOPs
and kind, which nodes belong to the forward and the backward -- and hands them to the C++
solver (``autosp._core.solve_remat``, csrc/plan/remat.h), which builds PyTorch's min-cut flow
network and decides the saved set. Python then builds the forward and backward graphs from
that set with PyTorch's own ``_extract_fwd_bwd_modules``.

Policies (``policy=``):

``"none"``
    Save what the backward reads; recompute nothing.
``"default"``
    PyTorch's partitioner behaviour (its allowlist, so matmuls are never recomputed, and its
    heuristics), solved by autosp's C++ min-cut. The baseline.
``"sequence-aware"`` (autosp.compile's default)
    Attention, collectives and random ops are never recomputed. Cheap ops (PyTorch's
    allowlist) may be. Matmuls may be recomputed while their summed forward FLOPs stay within
    ``recompute_flops_ratio`` times the step's attention FLOPs (forward plus backward attention
    of the graph, from the shapes at the real sequence length): as S grows, attention's
    O(S^2) cost dwarfs the projections' O(S), so recomputing them costs little time and saves
    their activations.
``MemoryBudget(bytes=...)`` / ``MemoryBudget(fraction=...)``
    Sequence-aware bans, but instead of the FLOP ratio: the fewest matmul recomputations (in
    cost-model order) whose saved bytes fit the budget, or an :class:`AutospError` if even
    recomputing every allowed matmul does not fit.
``Offload(policy)``
    ``policy`` (a name or a MemoryBudget), with the hidden states that decoder layers hand to
    each other kept in host memory between the forward and the backward (see
    :class:`autosp.remat_policy.Offload`).
``"auto"`` / ``Auto(memory=..., host_memory=...)`` (``autosp.compile`` only)
    At the first call, the combination of the policies above, the tiled loss, the tiled MLP
    and offload with the least predicted step-time overhead whose predicted peak fits the
    device (see :class:`autosp.remat_policy.Auto` and autosp.remat_auto).

Use it with plain ``torch.compile`` (no sequence parallelism)::

    model = torch.compile(model, backend=autosp.remat.backend("sequence-aware"))

and ask what it did::

    report = autosp.remat.RematReport()
    model = torch.compile(model, backend=autosp.remat.backend(report=report))
    model(x).sum().backward()
    print(report)          # per layer: saved and recomputed values, bytes and FLOPs

Modules: ``autosp.remat_policy`` (policies, MemoryBudget, reports, the solver's options),
``autosp.remat_facts`` and ``autosp.remat_flops`` (facts about the joint graph),
``autosp.remat_partition`` (the partition function; ``autosp.remat_graphs`` and
``autosp.remat_extract`` build its graphs as PyTorch's helpers would, without their copies, and
``autosp.remat_offload`` applies ``Offload``), and
this one (the partitioner in Inductor's hook, and the backend).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from autosp import shared_compile
from autosp.compile_cache import load_reports, marked_cacheable, report_key, save_reports, source_hash
from autosp.errors import AutospError
from autosp.remat_facts import gather_facts
from autosp.remat_flops import SizeFn, node_flops
from autosp.remat_partition import make_partition_fn
from autosp.remat_policy import (AOT_EAGER, AUTO, BACKENDS, DEFAULT_RECOMPUTE_FLOPS_RATIO, POLICIES, Auto,
                                 GraphRematReport, MemoryBudget, Offload, RematPolicy, RematReport,
                                 _core_options)

__all__ = [
    "AUTO",
    "Auto",
    "DEFAULT_RECOMPUTE_FLOPS_RATIO",
    "POLICIES",
    "GraphRematReport",
    "MemoryBudget",
    "Offload",
    "RematPolicy",
    "RematReport",
    "SizeFn",
    "backend",
    "compile_joint",
    "gather_facts",
    "make_partition_fn",
    "node_flops",
]


# --------------------------------------------------------------------------------------------
# The partitioner in Inductor's hook, and the backend


def _cache_key(policy: RematPolicy, recompute_flops_ratio: float) -> str:
    h = hashlib.sha256(source_hash().encode())
    # A budget by its exact value (its display name rounds the fraction).
    h.update(repr((policy if isinstance(policy, (MemoryBudget, Offload)) else str(policy),
                   float(recompute_flops_ratio))).encode())
    return h.hexdigest()


def _custom_partitioner_base() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


class AutospRematPartitioner(_custom_partitioner_base()):  # type: ignore[misc]
    """autosp's partition function in Inductor's ``custom_partitioner_fn`` hook. Inductor
    pickles its config into cache keys, so this pickles as (policy, ratio) -- a report is a
    per-run side channel, not part of the identity."""

    def __init__(
        self,
        policy: RematPolicy,
        recompute_flops_ratio: float,
        report: RematReport | None = None,
        partition_fn: Callable | None = None,
    ) -> None:
        self.policy = policy
        self.recompute_flops_ratio = recompute_flops_ratio
        self.report = report
        self.partition_fn = partition_fn or make_partition_fn(
            policy, recompute_flops_ratio=recompute_flops_ratio, report=report
        )

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        kwargs.pop("compiler", None)
        return self.partition_fn(gm, joint_inputs, **kwargs)

    def uuid(self) -> Any:
        return _cache_key(self.policy, self.recompute_flops_ratio)

    def __reduce__(self) -> tuple[Any, ...]:
        return (AutospRematPartitioner, (self.policy, self.recompute_flops_ratio))

    # Config snapshots copy their values; a copy must keep the same partition function and
    # report, not be rebuilt from __reduce__.
    def __copy__(self) -> "AutospRematPartitioner":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "AutospRematPartitioner":
        return self


@contextlib.contextmanager
def symbolic_trace_uncached(example_inputs: Sequence[Any]) -> Any:
    """PyTorch's fake-tensor cache off while AOTAutograd traces a graph whose sizes are
    symbolic, for the aot_eager backend and for the planner's trace (autosp.plan_trace).

    Tracing the joint graph of a symbolic S, the cache costs more than it saves: each miss
    builds an entry by synthesizing its output again (symbolic size and stride arithmetic),
    and about half the lookups miss. Off, the first call of the 2-layer Llama under aot_eager
    took 6.5-7.0 s against 7.0-8.2 s (docs/compile_time.md, "A symbolic S's trace"). With static
    sizes the cache pays, and under Inductor its later passes hit it thousands of times, so
    both keep it. The cache only saves work: what is traced is the same either way.
    """
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(list(example_inputs))
    # The rank is not a size: a static compile the ranks share takes it as a SymInt input
    # (autosp.shared_compile.rank_symbol), and its trace keeps the cache, which pays there.
    symbolic = mode is not None and any(
        (isinstance(x, torch.SymInt) and not shared_compile.is_rank_symbol(x))
        or (isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape))
        for x in example_inputs)
    if not symbolic:
        yield
        return
    was = mode.cache_enabled
    mode.cache_enabled = False
    try:
        yield
    finally:
        mode.cache_enabled = was


def compile_joint(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    policy: RematPolicy = "sequence-aware",
    backend: str = "inductor",
    recompute_flops_ratio: float = DEFAULT_RECOMPUTE_FLOPS_RATIO,
    report: RematReport | None = None,
) -> Callable:
    """What a Dynamo backend returns for ``gm``: AOTAutograd over it with autosp's partition
    function, then Inductor (``backend="inductor"``, through Inductor's
    ``custom_partitioner_fn`` hook, so Inductor's joint-graph passes still run first) or eager
    execution of the forward and backward graphs (``backend="aot_eager"``).

    PyTorch's AOTAutograd and FX graph caches take these graphs (autosp.compile_cache). A
    ``report`` gets the partition's report also on a cache hit: the one saved beside the cache
    when the partition was made (a warning where there is none).
    """
    if backend not in BACKENDS:
        raise AutospError(
            f"[remat] unknown backend {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}"
        )
    partition_fn = make_partition_fn(
        policy, recompute_flops_ratio=recompute_flops_ratio, report=report
    )
    from autosp.outline import regions_known_pure

    if backend == AOT_EAGER:
        from torch._dynamo.backends.common import aot_autograd

        from autosp.backend import eager_graph

        with regions_known_pure(gm), symbolic_trace_uncached(example_inputs):
            return aot_autograd(
                fw_compiler=eager_graph,
                bw_compiler=eager_graph,
                partition_fn=partition_fn,
                keep_inference_input_mutations=True,
            )(gm, example_inputs)

    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # Inductor's supported hook (torch >= 2.9): compile_fx runs its joint-graph passes, then
    # calls this partitioner instead of min_cut_rematerialization_partition.
    partitioner = AutospRematPartitioner(
        policy, recompute_flops_ratio, report=report, partition_fn=partition_fn
    )
    # autosp's SP functions in the graph get a key (autosp.compile_cache), so that AOTAutograd's
    # cache takes the graph rather than bypassing it. The key is autosp's source hash, and it
    # goes in compile_fx's config_patches, which reach the forward's and the backward's
    # Inductor compiles: their FX graph cache keys then change with autosp's code. Without it,
    # how autosp has Inductor compile a graph (the settings below) is not in those keys, and a
    # cache filled by an older autosp served its compiled code (measured: the donated-buffer
    # bug below came back from a cache filled before its fix).
    cacheable = marked_cacheable()
    # A report is filled when the partitioner runs, which a cache hit skips: it is then read
    # back from beside the cache (autosp.compile_cache), where the partition that made the
    # cache entry saved it. (A graph module cannot be compiled a second time to make a missing
    # report: AOTAutograd's first compile changes it.)
    import torch

    training = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
    key = (report_key(gm, partitioner.uuid(), example_inputs)
           if report is not None and training else None)
    # With regions (autosp.outline), Inductor's reuse of a dead buffer's memory for a new one
    # gave wrong gradients to every layer but the last (measured: torch 2.13, CPU; remat none or
    # sequence-aware, tiled loss or not): the values a region returns for its backward may
    # share storage with what the calling graph sees die. Off for a graph with regions, in the
    # forward and in the backward, which AOTAutograd compiles at the first backward, outside
    # this call: compile_fx's config_patches also patch that compile (a patch around this call
    # alone left the backward reusing buffers: a Hugging Face Llama whose layer 0 stays inline
    # got layer 0's and the embedding's gradients 50-110% off). Each buffer is still freed
    # when it dies. Nor does the calling graph write in place into a buffer it sees die
    # (inplace_buffers, a separate switch): a region whose backward reads its input returns
    # that input as a saved value, the caller's own buffer, and Inductor takes a region's
    # outputs to alias none of its operands, so `x = x0 + layers(x0)` or a sum of the layers'
    # outputs was written over a layer's saved input (embedding and layer 0 gradients 35-280%
    # off, loss exact; breaker helper-46, tests/test_regions_inductor_aliasing_breakers.py).
    #
    # And no donated buffers with regions (an independent fault: the test above fails with
    # buffer reuse on and donation off, and the one below with reuse off and donation on):
    # Inductor lowers a region's backward subgraph with the
    # calling backward's donated-input positions (GraphLowering reads bw_donated_idxs from the
    # tracing context, and a subgraph's lowering reads the caller's), so the subgraph's input at
    # a donated position, its tangent for one, was overwritten in place while the calling graph
    # still read it (measured, torch 2.13, CPU: a skip connection around three outlined layers
    # got the embedding's gradient 32% off; breaker helper-44). AOTAutograd decides donation
    # when it compiles the forward, inside this call.
    from torch._functorch import config as functorch_config

    outlined = any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)
    no_donation = functorch_config.patch(donated_buffer=False) if outlined else \
        contextlib.nullcontext()
    patches: dict[str, Any] = {"unsafe_marked_cacheable_functions": cacheable}
    if outlined:
        patches["allow_buffer_reuse"] = False
        patches["inplace_buffers"] = False
    with inductor_config.patch(custom_partitioner_fn=partitioner), regions_known_pure(gm), \
            no_donation:
        before = len(report.graphs) if report is not None else 0
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    if key is None:
        return compiled
    if len(report.graphs) > before:
        save_reports(key, report.graphs[before:])
    elif (stored := load_reports(key)) is not None:
        report.graphs.extend(stored)
    else:
        import warnings

        warnings.warn(
            "[remat] PyTorch's AOTAutograd cache held this compiled graph (a cache hit skips "
            "autosp's partitioner) but not the remat report autosp saves beside it (a cache "
            "filled by a compilation without remat_report, or a report removed): the report stays "
            "without this graph. Clear the cache directory (TORCHINDUCTOR_CACHE_DIR), or set "
            "torch._functorch.config.enable_autograd_cache = False, to have it.", stacklevel=2)
    return compiled


def backend(
    policy: RematPolicy = "sequence-aware",
    backend: str = "inductor",
    **kw: Any,
) -> Callable[[fx.GraphModule, list[Any]], Callable]:
    """A Dynamo backend for plain ``torch.compile`` (no sequence parallelism) that partitions
    with ``policy``: ``torch.compile(model, backend=autosp.remat.backend("sequence-aware"))``.
    Keyword arguments (``recompute_flops_ratio``, ``report``) go to :func:`compile_joint`."""
    _core_options(policy, kw.get("recompute_flops_ratio", DEFAULT_RECOMPUTE_FLOPS_RATIO))
    if backend not in BACKENDS:
        raise AutospError(
            f"[remat] unknown backend {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}"
        )
    compiler_backend = backend

    def autosp_remat_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return compile_joint(gm, example_inputs, policy=policy, backend=compiler_backend, **kw)

    return autosp_remat_backend
