"""Breaker round (helper-54) on the partition function's in-place CSE, in-place dead-code
elimination and fast subgraph extraction (autosp.remat_graphs.cse_in_place /
eliminate_dead_code, autosp.remat_extract.fast_extraction).

Each case compiles a model twice with autosp's partition function. The first compile uses
autosp's path as shipped. The second uses PyTorch's path: ``Graph.eliminate_dead_code``,
``fx_graph_cse`` copying into a new graph, and PyTorch's own
``_extract_graph_with_inputs_outputs``. The forward and backward graphs handed to the
compilers are then compared: code, nodes, metadata keys, find_nodes order and namespace.
Some cases also train end to end through ``autosp.remat.backend(..., backend="aot_eager")``
and compare the result with eager and with PyTorch's path.

Found (fixed): ``cse_in_place`` first used an exact key, while PyTorch's CSE looks a node up by
the ``hash`` of its flattened arguments, and only the FIRST node with that hash holds the slot.
With ``hash(-1) == hash(-2)`` in CPython, or a ``torch.Size`` that pytree flattens to the same
leaves as a list, a third node that repeats the second is compared with the first and KEPT.
For ``h.sum(-1)``, ``h.sum(-2)``, ``h.sum(-2)`` PyTorch's graphs keep two
``sum.dim_IntList(mm, [-2])`` and save ``exp, sum_5``; autosp's kept one and saved ``sum_3``.
Training was exact (a correct CSE), but the graphs, and the saved set, were not PyTorch's.
``cse_in_place`` now looks nodes up as PyTorch does.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.compile_utils import fx_graph_cse
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autosp.remat as remat
import autosp.remat_extract as remat_extract
import autosp.remat_partition as remat_partition
from autosp.remat import MemoryBudget, Offload
from autosp.remat_graphs import cse_in_place


# ----------------------------------------------------------------------------------------------
# Harness


def _described(gm: fx.GraphModule) -> tuple:
    namespace = gm.graph._graph_namespace
    nodes = [(n.format_node(), type(n.kwargs), sorted(n.meta)) for n in gm.graph.nodes]
    output = gm.graph.output_node()
    order = [[n.name for n in gm.graph.find_nodes(op=op, sort=False)]
             for op in ("placeholder", "get_attr")]
    return (gm.code, nodes, order, sorted(namespace._used_names), dict(namespace._base_count),
            sorted(output.meta), repr(output.meta.get("desc")))


@contextlib.contextmanager
def _pytorch_path():
    """The partition function as before 2911ff2: FX's dead-code elimination, PyTorch's CSE
    copy and PyTorch's extraction."""
    saved = (remat_partition.eliminate_dead_code, remat_partition.cse_in_place,
             remat_partition.fast_extraction)
    remat_partition.eliminate_dead_code = lambda graph: graph.eliminate_dead_code()
    remat_partition.cse_in_place = lambda gm: False
    remat_partition.fast_extraction = contextlib.nullcontext
    try:
        yield
    finally:
        (remat_partition.eliminate_dead_code, remat_partition.cse_in_place,
         remat_partition.fast_extraction) = saved


def _inputs(inputs, step):
    return inputs(step) if callable(inputs) else inputs


def _graphs(make, policy, pytorch: bool, *, dynamic=None, scalar=False, mark=None, steps=1):
    """The forward and backward graphs (described) that AOTAutograd hands the compilers, and the
    losses of ``steps`` steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs, loss_fn = make()
    graphs = []

    def compiler(kind):
        def compile_(gm, example_inputs):
            graphs.append((kind, _described(gm)))
            return boxed_nop(gm, example_inputs)
        return compile_

    backend = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"),
                           partition_fn=remat.make_partition_fn(policy),
                           keep_inference_input_mutations=True)
    losses = []
    with (_pytorch_path() if pytorch else contextlib.nullcontext()), \
            torch._dynamo.config.patch(capture_scalar_outputs=scalar):
        compiled = torch.compile(model, backend=backend, dynamic=dynamic)
        for step in range(steps):
            torch.manual_seed(100 + step)
            args = _inputs(inputs, step)
            if mark is not None:
                mark(args)
            loss = loss_fn(compiled(*args))
            loss.backward()
            losses.append(loss.detach())
    return graphs, losses


def _first_difference(ours, theirs) -> str | None:
    if len(ours) != len(theirs):
        return f"{len(ours)} graphs against PyTorch's {len(theirs)}"
    fields = ("code", "nodes", "find_nodes order", "used names", "base counts", "output meta",
              "output desc")
    for (kind, a), (_, b) in zip(ours, theirs):
        for field, x, y in zip(fields, a, b):
            if x != y:
                if field == "code":
                    return f"{kind} code:\n--- autosp\n{x}\n--- PyTorch\n{y}"
                return f"{kind} {field}: {x!r} != {y!r}"
    return None


def _compare(make, policy, **kw) -> None:
    ours, our_losses = _graphs(make, policy, pytorch=False, **kw)
    theirs, their_losses = _graphs(make, policy, pytorch=True, **kw)
    difference = _first_difference(ours, theirs)
    assert difference is None, difference
    for a, b in zip(our_losses, their_losses):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# In-place CSE against fx_graph_cse where two argument lists hash alike (failed before)


def _unsqueezes(graph: fx.Graph) -> None:
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.ops.aten.unsqueeze.default, (x, d)) for d in (-1, -2, -2)]
    graph.output(tuple(nodes))


def _transposes(graph: fx.Graph) -> None:
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.ops.aten.transpose.int, (x, *dims))
             for dims in ((-2, -1), (-1, -2), (-1, -2))]
    graph.output(tuple(nodes))


def _size_then_lists(graph: fx.Graph) -> None:
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.ops.aten.view.default, (x, shape))
             for shape in (torch.Size([4]), [4], [4])]
    graph.output(tuple(nodes))


@pytest.mark.parametrize("build", [_unsqueezes, _transposes, _size_then_lists],
                         ids=["unsqueeze(-1),(-2),(-2)", "transpose(-2,-1),(-1,-2)x2",
                              "view(Size),view(list)x2"])
def test_cse_in_place_keeps_what_fx_graph_cse_keeps_when_hashes_collide(build) -> None:
    """hash(-1) == hash(-2) (and pytree flattens torch.Size like a list): PyTorch's CSE keeps
    the third node, a repeat of the second, because the first holds the hash slot; so does
    autosp's in-place CSE (it removed it before)."""
    graph = fx.Graph()
    build(graph)
    theirs = [n.format_node() for n in fx_graph_cse(graph).nodes]
    gm = fx.GraphModule(nn.Module(), graph.__deepcopy__())
    assert cse_in_place(gm)
    ours = [n.format_node() for n in gm.graph.nodes]
    assert ours == theirs, f"autosp {len(ours)} nodes, PyTorch {len(theirs)}:\n{ours}\n{theirs}"


class RowAndColumnSums(nn.Module):
    """Row and column statistics of one matrix, the column one used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        return h.sum(-1).sum() + h.sum(-2).exp().sum() * h.sum(-2).sin().sum()


def test_row_and_column_sums_partition_like_pytorch() -> None:
    """PyTorch's keeps a second sum(mm, [-2]) (sum_5) and saves exp and sum_5; so does
    autosp's (it kept one and saved sum_3 before)."""
    _compare(lambda: (RowAndColumnSums(), (torch.randn(4, 4, requires_grad=True),),
                      lambda out: out), "default")


# ----------------------------------------------------------------------------------------------
# Held: the same graphs as PyTorch's path


class CheckpointDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def block(self, x):
        return F.dropout(torch.sin(self.a(x)), 0.5) * self.b(x).relu()

    def forward(self, x):
        y = checkpoint(self.block, x, use_reentrant=False)
        return checkpoint(self.block, y, use_reentrant=False).sum()


def _must_save_mm(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Selective(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))

    def block(self, x):
        h = F.dropout(torch.mm(x, self.w1).sin(), 0.5)
        return torch.mm(h, self.w2).cos() + torch.rand_like(h)

    def forward(self, x):
        context = functools.partial(create_selective_checkpoint_contexts, _must_save_mm)
        y = checkpoint(self.block, x, use_reentrant=False, context_fn=context)
        return checkpoint(self.block, y, use_reentrant=False, context_fn=context).sum()


class Dynamic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        b, t = x.shape[:2]
        h = self.lin(x).view(b * t, 8).softmax(-1)
        return h[: b * t - 1].reshape(-1, 2, 4).sum() * t + h.new_zeros(t, b).sum()


def _mark_dynamic(args):
    torch._dynamo.mark_dynamic(args[0], 0)
    torch._dynamo.mark_dynamic(args[0], 1)


class Stash(torch.autograd.Function):
    """One tensor kept on ctx (saved without a version check: PyTorch's second backward
    extraction takes the inputs in another order)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.x = x
        ctx.save_for_backward(y)
        return x * y.sin()

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y.sin(), g * ctx.x * y.cos()


class Stashing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        p, q = self.a(x).tanh(), self.b(x).exp()
        return Stash.apply(p, q).sum() + Stash.apply(q, p).sum()


class Unbacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        k = (x > 0).sum().item()
        torch._check(k >= 0)
        return (x @ self.w).sin().sum() * k + x.new_ones(k).sum()


@torch.library.custom_op("brk54::scale", mutates_args=())
def _scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


_scale.register_fake(lambda x, s: torch.empty_like(x))
_scale.register_autograd(lambda ctx, g: (g * ctx.s, None),
                         setup_context=lambda ctx, inputs, output: setattr(ctx, "s", inputs[1]))


@torch.library.custom_op("brk54::accumulate", mutates_args=("buf",))
def _accumulate(buf: torch.Tensor, x: torch.Tensor) -> None:
    buf.add_(x.detach())


_accumulate.register_fake(lambda buf, x: None)


class CustomOps(nn.Module):
    """A custom op twice (CSE), a mutating custom op on a buffer, outputs that alias."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("acc", torch.zeros(4, 8))

    def forward(self, x):
        h = _scale(self.lin(x), 2.0)
        _accumulate(self.acc, h)
        return (h * h).sum() + _scale(self.lin(x), 2.0).sum(), h.detach(), h.view(-1)


class Aliasing(nn.Module):
    """Views of one value and of an input as outputs, an output without grad, a buffer and an
    input written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x, y):
        h = self.bn(self.lin(x))
        y.mul_(2)
        v = h.view(2, -1)
        return h, v, v[0], h.t(), (h > 0).sum(), x.view(-1), h.detach() * 3


class Constants(nn.Module):
    """The same op with 1, 1.0, True and int/float alpha: CSE must keep them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        a, b, c, e = x + 1, x + 1.0, x + True, x + 1
        f, g = torch.add(x, 1, alpha=2), torch.add(x, 1, alpha=2.0)
        return ((a * b * c * e * f * g) @ self.w).sum() + (x.double() + 1).sum()


class ComplexAndInt(nn.Module):
    """A complex constant (an argument the in-place CSE does not mirror: PyTorch's copy) and
    integer tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.complex64))

    def forward(self, x):
        z = torch.fft.fft(x.to(torch.complex64)) @ self.w
        i = (x.abs() * 10).long() % 3
        return (z * 1j).abs().sum() + (z.real * i).sum() + i.sum()


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return F.dropout(torch.tanh(self.lin(x)), 0.1) + x


class Regions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x)) + x
        return x.pow(2).mean()


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.b(self.a(x).relu())
        return h.float().pow(2).mean()


def _x(*shape):
    return lambda: torch.randn(*shape, requires_grad=True)


def _total(out):
    return out if not isinstance(out, tuple) else out[0]


HELD = {
    "checkpoint-dropout": (lambda: (CheckpointDropout(), (_x(4, 8)(),), _total),
                           ("default", "sequence-aware"), {}),
    "selective-checkpoint": (lambda: (Selective(), (_x(4, 8)(),), _total), ("default",), {}),
    "mark-dynamic": (lambda: (Dynamic(), (lambda s: (torch.randn(2, 5 + s, 8,
                                                                 requires_grad=True),)), _total),
                     ("default", "none"), {"mark": _mark_dynamic, "steps": 2}),
    "ctx-stash": (lambda: (Stashing(), (_x(4, 8)(),), _total), ("default",), {}),
    "unbacked-item": (lambda: (Unbacked(), (_x(6, 8)(),), _total), ("default",),
                      {"scalar": True}),
    "custom-ops": (lambda: (CustomOps(), (_x(4, 8)(),),
                            lambda o: o[0] + o[2].sum()), ("default", "none"), {}),
    "aliasing-outputs": (lambda: (Aliasing(), (_x(4, 8)(), torch.randn(3)),
                                  lambda o: o[0].sum() + o[1].pow(2).sum()
                                  + o[2].sum() * o[3].sum() + o[5].sum()), ("default",), {}),
    "cse-constants": (lambda: (Constants(), (_x(4, 8)(),), _total), ("default",), {}),
    "complex-int": (lambda: (ComplexAndInt(), (_x(4, 8)(),), _total), ("default",), {}),
    "regions-dropout": (lambda: (Regions(), (_x(4, 8)(),), _total), ("sequence-aware",), {}),
    "offload-budget": (lambda: (Residual(), (_x(64, 32)(),), _total),
                       (Offload("default"), MemoryBudget(fraction=0.9)), {}),
    "autocast-bf16": (lambda: (Autocast(), (_x(4, 8)(),), _total), ("default",), {}),
}


@pytest.mark.parametrize("name,policy", [(name, policy) for name, (_, policies, _) in
                                         HELD.items() for policy in policies],
                         ids=lambda v: v if isinstance(v, str) else str(v)[:24])
def test_graphs_match_pytorch_path(name, policy) -> None:
    make, _, kw = HELD[name]
    _compare(make, policy, **kw)


def test_second_backward_reuse_was_exercised(monkeypatch) -> None:
    """The cases above that reorder the second backward's inputs took the reuse path (so the
    match above covers it): dynamic sizes (symbols bound first) and a ctx-stashed tensor (saved
    without a version check, last)."""
    hits = []
    build = remat_extract._build

    def counted(built, *args, **kwargs):
        hits.append(bool(built.kept) and built.subgraph == "backward")  # extended
        return build(built, *args, **kwargs)

    monkeypatch.setattr(remat_extract, "_build", counted)
    for name in ("mark-dynamic", "ctx-stash"):
        hits.clear()
        make, _, kw = HELD[name]
        _graphs(make, "default", pytorch=False, **kw)
        assert any(hits), name


def test_fallback_random_keeps_dead_random_ops_like_pytorch() -> None:
    """With Inductor's fallback_random, dead random draws are impure: kept in the joint graph
    and, for a draw without inputs, copied into the backward too, as PyTorch does."""
    class Draws(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            torch.rand(3)
            return (F.dropout(self.lin(x), 0.5) + torch.randn(4, 8)).sum()

    with torch._inductor.config.patch(fallback_random=True):
        _compare(lambda: (Draws(), (_x(4, 8)(),), _total), "default")


# ----------------------------------------------------------------------------------------------
# Held: training end to end (autosp.remat.backend, aot_eager) is PyTorch's path's, bit for bit,
# and eager's


def _train(make, policy, pytorch=False, steps=2, scalar=False, dynamic=None):
    """Losses and gradients of ``steps`` steps: compiled with ``policy`` (eager where None)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs, loss_fn = make()
    losses = []
    with (_pytorch_path() if pytorch else contextlib.nullcontext()), \
            torch._dynamo.config.patch(capture_scalar_outputs=scalar):
        run = model if policy is None else torch.compile(
            model, backend=remat.backend(policy, backend="aot_eager"), dynamic=dynamic)
        for step in range(steps):
            torch.manual_seed(100 + step)
            loss = loss_fn(run(*_inputs(inputs, step)))
            loss.backward()
            losses.append(loss.detach())
    return losses, [p.grad for p in model.parameters()]


TRAINED = {
    "checkpoint-dropout": (lambda: (CheckpointDropout(), (_x(4, 8)(),), _total), {}),
    "unbacked-item": (lambda: (Unbacked(), (lambda s: (torch.randn(6, 8, requires_grad=True),)),
                               _total), {"scalar": True}),
    "dynamic": (lambda: (Dynamic(), (lambda s: (torch.randn(2, 5 + 2 * s, 8,
                                                            requires_grad=True),)), _total),
                {"dynamic": True}),
}


@pytest.mark.parametrize("name", sorted(TRAINED))
@pytest.mark.parametrize("policy", ["default", "sequence-aware"])
def test_training_is_exact(name, policy) -> None:
    make, kw = TRAINED[name]
    ours = _train(make, policy, pytorch=False, **kw)
    theirs = _train(make, policy, pytorch=True, **kw)
    eager = _train(make, None)
    for a, b, c in zip(ours[0] + ours[1], theirs[0] + theirs[1], eager[0] + eager[1]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
