"""Apply a core SP plan to the FX graph it was computed from.

The plan is a core graph whose nodes either come from an FX node (``origin``), with
possibly new operands and attribute updates, or are inserted SP ops. This module
replays it: it copies FX nodes, substitutes operands at the recorded argument paths,
rewrites size arguments the plan marks local, and emits the SP ops from
``autosp.collectives`` (what communicates) and ``autosp.chunks`` (this rank's part, its
sizes, its random draws). It makes no decision of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autosp import chunks, collectives, tiled_attention, tiled_loss, tiled_rows
from autosp.bridge import BridgeResult
from autosp.apply_args import (current_reduction, node_loc, nodes_in, replaced_expr, rewrite_target, set_path,
                               set_reduction, to_mutable, to_tuples, unslice)
from autosp.canon import target_name
from autosp.errors import AutospError, at_node


@dataclass(frozen=True)
class RankContext:
    """Where this rank sits in its SP group."""

    rank: int
    world: int
    group: str  # process-group name, as functional collectives take it
    # The graph takes the rank as its last input (named RANK_INPUT) instead of holding it as a
    # constant, so that every rank of a group compiles the same graph and PyTorch's caches can
    # serve one rank's compile to the others (autosp.specialize keeps it symbolic).
    rank_input: bool = False


#: The name of the rank's placeholder in a graph applied with ``RankContext.rank_input``.
RANK_INPUT = "autosp_rank"


# Inserted SP ops whose result stands for the same single-device value as their operand (a
# chunk of it, its gradient sync, its gather, its exchange): such a node gets its operand's
# meta, the convention of copied nodes (the example value is the single-device value). The
# caches take method calls only on nodes with an example value (autosp.compile_cache). Its
# module path too (nn_module_stack, which AOTAutograd carries to the joint graph's nodes): an
# exchange inside a decoder layer belongs to that layer for remat (remat_facts._layer_of:
# Offload(saved="all") offloads what a layer saves).
_SAME_VALUE_OPS = {"sp.slice", "sp.grad_sync", "sp.reduce_partial", "sp.all_gather", "sp.check_index",
                   "sp.scan"}
_SAME_VALUE_META = ("example_value", "nn_module_stack")


def _stands_for(node: fx.Node, operand: Any) -> fx.Node:
    if isinstance(operand, fx.Node):
        for key in _SAME_VALUE_META:
            if key in operand.meta:
                node.meta[key] = operand.meta[key]
    return node


def _where(loc: Any) -> str:
    """The user's source line as a constant of the graph: its file and code, not its number.
    The compile caches key a graph by its constants; with the line number in one, a line added
    anywhere above it in the user's file made every compile miss (plain torch.compile hits)."""
    return f"{loc.file}, `{loc.code}`" if loc.code else str(loc.file or "the model")


def _in_module_of(node: fx.Node, operand: Any) -> fx.Node:
    """An inserted SP op takes its operand's module path (see _SAME_VALUE_META)."""
    if isinstance(operand, fx.Node) and "nn_module_stack" in operand.meta:
        node.meta.setdefault("nn_module_stack", operand.meta["nn_module_stack"])
    return node


_SIZE_ARG_METHODS = {"view", "reshape", "expand", "broadcast_to", "new_empty", "new_zeros", "new_ones",
                     "new_full"}


class _Replayer:
    def __init__(self, gm: fx.GraphModule, bridge: BridgeResult, plan: Any, ctx: RankContext) -> None:
        self.gm = gm
        self.bridge = bridge
        self.plan = plan
        self.ctx = ctx
        self.graph = fx.Graph()
        self.env: dict[int, fx.Node] = {}
        self.old_to_new: dict[fx.Node, fx.Node] = {}
        self.seq_node: fx.Node | None = None
        self.rank_node: fx.Node | None = None
        if ctx.rank_input:  # moved after the copied inputs once they are all made (run)
            self.rank_node = self.graph.placeholder(RANK_INPUT, type_expr=int)
            self.ctx = dataclasses.replace(ctx, rank=self.rank_node)  # type: ignore[arg-type]

    def value_node(self, vid: int) -> fx.Node:
        return self.env[vid]

    def run(self) -> fx.GraphModule:
        for cn in self.plan.graph.nodes:
            where = self.bridge.fx_nodes[cn.origin] if cn.origin >= 0 else f"the inserted {cn.op} at {cn.loc}"
            with at_node("apply", where):
                if cn.origin >= 0:
                    self.copy(cn)
                else:
                    self.insert(cn)
        if self.rank_node is not None:
            inputs = [n for n in self.graph.nodes if n.op == "placeholder" and n is not self.rank_node]
            if inputs:
                inputs[-1].append(self.rank_node)  # the last input, after Dynamo's
        self.graph.lint()
        gm = fx.GraphModule(self.gm, self.graph)
        gm.meta.update(self.gm.meta)  # Dynamo's facts about the inputs (static params, ...)
        gm.recompile()
        return gm

    # -- original nodes ------------------------------------------------------------------
    def copy(self, cn: Any) -> None:
        fxn = self.bridge.fx_nodes[cn.origin]
        paths = self.bridge.input_paths[cn.origin]
        if cn.op == "input" and fxn.op == "get_attr":
            # A constant or submodule of the graph module (flex_attention's score_mod graph).
            nn = self.graph.get_attr(fxn.target)
            nn.meta = copy.copy(fxn.meta)
        elif cn.op == "input":
            nn = self.graph.placeholder(fxn.name, type_expr=fxn.type)
            nn.meta = copy.copy(fxn.meta)
            ex = fxn.meta.get("example_value")
            if isinstance(ex, torch.SymInt) and self.seq_node is None:
                if ex.node.expr in self.bridge.seq_symbols or replaced_expr(ex) in self.bridge.seq_symbols:
                    self.seq_node = nn
        elif "mask_tiles" in cn.attrs:
            # SDPA whose [S, S] mask is replayed per tile of query rows (tiled_attention).
            nn = tiled_attention.emit(self.graph, fxn, cn, self.bridge,
                                      [self.value_node(v) for v in cn.inputs], self.old_to_new)
            nn.meta = copy.copy(fxn.meta)
        elif "head_chain" in cn.attrs:
            # Cross-entropy over lm_head's operands, a chunk of rows at a time (tiled_loss).
            reduction = cn.attrs.get("reduction", current_reduction(fxn))
            ins = [self.value_node(v) if v >= 0 else None for v in cn.inputs]
            nn = tiled_loss.emit(self.graph, fxn, cn, self.bridge, ins, str(reduction))
            nn.meta = copy.copy(fxn.meta)
        elif "row_nodes" in cn.attrs:
            # A row-wise block (an MLP) run a chunk of rows at a time (tiled_rows).
            nn = tiled_rows.emit(self.graph, fxn, cn, self.bridge,
                                 [self.value_node(v) for v in cn.inputs])
            nn.meta = copy.copy(fxn.meta)
        else:
            # Tensor operands are substituted below by path; the rest map to their copies.
            args = to_mutable(fx.node.map_arg(fxn.args, lambda n: self.old_to_new.get(n, n)))
            kwargs = dict(fx.node.map_arg(fxn.kwargs, lambda n: self.old_to_new.get(n, n)))
            kwargs = {k: to_mutable(v) for k, v in kwargs.items()}
            for i, path in enumerate(paths):
                if cn.inputs[i] >= 0:
                    set_path(args, kwargs, path, self.value_node(cn.inputs[i]))
            args = to_tuples(args, fxn.args)
            stale = [n for n in nodes_in((args, kwargs))
                     if n.graph is not self.graph]
            if stale:
                raise AssertionError(f"plan replay: {fxn.name} still refers to {stale} of the input graph")
            kwargs = {k: to_tuples(v, fxn.kwargs[k]) if k in fxn.kwargs else v for k, v in kwargs.items()}
            attrs = cn.attrs
            target, kind = fxn.target, fxn.op
            if "rewrite_target" in attrs:
                target = rewrite_target(fxn, attrs["rewrite_target"])
            if "reduction" in attrs and attrs["reduction"] != current_reduction(fxn):
                args, kwargs = set_reduction(args, kwargs, attrs["reduction"])
            if "local_dims" in attrs:
                args, kwargs = self.localise_sizes(fxn, cn, args, kwargs, list(attrs["local_dims"]))
            if attrs.get("zero_padding", False):
                # conv1d(input, weight, bias, stride, padding, ...): sp.halo padded the input.
                if len(args) > 4:
                    args = tuple(args[:4]) + (0,) + tuple(args[5:])
                else:
                    kwargs = dict(kwargs, padding=0)
            if "unslice_dim" in attrs:
                # sp.shift already took this rank's part of the sliced sequence dim.
                target, args, kwargs = unslice(fxn, args, kwargs, attrs["unslice_dim"])
                kind = "call_function"
            if cn.op == "output":
                nn = self.graph.output(args[0] if len(args) == 1 else args)
                return
            if "random_dim" in attrs:
                nn = self.sharded_random(cn, args, kwargs)
            elif attrs.get("guarded_logsumexp", False):
                nn = self.graph.call_function(collectives.guarded_logsumexp, tuple(args), kwargs)
            else:
                nn = self.graph.create_node(kind, target, tuple(args), kwargs, name=fxn.name)
            nn.meta = copy.copy(fxn.meta)
            if attrs.get("scale_by_sp", False):
                # The global size(s) stand for the original node: same meta (its example value
                # is the single-device size, which later size arguments are read from).
                ctx = self.ctx
                unit, offset = attrs.get("scale_unit", 1), attrs.get("scale_offset", 0)
                if "scale_dim" in attrs:
                    nn = self.graph.call_function(
                        chunks.global_size, (nn, attrs["scale_dim"], ctx.world, unit, offset, ctx.rank))
                elif offset:
                    nn = self.graph.call_function(chunks.global_extent, (nn, unit, offset, ctx.rank, ctx.world))
                else:
                    nn = self.graph.call_function(operator.mul, (nn, ctx.world))
                nn.meta = copy.copy(fxn.meta)
            if attrs.get("clone", False):
                # A local copy of a replicated computation (a hoisted slice); the original
                # FX node keeps its own copy.
                for vid in cn.outputs:
                    self.env[vid] = nn
                return
        self.old_to_new[fxn] = nn
        items = self.bridge.tuple_items.get(cn.origin)
        if items is not None:
            for i, vid in enumerate(cn.outputs):
                item = self.graph.call_function(operator.getitem, (nn, i))
                for old_item in items[i]:
                    item.meta = item.meta or copy.copy(old_item.meta)
                    self.old_to_new[old_item] = item
                self.env[vid] = item
        else:
            for vid in cn.outputs:
                self.env[vid] = nn

    def sharded_random(self, cn: Any, args: Any, kwargs: dict) -> fx.Node:
        """A random op on a sequence-sharded value, drawn at full length (see
        chunks.sharded_dropout)."""
        a = cn.attrs
        where = (a["random_dim"], a["random_outer"], a["random_inner"], self.ctx.rank, self.ctx.world)
        x = args[0] if args else kwargs.pop("input")
        if cn.op == "dropout":
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            # F.dropout(input, p, training) / torch.dropout(input, p, train)
            training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
            return self.graph.call_function(chunks.sharded_dropout, (x, p, training) + where)
        extra = {k: v for k, v in kwargs.items() if k in ("dtype", "device", "layout")}
        return self.graph.call_function(chunks.sharded_random_like, (x, cn.op) + where, extra)

    def localise_sizes(self, fxn: fx.Node, cn: Any, args: Any, kwargs: dict, dims: list[int]) -> tuple:
        name = target_name(fxn)
        if name not in _SIZE_ARG_METHODS:
            return args, kwargs  # sizes come from the (local) input itself
        args = list(args)
        tail: list = []
        if name == "new_full":  # new_full(size, fill_value, ...): only the size is localised
            args, tail = args[:2], args[2:]
        if len(args) == 2 and isinstance(args[1], fx.Node) and args[1].target is torch.Size:
            # x.view(size) with size = torch.Size([...]) built in the graph (x.size()[:-1] +
            # (n,)): localise the sizes it is built from.
            args[1] = tuple(args[1].args[0])
        elif len(args) == 2 and isinstance(args[1], fx.Node) and isinstance(
                args[1].meta.get("example_value", args[1].meta.get("val")), (tuple, list)):
            # x.reshape(y.shape): a torch.Size value (global, see chunks.global_size);
            # take it apart to localise its entries. (x.reshape(b * s): one size, below.)
            n = len(args[1].meta.get("example_value", args[1].meta.get("val", ())))
            args[1] = tuple(self.graph.call_function(operator.getitem, (args[1], i)) for i in range(n))
        flat = not (len(args) == 2 and isinstance(args[1], (tuple, list)))
        sizes = list(args[1:]) if flat else list(args[1])
        if not sizes and "size" in kwargs:
            sizes, flat = list(kwargs["size"]), None
        out_shape = self.plan.graph.value(cn.outputs[0]).shape
        for d in dims:
            s = sizes[d]
            size = out_shape[d]
            if isinstance(s, fx.Node) and size.offset:
                # unit * (S + offset) elements, split unevenly (chunks.chunk_bounds)
                ctx = self.ctx
                sizes[d] = self.graph.call_function(
                    chunks.local_extent, (s, size.coef, size.offset, ctx.rank, ctx.world))
            elif isinstance(s, fx.Node):
                sizes[d] = self.graph.call_function(operator.floordiv, (s, self.ctx.world))
            elif isinstance(s, int) and s == -1:
                continue
            elif isinstance(s, int) and size.power == 0 and not size.opaque and s == size.coef:
                # a static dim split over the ranks (attention heads, see csrc/plan/heads.cpp)
                sizes[d] = s // self.ctx.world
            else:
                raise AutospError(
                    f"[autosp:apply] op '{name}' at {node_loc(fxn)}: found size argument {s!r} for the "
                    f"sharded sequence dim {d}; expected a size derived from the input's shape or -1."
                )
        if flat is None:
            kwargs = dict(kwargs, size=tuple(sizes))
        elif flat:
            args = [args[0]] + sizes
        else:
            args = [args[0], type(args[1])(sizes)]
        return tuple(list(args) + tail), kwargs

    # -- inserted SP ops -----------------------------------------------------------------
    def insert(self, cn: Any) -> None:
        ins = [self.value_node(v) for v in cn.inputs]
        a = cn.attrs
        ctx = self.ctx
        g = self.graph
        op = cn.op
        if op == "sp.slice":
            node = g.call_function(chunks.local_chunk, (ins[0], a["dim"], a["outer"], a["inner"], ctx.rank,
                                                             ctx.world, a.get("offset", 0)))
        elif op == "sp.halo":
            node = g.call_function(collectives.halo, (ins[0], a["dim"], a["left"], a["right"], a["last_pad"],
                                                      ctx.group, ctx.rank, ctx.world))
        elif op == "sp.shift":
            node = g.call_function(collectives.shift, (ins[0], a["dim"], a["start"], a["offset"],
                                                       a.get("in_offset", 0), ctx.group, ctx.rank, ctx.world))
        elif op == "sp.grad_sync" and len(ins) > 1:
            tup = _in_module_of(g.call_function(collectives.grad_sync_many, (tuple(ins), ctx.group)),
                                ins[0])
            for i, vid in enumerate(cn.outputs):
                self.env[vid] = _stands_for(g.call_function(operator.getitem, (tup, i)), ins[i])
            return
        elif op == "sp.grad_sync":
            node = g.call_function(collectives.grad_sync, (ins[0], ctx.group))
        elif op == "sp.reduce_partial":
            node = g.call_function(collectives.reduce_partial, (ins[0], ctx.group))
        elif op == "sp.all_gather":
            shape = self.plan.graph.value(cn.inputs[0]).shape
            outer = shape[a["dim"]].coef // a["inner"]
            node = g.call_function(collectives.all_gather_seq,
                                   (ins[0], a["dim"], outer, a["inner"], ctx.group, ctx.rank, ctx.world))
        elif op == "sp.all_to_all":
            tup = _in_module_of(g.call_function(
                collectives.all_to_all,
                (tuple(ins), a["scatter_dim"], a["gather_dim"], ctx.group, ctx.world)), ins[0])
            for i, vid in enumerate(cn.outputs):
                self.env[vid] = _stands_for(g.call_function(operator.getitem, (tup, i)), ins[i])
            return
        elif op == "sp.repeat_heads":
            node = g.call_function(collectives.repeat_heads, (ins[0], a["dim"], a["repeats"]))
        elif op == "sp.check_index":
            node = g.call_function(collectives.check_index, (ins[0], a["below"], _where(cn.loc)))
        elif op == "sp.scan":
            node = g.call_function(collectives.scan, (ins[0], a["dim"], a["op"], ctx.group, ctx.rank))
        elif op == "sp.combine":
            node = g.call_function(collectives.combine, (ins[0], a["op"], ctx.group, ctx.rank))
        elif op == "sp.count_valid":
            node = g.call_function(collectives.count_valid, (ins[0], a["ignore_index"], ctx.group))
        elif op == "div":
            if len(ins) == 2:
                node = g.call_function(operator.truediv, (ins[0], ins[1]))
            else:
                divisor = self.divisor(a["divisor_coef"], a["divisor_power"], a.get("divisor_offset", 0))
                node = g.call_function(operator.truediv, (ins[0], divisor))
        else:
            raise AssertionError(f"unknown inserted op {op}")
        if op in _SAME_VALUE_OPS:
            _stands_for(node, ins[0])
        else:
            _in_module_of(node, ins[0] if ins else None)
        for vid in cn.outputs:
            self.env[vid] = node

    def divisor(self, coef: int, power: int, offset: int = 0) -> Any:
        """coef * (S + offset)^power, S being the graph's sequence-length input."""
        if power == 0:
            return coef
        if self.seq_node is None:
            raise AssertionError("plan divides by a multiple of S but the graph has no S input")
        base: Any = self.seq_node
        if offset:
            base = self.graph.call_function(operator.add, (base, offset))
        d: Any = base
        for _ in range(power - 1):
            d = self.graph.call_function(operator.mul, (d, base))
        if coef != 1:
            d = self.graph.call_function(operator.mul, (d, coef))
        return d


def apply_plan(gm: fx.GraphModule, bridge: BridgeResult, plan: Any, ctx: RankContext) -> fx.GraphModule:
    """The FX graph one rank runs: ``gm`` rewritten by ``plan``."""
    return _Replayer(gm, bridge, plan, ctx).run()
