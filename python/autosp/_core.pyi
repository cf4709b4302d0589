"""
autosp's C++ core: graph IR, placement analysis, SP plans, remat solver.
"""

from collections.abc import Mapping, Sequence
import enum
from typing import overload


class Dim:
    @staticmethod
    def constant(n: int) -> Dim: ...

    @staticmethod
    def seq(coef: int = 1, power: int = 1, offset: int = 0) -> Dim: ...

    @staticmethod
    def expr(text: str) -> Dim: ...

    @property
    def coef(self) -> int: ...

    @coef.setter
    def coef(self, arg: int, /) -> None: ...

    @property
    def power(self) -> int: ...

    @power.setter
    def power(self, arg: int, /) -> None: ...

    @property
    def opaque(self) -> str: ...

    @opaque.setter
    def opaque(self, arg: str, /) -> None: ...

    @property
    def offset(self) -> int: ...

    @offset.setter
    def offset(self, arg: int, /) -> None: ...

    def __str__(self) -> str: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: Dim, /) -> bool: ...

class ValueKind(enum.Enum):
    Tensor = 0

    Symbol = 1

    Other = 2

class Value:
    def __init__(self) -> None: ...

    @property
    def id(self) -> int: ...

    @id.setter
    def id(self, arg: int, /) -> None: ...

    @property
    def kind(self) -> ValueKind: ...

    @kind.setter
    def kind(self, arg: ValueKind, /) -> None: ...

    @property
    def shape(self) -> list[Dim]: ...

    @shape.setter
    def shape(self, arg: Sequence[Dim], /) -> None: ...

    @property
    def dtype(self) -> str: ...

    @dtype.setter
    def dtype(self, arg: str, /) -> None: ...

    @property
    def requires_grad(self) -> bool: ...

    @requires_grad.setter
    def requires_grad(self, arg: bool, /) -> None: ...

class SourceLoc:
    def __init__(self) -> None: ...

    @property
    def file(self) -> str: ...

    @file.setter
    def file(self, arg: str, /) -> None: ...

    @property
    def line(self) -> int: ...

    @line.setter
    def line(self, arg: int, /) -> None: ...

    @property
    def code(self) -> str: ...

    @code.setter
    def code(self, arg: str, /) -> None: ...

    def __str__(self) -> str: ...

class Node:
    def __init__(self) -> None: ...

    @property
    def id(self) -> int: ...

    @id.setter
    def id(self, arg: int, /) -> None: ...

    @property
    def op(self) -> str: ...

    @op.setter
    def op(self, arg: str, /) -> None: ...

    @property
    def target(self) -> str: ...

    @target.setter
    def target(self, arg: str, /) -> None: ...

    @property
    def inputs(self) -> list[int]: ...

    @inputs.setter
    def inputs(self, arg: Sequence[int], /) -> None: ...

    @property
    def outputs(self) -> list[int]: ...

    @outputs.setter
    def outputs(self, arg: Sequence[int], /) -> None: ...

    @property
    def attrs(self) -> dict[str, int | float | bool | str | list[int]]: ...

    @attrs.setter
    def attrs(self, arg: Mapping[str, int | float | bool | str | Sequence[int]], /) -> None: ...

    @property
    def loc(self) -> SourceLoc: ...

    @loc.setter
    def loc(self, arg: SourceLoc, /) -> None: ...

    @property
    def origin(self) -> int: ...

    @origin.setter
    def origin(self, arg: int, /) -> None: ...

class Graph:
    def __init__(self) -> None: ...

    def add_value(self, value: Value) -> int: ...

    def add_node(self, node: Node) -> int: ...

    def value(self, id: int) -> Value: ...

    @property
    def values(self) -> list[Value]: ...

    @property
    def nodes(self) -> list[Node]: ...

    def __str__(self) -> str: ...

class PlanError(ValueError):
    pass

class PlacementKind(enum.Enum):
    Replicate = 0

    Shard = 1

    Partial = 2

    Local = 3

class Placement:
    @property
    def kind(self) -> PlacementKind: ...

    @property
    def dim(self) -> int: ...

    @property
    def inner(self) -> int: ...

    @property
    def positions(self) -> bool: ...

    @property
    def coef(self) -> int: ...

    @staticmethod
    def replicate() -> Placement: ...

    @staticmethod
    def shard(dim: int, inner: int = 1) -> Placement: ...

    @staticmethod
    def partial() -> Placement: ...

    @staticmethod
    def local(bag: int) -> Placement: ...

    @staticmethod
    def local_positions(bag: int, inner: int, coef: int) -> Placement: ...

    def is_shard(self) -> bool: ...

    def is_partial(self) -> bool: ...

    def is_replicate(self) -> bool: ...

    def is_local(self) -> bool: ...

    def __str__(self) -> str: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: Placement, /) -> bool: ...

class SpConfig:
    def __init__(self) -> None: ...

    @property
    def sp_size(self) -> int: ...

    @sp_size.setter
    def sp_size(self, arg: int, /) -> None: ...

    @property
    def fuse_qkv(self) -> bool: ...

    @fuse_qkv.setter
    def fuse_qkv(self, arg: bool, /) -> None: ...

    @property
    def bucket_grad_sync(self) -> bool: ...

    @bucket_grad_sync.setter
    def bucket_grad_sync(self, arg: bool, /) -> None: ...

    @property
    def gather_outputs(self) -> bool: ...

    @gather_outputs.setter
    def gather_outputs(self, arg: bool, /) -> None: ...

    @property
    def gather_unsupported(self) -> bool: ...

    @gather_unsupported.setter
    def gather_unsupported(self, arg: bool, /) -> None: ...

    @property
    def tile_loss(self) -> bool: ...

    @tile_loss.setter
    def tile_loss(self, arg: bool, /) -> None: ...

    @property
    def loss_chunks(self) -> int: ...

    @loss_chunks.setter
    def loss_chunks(self, arg: int, /) -> None: ...

    @property
    def tile_mlp(self) -> bool: ...

    @tile_mlp.setter
    def tile_mlp(self, arg: bool, /) -> None: ...

class SpPlan:
    @property
    def graph(self) -> Graph: ...

    @property
    def placements(self) -> list[Placement]: ...

    @property
    def gathered(self) -> list[str]: ...

    @property
    def loss_tiling(self) -> list[str]: ...

    @property
    def mlp_tiling(self) -> list[str]: ...

    def collective_counts(self) -> dict[str, int]: ...

    def __str__(self) -> str: ...

def plan_ulysses(graph: Graph, config: SpConfig) -> SpPlan:
    """
    Plan Ulysses sequence parallelism for one rank; raises PlanError for models it cannot make exact.
    """

def print_placements(graph: Graph, plan: SpPlan) -> str:
    """
    The placements the plan's propagation stage decided for the input graph, one line per node: the operands it reads (with the SP steps that make each so) and its results.
    """

def registered_ops() -> list[str]:
    """
    Canonical ops with a placement rule or their own emitter (the op table's rows).
    """

INFINITE_CAPACITY: int = 9223372036854775807

class MinCut:
    @property
    def value(self) -> int: ...

    @property
    def source_side(self) -> list[bool]: ...

    @property
    def cut_edges(self) -> list[int]: ...

    @property
    def flow(self) -> list[int]: ...

def solve_min_cut(num_vertices: int, edges: Sequence[tuple[int, int, int]], source: int, sink: int) -> MinCut:
    """
    Max-flow/min-cut (Dinic) on a network given as (from, to, capacity) edges; capacity INFINITE_CAPACITY marks an uncuttable edge. Returns a MinCut whose cut_edges index into `edges`.
    """

class RematOpKind(enum.Enum):
    INPUT = 0

    VIEW = 1

    CHEAP = 2

    MATMUL = 3

    ATTENTION = 4

    COLLECTIVE = 5

    RANDOM = 6

    OTHER = 7

class RematSaveCost(enum.Enum):
    TENSOR = 0

    SYM_INT = 1

    SYM_FLOAT = 2

    FREE = 3

    UNSAVEABLE = 4

class RematPolicy(enum.Enum):
    NONE = 0

    DEFAULT = 1

    SEQUENCE_AWARE = 2

class RematFate(enum.Enum):
    BACKWARD_ONLY = 0

    SAVED = 1

    RECOMPUTED = 2

    FORWARD_ONLY = 3

class RematNode:
    def __init__(self) -> None: ...

    @property
    def name(self) -> str: ...

    @name.setter
    def name(self, arg: str, /) -> None: ...

    @property
    def target(self) -> str: ...

    @target.setter
    def target(self, arg: str, /) -> None: ...

    @property
    def layer(self) -> str: ...

    @layer.setter
    def layer(self, arg: str, /) -> None: ...

    @property
    def kind(self) -> RematOpKind: ...

    @kind.setter
    def kind(self, arg: RematOpKind, /) -> None: ...

    @property
    def save_cost(self) -> RematSaveCost: ...

    @save_cost.setter
    def save_cost(self, arg: RematSaveCost, /) -> None: ...

    @property
    def bytes(self) -> int: ...

    @bytes.setter
    def bytes(self, arg: int, /) -> None: ...

    @property
    def flops(self) -> float: ...

    @flops.setter
    def flops(self, arg: float, /) -> None: ...

    @property
    def required_fw(self) -> bool: ...

    @required_fw.setter
    def required_fw(self, arg: bool, /) -> None: ...

    @property
    def required_bw(self) -> bool: ...

    @required_bw.setter
    def required_bw(self, arg: bool, /) -> None: ...

    @property
    def tangents_closure(self) -> bool: ...

    @tangents_closure.setter
    def tangents_closure(self, arg: bool, /) -> None: ...

    @property
    def primal_input(self) -> bool: ...

    @primal_input.setter
    def primal_input(self, arg: bool, /) -> None: ...

    @property
    def static_lifetime(self) -> bool: ...

    @static_lifetime.setter
    def static_lifetime(self, arg: bool, /) -> None: ...

    @property
    def forward_output(self) -> bool: ...

    @forward_output.setter
    def forward_output(self, arg: bool, /) -> None: ...

    @property
    def must_save(self) -> bool: ...

    @must_save.setter
    def must_save(self, arg: bool, /) -> None: ...

    @property
    def must_recompute(self) -> bool: ...

    @must_recompute.setter
    def must_recompute(self, arg: bool, /) -> None: ...

    @property
    def parameter_collective(self) -> bool: ...

    @parameter_collective.setter
    def parameter_collective(self, arg: bool, /) -> None: ...

    @property
    def fusible(self) -> bool: ...

    @fusible.setter
    def fusible(self, arg: bool, /) -> None: ...

    @property
    def getitem(self) -> bool: ...

    @getitem.setter
    def getitem(self, arg: bool, /) -> None: ...

    @property
    def contiguous(self) -> bool: ...

    @contiguous.setter
    def contiguous(self, arg: bool, /) -> None: ...

    @property
    def users(self) -> list[int]: ...

    @users.setter
    def users(self, arg: Sequence[int], /) -> None: ...

    @property
    def fusible_user(self) -> list[int]: ...

    @fusible_user.setter
    def fusible_user(self, arg: Sequence[int], /) -> None: ...

    @property
    def args(self) -> list[int]: ...

    @args.setter
    def args(self, arg: Sequence[int], /) -> None: ...

    @property
    def aliases(self) -> int: ...

    @aliases.setter
    def aliases(self, arg: int, /) -> None: ...

class RematOptions:
    def __init__(self) -> None: ...

    @property
    def policy(self) -> RematPolicy: ...

    @policy.setter
    def policy(self, arg: RematPolicy, /) -> None: ...

    @property
    def recompute_flops_ratio(self) -> float: ...

    @recompute_flops_ratio.setter
    def recompute_flops_ratio(self, arg: float, /) -> None: ...

    @property
    def budget_bytes(self) -> int | None: ...

    @budget_bytes.setter
    def budget_bytes(self, arg: int | None, /) -> None: ...

    @property
    def budget_fraction(self) -> float | None: ...

    @budget_fraction.setter
    def budget_fraction(self, arg: float | None, /) -> None: ...

    @property
    def max_dist_from_bw(self) -> int: ...

    @max_dist_from_bw.setter
    def max_dist_from_bw(self, arg: int, /) -> None: ...

    @property
    def offload_layer_outputs(self) -> bool: ...

    @offload_layer_outputs.setter
    def offload_layer_outputs(self, arg: bool, /) -> None: ...

    @property
    def offload_layer_saved(self) -> bool: ...

    @offload_layer_saved.setter
    def offload_layer_saved(self, arg: bool, /) -> None: ...

    @property
    def admitted(self) -> list[int] | None: ...

    @admitted.setter
    def admitted(self, arg: Sequence[int] | None, /) -> None: ...

class RematLayerSummary:
    @property
    def layer(self) -> str: ...

    @property
    def saved_bytes(self) -> int: ...

    @property
    def saved_count(self) -> int: ...

    @property
    def recomputed_count(self) -> int: ...

    @property
    def recomputed_bytes(self) -> int: ...

    @property
    def recompute_flops(self) -> float: ...

class RematSolution:
    @property
    def saved(self) -> list[int]: ...

    @property
    def recomputed(self) -> list[int]: ...

    @property
    def fate(self) -> list[RematFate]: ...

    @property
    def ban_reason(self) -> list[str]: ...

    @property
    def saved_bytes(self) -> int: ...

    @property
    def offloaded(self) -> list[int]: ...

    @property
    def offloaded_bytes(self) -> int: ...

    @property
    def none_saved_bytes(self) -> int: ...

    @property
    def budget_bytes(self) -> int: ...

    @property
    def recompute_flops(self) -> float: ...

    @property
    def attention_flops(self) -> float: ...

    @property
    def admitted_matmul_flops(self) -> float: ...

    @property
    def admitted_matmuls(self) -> int: ...

    @property
    def admitted(self) -> list[int]: ...

    @property
    def cut_value(self) -> int: ...

    @property
    def flow_vertices(self) -> int: ...

    @property
    def flow_edges(self) -> int: ...

    @property
    def solves(self) -> int: ...

    @property
    def layers(self) -> list[RematLayerSummary]: ...

def solve_remat(nodes: Sequence[RematNode], options: RematOptions) -> RematSolution:
    """
    Decide which forward values to save for the backward (see csrc/plan/remat.h).
    """

def attention_flops(nodes: Sequence[RematNode]) -> float:
    """The graph's attention FLOPs (see csrc/plan/remat.h)."""

def matmul_candidates(nodes: Sequence[RematNode]) -> list[int]:
    """
    The matmuls sequence-aware may admit, in graph order (csrc/plan/remat.h).
    """

def storage_owners(aliases: Sequence[int]) -> list[int]:
    """
    For each value, the value whose storage it lives in: aliases[i] (the value i is a view of, or -1) followed to one that aliases nothing (csrc/plan/remat.h).
    """

def admit_matmuls(flops: Sequence[float], bytes: Sequence[int], allowance: float, layers: Sequence[str] = []) -> list[bool]:
    """
    Sequence-aware's choice among matmuls given in graph order, alike layers alike (csrc/plan/remat.h).
    """

class SeqTerm:
    @overload
    def __init__(self) -> None: ...

    @overload
    def __init__(self, coef: int, power: int = 0, shard: int = 1, cap: int = 0) -> None: ...

    @property
    def coef(self) -> int: ...

    @coef.setter
    def coef(self, arg: int, /) -> None: ...

    @property
    def power(self) -> int: ...

    @power.setter
    def power(self, arg: int, /) -> None: ...

    @property
    def shard(self) -> int: ...

    @shard.setter
    def shard(self, arg: int, /) -> None: ...

    @property
    def cap(self) -> int: ...

    @cap.setter
    def cap(self, arg: int, /) -> None: ...

    def __eq__(self, arg: SeqTerm, /) -> bool: ...

class SeqBytes:
    @overload
    def __init__(self) -> None: ...

    @overload
    def __init__(self, terms: Sequence[SeqTerm]) -> None: ...

    @property
    def terms(self) -> list[SeqTerm]: ...

    @terms.setter
    def terms(self, arg: Sequence[SeqTerm], /) -> None: ...

    def at(self, seq: int) -> int:
        """Bytes at sequence length `seq`."""

    def __str__(self) -> str: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: SeqBytes, /) -> bool: ...

class SeqFlops:
    @overload
    def __init__(self) -> None: ...

    @overload
    def __init__(self, coef: float, power: int) -> None: ...

    @property
    def coef(self) -> float: ...

    @coef.setter
    def coef(self, arg: float, /) -> None: ...

    @property
    def power(self) -> int: ...

    @power.setter
    def power(self, arg: int, /) -> None: ...

    def at(self, seq: int) -> float: ...

class MemoryRole(enum.Enum):
    PARAMETER = 0

    INPUT = 1

    TANGENT = 2

    COMPUTE = 3

class MemoryNode:
    def __init__(self) -> None: ...

    @property
    def facts(self) -> RematNode: ...

    @facts.setter
    def facts(self, arg: RematNode, /) -> None: ...

    @property
    def role(self) -> MemoryRole: ...

    @role.setter
    def role(self, arg: MemoryRole, /) -> None: ...

    @property
    def save_bytes(self) -> SeqBytes: ...

    @save_bytes.setter
    def save_bytes(self, arg: SeqBytes, /) -> None: ...

    @property
    def flops(self) -> SeqFlops: ...

    @flops.setter
    def flops(self, arg: SeqFlops, /) -> None: ...

    @property
    def inner_recompute_flops(self) -> SeqFlops: ...

    @inner_recompute_flops.setter
    def inner_recompute_flops(self, arg: SeqFlops, /) -> None: ...

    @property
    def alloc_bytes(self) -> SeqBytes: ...

    @alloc_bytes.setter
    def alloc_bytes(self, arg: SeqBytes, /) -> None: ...

    @property
    def scratch_bytes(self) -> SeqBytes: ...

    @scratch_bytes.setter
    def scratch_bytes(self, arg: SeqBytes, /) -> None: ...

    @property
    def chunked_bytes(self) -> SeqBytes: ...

    @chunked_bytes.setter
    def chunked_bytes(self, arg: SeqBytes, /) -> None: ...

    @property
    def chunks(self) -> int: ...

    @chunks.setter
    def chunks(self, arg: int, /) -> None: ...

    @property
    def alias_of(self) -> int: ...

    @alias_of.setter
    def alias_of(self, arg: int, /) -> None: ...

    @property
    def collective(self) -> bool: ...

    @collective.setter
    def collective(self, arg: bool, /) -> None: ...

    @property
    def gradient(self) -> bool: ...

    @gradient.setter
    def gradient(self, arg: bool, /) -> None: ...

    @property
    def forward_output(self) -> bool: ...

    @forward_output.setter
    def forward_output(self, arg: bool, /) -> None: ...

    @property
    def layer(self) -> int: ...

    @layer.setter
    def layer(self, arg: int, /) -> None: ...

class MemoryGraph:
    @overload
    def __init__(self) -> None: ...

    @overload
    def __init__(self, nodes: Sequence[MemoryNode]) -> None: ...

    @property
    def nodes(self) -> list[MemoryNode]: ...

    @nodes.setter
    def nodes(self, arg: Sequence[MemoryNode], /) -> None: ...

    def __len__(self) -> int: ...

class RematStrategy(enum.Enum):
    NONE = 0

    DEFAULT = 1

    SEQUENCE_AWARE = 2

    FULL_CHECKPOINT = 3

class DtypePolicy(enum.Enum):
    FP32 = 0

    BF16_MIXED = 1

class TrainingConfig:
    def __init__(self) -> None: ...

    @property
    def num_params(self) -> int: ...

    @num_params.setter
    def num_params(self, arg: int, /) -> None: ...

    @property
    def dtype(self) -> DtypePolicy: ...

    @dtype.setter
    def dtype(self, arg: DtypePolicy, /) -> None: ...

    @property
    def optimizer_shards(self) -> int: ...

    @optimizer_shards.setter
    def optimizer_shards(self, arg: int, /) -> None: ...

    @property
    def param_shards(self) -> int: ...

    @param_shards.setter
    def param_shards(self, arg: int, /) -> None: ...

    @property
    def optimizer_foreach(self) -> bool: ...

    @optimizer_foreach.setter
    def optimizer_foreach(self, arg: bool, /) -> None: ...

    @property
    def optimizer_offload(self) -> bool: ...

    @optimizer_offload.setter
    def optimizer_offload(self, arg: bool, /) -> None: ...

class MemoryOptions:
    def __init__(self) -> None: ...

    @property
    def strategy(self) -> RematStrategy: ...

    @strategy.setter
    def strategy(self, arg: RematStrategy, /) -> None: ...

    @property
    def recompute_flops_ratio(self) -> float: ...

    @recompute_flops_ratio.setter
    def recompute_flops_ratio(self, arg: float, /) -> None: ...

    @property
    def max_dist_from_bw(self) -> int: ...

    @max_dist_from_bw.setter
    def max_dist_from_bw(self, arg: int, /) -> None: ...

    @property
    def offload_layer_outputs(self) -> bool: ...

    @offload_layer_outputs.setter
    def offload_layer_outputs(self, arg: bool, /) -> None: ...

    @property
    def offload_layer_saved(self) -> bool: ...

    @offload_layer_saved.setter
    def offload_layer_saved(self, arg: bool, /) -> None: ...

    @property
    def loss_chunks(self) -> int: ...

    @loss_chunks.setter
    def loss_chunks(self, arg: int, /) -> None: ...

    @property
    def training(self) -> TrainingConfig: ...

    @training.setter
    def training(self, arg: TrainingConfig, /) -> None: ...

class MemoryBreakdown:
    def __init__(self) -> None: ...

    @property
    def seq_len(self) -> int: ...

    @seq_len.setter
    def seq_len(self, arg: int, /) -> None: ...

    @property
    def parameters(self) -> int: ...

    @parameters.setter
    def parameters(self, arg: int, /) -> None: ...

    @property
    def gradients(self) -> int: ...

    @gradients.setter
    def gradients(self, arg: int, /) -> None: ...

    @property
    def optimizer_state(self) -> int: ...

    @optimizer_state.setter
    def optimizer_state(self, arg: int, /) -> None: ...

    @property
    def saved_activations(self) -> int: ...

    @saved_activations.setter
    def saved_activations(self, arg: int, /) -> None: ...

    @property
    def transient(self) -> int: ...

    @transient.setter
    def transient(self, arg: int, /) -> None: ...

    @property
    def communication(self) -> int: ...

    @communication.setter
    def communication(self, arg: int, /) -> None: ...

    @property
    def inputs(self) -> int: ...

    @inputs.setter
    def inputs(self, arg: int, /) -> None: ...

    @property
    def peak(self) -> int: ...

    @peak.setter
    def peak(self, arg: int, /) -> None: ...

    @property
    def phase(self) -> str: ...

    @phase.setter
    def phase(self, arg: str, /) -> None: ...

    @property
    def peak_node(self) -> str: ...

    @peak_node.setter
    def peak_node(self, arg: str, /) -> None: ...

    @property
    def saved_bytes(self) -> int: ...

    @saved_bytes.setter
    def saved_bytes(self, arg: int, /) -> None: ...

    @property
    def saved_count(self) -> int: ...

    @saved_count.setter
    def saved_count(self, arg: int, /) -> None: ...

    @property
    def recomputed_count(self) -> int: ...

    @recomputed_count.setter
    def recomputed_count(self, arg: int, /) -> None: ...

    @property
    def step_flops(self) -> float: ...

    @step_flops.setter
    def step_flops(self, arg: float, /) -> None: ...

    @property
    def recompute_flops(self) -> float: ...

    @recompute_flops.setter
    def recompute_flops(self, arg: float, /) -> None: ...

    @property
    def offloaded_bytes(self) -> int: ...

    @offloaded_bytes.setter
    def offloaded_bytes(self, arg: int, /) -> None: ...

    @property
    def host_bytes(self) -> int: ...

    @host_bytes.setter
    def host_bytes(self, arg: int, /) -> None: ...

class TrainabilityQuery:
    def __init__(self) -> None: ...

    @property
    def budget_bytes(self) -> int: ...

    @budget_bytes.setter
    def budget_bytes(self, arg: int, /) -> None: ...

    @property
    def seq_multiple(self) -> int: ...

    @seq_multiple.setter
    def seq_multiple(self, arg: int, /) -> None: ...

    @property
    def max_seq(self) -> int: ...

    @max_seq.setter
    def max_seq(self, arg: int, /) -> None: ...

    @property
    def host_budget_bytes(self) -> int: ...

    @host_budget_bytes.setter
    def host_budget_bytes(self, arg: int, /) -> None: ...

class Trainability:
    @property
    def longest_seq(self) -> int: ...

    @property
    def at_longest(self) -> MemoryBreakdown: ...

    @property
    def first_oom(self) -> MemoryBreakdown: ...

    @property
    def capped(self) -> bool: ...

    @property
    def evaluations(self) -> int: ...

LAYER_UNKNOWN: int = -1

NO_LAYER: int = -2

def label_layers(graph: MemoryGraph) -> list[int]:
    """
    The decoder layer of every node (NO_LAYER outside layers): the seeds in MemoryNode.layer, completed from inputs and users (see csrc/plan/layers.h).
    """

def replicate_layers(graph: MemoryGraph, num_layers: int) -> MemoryGraph:
    """
    The memory graph of `num_layers` decoder layers from the trace of 3 or more (copies of layer 1 inserted after it). Raises ValueError when the trace does not have that structure.
    """

class CostModel:
    def __init__(self) -> None: ...

    @property
    def host_bandwidth(self) -> float: ...

    @host_bandwidth.setter
    def host_bandwidth(self, arg: float, /) -> None: ...

    @property
    def device_flops(self) -> float: ...

    @device_flops.setter
    def device_flops(self, arg: float, /) -> None: ...

def offload_seconds(breakdown: MemoryBreakdown, cost: CostModel = ...) -> float:
    """
    Seconds per step the offloaded bytes spend on the host link, there and back.
    """

def step_overhead(breakdown: MemoryBreakdown, cost: CostModel = ...) -> float:
    """
    Predicted step-time overhead: recomputed FLOPs over the step's, plus the offload's link seconds over the step's compute seconds.
    """

def cheapest_fit(candidates: Sequence[MemoryBreakdown], budget_bytes: int, host_budget_bytes: int, cost: CostModel = ...) -> int:
    """
    The index of the candidate with the least step_overhead (then the lowest peak) whose peak fits budget_bytes and host_bytes fits host_budget_bytes (0: any); -1 if none.
    """

LOSS_CHUNKS_HEADROOM: float = 0.9

def optimizer_state_bytes(config: TrainingConfig) -> int: ...

def host_optimizer_bytes(config: TrainingConfig) -> int: ...

def optimizer_workspace_bytes(config: TrainingConfig) -> int: ...

class TiledLossWorkspace:
    @property
    def per_row(self) -> int: ...

    @property
    def cap(self) -> int: ...

    @property
    def constant(self) -> int: ...

    @property
    def chunks(self) -> int: ...

class TiledLossPass(enum.Enum):
    FORWARD = 0

    BACKWARD = 1

    FORWARD_WITH_GRADS = 2

def tiled_loss_workspace(pass_: TiledLossPass, classes: int, hidden: int, weight_itemsize: int, fixed_rows: int, chunks: int) -> TiledLossWorkspace:
    """
    Scratch bytes of a tiled loss op: per_row bytes per row of one chunk, capped or split over chunks, + constant (see csrc/plan/memory.h).
    """

def tiled_loss_chunks(classes: int, hidden: int, chunks: int) -> int:
    """
    Chunks of a tiled loss's rows: `chunks` when positive, else ceil(classes / hidden).
    """

def fewest_loss_chunks(graph: MemoryGraph, seq: int, options: MemoryOptions, budget_bytes: int, max_chunks: int) -> int:
    """
    The fewest chunks per tiled loss, up to max_chunks, whose predicted peak at seq fits budget_bytes; 0 when none does or the graph has no tiled loss.
    """

class TiledRowsWorkspace:
    @property
    def per_row(self) -> int: ...

    @property
    def capped_per_row(self) -> int: ...

    @property
    def cap(self) -> int: ...

    @property
    def constant(self) -> int: ...

def tiled_rows_workspace(backward: bool, in_bytes: int, inner_bytes: int, out_bytes: int, whole_bytes: int, whole_elements: int, batch: int, fixed_rows: int) -> TiledRowsWorkspace:
    """
    Scratch bytes of a tiled row-wise block's op: per_row * tokens + min(capped_per_row * tokens, cap) + constant (see csrc/plan/memory.h).
    """

def tiled_rows_chunk(rows: int, in_bytes: int, inner_bytes: int, fixed_rows: int) -> int:
    """Rows per chunk of a tiled row-wise block (see csrc/plan/memory.h)."""

def decide_fates(graph: MemoryGraph, seq: int, options: MemoryOptions) -> list[RematFate]:
    """
    Fate of every node (RematFate) at sequence length `seq` under the options' strategy.
    """

def simulate_peak_memory(graph: MemoryGraph, seq: int, options: MemoryOptions) -> MemoryBreakdown:
    """
    Predicted peak memory per rank of one training step at sequence length `seq` (see csrc/plan/memory.h).
    """

def longest_trainable_seq(graph: MemoryGraph, options: MemoryOptions, query: TrainabilityQuery) -> Trainability:
    """
    The longest multiple of query.seq_multiple whose predicted peak fits query.budget_bytes.
    """
