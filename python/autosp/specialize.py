"""Static shapes per call (``autosp.compile(..., dynamic=False)``).

autosp plans on Dynamo's trace with the sequence length symbolic: it finds the sequence dims
by their symbol, and one plan serves every length. AOTAutograd and Inductor, though, compile a
graph with symbolic sizes more slowly than a static one (measured in fresh processes: autosp's
first call 0.85x at 2 layers and 0.64x at 16 with static S; docs/compile_time.md, "Static
against dynamic S"). With ``dynamic=False`` the backend returns a :class:`PerShapeCompiled`
instead of compiling: at the first call with given input shapes it compiles a copy of the
applied graph on static fake copies of the call's tensors, and reuses that for every later
call with the same shapes, strides and integer inputs.

The compile happens where PyTorch's own backend specialisations compile (Dynamo's
``specialized_dispatch``): at the call, on static fake copies of its inputs. Every size is then
a constant of the compiled graph, so nothing it assumes needs a guard: the shapes are the key.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx

from autosp import shared_compile
from autosp.compile_cache import STATIC_INPUTS
from autosp.errors import AutospError

#: A bound on the graphs one shape compiles from (autosp.backend makes each attempt change
#: some layer's admissions, so they end; this only guards against a fault of autosp's).
_MAX_RETEMPLATES = 8

#: Distinct shapes after which a warning suggests ``dynamic=True`` (each one compiles anew).
WARN_AFTER = 8


def shape_key(args: tuple) -> tuple:
    """What a static compile is specialised on: each tensor's shape, strides, dtype and device,
    and the value of each other argument (the integers that stand for symbolic sizes)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad))
        elif isinstance(a, (int, float, bool)) or a is None:
            key.append(a)
        else:
            key.append(type(a).__name__)
    return tuple(key)


class Retemplate(AutospError):
    """Raised by a compile function: compile this shape from ``template`` instead (a graph
    outlined again by its layers' admissions, autosp.remat_regions)."""

    def __init__(self, template: fx.GraphModule) -> None:
        super().__init__("a shape's graph outlined again")
        self.template = template


def _forget_unbacked_bindings(gm: fx.GraphModule) -> None:
    """Drop the data-dependent symbols Dynamo bound at ``gm``'s nodes (``torch.where(mask)`` in
    MoE routing makes one). AOTAutograd's retrace renames the symbol it makes at such a node to
    the one in its meta, which a static compile's own shape env never had: the symbols share a
    name (u0) and PyTorch stops ("u0 possible memo disaster"), or, named apart, it has no range
    for Dynamo's (found by breaker helper-48: a top-2 MoE with ``dynamic=False``). The retrace's
    own symbols serve the static compile, as its sizes do."""
    for node in gm.graph.nodes:
        node.meta.pop("unbacked_bindings", None)


class PerShapeCompiled:
    """The applied graph ``gm`` compiled (by ``compile_fn(gm, example_inputs)``) once per
    distinct :func:`shape_key` of its inputs, at the first call with them. ``shapes`` lists
    the keys compiled so far, in order; ``seconds`` the time each compile took."""

    def __init__(self, gm: fx.GraphModule, compile_fn: Callable[[fx.GraphModule, list], Callable],
                 rank: int | None = None, share: bool = False, last: bool = False):
        self._template = gm  # never compiled itself: each shape compiles a copy of its graph
        self._compile = compile_fn
        # With a rank, ``gm`` takes it as its last input (autosp.apply.RankContext.rank_input):
        # appended to every call, and compiled as a symbol, so that the ranks of a group
        # compile one graph (autosp.shared_compile).
        self._rank = rank
        self._share = share  # a compile waits for another rank's of the same graph
        # Whether this is the last rank of its group, whose part is the one that differs where
        # a shift or a halo makes an offset: it never waits for the others' compile, nor they
        # for its.
        self._last = last
        self._compiled: dict[tuple, Callable] = {}
        self.shapes: list[tuple] = []
        self.seconds: list[float] = []
        # Per compile, with a rank: the rank's sympy symbol and the guards it put on it
        # (shared_compile.rank_guards; what decides which ranks the compile serves).
        self.rank_guards: list[tuple[Any, list]] = []

    def _copy(self, args: tuple, template: fx.GraphModule | None = None
              ) -> tuple[fx.GraphModule, list[int]]:
        """A copy of the graph with every integer input (a symbolic size at capture) replaced by
        its value in ``args`` and dropped from the inputs, and the positions of the inputs the
        copy keeps. AOTAutograd makes an integer input a symbol, so left as an input, what is
        computed from it (the rotary table's length, a region's operand) would be compiled with
        a symbolic size. The shape key holds these values, so each copy serves only them."""
        template = template if template is not None else self._template
        gm = fx.GraphModule(template, copy.deepcopy(template.graph))
        gm.meta = dict(template.meta)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        rank_at = len(args) - 1 if self._rank is not None else -1
        baked = {i for i, a in enumerate(args) if type(a) is int and i != rank_at}
        for i in baked:
            _bake(placeholders[i], args[i])
        if baked and not _bake_regions(gm):  # a region cannot take a literal: keep the symbols
            return self._copy((), template)[0], list(range(len(args)))
        for i in baked:
            gm.graph.erase_node(placeholders[i])
        gm.recompile()
        return gm, [i for i in range(len(args)) if i not in baked]

    def _compile_static(self, args: tuple, template: fx.GraphModule | None = None,
                        attempts: int = 0) -> Callable:
        """Compiles a copy of the graph for ``args``' shapes: static fake copies of the
        tensors in a fake mode with a shape env of its own (no symbol in it, so nothing to
        guard), traced in a tracing context of that mode as Dynamo traces, so that PyTorch's
        AOTAutograd and FX graph caches take the result (they bypass a graph without a shape
        env)."""
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        gm, keep = self._copy(args, template)
        gm.meta[STATIC_INPUTS] = True  # keys its remat report by these sizes (compile_cache)
        _forget_unbacked_bindings(gm)
        inputs = [fake_mode.from_tensor(args[i], static_shapes=True)
                  if isinstance(args[i], torch.Tensor) else args[i] for i in keep]
        if self._rank is not None:
            inputs[-1] = shared_compile.rank_symbol(fake_mode.shape_env, self._rank)
        try:
            same = shape_key(args[:-1] if self._rank is not None else args) + (self._last,)
            with tracing(TracingContext(fake_mode)), \
                    shared_compile.one_at_a_time(gm, same, self._share):
                fn = self._compile(gm, inputs)
        except Retemplate as again:  # this shape compiles another graph
            if attempts >= _MAX_RETEMPLATES:
                raise AutospError(f"[autosp:compile] internal error: {again} "
                                  f"{attempts + 1} times; compile with regions=False and "
                                  "report this") from None
            return self._compile_static(args, again.template, attempts + 1)
        if self._rank is not None:
            self.rank_guards.append(shared_compile.rank_guards(fake_mode.shape_env, inputs[-1]))
        if len(keep) == len(args):
            return fn
        return lambda *a: fn(*[a[i] for i in keep])

    def __call__(self, *args: Any) -> Any:
        if self._rank is not None:
            args = args + (self._rank,)
        key = shape_key(args)
        fn = self._compiled.get(key)
        if fn is None:
            start = time.perf_counter()
            fn = self._compile_static(args)
            self._compiled[key] = fn
            self.shapes.append(key)
            self.seconds.append(time.perf_counter() - start)
            if len(self.shapes) == WARN_AFTER + 1:
                warnings.warn(
                    f"[autosp:compile] dynamic=False has compiled this graph for {len(self.shapes)} "
                    "distinct input shapes, each a full compile; pass dynamic=True to compile "
                    "one graph for every sequence length instead.", stacklevel=2)
        return fn(*args)


def _bake(ph: fx.Node, value: int) -> None:
    """Replaces every use of the placeholder ``ph`` by the integer ``value``."""
    def sub(a: Any) -> Any:
        return value if a is ph else a

    for user in list(ph.users):
        user.args = torch.fx.node.map_aggregate(user.args, sub)
        user.kwargs = torch.fx.node.map_aggregate(user.kwargs, sub)


def _bake_regions(gm: fx.GraphModule) -> bool:
    """After :func:`_bake`, an ``invoke_subgraph`` call (autosp.outline) may pass a literal
    integer, which PyTorch's region compile does not take (its subgraph placeholder then has no
    value). Where every call of a subgraph passes one value at a position, the subgraph gets a
    copy with that value in place of the placeholder, and the calls drop the operand. False
    when the calls of a subgraph pass different literals at one position."""
    calls: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph:
            calls.setdefault(n.args[0].target, []).append(n)
    for name, nodes in calls.items():
        operands = [n.args[2:] for n in nodes]
        literal = {i for i, a in enumerate(operands[0]) if not isinstance(a, fx.Node)}
        for ops in operands:
            if {i for i, a in enumerate(ops) if not isinstance(a, fx.Node)} != literal:
                return False
            if any(ops[i] != operands[0][i] for i in literal):
                return False
        if not literal:
            continue
        sub = getattr(gm, name)
        graph = copy.deepcopy(sub.graph)
        phs = [p for p in graph.nodes if p.op == "placeholder"]
        for i in literal:
            _bake(phs[i], operands[0][i])
            graph.erase_node(phs[i])
        gm.add_submodule(name, fx.GraphModule(sub, graph))
        for n in nodes:
            n.args = n.args[:2] + tuple(a for i, a in enumerate(n.args[2:]) if i not in literal)
    return True
