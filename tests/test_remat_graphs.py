"""autosp's partition function gives PyTorch's graphs without PyTorch's copies: the in-place CSE
and dead-code elimination (autosp.remat_graphs) and the subgraph extraction that copies only
what it keeps (autosp.remat_extract). Each is compared with PyTorch's own on joint graphs of
several kinds of model: same code, node names, metadata and namespace."""

from __future__ import annotations

import contextlib
import functools
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.compile_utils import fx_graph_cse
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx._lazy_graph_module import _make_graph_module

import autosp.remat as remat
import autosp.remat_extract as remat_extract
import autosp.remat_partition as remat_partition
from autosp.models.llama import LlamaConfig, LlamaForCausalLM
from autosp.remat_graphs import cse_in_place, eliminate_dead_code


class Repeats(nn.Module):
    """Work CSE removes (the same matmul and sine twice), random draws it must keep apart, an
    output that aliases a value, and a buffer written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.sin(x @ self.w)
        b = torch.sin(x @ self.w)
        d = F.dropout(a, 0.5) + F.dropout(a, 0.5)
        self.steps.add_(1)
        y = (a + b + d) * torch.sin(x @ self.w.t().t())
        return y.sum() + self.steps, a.view(-1)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class Regions(nn.Module):
    """Layers compiled once (invoke_subgraph): the joint graph reads its subgraphs by get_attr."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


class Asserts(nn.Module):
    """A size read from the data (an unbacked symbol): the joint graph asserts on it, nodes that
    nothing uses but that no elimination may remove."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = (x > 0).sum().item()
        torch._check(n >= 0)
        torch._check(n <= x.numel())
        return (x @ self.w).sin().sum() * n


def _llama() -> tuple[nn.Module, tuple, bool]:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=86, num_layers=2,
                      num_heads=2, num_kv_heads=2)
    ids = torch.randint(0, 64, (1, 64))
    return LlamaForCausalLM(cfg), (ids, ids), False


MODELS = {
    "llama": _llama,
    "llama-dynamic": lambda: (*_llama()[:2], True),
    "asserts": lambda: (Asserts(), (torch.randn(4, 8, requires_grad=True),), False),
    "repeats": lambda: (Repeats(), (torch.randn(4, 16, requires_grad=True),), False),
    "regions": lambda: (Regions(), (torch.randn(4, 16, requires_grad=True),), False),
}


@functools.lru_cache(maxsize=None)
def _joints(name: str) -> list[tuple[fx.GraphModule, object, dict]]:
    """The joint graphs AOTAutograd hands a partition function for MODELS[name] (each test
    works on copies)."""
    torch.manual_seed(0)
    model, inputs, dynamic = MODELS[name]()
    joints = []

    def capture(joint, joint_inputs, **kwargs):
        joints.append((fx.GraphModule(joint, joint.graph.__deepcopy__()), joint_inputs, kwargs))
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=capture)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    (out[0] if isinstance(out, tuple) else out).backward()
    assert joints, name
    return joints


def _copy(joint: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(joint, joint.graph.__deepcopy__())


def _described(gm: fx.GraphModule, code: bool = True) -> tuple:
    """The module's code (``code``: the joint graph's CSE'd in place keeps its pytree calling
    convention, unlike PyTorch's copy, but no code of it is run) and, node by node, what FX
    prints, the metadata's keys, and the namespace nodes added later take their names from."""
    namespace = gm.graph._graph_namespace
    nodes = [(n.format_node(), type(n.kwargs), sorted(n.meta)) for n in gm.graph.nodes]
    output = gm.graph.output_node()
    order = [[n.name for n in gm.graph.find_nodes(op=op, sort=False)]
             for op in ("placeholder", "get_attr")]
    return (gm.code if code else None, nodes, order, sorted(namespace._used_names),
            dict(namespace._base_count), sorted(output.meta), repr(output.meta.get("desc")))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cse_and_dead_code_in_place_match_pytorch(name: str) -> None:
    removed = 0
    for joint, _, _ in _joints(name):
        theirs = _copy(joint)
        theirs.graph.eliminate_dead_code()
        theirs = _make_graph_module(theirs, fx_graph_cse(theirs.graph))
        ours = _copy(joint)
        eliminate_dead_code(ours.graph)
        assert cse_in_place(ours)
        assert _described(ours, code=False) == _described(theirs, code=False)
        removed += len(joint.graph.nodes) - len(ours.graph.nodes)
    if name == "repeats":  # the in-place removal itself was exercised
        assert removed >= 3, removed
    if name == "asserts":  # and nodes no one uses that must stay
        assert any(n.target is torch.ops.aten._assert_scalar.default and not n.users
                   for n in ours.graph.nodes)


def test_dead_code_keeps_what_fx_keeps() -> None:
    """Dead pure nodes go; a dead random draw, in-place write and print stay, as in FX's."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    unused = graph.placeholder("unused")
    graph.call_function(torch.ops.aten.sin.default, (x,))
    graph.call_function(torch.ops.aten.rand_like.default, (x,))
    graph.call_function(torch.ops.aten.add_.Tensor, (unused, x))
    dead = graph.call_function(torch.ops.aten.cos.default, (x,))
    graph.call_function(torch.ops.aten.neg.default, (dead,))
    graph.call_function(torch.ops.aten._print.default, ("hi",))
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (x, x)))
    theirs = graph.__deepcopy__()
    assert theirs.eliminate_dead_code() is True
    assert eliminate_dead_code(graph) is True
    assert [n.format_node() for n in graph.nodes] == [n.format_node() for n in theirs.nodes]
    assert {str(n.target) for n in graph.nodes} >= {"aten.rand_like.default", "aten.add_.Tensor",
                                                     "aten._print.default"}
    assert eliminate_dead_code(graph) is False


def test_cse_leaves_a_graph_it_does_not_mirror_alone() -> None:
    """An argument of a kind the in-place CSE does not mirror (here a slice): it changes nothing
    and says so, and the partition function runs PyTorch's CSE."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(operator.getitem, (x, slice(0, 2)))
    b = graph.call_function(operator.getitem, (x, slice(0, 2)))
    graph.output((a, b))
    gm = fx.GraphModule(nn.Module(), graph)
    before = gm.code
    assert cse_in_place(gm) is False
    assert gm.code == before and len(graph.nodes) == 4


def _partition(joint, joint_inputs, kwargs, policy, fast: bool):
    context = remat_extract.fast_extraction if fast else contextlib.nullcontext
    original = remat_partition.fast_extraction
    remat_partition.fast_extraction = context
    try:
        return remat.make_partition_fn(policy)(_copy(joint), joint_inputs, **kwargs)
    finally:
        remat_partition.fast_extraction = original


@pytest.mark.parametrize("name", sorted(MODELS))
def test_extraction_matches_pytorch(name: str, monkeypatch) -> None:
    """The forward and backward graphs are PyTorch's (its _extract_graph_with_inputs_outputs,
    copying every node it can compute, then eliminating the dead ones), under three policies."""
    from torch._functorch import partitioners

    mirrored = remat_extract.mirrored()
    calls = []
    extract = remat_extract._extract

    def counted(*args, **kwargs):
        calls.append(1)
        return extract(*args, **kwargs)

    monkeypatch.setattr(remat_extract, "_extract", counted)
    again = []
    build = remat_extract._build

    def counted_again(built, *args, **kwargs):
        again.append(bool(built.kept))  # nodes in it already: extended
        return build(built, *args, **kwargs)

    monkeypatch.setattr(remat_extract, "_build", counted_again)
    for joint, joint_inputs, kwargs in _joints(name):
        for policy in ("default", "sequence-aware", "none"):
            ours = _partition(joint, joint_inputs, kwargs, policy, fast=True)
            theirs = _partition(joint, joint_inputs, kwargs, policy, fast=False)
            for a, b in zip(ours, theirs):
                assert _described(a) == _described(b), (name, policy)
    # Where torch has the function it mirrors, the fast path ran (torch 2.13), and a second
    # extraction from the same inputs extended the first one's graph.
    assert bool(calls) == mirrored
    assert any(again) == mirrored
    assert partitioners._extract_graph_with_inputs_outputs.__name__ == \
        "_extract_graph_with_inputs_outputs"  # put back after each partition


def test_the_fast_path_runs_on_the_torch_it_mirrors() -> None:
    """autosp.remat_extract mirrors torch 2.13.0's helpers to the letter; on that torch the fast
    path must run (a source that changed in a patch release falls back, and shows here)."""
    if torch.__version__.split("+")[0] != "2.13.0":
        pytest.skip(f"torch {torch.__version__}: PyTorch's own extraction runs")
    assert remat_extract.mirrored()


def test_a_second_extraction_from_the_same_inputs_matches_pytorch() -> None:
    """PyTorch's second backward extraction may take the same inputs in another order (symbolic
    sizes that bind a symbol first, tensors saved without a version check last): the first
    graph handed back rearranged is then the graph PyTorch builds for that order."""
    from torch._functorch import partitioners

    original = partitioners._extract_graph_with_inputs_outputs
    if not remat_extract.mirrored():
        pytest.skip("torch's extraction is not the one autosp.remat_extract mirrors")
    joint, _, kwargs = _joints("llama-dynamic")[0]
    joint = _copy(joint)
    inputs = joint.graph.find_nodes(op="placeholder")
    output = joint.graph.output_node()
    outputs = list(output.args[0])
    descs = output.meta.get("desc", [None] * len(outputs))
    reordered = inputs[::2] + inputs[1::2]
    with remat_extract.fast_extraction():
        extract = partitioners._extract_graph_with_inputs_outputs
        first = extract(joint.graph, inputs, outputs, descs, "backward", True)
        second = extract(joint.graph, reordered, outputs, descs, "backward", True)
    assert second is first  # handed back, rearranged
    theirs = original(joint.graph, reordered, outputs, descs, "backward", True)
    assert _described(fx.GraphModule(joint, second)) == _described(fx.GraphModule(joint, theirs))
    # Fewer outputs keep fewer nodes: not an extension of the graph built before.
    with remat_extract.fast_extraction():
        extract = partitioners._extract_graph_with_inputs_outputs
        extract(joint.graph, inputs, outputs, descs, "backward", True)
        fewer = extract(joint.graph, inputs, outputs[:1], descs[:1], "backward", True)
    theirs = original(joint.graph, inputs, outputs[:1], descs[:1], "backward", True)
    assert _described(fx.GraphModule(joint, fewer)) == _described(fx.GraphModule(joint, theirs))


def test_another_torch_gets_pytorchs_own_extraction(monkeypatch) -> None:
    """Where PyTorch's helpers are not the ones mirrored (another torch release), the partition
    runs PyTorch's extraction: nothing of autosp.remat_extract is called, and PyTorch's
    function is in place afterwards."""
    from torch._functorch import partitioners

    original = partitioners._extract_graph_with_inputs_outputs
    monkeypatch.setattr(remat_extract, "mirrored", lambda: False)
    monkeypatch.setattr(remat_extract, "_extract", None)  # fails if called
    joint, joint_inputs, kwargs = _joints("llama")[0]
    fw, bw = remat.make_partition_fn("default")(_copy(joint), joint_inputs, **kwargs)
    assert fw.graph.find_nodes(op="placeholder") and bw.graph.find_nodes(op="placeholder")
    assert partitioners._extract_graph_with_inputs_outputs is original


def test_a_namespace_is_filled_when_first_used_and_as_fx_fills_it() -> None:
    """An extracted graph's namespace (remat_graphs.LazyNamespace) is filled only when something
    reads it: in a partition, graphs that are extended or reordered later never are. Once used
    it names new nodes as PyTorch's graph does, and it copies as FX's own."""
    import copy

    from torch._functorch import partitioners
    from torch.fx.graph import _Namespace

    if not remat_extract.mirrored():
        pytest.skip("torch's extraction is not the one autosp.remat_extract mirrors")
    fills = []
    namespace_of = remat_extract._namespace

    def counted(*args):
        fills.append(1)
        return namespace_of(*args)

    joint, joint_inputs, kwargs = _joints("llama")[0]
    original = remat_extract._namespace
    remat_extract._namespace = counted
    try:
        fw, bw = remat.make_partition_fn("default")(_copy(joint), joint_inputs, **kwargs)
        assert fills == []  # four graphs extracted: two extended, the backward reordered
        assert fw.graph._graph_namespace._used_names  # filled now
        assert fills == [1]
    finally:
        remat_extract._namespace = original

    # A node added later gets the name PyTorch's graph gives it.
    graph = _copy(joint).graph
    inputs = graph.find_nodes(op="placeholder")
    output = graph.output_node()
    outputs, descs = list(output.args[0]), output.meta.get("desc", [None] * len(output.args[0]))
    with remat_extract.fast_extraction():
        ours = partitioners._extract_graph_with_inputs_outputs(graph, inputs, outputs, descs,
                                                                "backward", True)
    theirs = partitioners._extract_graph_with_inputs_outputs(graph, inputs, outputs, descs,
                                                              "backward", True)
    assert type(ours._graph_namespace) is not _Namespace  # not filled yet
    for g in (ours, theirs):
        first = g.find_nodes(op="placeholder")[0]
        with g.inserting_after(first):
            g.call_function(torch.ops.aten.neg.default, (first,))
            g.call_function(torch.ops.aten.mm.default, (first, first))
    assert _described(fx.GraphModule(joint, ours)) == _described(fx.GraphModule(joint, theirs))
    clone = copy.copy(ours._graph_namespace)
    assert type(clone) is _Namespace
    assert (clone._used_names, clone._base_count) == (
        theirs._graph_namespace._used_names, theirs._graph_namespace._base_count)


NAMES = ["add", "add_1", "add", "add_01", "mm_3", "mm", "mm_3", "list", "for", "input", "x_0",
         "1abc", "a-b", "_", "output", "output_2", "getitem_12", "getitem_2", "sum_1", "sum"]


@pytest.mark.parametrize("mirrored", [True, False])
def test_a_name_replay_names_as_fx_does(mirrored: bool, monkeypatch) -> None:
    """remat_graphs.NameReplay against FX's _Namespace.create_name, name by name: repeats,
    leading zeros, keywords and builtins, names FX must clean; where FX's is not the one it
    mirrors (another torch), FX's own names each."""
    from torch.fx.graph import _Namespace

    from autosp import remat_graphs

    if mirrored and not remat_graphs._mirrors_create_name():
        pytest.skip("FX's create_name is not the one NameReplay mirrors")
    monkeypatch.setattr(remat_graphs, "_mirrors_create_name", lambda: mirrored)
    replay, fx_namespace = remat_graphs.NameReplay(), _Namespace()
    for name in NAMES:
        assert replay.create_name(name) == fx_namespace.create_name(name, None), name
        assert (replay.namespace._used_names, replay.namespace._base_count) == (
            fx_namespace._used_names, fx_namespace._base_count), name


def test_an_unfilled_namespace_holds_no_joint_graph_and_a_failed_fill_fails_again() -> None:
    """The forward's namespace stays unfilled after a partition: it must not keep the joint
    graph alive (it holds names and the forward's own nodes). A fill that raises leaves the
    namespace unfilled, to raise again, not empty."""
    import gc
    import weakref

    from autosp.remat_graphs import LazyNamespace

    if not remat_extract.mirrored():
        pytest.skip("torch's extraction is not the one autosp.remat_extract mirrors")
    joint, joint_inputs, kwargs = _joints("llama")[0]
    copy = _copy(joint)
    joint_graph = weakref.ref(copy.graph)
    fw, bw = remat.make_partition_fn("default")(copy, joint_inputs, **kwargs)
    del copy
    gc.collect()
    assert type(fw.graph._graph_namespace) is LazyNamespace and \
        "_fill" in vars(fw.graph._graph_namespace)
    assert joint_graph() is None

    calls = []

    def fill(replay):
        calls.append(1)
        replay.create_name("x")
        raise KeyError("a fill that fails")

    namespace = LazyNamespace(fill)
    for _ in range(2):
        with pytest.raises(KeyError):
            namespace.create_name("y", None)
    assert calls == [1, 1]
