"""autosp.remat: the C++ min-cut against networkx, every policy against no checkpointing, the
sequence-aware saving order, collectives and random ops never recomputed, and user errors."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop

import autosp.remat as remat
from autosp import _core
from autosp.errors import AutospError
from autosp.models.llama import LlamaConfig, LlamaForCausalLM

nx = pytest.importorskip("networkx")

INF = _core.INFINITE_CAPACITY

# Small enough for CPU, long enough that attention dominates the step, so the sequence-aware
# policy recomputes matmuls (the point of these tests).
CFG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=86, num_layers=2, num_heads=2, num_kv_heads=2
)
SEQ = 512


# ------------------------------------------------------------------------------------------
# Max-flow vs networkx


def _random_network(rng: random.Random, n: int, m: int, inf_prob: float):
    edges = []
    for _ in range(m):
        u, v = rng.randrange(n), rng.randrange(n)
        if u == v:
            continue
        cap = INF if rng.random() < inf_prob else rng.randrange(0, 1000)
        edges.append((u, v, cap))
    return edges


def _nx_graph(n: int, edges):
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for u, v, cap in edges:
        # Parallel edges: networkx keeps one edge per pair, so sum capacities.
        if g.has_edge(u, v):
            old = g[u][v].get("capacity")
            if old is None or cap == INF:
                g[u][v].pop("capacity", None)
            else:
                g[u][v]["capacity"] = old + cap
        elif cap == INF:
            g.add_edge(u, v)  # no capacity attribute: infinite in networkx
        else:
            g.add_edge(u, v, capacity=cap)
    return g


@pytest.mark.parametrize("seed", range(6))
def test_min_cut_value_matches_networkx(seed: int) -> None:
    rng = random.Random(seed)
    checked = unbounded = 0
    for _ in range(40):
        n = rng.randrange(4, 60)
        edges = _random_network(rng, n, rng.randrange(n, 5 * n), inf_prob=0.15)
        g = _nx_graph(n, edges)
        try:
            expected, _ = nx.minimum_cut(g, 0, n - 1)
        except nx.NetworkXUnbounded:
            with pytest.raises(OverflowError, match=r"\[maxflow\] no finite cut"):
                _core.solve_min_cut(n, edges, 0, n - 1)
            unbounded += 1
            continue
        cut = _core.solve_min_cut(n, edges, 0, n - 1)
        assert cut.value == expected
        # The cut separates source from sink and its edges sum to the value.
        assert cut.source_side[0] and not cut.source_side[n - 1]
        assert sum(edges[e][2] for e in cut.cut_edges) == cut.value
        for u, v, _ in (edges[e] for e in cut.cut_edges):
            assert cut.source_side[u] and not cut.source_side[v]
        checked += 1
    assert checked > 0


# ------------------------------------------------------------------------------------------
# Helpers


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG)


def _batch(seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (1, seq), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (1, seq), generator=g)
    labels[0, :7] = -100
    return ids, labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _run(model, fn, *args):
    model.zero_grad(set_to_none=True)
    loss = fn(*args)
    loss.backward()
    return loss.detach(), _grads(model)


def _assert_close(loss, grads, ref_loss, ref_grads) -> None:
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        # 1e-5 relative to the gradient's scale (elementwise relative error is meaningless
        # for entries that are exactly zero in one and 1e-12 in the other).
        scale = ref_grads[name].abs().max()
        err = (grads[name] - ref_grads[name]).abs().max()
        assert err <= 1e-5 * scale, f"{name}: max error {err} vs scale {scale}"


class SavedBytesMeter:
    """Measures what the compiled forward really hands to the backward: the tensors its graph
    returns after the user-visible outputs, deduplicated by storage, inputs (parameters, ids)
    excluded. Wraps a partition function (to learn num_fwd_outputs) and is the forward
    compiler."""

    def __init__(self, partition_fn) -> None:
        self.partition_fn = partition_fn
        self.num_fwd_outputs = None
        self.total = None

    def partition(self, joint, inputs, *, num_fwd_outputs, **kwargs):
        self.num_fwd_outputs = num_fwd_outputs
        return self.partition_fn(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    def fw_compiler(self, gm, example_inputs):
        run = boxed_nop(gm, example_inputs)

        def measured(args):
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            outs = run(args)
            storages = {}
            for t in outs[self.num_fwd_outputs :]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            self.total = sum(storages.values())
            return outs

        measured._boxed_call = True
        return measured

    def backend(self):
        return aot_autograd(
            fw_compiler=self.fw_compiler, bw_compiler=boxed_nop, partition_fn=self.partition
        )


# ------------------------------------------------------------------------------------------
# Policies vs no checkpointing


POLICIES = ["none", "default", "sequence-aware", remat.MemoryBudget(fraction=0.5),
            remat.Offload("sequence-aware"), remat.Offload("sequence-aware", saved="all")]


@pytest.fixture(scope="module")
def eager_reference():
    model = _model()
    ids, labels = _batch()
    return _run(model, model, ids, labels)


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_policy_matches_no_checkpointing(policy, eager_reference) -> None:
    ref_loss, ref_grads = eager_reference
    model = _model()
    ids, labels = _batch()
    report = remat.RematReport()
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend=remat.backend(policy, backend="aot_eager", report=report), fullgraph=True
    )
    loss, grads = _run(model, compiled, ids, labels)
    _assert_close(loss, grads, ref_loss, ref_grads)
    assert len(report.graphs) == 1
    graph = report.graphs[0]
    recomputed_ops = {n.target for n in graph.recomputed()}
    if policy == "sequence-aware" or isinstance(policy, (remat.MemoryBudget, remat.Offload)):
        # The point of the policy at this length: projections are recomputed.
        assert "aten.mm.default" in recomputed_ops, recomputed_ops
    else:
        assert "aten.mm.default" not in recomputed_ops
    if isinstance(policy, remat.MemoryBudget):
        assert graph.saved_bytes <= 0.5 * graph.none_saved_bytes
    # Offload: the hidden state each decoder layer hands to the next goes to host memory, one
    # copy per layer ([1, S, hidden] fp32 each); other policies offload nothing.
    per_layer = SEQ * CFG.hidden_size * 4
    if isinstance(policy, remat.Offload) and policy.saved == "all":
        # Every tensor a layer saves: more copies and bytes than the hidden states alone, and
        # no more than what the forward saves.
        assert graph.offload_copies > CFG.num_layers, str(graph)
        assert CFG.num_layers * per_layer < graph.offloaded_bytes <= graph.saved_bytes, str(graph)
    elif isinstance(policy, remat.Offload):
        assert graph.offload_copies == CFG.num_layers, str(graph)
        assert graph.offloaded_bytes == CFG.num_layers * per_layer, str(graph)
    else:
        assert graph.offload_copies == 0 and graph.offloaded_bytes == 0


def _saved_bytes(partition_fn) -> int:
    model = _model()
    ids, labels = _batch()
    meter = SavedBytesMeter(partition_fn)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=meter.backend(), fullgraph=True)
    compiled(ids, labels).backward()
    return meter.total


def test_sequence_aware_saves_less_than_default() -> None:
    measured, predicted = {}, {}
    for policy in ("none", "default", "sequence-aware"):
        report = remat.RematReport()
        measured[policy] = _saved_bytes(remat.make_partition_fn(policy, report=report))
        predicted[policy] = report.saved_bytes
    assert measured["sequence-aware"] < measured["default"] <= measured["none"], measured
    # The solver's accounting is what the forward really returns for the backward, each
    # storage once, plus the inputs it saves (the parameters here, and the ids), which the
    # meter leaves out.
    for policy in measured:
        assert measured[policy] <= predicted[policy], (policy, measured, predicted)


def test_default_matches_pytorch_partitioner_bytes() -> None:
    """Policy 'default' reproduces PyTorch's min_cut_rematerialization_partition: same saved
    bytes on the same joint graph (ties may pick different but equal-sized values)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    ours = _saved_bytes(remat.make_partition_fn("default"))
    theirs = _saved_bytes(min_cut_rematerialization_partition)
    assert ours == theirs


def test_backward_reorder_matches_pytorch(monkeypatch) -> None:
    """The partition function reorders the backward in place (autosp.remat_graphs); its graphs
    are those PyTorch's reordering_to_mimic_autograd_engine (a copy) gives: same code, names,
    and namespace (so nodes added later get the same names)."""
    import autosp.remat_partition as remat_partition
    from torch._functorch.partitioners import reordering_to_mimic_autograd_engine

    captured = {}

    def capture(joint, joint_inputs, **kwargs):
        captured.update(joint=joint, inputs=joint_inputs, kwargs=kwargs)
        return remat.make_partition_fn("default")(joint, joint_inputs, **kwargs)

    torch._dynamo.reset()
    model = _model()
    ids, labels = _batch()
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=capture)
    torch.compile(model, backend=backend, fullgraph=True)(ids, labels).backward()

    def partition(policy):
        joint = captured["joint"]
        fw, bw = remat.make_partition_fn(policy)(
            fx.GraphModule(joint, joint.graph.__deepcopy__()), captured["inputs"],
            **captured["kwargs"])
        namespace = bw.graph._graph_namespace
        return (fw.code, bw.code, [n.name for n in bw.graph.nodes],
                sorted(namespace._used_names), namespace._base_count)

    for policy in ("default", "sequence-aware", "none"):
        ours = partition(policy)
        with monkeypatch.context() as m:
            m.setattr(remat_partition, "reorder_like_autograd", reordering_to_mimic_autograd_engine)
            theirs = partition(policy)
        assert ours == theirs, policy


def test_dynamic_sequence_length_uses_hints() -> None:
    """With a symbolic S the solver sees sizes at the actual S (the hint), without guards."""
    ids, labels = _batch()
    model = _model()
    report = remat.RematReport()
    torch._dynamo.reset()
    compiled = torch.compile(
        model,
        backend=remat.backend("sequence-aware", backend="aot_eager", report=report),
        fullgraph=True,
        dynamic=True,
    )
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(labels, 1)
    compiled(ids, labels).backward()
    graph = report.graphs[0]
    # Forward 4*b*h*S*S*d and backward 10*b*h*S*S*d per layer, at S = SEQ.
    head_dim = CFG.hidden_size // CFG.num_heads
    expected = CFG.num_layers * (4 + 10) * CFG.num_heads * SEQ * SEQ * head_dim
    assert graph.attention_flops == expected
    # The hidden states saved at the layer boundaries have their size at S = SEQ.
    hidden_bytes = SEQ * CFG.hidden_size * 4
    assert any(n.fate == "saved" and n.bytes == hidden_bytes for n in graph.nodes)
    assert "aten.mm.default" in {n.target for n in graph.recomputed()}
    # The compiled function still serves another length without recompiling.
    short_ids, short_labels = _batch(SEQ // 2)
    compiled(short_ids, short_labels).backward()
    assert len(report.graphs) == 1


def _exact_under_aot_eager(eager_reference: Any, dynamic: bool) -> None:
    """The model compiled with the sequence-aware partitioner under aot_eager, S symbolic
    (``dynamic``) or static: loss and gradients as eager."""
    ref_loss, ref_grads = eager_reference
    model = _model()
    ids, labels = _batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=remat.backend("sequence-aware", backend="aot_eager"),
                             fullgraph=True, dynamic=dynamic)
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(labels, 1)
    loss, grads = _run(model, compiled, ids, labels)
    _assert_close(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("dynamic", [True, False])
def test_fake_tensor_cache_is_off_while_a_symbolic_joint_graph_is_traced(monkeypatch, dynamic,
                                                                        eager_reference) -> None:
    """Under aot_eager, AOTAutograd traces a graph of symbolic S with PyTorch's fake-tensor
    cache off (it cost more than it saved: remat.symbolic_trace_uncached), and one of static
    sizes with it on; the fake mode has its cache back after the compile, and both are exact.
    Seen by the fake mode's switch when the partition function runs, inside the trace."""
    from torch._guards import detect_fake_mode

    seen: list[tuple[Any, bool]] = []
    make = remat.make_partition_fn

    def spying(*args: Any, **kwargs: Any) -> Any:
        partition = make(*args, **kwargs)

        def spy(joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
            mode = detect_fake_mode(list(joint_inputs))
            seen.append((mode, mode.cache_enabled))
            return partition(joint, joint_inputs, **kw)

        return spy

    monkeypatch.setattr(remat, "make_partition_fn", spying)
    _exact_under_aot_eager(eager_reference, dynamic)
    assert len(seen) == 1
    mode, enabled_in_trace = seen[0]
    assert enabled_in_trace is not dynamic
    assert mode.cache_enabled  # back on after the compile


def test_fake_tensor_cache_comes_back_as_it_was_also_when_the_trace_raises() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dyn = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC])
    symbolic = mode.from_tensor(torch.zeros(2, 8), symbolic_context=dyn)
    fixed = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC])
    static = mode.from_tensor(torch.zeros(2, 8), symbolic_context=fixed)
    assert isinstance(symbolic.shape[1], torch.SymInt) and mode.cache_enabled
    assert all(type(d) is int for d in static.shape)
    with remat.symbolic_trace_uncached([static]):
        assert mode.cache_enabled
    with pytest.raises(RuntimeError, match="trace failed"):
        with remat.symbolic_trace_uncached([static, symbolic]):
            assert not mode.cache_enabled
            raise RuntimeError("trace failed")
    assert mode.cache_enabled
    # The rank of a static compile the ranks share is a SymInt input (shared_compile.rank_symbol):
    # the sizes stay static, so the cache stays on (it was off: every static compile under
    # aot_eager traced uncached, and each layer's invoke_subgraph ran again at every call).
    from autosp.shared_compile import rank_symbol

    with remat.symbolic_trace_uncached([static, rank_symbol(mode.shape_env, 1)]):
        assert mode.cache_enabled
    from torch._dynamo.source import ConstantSource

    env = mode.shape_env
    length = env.create_symintnode(env.create_symbol(8, ConstantSource("sym_size")), hint=8)
    with remat.symbolic_trace_uncached([static, length]):  # any other SymInt: symbolic
        assert not mode.cache_enabled
    assert mode.cache_enabled
    mode.cache_enabled = False  # whoever turned it off gets it back off
    with remat.symbolic_trace_uncached([symbolic]):
        assert not mode.cache_enabled
    assert not mode.cache_enabled


def test_symbolic_s_partitions_on_torch_2_11(monkeypatch, eager_reference) -> None:
    """torch 2.11's partitioners module has no ``_is_assert_only_symbool`` (2.13 has): with a
    symbolic S the partitioner saves sym nodes, and looking that function up crashed every
    dynamic compile on a 2.11 GPU machine (found 2026-12-04). Without it, still exact."""
    from torch._functorch import partitioners

    monkeypatch.delattr(partitioners, "_is_assert_only_symbool", raising=False)
    _exact_under_aot_eager(eager_reference, dynamic=True)


def test_report_lists_layers() -> None:
    model = _model()
    ids, labels = _batch()
    report = remat.RematReport()
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend=remat.backend("sequence-aware", backend="aot_eager", report=report)
    )
    compiled(ids, labels).backward()
    graph = report.graphs[0]
    layers = {row.layer: row for row in graph.layers}
    assert {"layers.0", "layers.1"} <= layers.keys()
    for name in ("layers.0", "layers.1"):
        assert layers[name].recompute_flops > 0 and layers[name].saved_bytes > 0
    assert sum(row.saved_bytes for row in graph.layers) == graph.saved_bytes
    text = str(report)
    assert "remat policy sequence-aware" in text and "layers.1" in text
    for node in graph.recomputed():
        assert node.ban_reason == ""
    attention = [n for n in graph.nodes if "scaled_dot_product" in n.target]
    assert attention and all(n.fate != "recomputed" and n.ban_reason == "attention" for n in attention)


# ------------------------------------------------------------------------------------------
# Collectives and random ops


@pytest.fixture(scope="module")
def single_rank_group():
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def _collectives(gm: fx.GraphModule) -> list[str]:
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"
    ]


def test_collectives_are_never_recomputed(single_rank_group) -> None:
    import torch.distributed._functional_collectives as funcol

    group = single_rank_group

    class GatherSeq(torch.autograd.Function):
        # The shape of autosp's SP collectives: a Python function over an autograd.Function
        # whose forward and backward call functional collectives.
        @staticmethod
        def forward(ctx, x):
            return funcol.all_gather_tensor(x, 1, group)

        @staticmethod
        def backward(ctx, grad):
            return funcol.reduce_scatter_tensor(grad, "sum", 1, group)

    def gather_seq(x):
        return GatherSeq.apply(x)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(16, 16, bias=False)
            self.b = torch.nn.Linear(16, 16, bias=False)

        def forward(self, x):
            gathered = gather_seq(self.a(x))
            # Cheap pointwise ops after the collective: recomputing them from the gather's input
            # would be the cheapest cut if the collective were allowed to be recomputed.
            return self.b(torch.relu(gathered) * 2).pow(2).sum()

    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 64, 16)
    ref_loss, ref_grads = _run(model, model, x)
    for policy in ("none", "default", "sequence-aware", remat.MemoryBudget(fraction=0.6)):
        graphs: dict[str, fx.GraphModule] = {}

        def capture(name):
            def compiler(gm, example_inputs):
                graphs[name] = gm
                return boxed_nop(gm, example_inputs)

            return compiler

        report = remat.RematReport()
        torch._dynamo.reset()
        backend = aot_autograd(
            fw_compiler=capture("fw"),
            bw_compiler=capture("bw"),
            partition_fn=remat.make_partition_fn(policy, recompute_flops_ratio=1e9, report=report),
        )
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        loss, grads = _run(model, compiled, x)
        _assert_close(loss, grads, ref_loss, ref_grads)
        fw, bw = _collectives(graphs["fw"]), _collectives(graphs["bw"])
        assert "_c10d_functional.all_gather_into_tensor.default" in fw
        # The backward holds only the backward's own collective (reduce-scatter + wait).
        assert bw == [
            "_c10d_functional.reduce_scatter_tensor.default",
            "_c10d_functional.wait_tensor.default",
        ], (policy, bw)
        collective_nodes = [n for n in report.graphs[0].nodes if "_c10d_functional" in n.target]
        assert collective_nodes
        for node in collective_nodes:
            assert node.fate != "recomputed" and node.ban_reason, (policy, node)


def test_random_ops_are_never_recomputed() -> None:
    class Dropped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(16, 64, bias=False)
            self.b = torch.nn.Linear(64, 16, bias=False)

        def forward(self, x):
            return self.b(torch.nn.functional.dropout(torch.relu(self.a(x)), p=0.5)).pow(2).sum()

    x = torch.randn(4, 32, 16)
    results = {}
    for policy in ("none", "sequence-aware"):
        torch.manual_seed(0)
        model = Dropped()
        report = remat.RematReport()
        torch._dynamo.reset()
        compiled = torch.compile(
            model,
            backend=remat.backend(
                policy, backend="aot_eager", recompute_flops_ratio=1e9, report=report
            ),
            fullgraph=True,
        )
        torch.manual_seed(123)
        results[policy] = _run(model, compiled, x)
        random_nodes = [
            n for n in report.graphs[0].nodes if n.ban_reason in ("random op", "policy 'none'")
            and ("dropout" in n.target or "rand" in n.target or "bernoulli" in n.target)
        ]
        assert random_nodes, [n.target for n in report.graphs[0].nodes]
        assert all(n.fate != "recomputed" for n in random_nodes)
    # Same seed, same masks: recomputing anything else must not change the result.
    _assert_close(*results["sequence-aware"], *results["none"])


# ------------------------------------------------------------------------------------------
# Errors users can hit


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(AutospError, match=r"\[remat\] unknown policy 'fast'; expected one of "
                       r"'none', 'default', 'sequence-aware', a MemoryBudget or an Offload"):
        remat.make_partition_fn("fast")
    with pytest.raises(AutospError, match=r"\[remat\] unknown policy 'fast'"):
        remat.make_partition_fn(remat.Offload("fast"))
    with pytest.raises(AutospError, match=r"Offload\(policy=...\) takes a policy name or a "
                       r"MemoryBudget, got 3"):
        remat.Offload(3)
    with pytest.raises(AutospError, match=r"takes a policy name or a MemoryBudget"):
        remat.Offload(remat.Offload())
    with pytest.raises(AutospError, match=r"Offload\(saved=...\) found 'everything'; expected one "
                                          r"of 'layer outputs', 'all'"):
        remat.Offload(saved="everything")
    # Offloading is part of the partitioner's cache identity.
    assert remat._cache_key(remat.Offload(), 0.1) != remat._cache_key("sequence-aware", 0.1)
    assert remat._cache_key(remat.Offload(), 0.1) != remat._cache_key(remat.Offload(saved="all"), 0.1)
    with pytest.raises(AutospError, match=r"\[remat\] unknown backend 'tvm'"):
        remat.backend("none", backend="tvm")
    with pytest.raises(AutospError, match=r"recompute_flops_ratio must be a finite number >= 0, got -1"):
        remat.make_partition_fn("sequence-aware", recompute_flops_ratio=-1)


def test_memory_budget_is_validated() -> None:
    with pytest.raises(AutospError, match=r"exactly one of bytes= or fraction="):
        remat.MemoryBudget()
    with pytest.raises(AutospError, match=r"exactly one of bytes= or fraction="):
        remat.MemoryBudget(bytes=10, fraction=0.5)
    with pytest.raises(AutospError, match=r"fraction must be in \(0, 1\], got 1.5"):
        remat.MemoryBudget(fraction=1.5)
    with pytest.raises(AutospError, match=r"bytes must be an int >= 0, got -4"):
        remat.MemoryBudget(bytes=-4)


def test_unreachable_budget_is_a_clear_error() -> None:
    model = _model()
    ids, labels = _batch()
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend=remat.backend(remat.MemoryBudget(bytes=1024), backend="aot_eager")
    )
    with pytest.raises(Exception) as info:
        compiled(ids, labels)
    err = info.value
    # Dynamo wraps backend errors in BackendCompilerFailed, whose message carries ours.
    err = getattr(err, "inner_exception", err)
    assert isinstance(err, AutospError), repr(info.value)
    message = str(err)
    assert message.startswith("[remat] memory budget of 1024 bytes cannot be met: recomputing "
                              "everything the sequence-aware policy allows")
    assert "attention, collectives and random ops are never recomputed" in message
    assert message.endswith("[policy sequence-aware, budget 1024 bytes; joint graph of 485 nodes]")


# ------------------------------------------------------------------------------------------
# Inductor


# 21 s of the default suite's 20 minutes. By default, Inductor's use of autosp's partitioner
# (a report filled) and exactness through it are test_compile_cache.py's
# test_second_process_hits_aot_autograds_cache_and_stays_exact (world 2, sequence-aware).
@pytest.mark.slow
def test_inductor_uses_the_partitioner() -> None:
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=86, num_layers=1, num_heads=2,
        num_kv_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids, labels = _batch(256)
    ref_loss, ref_grads = _run(model, model, ids, labels)
    report = remat.RematReport()
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend=remat.backend("sequence-aware", backend="inductor", report=report),
        fullgraph=True,
    )
    loss, grads = _run(model, compiled, ids, labels)
    assert len(report.graphs) == 1 and report.graphs[0].saved_bytes > 0
    _assert_close(loss, grads, ref_loss, ref_grads)


class _Block(torch.nn.Module):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.RMSNorm(32), torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        if self.out == "view":
            return y.view(y.shape[0], y.shape[1], 2, -1).flatten(2)
        if self.out == "strided":  # a transposed view of a transposed copy: not contiguous
            return y.transpose(1, 2).contiguous().transpose(1, 2)
        return y


class _Stack(torch.nn.Module):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.layers = torch.nn.ModuleList([_Block(out) for _ in range(3)])
        self.head = torch.nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("out", ["tensor", "view", "strided"])
def test_offload_reports_what_moved_and_warns_when_nothing_can(out: str) -> None:
    """Layers handing plain tensors on: the saved hidden states between layers are copied (2
    here, [2, 64, 32] fp32 each). Layers ending in a contiguous view: PyTorch's pass does not
    offload views, so the partitioner hands it a copy of each; the same 2 move, exact. Layers
    ending in a strided view: nothing moves (the pass copies contiguous tensors only), the
    report says 0 bytes (before, it said the chosen bytes: found by a breaker) and a warning
    says why."""
    import warnings

    torch.manual_seed(0)
    model = _Stack(out)
    ids = torch.randint(0, 50, (2, 64), generator=torch.Generator().manual_seed(0))
    model(ids).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    report = remat.RematReport()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=remat.backend(remat.Offload(), backend="aot_eager",
                                                          report=report))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(ids).backward()
    for p, r in zip(model.parameters(), ref):
        assert torch.allclose(p.grad, r, rtol=1e-5, atol=1e-7)
    graph = report.graphs[0]
    said = [str(w.message) for w in caught if "[remat] Offload" in str(w.message)]
    if out == "strided":
        assert graph.offload_copies == 0 and graph.offloaded_bytes == 0
        assert said and "nothing offloaded" in said[0], said
    else:
        assert graph.offload_copies == 2 and graph.offloaded_bytes == 2 * 2 * 64 * 32 * 4
        assert not said, said
