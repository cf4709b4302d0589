"""When autosp lets Dynamo reuse a traced layer (``regions=True``; see autosp.dynamo_regions).

PyTorch 2.13's Dynamo traces the first call of a nested compile region and stamps that trace
out for later calls whose inputs match, re-checking the guards of what the first trace read
(``torch/_dynamo/variables/invoke_subgraph.py``). Its safety argument: a value reaches a region
through the region's arguments or through a source it can re-read on the new layer. State the
calling code wrote during the same trace breaks that argument. Dynamo serves such a read from
its record of side effects, with no source and so no guard, and the later calls get the first
call's value. Found by breaker helper-48 (torch 2.13, every gradient wrong, no error):

- a tensor set on a submodule of the layer before each call (``layer.sub.ctx = x0``), or in a
  list or plain object held by the layer (``layer.ctxl = [x0]``);
- a tensor set in a module-level dict or a global (``_CTX["t"] = x0``, ``global _G``);
- a number set in a global per layer (``global _SCALE; _SCALE = float(i + 1)``): every layer
  ran with layer 0's;
- and, where the hidden tensor was not also the call's input, torch's internal
  ``AssertionError: Freevar has no source``.

The rule here (:func:`gated`): a region call's trace is kept for reuse, and stamped out for a
later call, only while the state the calling trace wrote is the same at both calls, and only
where that state is of a kind no two layers can read differently:

- a store on an object that existed before the trace (an attribute of a module or object, a
  global, a dict or list) refuses the reuse, save one kind: a tensor, number, string or None
  stored as an attribute of a module that holds every marked layer (the model itself; Meta's
  reference Llama starts with ``self.freqs_cis = self.freqs_cis.to(h.device)``). That object
  is one for every layer;
- a tensor's attribute refuses it too, whoever made the tensor (``x.ctx = x0; x = layer(x)``);
- so does an autocast or grad mode entered or left since the trace was kept: Dynamo's reuse
  does not compare the mode at the call, and a layer that reads it
  (``torch.is_autocast_enabled()``, ``torch.is_grad_enabled()``) has the read folded into the
  first trace (layer 1 of 3 under ``torch.autocast`` ran layer 0's branch; breaker helper-50).

A store between two layer calls, even a tolerated one, ends the reuse for the rest of the trace.
The layers stay exact, and autosp.outline still compiles alike layers once after the SP pass.
A model whose forward writes no such state (autosp.models' Llama, nanoGPT, a from-scratch
Llama) keeps the reuse, as does one that writes its own attribute before the layers (3 of 3
hits where the first rule, which refused every store, gave 0). Hugging Face's decoder layers
are never reused by Dynamo (it finds side effects in them).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

def _plain(values: Any) -> bool:
    """Each value a tensor, a number, a string or None that the trace made (a tensor's
    attributes are refused apart; a container could be changed in place between two calls
    unseen). A value with a source is refused: Dynamo stamps a trace out by putting the new
    layer's source for the first layer's wherever it occurs, so ``self.gain =
    self.layers[0].gain`` read by every layer was read as each layer's own (breaker
    helper-51: all gradients off)."""
    from torch._dynamo.variables import ConstantVariable, SymNodeVariable, TensorVariable

    return all(isinstance(v, (TensorVariable, ConstantVariable, SymNodeVariable))
               and getattr(v, "source", None) is None for v in values)


def _held_items(var: Any) -> tuple[Any, ...] | None:
    """A holder's ``_buffers`` dict or ``_non_persistent_buffers_set`` changed by the trace
    (``self.freqs_cis = ...`` on a registered buffer): its keys (constants) and values (the
    trackers), or None when an item the trace changed is not :func:`_plain`."""
    items = getattr(var, "items", None)
    original = getattr(var, "original_items", None)
    if not isinstance(items, dict):
        return None
    held = []
    for k, v in items.items():
        key = getattr(k, "vt", k)
        unchanged = isinstance(original, dict) and original.get(k) is v
        if not key.is_python_constant() or not (unchanged or _plain([v])):
            return None
        held.append((str(key.as_python_constant()), v))
    return tuple(held)


def written_state(tx: Any, shared: frozenset[int] = frozenset()) -> tuple[Any, ...] | None:
    """What the trace ``tx`` belongs to has written so far that a region call depends on.

    None when it has written to an object that existed before it (Dynamo's ``SideEffects``:
    attribute and global stores, mutated dicts and lists), other than a tensor, number, string
    or None stored on a module that holds every marked layer (``shared``, from
    :func:`shared_modules`: one object for every layer, so a layer that reads it reads what
    the first layer read, as long as it is not written again between the calls), or an
    attribute of a tensor (``x.ctx = x0``: a tensor the trace made
    can reach a region as its argument, and the attribute with it, read without a source;
    breaker helper-49). Otherwise a tuple of the tolerated stores (the object, the name and
    the value's tracker, so a store made again gives another tuple) and the autocast and grad
    mode nodes in its graph (``autosp.ops.MODE_NODES``)."""
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables import TensorVariable
    from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew

    from autosp.ops import MODE_NODES

    effects = tx.output.side_effects
    stores: list[Any] = []
    tolerated: set[int] = set()
    sources: set[Any] = set()
    for var, attrs in list(effects.store_attr_mutations.items()):
        if not attrs:
            continue
        if isinstance(var, TensorVariable):
            return None
        if isinstance(var.mutation_type, (AttributeMutationNew, ValueMutationNew)):
            continue
        if id(getattr(var, "value", None)) not in shared or var.source is None \
                or not _plain(attrs.values()):
            return None
        tolerated.add(id(var))
        stores.append((var, tuple(attrs.items())))
        sources.update(AttrSource(var.source, name) for name in attrs)
    for obj, var in list(effects.id_to_variable.items()):
        if isinstance(var.mutation_type, (AttributeMutationNew, ValueMutationNew)) \
                or id(var) in tolerated or not effects.is_modified(var):
            continue
        held = _held_items(var) if obj in shared and var.source is not None else None
        if held is None:
            return None
        stores.append((var, held))
        sources.add(var.source)
    if any(s not in sources for s in effects.mutated_sources):
        return None
    # The mode nodes of the current graph and of every graph it is traced inside (a layer
    # called in a checkpoint's body under an autocast entered outside it; reviewer helper-52),
    # and the tracer itself: a trace kept in one graph is not stamped out into another.
    tracer = tx.output.current_tracer
    modes: list[Any] = [tracer]
    while tracer is not None:
        modes += [n for n in tracer.graph.nodes if n.op == "call_function"
                  and getattr(n.target, "__name__", "") in MODE_NODES]
        tracer = tracer.parent
    return (tuple(stores), tuple(modes))


def _made_module_argument(fingerprint: Any) -> bool:
    """Whether a region call is handed a module the calling trace made (``layer(x, Ctx(k))``):
    Dynamo's reuse condition tags a module argument as a module, with nothing about what it
    holds, so layer 0's ``k`` was baked into every layer (reviewer helper-52). Also True for a
    fingerprint this does not know."""
    flat = getattr(fingerprint, "flat_vts", None)
    if flat is None:
        return True
    return any(getattr(tag, "name", "") == "MODULE" and getattr(vt, "source", None) is None
               for tag, vt in flat)


def _same(a: Any, b: Any) -> bool:
    """The two states hold the same objects (compared by identity, element by element)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or (isinstance(a, str) and a == b)


def shared_modules(model: Any, layer_paths: Sequence[str]) -> tuple[Any, ...]:
    """The modules that hold every marked layer (``layer_paths``, as
    ``dynamo_regions.mark_layers`` returns them), and of their ``_buffers`` dicts and
    ``_non_persistent_buffers_set`` sets (where storing a registered buffer writes): the model,
    and the containers on the way to the layers that they all share. A module inside a layer
    (one shared by every layer, a rotary table, included) is left out. :func:`gated` holds
    them, so their ids stay theirs while it runs (a module swapped out after the compile is
    not mistaken for one of these)."""
    common: set[int] | None = None
    for path in layer_paths:
        parts = path.split(".")[:-1]
        holders = {id(model)} | {id(model.get_submodule(".".join(parts[:i + 1])))
                                 for i in range(len(parts))}
        common = holders if common is None else common & holders
    inside = {id(m) for path in layer_paths for m in model.get_submodule(path).modules()}
    holders = [m for m in model.modules() if id(m) in (common or set()) - inside]
    return tuple(o for m in holders
                 for o in (m, m._buffers, getattr(m, "_non_persistent_buffers_set", m)))


@contextlib.contextmanager
def gated(holders: tuple[Any, ...] = ()) -> Iterator[None]:
    """Dynamo's region reuse, refused where a stamped-out call could read other state than the
    first call did (see the module). Patches ``find_reuse_match`` and ``save_reuse_entry`` in
    ``torch._dynamo.variables.invoke_subgraph`` for the duration (autosp.dynamo_regions marks
    no layer on a Dynamo without them). ``holders``: :func:`shared_modules` of the model.

    A trace is kept for reuse only where :func:`written_state` is not None, and stamped out
    only where the state is what it was when the trace was kept (the same tolerated stores,
    no new one, no mode entered or left since). A region whose trace read a value the calling
    trace wrote (Dynamo raises "Freevar has no source" while keeping it) is not kept."""
    try:
        from torch._dynamo.variables import invoke_subgraph
    except ImportError:
        yield
        return
    find = getattr(invoke_subgraph, "find_reuse_match", None)
    save = getattr(invoke_subgraph, "save_reuse_entry", None)
    code_of = getattr(invoke_subgraph, "get_fn_code", None)
    if find is None or save is None:
        yield
        return
    shared = frozenset(id(o) for o in holders)
    kept: dict[int, tuple[Any, dict[Any, Any]]] = {}  # id(OutputGraph) -> (it, {code: state})

    def state(tx: Any, fingerprint: Any) -> tuple[Any, ...] | None:
        try:
            if _made_module_argument(fingerprint):
                return None
            return written_state(tx, shared)
        except (AttributeError, ImportError, TypeError):  # a Dynamo this does not know: no reuse
            return None

    def key(tx: Any, fn_var: Any) -> tuple[dict[Any, Any], Any]:
        states = kept.setdefault(id(tx.output), (tx.output, {}))[1]
        code = code_of(fn_var) if code_of is not None else None
        return states, code

    def gated_find(tx: Any, fn_var: Any, *args: Any, **kwargs: Any) -> Any:
        now = state(tx, args[0] if args else kwargs.get("fingerprint"))
        states, code = key(tx, fn_var)
        if now is None or code is None or code not in states or not _same(states[code], now):
            return None
        return find(tx, fn_var, *args, **kwargs)

    def gated_save(tx: Any, fn_var: Any, *args: Any, **kwargs: Any) -> Any:
        now = state(tx, args[0] if args else kwargs.get("fingerprint"))
        states, code = key(tx, fn_var)
        if now is None or code is None or (code in states and not _same(states[code], now)):
            return None
        try:
            save(tx, fn_var, *args, **kwargs)
        except AssertionError as e:
            if "has no source" not in str(e):
                raise
            return None  # the region read a value the calling trace wrote: traced at every call
        states.setdefault(code, now)
        return None

    invoke_subgraph.find_reuse_match = gated_find
    invoke_subgraph.save_reuse_entry = gated_save
    try:
        yield
    finally:
        invoke_subgraph.find_reuse_match = find
        invoke_subgraph.save_reuse_entry = save
        kept.clear()
