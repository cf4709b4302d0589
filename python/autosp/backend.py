"""The Dynamo backend: FX graph -> core IR -> Ulysses plan -> rewritten FX -> AOTAutograd.

Each stage's output is kept on the backend object (``last``), so a user can see what
the compiler did: the core graph, the plan with every value's placement, and the FX
graph each rank runs.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from autosp import _core
from autosp.apply import RankContext, apply_plan
from autosp.bridge import fx_to_core
from autosp.decompose import decompose_composites
from autosp.dynamo_regions import RegionReuseError, inline_regions
from autosp.compile_cache import load_admissions, save_admissions
from autosp.errors import AutospError, AutospGatherWarning, stage
from autosp.outline import outline_by_admissions
from autosp.remat_policy import AUTO, BACKENDS, INDUCTOR, MemoryBudget, Offload  # names defined once
from autosp.remat_regions import RegionAdmissions
from autosp.specialize import PerShapeCompiled, Retemplate


class CompileRefused(Exception):
    """Raised by a backend whose ``refuse_compiles`` is set, before anything is compiled (the
    static compile of ``autosp.compile(dynamic=None)`` after its switch: a call that its static
    graphs no longer serve takes the symbolic graph instead; autosp.sp_module)."""


@dataclass
class Stage:
    name: str
    text: str
    seconds: float


@dataclass
class CompileRecord:
    """What one compilation did, stage by stage."""

    stages: list[Stage] = field(default_factory=list)
    collective_counts: dict[str, int] = field(default_factory=dict)
    graph_module: fx.GraphModule | None = None  # what this rank runs, before AOTAutograd
    example_inputs: list[Any] = field(default_factory=list)  # graph_module's inputs at compile time
    # Ops run on the all-gathered sequence (no sequence-parallel form for their sharded
    # inputs): for each, the error the plan would have stopped with.
    gathered: list[str] = field(default_factory=list)
    # Attention calls whose [S, S] mask is computed one tile of query rows at a time
    # (autosp.tiled_attention), each as its source location.
    tiled_masks: list[str] = field(default_factory=list)
    # Composite Torch functions taken apart into ATen ops before the plan (autosp.decompose),
    # by name, in program order.
    decomposed: list[str] = field(default_factory=list)
    # With tile_loss: per cross-entropy, "tiled: ..." or "not tiled: <why>" (autosp.tiled_loss).
    loss_tiling: list[str] = field(default_factory=list)
    # With tile_mlp: per row-wise block, "tiled: ..." or "not tiled: <why>" (autosp.tiled_rows).
    mlp_tiling: list[str] = field(default_factory=list)
    # With dynamic=False: the graph compiled per input shape (autosp.specialize), else None.
    per_shape: Any = None
    # With regions=True: per decoder layer, the subgraph it calls or why it stays inline
    # (autosp.outline).
    outlined: list[str] = field(default_factory=list)
    # Calls of layers Dynamo traced once and stamped out (regions=True; autosp.dynamo_regions),
    # inlined back before the bridge.
    traced_once: int = 0

    def stage(self, name: str) -> str:
        for s in self.stages:
            if s.name == name:
                return s.text
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")


def gather_warning(gathered: list[str]) -> str:
    """The warning for ops run on the all-gathered sequence (SpConfig.gather_unsupported)."""
    shown = "\n".join(f"  - {reason}" for reason in gathered[:5])
    more = f"\n  ... and {len(gathered) - 5} more" if len(gathered) > 5 else ""
    return (
        f"[autosp:ulysses] {len(gathered)} op(s) have no sequence-parallel form for their "
        "sequence-sharded inputs; autosp all-gathers those inputs and runs these ops, and what "
        "is computed from their results alone, on the full sequence on every rank. The result is "
        "exact, but those activations are not split across ranks and that work is repeated on "
        "each. Pass unsupported=\"error\" to autosp.compile to stop at them instead.\n"
        f"{shown}{more}"
    )


def eager_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """The ``aot_eager`` compiler for AOTAutograd's forward and backward graphs: runs them
    eagerly, with each ``aten.view`` a ``reshape``.

    AOTAutograd traces with symbolic sizes, and for some layouts its fake tensors decide
    strides differently from the eager kernels at run time: a ``cat`` of gradients whose
    strides look channels-last is traced contiguous but returns channels-last, and a later
    ``view`` fails (seen in the backward of gated-DeltaNet models, also under plain
    ``torch.compile`` with a dynamic length). These graphs are functional, so a ``reshape``
    (a view where the strides allow, a copy otherwise) computes the same values."""
    from torch._dynamo.backends.debugging import boxed_nop

    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    return boxed_nop(gm, example_inputs)


# A graph outlined again by its layers' admissions carries them, and where they are kept
# (autosp.compile_cache), in its meta.
_ADMISSIONS, _ADMISSIONS_KEY = "autosp_admissions", "autosp_admissions_key"


def admissions_key(gm: fx.GraphModule, remat: Any) -> str:
    """Where the admissions each region call of ``gm`` needs are kept (autosp.compile_cache)."""
    from autosp.compile_cache import report_key
    from autosp.remat import DEFAULT_RECOMPUTE_FLOPS_RATIO, _cache_key

    return report_key(gm, _cache_key(remat, DEFAULT_RECOMPUTE_FLOPS_RATIO) + torch.__version__)


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any], *, remat: Any, backend: str,
                  report: Any = None) -> Callable:
    """AOTAutograd over ``gm`` with autosp's remat partitioner, then Inductor or eager."""
    from autosp.remat import compile_joint

    return compile_joint(gm, example_inputs, policy=remat, backend=backend, report=report)


class SequenceParallelBackend:
    """A torch.compile backend that makes one rank's part of Ulysses SP training.

    ``torch.compile(model, backend=SequenceParallelBackend(...), fullgraph=True)``; mark
    the inputs' sequence dim dynamic (autosp.compile does both for you).
    """

    def __init__(self, *, rank: int, world: int, group: str, seq_dim: int = 1,
                 remat: Any = "sequence-aware", backend: str = "inductor", fuse_qkv: bool = True,
                 remat_report: Any = None, gather_outputs: bool = True,
                 gather_unsupported: bool = True, tile_loss: bool = False,
                 tile_mlp: bool = False, loss_chunks: int = 0, dynamic: bool = True,
                 regions: bool | str = False) -> None:
        if backend not in BACKENDS:
            raise AutospError(f"[autosp:compile] found backend={backend!r}; expected one of {BACKENDS}.")
        self.ctx = RankContext(rank=rank, world=world, group=group)
        self.seq_dim = seq_dim
        self.remat = remat
        self.backend = backend
        self.fuse_qkv = fuse_qkv
        self.gather_outputs = gather_outputs
        self.gather_unsupported = gather_unsupported
        self.tile_loss = tile_loss
        self.tile_mlp = tile_mlp
        self.loss_chunks = loss_chunks
        self.dynamic = dynamic
        self.regions = regions
        self.remat_report = remat_report
        self.records: list[CompileRecord] = []
        # With layers marked for Dynamo to trace once: which one is no longer alike the others
        # (autosp.dynamo_regions.marked_apart), asked before each compile; set by the module.
        self.layers_apart: Callable[[], str | None] | None = None
        self.refuse_compiles = False  # set by the module around calls that must not compile

    @property
    def last(self) -> CompileRecord:
        if not self.records:
            raise RuntimeError("nothing has been compiled yet: call the compiled module first")
        return self.records[-1]

    def _dump(self, rec: CompileRecord) -> None:
        """With AUTOSP_DUMP_DIR set, write every stage to
        ``$AUTOSP_DUMP_DIR/rank<r>-<n>-<stage>.txt``."""
        out = os.environ.get("AUTOSP_DUMP_DIR")
        if not out:
            return
        os.makedirs(out, exist_ok=True)
        n = len(self.records) - 1
        for st in rec.stages:
            path = os.path.join(out, f"rank{self.ctx.rank}-{n}-{st.name}.txt")
            with open(path, "w") as f:
                f.write(st.text)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        """Compile one Dynamo graph. Raises only AutospError: a problem with the model is
        reported as such; any other exception from autosp's own stages (bridge, plan,
        apply, compile) becomes an internal-error AutospError chained to it."""
        if self.refuse_compiles:
            raise CompileRefused()
        if not isinstance(self.remat, (str, MemoryBudget, Offload)) or self.remat == AUTO:
            raise AutospError(f"[autosp:compile] found remat={self.remat!r} at compile time; "
                              "expected a policy name, a MemoryBudget or an Offload (remat="
                              "'auto' is resolved by autosp.compile's module at its first call)")
        rec = CompileRecord()
        self.records.append(rec)
        pristine: fx.GraphModule | None = None
        t0 = time.perf_counter()
        rec.stages.append(Stage("dynamo", gm.print_readable(print_output=False), 0.0))
        try:  # dump what was produced, also when a stage fails (AUTOSP_DUMP_DIR)
            with stage("inline"):  # layers Dynamo traced once (autosp.dynamo_regions)
                if self.layers_apart is not None and (why := self.layers_apart()):
                    raise RegionReuseError(why)
                rec.traced_once = inline_regions(gm)
            with stage("decompose"):
                rec.decomposed = decompose_composites(gm)
                if rec.decomposed:
                    rec.stages.append(Stage("decomposed", gm.print_readable(print_output=False),
                                            time.perf_counter() - t0))
            with stage("bridge"):
                bridge = fx_to_core(gm, list(example_inputs), self.seq_dim)
                t1 = time.perf_counter()
                rec.stages.append(Stage("core", str(bridge.graph), t1 - t0))
            with stage("plan"):
                cfg = _core.SpConfig()
                cfg.sp_size = self.ctx.world
                cfg.fuse_qkv = self.fuse_qkv
                cfg.gather_outputs = self.gather_outputs
                cfg.gather_unsupported = self.gather_unsupported
                cfg.tile_loss = self.tile_loss
                cfg.tile_mlp = self.tile_mlp
                cfg.loss_chunks = self.loss_chunks
                try:
                    plan = _core.plan_ulysses(bridge.graph, cfg)
                except _core.PlanError as e:
                    raise AutospError(str(e)) from None
                t2 = time.perf_counter()
                rec.stages.append(Stage("ulysses", str(plan), t2 - t1))
                rec.stages.append(Stage("placements", _core.print_placements(bridge.graph, plan), 0.0))
                rec.collective_counts = dict(plan.collective_counts())
                rec.gathered = list(plan.gathered)
                rec.loss_tiling = list(plan.loss_tiling)
                rec.mlp_tiling = list(plan.mlp_tiling)
                rec.tiled_masks = [str(n.loc) for n in plan.graph.nodes if "mask_tiles" in n.attrs]
                if rec.gathered:
                    warnings.warn(gather_warning(rec.gathered), AutospGatherWarning, stacklevel=2)
            with stage("apply"):
                ctx = self.ctx if self.dynamic else dataclasses.replace(self.ctx, rank_input=True)
                new_gm = apply_plan(gm, bridge, plan, ctx)
                rec.graph_module = new_gm
                rec.example_inputs = list(example_inputs) + ([self.ctx.rank] if ctx.rank_input else [])
                rec.stages.append(Stage("applied", new_gm.print_readable(print_output=False),
                                        time.perf_counter() - t2))
            if self.regions:
                with stage("outline"):
                    from autosp.outline import outline_layers, whole_graph_policy

                    why_flat = whole_graph_policy(self.remat)
                    if not why_flat and self.remat == "sequence-aware":
                        # kept to outline again by each layer's admissions (remat_regions)
                        pristine = fx.GraphModule(new_gm, copy.deepcopy(new_gm.graph))
                        pristine.meta = dict(new_gm.meta)
                    rec.outlined = [why_flat] if why_flat else outline_layers(new_gm)
                    first_outline = (rec.outlined, new_gm)
                    if not why_flat:
                        rec.stages.append(Stage("outlined", new_gm.print_readable(
                            print_output=False), 0.0))
        finally:
            self._dump(rec)
        def compile_fn(gm: fx.GraphModule, inputs: list[Any]) -> Callable:
            report = self.remat_report
            before = len(report.graphs) if report is not None else 0

            def outlined_again(admissions: dict[str, tuple[bool, ...]], key: str) -> Callable:
                # Layers need other sequence-aware admissions than their region's: outline again
                # by them (autosp.remat_regions) and compile that graph.
                again, rec.outlined = outline_by_admissions(pristine, admissions)
                again.meta.update({_ADMISSIONS: admissions, _ADMISSIONS_KEY: key})
                rec.graph_module = again
                rec.stages.append(Stage("outlined", again.print_readable(print_output=False), 0.0))
                if not self.dynamic:  # autosp.specialize compiles this shape from it
                    raise Retemplate(again)
                return compile_fn(again, inputs)

            with stage("compile"):
                if pristine is None:
                    return compile_graph(gm, inputs, remat=self.remat, backend=self.backend,
                                         report=report)
                given = gm.meta.get(_ADMISSIONS)  # None: the first outline
                if given is None:  # another shape may have been outlined again before
                    rec.outlined, rec.graph_module = first_outline
                key = gm.meta.get(_ADMISSIONS_KEY) or admissions_key(gm, self.remat)
                if given is None and (known := load_admissions(key)) is not None:
                    return outlined_again(known, key)  # what an earlier process found
                try:
                    return compile_graph(gm, inputs, remat=self.remat, backend=self.backend,
                                         report=report)
                except RegionAdmissions as r:
                    found = {**(given or {}), **r.per_layer}
                    if found == given:  # each attempt must change some layer's admissions
                        raise
                    if report is not None:
                        del report.graphs[before:]
                    save_admissions(key, found)
                    return outlined_again(found, key)

        if self.dynamic:
            return compile_fn(new_gm, list(example_inputs))
        # Planned with S symbolic; compiled with each call's static shapes (autosp.specialize).
        # The rank is an input of the graph, so that the ranks of a group compile one graph.
        rec.per_shape = PerShapeCompiled(new_gm, compile_fn, rank=self.ctx.rank,
                                         share=self.backend == INDUCTOR,
                                         last=self.ctx.rank == self.ctx.world - 1)
        return rec.per_shape
