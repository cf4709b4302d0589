"""Dynamo traces a repeated decoder layer once (``autosp.compile(..., regions=True)``).

Without this, Dynamo runs the Python of every decoder layer to capture the model, which is
most of a warm compile's time and grows with depth. PyTorch (2.13 and later) can trace a
function marked with ``torch.compiler.nested_compile_region`` once and stamp out later calls
of it whose inputs match (same shapes, guards re-checked on the new layer's attributes; see
"invoke_subgraph subgraph reuse" in ``torch/_dynamo/variables/invoke_subgraph.py``).

``mark_layers`` marks the forward of every numbered layer (``layers.3``, ``transformer.h.3``)
whose class has two or more of them: the layer's class becomes a subclass whose ``forward`` is
marked (a no-op outside ``torch.compile``; ``unmark_layers`` restores the class; a pickled or
deep-copied layer is of the user's class).
Dynamo then hands the backend a graph calling ``invoke_subgraph`` once per layer.
``inline_regions`` puts each call's nodes back into the calling graph before the bridge, with
the module paths of the layer that called it, so the SP pass sees the graph it always saw;
autosp.outline makes the regions again after the SP rewrite.
"""

from __future__ import annotations

import copyreg
import functools
import math
import importlib.util
import operator
import re
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from autosp.fx_source import REGION_SELF, dotted_path, input_name, module_path
from autosp.errors import AutospError
from autosp.layer_alike import back_reference, layer_signature, mutable_state
from autosp.remat_facts import layer_of_path

_MARK = "_autosp_marked_from"


class RegionReuseError(AutospError):
    """Dynamo's graph of traced-once layers is not what the inlining takes (a layer's call reads
    another layer's parameters: Dynamo's reuse went wrong). The module traces every layer
    instead (autosp.sp_module)."""


def reuse_supported() -> bool:
    """Whether this PyTorch's Dynamo reuses a traced nested compile region (2.12 has the hook
    this looks for, 2.11 has not; tested on 2.13 only); without it every call is traced
    anyway, so nothing is marked."""
    if not hasattr(torch.compiler, "nested_compile_region"):
        return False
    spec = importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph")
    if spec is None:
        return False
    from torch._dynamo.variables import invoke_subgraph

    # What autosp.dynamo_reuse.gated patches and reads, too: without them it cannot refuse an
    # unsafe reuse, so nothing is marked (reviewer helper-52).
    return all(hasattr(invoke_subgraph, name) for name in
               ("is_reusable", "find_reuse_match", "save_reuse_entry", "get_fn_code"))


def numbered_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's numbered layers (a path that is its own layer_of_path and ends in a
    number) whose class has at least two of them, in module order."""
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for path, mod in model.named_modules():
        if path and path.rpartition(".")[2].isdigit() and layer_of_path(path) == path:
            by_class.setdefault(type(mod), []).append((path, mod))
    return [pm for mods in by_class.values() if len(mods) > 1 for pm in mods]


#: The marked subclass of each layer class (one per class, so that Dynamo sees one function).
_MARKED: dict[type, type] = {}


def _reduce_as_unmarked(self: nn.Module, protocol: int) -> Any:
    """Pickled and deep-copied as the user's class (the marked one is made at run time)."""
    marked = type(self)
    self.__class__ = vars(marked)[_MARK]
    try:
        reduced = list(self.__reduce_ex__(protocol))
    finally:
        self.__class__ = marked
    if reduced[0] is copyreg.__newobj__:  # pickle checks __newobj__'s class against the object's
        reduced[0] = object.__new__
    return tuple(reduced)


def _marked_forward(forward: Callable) -> Callable:
    """`forward` as a region Dynamo traces once, except in a call that hands one tensor as two
    operands: that call runs `forward` inline. Dynamo traces the region of such a call with one
    input for both, and stamps that trace out for the later layers' calls, dropping their
    second operand (found: torch 2.13, a layer called as ``layer(x, x0)`` with ``x = x0`` for
    the first layer; every later layer read its hidden state for both, and the loss and every
    gradient were wrong; breaker helper-46).

    A call also runs inline when the layer holds a tensor attribute that is neither a
    parameter nor a buffer (set before the call, ``layer.ctx = x0``): Dynamo makes it a free
    variable of the region, which failed with an internal error ("Freevar has no source"), or,
    when it was the call's input too, was read as that input by every later layer (breaker
    helper-47). Operands are looked for inside lists, tuples and dicts as well. State the
    caller writes elsewhere (a submodule's attribute, a global) is autosp.dynamo_reuse's.

    The region is handed the kinds of the call's number arguments as well (``_kinds``: each
    one's type and sign): Dynamo's reuse compares a constant argument with ``!=``, so a layer
    called with ``1`` ran the trace made for ``True``, and one with ``-0.0`` the trace made for
    ``0.0`` (breaker helper-81)."""
    def kinded(self: nn.Module, _kinds: tuple, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    region = torch.compiler.nested_compile_region(kinded)

    @functools.wraps(forward)
    def marked(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch._C._len_torch_function_stack() > 0:
            # A TorchFunctionMode entered around the call: Dynamo drops it inside a region's
            # body, reused or not (breaker helper-53: a mode doubling tanh around layer 2 was
            # lost, silently). The call runs inline.
            return forward(self, *args, **kwargs)
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        if any(a is b for i, a in enumerate(tensors) for b in tensors[i + 1:]) or any(
                isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
                for v in self.__dict__.values()):
            return forward(self, *args, **kwargs)
        # (Nothing computed from an int: one made from the sequence length is symbolic, and
        # a sign test would fix its value. A float's sign only where it is zero: -0.0.)
        kinds = tuple((type(a).__name__,
                       math.copysign(1.0, a) if type(a) is float and a == 0.0 else 1.0)
                      for a in leaves if type(a) in (bool, int, float))
        return region(self, kinds, *args, **kwargs)

    return marked


def _marked_class(cls: type) -> type:
    sub = _MARKED.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "forward": _marked_forward(cls.forward),
            "__reduce_ex__": _reduce_as_unmarked,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, _MARK: cls})
        _MARKED[cls] = sub
    return sub


def mark_layers(model: nn.Module) -> list[str]:
    """Marks repeated numbered layers' forward as a nested compile region: the layer's class
    becomes a subclass of it whose ``forward`` is marked, one per class. (Marking the forward as
    an instance attribute instead made torch 2.13's Dynamo stamp out every layer with the first
    layer's weights, silently.) Per class, only the largest group of two or more layers with one
    ``layer_signature`` is marked: Dynamo's reuse guards were found to miss a submodule chosen
    per layer (an activation) and a hook on one layer's submodule, and the other layers are
    traced as usual. Leaves alone a layer with a forward of its own (an instance attribute), one
    its author marked, and one that reaches another layer's state (:func:`back_reference`). Undoes an earlier call's marks first. Returns the marked paths."""
    unmark_layers(model)  # an earlier compile's marks: marked anew
    if not reuse_supported():
        return []
    groups: dict[type, dict[tuple, list[tuple[str, nn.Module]]]] = {}
    layers = numbered_layers(model)
    for path, mod in layers:
        cls = type(mod)
        if "forward" in vars(mod) or hasattr(cls.forward, "__marked_compile_region_fn__") \
                or back_reference(model, path, mod, layers) is not None:
            continue
        groups.setdefault(cls, {}).setdefault(layer_signature(mod), []).append((path, mod))
    marked = []
    for cls, by_signature in groups.items():
        largest = max(by_signature.values(), key=len)
        # A mutable object (a list, a dict, a plain object) that a layer holds alone is not
        # watched after the compile by Dynamo's reuse: such a layer is traced on its own. One
        # every layer of the group holds (a shared config) is watched through the first.
        alone = held_alone([mod for _, mod in largest])
        largest = [layer for layer, held in zip(largest, alone) if not held]
        if len(largest) < 2:
            continue
        for path, mod in largest:
            mod.__class__ = _marked_class(cls)
            marked.append(path)
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return sorted(marked, key=order.__getitem__)


def held_alone(layers: list[nn.Module]) -> list[str]:
    """Per layer of one class, where it holds a mutable object (a list, a dict, a plain object:
    layer_alike.mutable_state) that not every other layer holds too, or "". Dynamo's reuse keeps
    no guard on what a later layer reads from such an object, so a change to it after the
    compile would go unseen; one every layer holds (a shared config) is guarded through the
    first layer's reads."""
    states = [mutable_state(mod) for mod in layers]
    shared = set.intersection(*(set(st) for st in states)) if states else set()
    return [next((where for i, where in st.items() if i not in shared), "") for st in states]


def marked_apart(model: nn.Module) -> str | None:
    """Which marked layer is no longer alike the first marked layer of its class (its
    ``layer_signature`` changed after ``mark_layers``: a hook, a submodule, a function
    attribute or a parameter's attribute set on one layer after ``autosp.compile``), or holds a
    mutable object alone (:func:`held_alone`: set after ``autosp.compile``), or None. Dynamo's
    reuse guards do not check those, so a trace made now would give that layer the first
    layer's; the caller traces every layer instead."""
    for layers in marked_groups(model):
        first = layer_signature(layers[0][1])
        for path, mod in layers[1:]:
            if layer_signature(mod) != first:
                return (f"{path} is no longer alike {layers[0][0]} (a hook, submodule, function "
                        "attribute or parameter attribute set on one of them after "
                        "autosp.compile, which Dynamo's reuse guards do not check)")
        for (path, _), where in zip(layers, held_alone([mod for _, mod in layers])):
            if where:
                return (f"{path}.{where} is a mutable object (a list, dict or plain object) no "
                        "other layer holds, which Dynamo's reuse does not watch after the "
                        "compile")
    return None


def marked_groups(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """Per class, its marked layers as ``(path, layer)``, in the model's order."""
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for path, mod in numbered_layers(model):
        if _MARK in vars(type(mod)):
            by_class.setdefault(type(mod), []).append((path, mod))
    return list(by_class.values())


def marked_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The marked layers' parameters and buffers, whose Python attributes the module compares at
    every call (layer_alike.tensor_attributes), asking :func:`marked_apart` when they change."""
    return [t for _, mod in numbered_layers(model) if _MARK in vars(type(mod))
            for m in mod.modules() for t in (*m._parameters.values(), *m._buffers.values())
            if t is not None]


def unmark_layers(model: nn.Module) -> None:
    """Undoes mark_layers."""
    for mod in model.modules():
        original = vars(type(mod)).get(_MARK)
        if original is not None:
            mod.__class__ = original


def _unnumbered(path: str) -> str:
    return re.sub(r"\d+\]?$", "", path)


def _remap_stack(stack: dict, site: dict) -> dict:
    """A subgraph node's module stack as seen from the call ``site``: the call site's own
    stack (ending with the calling layer), then the subgraph's entries below the layer that
    was traced, that layer's path prefix replaced by the calling layer's."""
    if not site:
        return dict(stack or {})
    site_key, (site_path, _) = next(reversed(site.items()))
    out = dict(site)
    entries = [(k, p.replace(REGION_SELF, ""), c) for k, (p, c) in (stack or {}).items()]
    traced = next((i for i, (_, p, _) in enumerate(entries)
                   if p != _unnumbered(p) and _unnumbered(p) == _unnumbered(site_path)), None)
    if traced is None:
        return out
    traced_path = entries[traced][1]
    for key, path, cls in entries[traced + 1:]:
        if path.startswith(traced_path):
            path = site_path + path[len(traced_path):]
        out[f"{key}@{site_key}"] = (path, cls)
    return out


def _is_state(node: Any) -> bool:
    """A placeholder for a parameter or buffer of the model (by Dynamo's source)."""
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return False
    name = input_name(node)
    return "._parameters[" in name or "._buffers[" in name


def _size_reads(nodes: list[fx.Node], symbols: dict[Any, fx.Node]) -> None:
    """Inside a traced region Dynamo reads a size of a tensor the region was handed
    (``bsz, seq_len, _ = x.shape``) from the tensor, as graph nodes; tracing the whole model, it
    uses the calling graph's integer or symbol, with no node. Put back the latter, which the SP
    rewrite and AOTAutograd's trace of a region (a symbolic size made inside one is not tracked
    in its backward) both expect: an integer as a constant, a symbol as the placeholder holding
    it. A size that is neither stays a node."""
    def known(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, torch.SymInt):
            return symbols.get(value.node.expr)
        return None

    for n in nodes:
        if n.op != "call_method" or n.target != "size":
            continue
        value = n.meta.get("example_value")
        if len(n.args) > 1 or n.kwargs:  # x.size(1)
            new = known(value)
            if new is not None:
                n.replace_all_uses_with(new)
        else:
            for user in list(n.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    new = known(user.meta.get("example_value"))
                    if new is not None:
                        user.replace_all_uses_with(new)
                        n.graph.erase_node(user)
        if not n.users:
            n.graph.erase_node(n)


def _inline_call(gm: fx.GraphModule, call: fx.Node, symbols: dict[Any, fx.Node]) -> list[fx.Node]:
    sub = getattr(gm, str(call.args[0].target))
    env: dict[fx.Node, Any] = {}
    for p, operand in zip(sub.graph.find_nodes(op="placeholder"), call.args[2:]):
        value = p.meta.get("example_value")
        env[p] = symbols.get(value.node.expr, operand) if isinstance(value, torch.SymInt) else operand
    site = call.meta.get("nn_module_stack") or {}
    copies: list[fx.Node] = []
    if site:
        layer = layer_of_path(dotted_path(next(reversed(site.values()))[0]))
        for a in call.args[2:]:
            if _is_state(a):
                other = layer_of_path(module_path(a))
                if other != layer and other.rpartition(".")[2].isdigit():
                    raise RegionReuseError(
                        f"[autosp:capture] found Dynamo's call of the traced layer {layer} "
                        f"reading {module_path(a)}, another layer's; expected each layer's call "
                        "to read its own parameters.")
    with gm.graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n.op == "get_attr":
                raise RegionReuseError(f"[autosp:capture] found a get_attr ({n.target}) inside "
                                       "Dynamo's traced layer; expected only its operands.")
            new = gm.graph.node_copy(n, lambda a: env[a])
            new.meta = dict(n.meta)
            if "nn_module_stack" in n.meta or site:
                new.meta["nn_module_stack"] = _remap_stack(n.meta.get("nn_module_stack"), site)
            env[n] = new
            copies.append(new)
    outs = sub.graph.output_node().args[0]
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(env[outs[user.args[1]]])
            gm.graph.erase_node(user)
        else:
            raise RegionReuseError(f"[autosp:capture] found {user.name} reading a traced layer's "
                                   "outputs whole; expected one getitem per output.")
    attr = call.args[0]
    gm.graph.erase_node(call)
    if not attr.users:
        gm.graph.erase_node(attr)
    return copies


def inline_regions(gm: fx.GraphModule) -> int:
    """Puts the nodes of every ``invoke_subgraph`` call of Dynamo's graph back in place (nested
    ones first), in place; each copy's module stack is its calling layer's. Returns the number
    of calls inlined."""
    calls = list(gm.graph.find_nodes(op="call_function",
                                     target=torch.ops.higher_order.invoke_subgraph))
    if not calls:
        return 0
    done = 0
    for name, sub in list(gm.named_children()):
        if isinstance(sub, fx.GraphModule):
            done += inline_regions(sub)
    # The placeholder of each symbol, one the graph reads outside the calls where there is one
    # (Dynamo lifts another for the calls; Inductor then fails to find a size's symbol).
    symbols: dict[Any, fx.Node] = {}
    for p in gm.graph.find_nodes(op="placeholder"):
        value = p.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            outside = any(u.target is not torch.ops.higher_order.invoke_subgraph for u in p.users)
            if outside or value.node.expr not in symbols:
                symbols[value.node.expr] = p
    copies: list[fx.Node] = []
    for call in calls:
        copies += _inline_call(gm, call, symbols)
        done += 1
    _size_reads(copies, symbols)
    for name, sub in list(gm.named_children()):
        if isinstance(sub, fx.GraphModule) and not any(
                n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
            delattr(gm, name)
    gm.graph.lint()
    gm.recompile()
    return done
