"""When two numbered layers are alike for Dynamo's reuse, and when a layer reaches another
layer's state (autosp.dynamo_regions marks only layers that pass both): ``layer_signature``
tells apart what Dynamo's reuse guards do not check, ``back_reference`` finds what Dynamo's
stamp-out would re-root to the wrong layer."""

from __future__ import annotations

import functools
import operator
import types
from collections import deque
from collections.abc import Collection, Mapping
from itertools import chain
from typing import Any, Iterator

import torch
import torch.nn as nn


#: What every nn.Module has in its __dict__ (registries, hook dicts), left out of a signature
#: except the hooks and the training flag, which it takes separately.
_MODULE_STATE = frozenset(vars(nn.Module()))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")


def _attr_signature(value: Any, depth: int = 0) -> Any:
    """A plain attribute's part of a signature: None for values Dynamo's reuse guards check
    (numbers, strings, flags: found guarded, each differing layer traced anew); a tensor's
    metadata; a function's name (and identity, for a closure); a module held outside the
    registered submodules (in a dict, on a plain object) by its own signature."""
    if depth > 3:
        return None
    if isinstance(value, nn.Module):
        return ("module", layer_signature(value, depth + 1))
    if isinstance(value, (tuple, list)):
        parts = tuple(_attr_signature(v, depth + 1) for v in value)
        return parts if any(p is not None for p in parts) else None
    if isinstance(value, dict):
        parts = tuple((repr(k), _attr_signature(v, depth + 1)) for k, v in value.items())
        return parts if any(p[1] is not None for p in parts) else None
    if isinstance(value, torch.Tensor):
        return tensor_signature(value)
    if isinstance(value, type):
        return None
    if callable(value):  # a function chosen per layer
        closure = getattr(value, "__closure__", None)
        return ("callable", getattr(value, "__module__", ""),
                getattr(value, "__qualname__", type(value).__qualname__),
                id(value) if closure else 0)
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):  # a plain object: what it holds
        parts = tuple(sorted((k, a) for k, v in fields.items()
                             if (a := _attr_signature(v, depth + 1)) is not None))
        return (type(value).__qualname__, parts) if parts else None
    return None


def tensor_signature(t: torch.Tensor) -> tuple:
    """A parameter's, buffer's or tensor attribute's part of a signature: its Python class (a
    subclass of nn.Parameter can change what an op computes with it, in its __torch_function__
    or through an isinstance test in the forward, and Dynamo's reuse compares only shape,
    stride, dtype, device and requires_grad: found by breaker helper-77, one fake-quantised
    layer ran the first layer's trace), the attributes set on it (by value: the subclass may
    read them), its dtype, shape and requires_grad."""
    cls = type(t)
    fields = tuple(sorted((k, repr(v) if not isinstance(v, torch.Tensor) else
                           ("tensor", type(v).__qualname__, v.dtype, tuple(v.shape)))
                          for k, v in vars(t).items()))
    return ("tensor", cls.__module__, cls.__qualname__, fields, t.dtype, tuple(t.shape),
            t.requires_grad)


def layer_signature(layer: nn.Module, depth: int = 0) -> tuple:
    """What tells two layers of one class apart beyond their weights' values and what torch
    2.13's reuse guards check (numbers, strings, flags): found missed, a submodule's class and a
    hook on it. Per submodule, its path, class, hooks (by identity), training flag, tensor and
    function attributes; per parameter and buffer, its class, attributes, shape, dtype and
    requires_grad (:func:`tensor_signature`)."""
    out = []
    for rel, m in layer.named_modules():
        hooks = tuple(tuple(id(h) for h in getattr(m, name, {}).values()) for name in _HOOKS)
        attrs = tuple(sorted((k, a) for k, v in vars(m).items()
                             if k not in _MODULE_STATE
                             and (a := _attr_signature(v, depth)) is not None))
        tensors = tuple((k, tensor_signature(t))
                        for k, t in list(m._parameters.items()) + list(m._buffers.items())
                        if t is not None)
        out.append((rel, type(m).__qualname__, type(m).__module__, m.training, hooks, attrs,
                    tensors))
    return tuple(out)


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _mutables(value: Any, depth: int = 0) -> Iterator[Any]:
    """The mutable objects ``value`` is or holds (containers, objects with a __dict__ or
    __slots__, and any other object that is not a module, tensor, class, function or immutable
    value) that hold data themselves: a number, string, flag or tensor, which a forward reads
    as a value. An object whose contents autosp cannot list (a numpy array, a C extension's)
    counts as holding data. Three levels deep. (A dict of functions, or a list holding a
    module, as Hugging Face's attention and the ``[module]`` idiom have per layer, holds no data
    of its own.) Found by breaker helper-81: a ``__slots__`` object and a ``collections.deque``
    per layer were not found, and a change to one on layer 1 after the first call went unseen."""
    if depth > 3 or isinstance(value, (nn.Module, torch.Tensor, type) + _IMMUTABLE):
        return
    if callable(value):  # a function's own state is PlainWatch's (_function_state)
        return
    if isinstance(value, (tuple, frozenset)):
        for v in value:
            yield from _mutables(v, depth + 1)
        return
    held = _contents(value)
    if held is None or any(isinstance(v, (torch.Tensor,) + _IMMUTABLE) for v in held):
        yield value
    for v in held or ():
        yield from _mutables(v, depth + 1)


def _contents(value: Any) -> list | None:
    """What a container or plain object holds, or None where it cannot be listed."""
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (Collection, deque)) and not isinstance(value, (str, bytes)):
        return list(value)
    fields = getattr(value, "__dict__", None)
    slots = [name for cls in type(value).__mro__ for slot in [getattr(cls, "__slots__", ())]
             for name in ((slot,) if isinstance(slot, str) else slot)]
    if isinstance(fields, dict) or slots:
        held = list(fields.values()) if isinstance(fields, dict) else []
        return held + [getattr(value, n) for n in slots if n != "__dict__" and hasattr(value, n)]
    return None


def mutable_state(layer: nn.Module) -> dict[int, str]:
    """The mutable plain objects a layer's modules hold in their attributes, by identity, with
    where (``mlp.cfg``). One a layer holds alone can change after a compile without Dynamo
    noticing, where Dynamo traced the layer once: the reuse keeps no guard on the later
    layers' reads (found by breaker helper-78: ``layers[1].cfg.scale = 2.0`` after the first
    call, and layer 1 kept the old value)."""
    out: dict[int, str] = {}
    for rel, m in layer.named_modules():
        for k, v in vars(m).items():
            if k not in _MODULE_STATE:
                for obj in _mutables(v):
                    out.setdefault(id(obj), f"{rel}.{k}" if rel else k)
    return out


def tensor_attributes(tensors: list[torch.Tensor]) -> tuple:
    """What was set on each tensor as a Python attribute (a number or string by value, any other
    object by identity): a parameter's attribute changed on one layer after a compile is not
    seen by the trace Dynamo reuses for it (breaker helper-78)."""
    return tuple(tuple((k, v if isinstance(v, _IMMUTABLE) else id(v))
                       for k, v in t.__dict__.items()) for t in tensors)


def _plain_modules(value: Any, depth: int = 0) -> Iterator[nn.Module]:
    """The modules a plain attribute holds (itself, or in lists, tuples, dicts and plain
    objects, three levels deep)."""
    if depth > 3:
        return
    if isinstance(value, nn.Module):
        yield value
    elif isinstance(value, (tuple, list, set, frozenset)):
        for v in value:
            yield from _plain_modules(v, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _plain_modules(v, depth + 1)
    elif not isinstance(value, (torch.Tensor, type)) and isinstance(getattr(value, "__dict__", None), dict):
        for v in vars(value).values():
            yield from _plain_modules(v, depth + 1)


def back_reference(model: nn.Module, path: str, layer: nn.Module,
                   layers: list[tuple[str, nn.Module]]) -> str | None:
    """Why ``layer`` (at ``path``) reaches another layer's state, or None: it holds the model,
    a module on the way to the layers or another layer as a submodule, or holds one of those
    or a part of another layer in a plain attribute (``self._root = [model]``, ``self._first =
    [layers[0]]``). Dynamo stamps a layer's trace out by putting the new layer's source in
    place of the first layer's wherever it occurs, so a layer that read layer 0's buffer
    through such a reference read its own (breaker helper-51: all gradients off, plain
    ``nested_compile_region`` alike). A submodule shared by registration (the same module
    registered in every layer) is left alone: its source names the same object in each. Not
    seen: a reference through a global, a weakref, a bound method, a ``functools.partial``,
    a closure, ``__slots__``, a class attribute, or handed to the call as an argument
    (reviewer helper-52; the global is a strict xfail in tests/test_regions_round8_breakers.py)."""
    holders = {id(model): "the model"}
    for p, _ in layers:
        parts = p.split(".")
        for i in range(1, len(parts)):
            holders.setdefault(id(model.get_submodule(".".join(parts[:i]))), ".".join(parts[:i]))
    own = {id(m) for m in layer.modules()}
    others: dict[int, str] = {}
    for p, other in layers:
        if other is not layer:
            others.setdefault(id(other), p)
            for rel, m in other.named_modules():
                if id(m) not in own:
                    others.setdefault(id(m), f"{p}.{rel}" if rel else p)
    layer_ids = {id(other): p for p, other in layers if other is not layer}
    for rel, m in layer.named_modules():
        if id(m) in holders or id(m) in layer_ids:
            return f"{path}.{rel} is {holders.get(id(m)) or layer_ids[id(m)]}"
        for name, value in vars(m).items():
            if name in _MODULE_STATE:
                continue
            for held in _plain_modules(value):
                if id(held) in holders or (id(held) in others and id(held) not in own):
                    where = f"{path}.{rel}.{name}" if rel else f"{path}.{name}"
                    return f"{where} holds {holders.get(id(held)) or others[id(held)]}"
    return None


def _watched_modules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """A layer's modules: its registered submodules, and the modules its modules hold outside
    the registry (in a list, dict or plain object: the ``[module]`` idiom), by a path of their
    own (``mlp._aux.0``). Found by breaker helper-81: a LeakyReLU held in a list, its slope
    changed on layer 1 alone, went unseen."""
    out = list(layer.named_modules())
    seen = {id(m) for _, m in out}
    for rel, m in list(out):
        for k, v in vars(m).items():
            if k in _MODULE_STATE:
                continue
            for i, held in enumerate(_plain_modules(v)):
                for sub_rel, sub in held.named_modules():
                    if id(sub) not in seen:
                        seen.add(id(sub))
                        out.append((".".join(p for p in (rel, k, str(i), sub_rel) if p), sub))
    return out


class PlainWatch:
    """The plain state of marked layers, compared at every call: each module's class and the
    values in its ``__dict__`` (numbers, strings and flags such as ``training`` or a norm's
    ``eps``, by identity first). Dynamo's reuse guards only what the first layer of a class
    reads, so a value changed after the first call on another layer alone went unseen: that
    layer kept running the first layer's trace (breaker helper-79: a per-layer flag, a string
    mode, LayerNorm's eps, LeakyReLU's slope, ``layers[1].eval()``, a submodule's ``__class__``
    set in place; plain ``nested_compile_region`` alike). A change every marked layer of the class
    made (``model.eval()``, a flag set on every layer) fails the guards of whichever layer Dynamo
    traced, and Dynamo traces the model again, comparing every layer; that is left to it. A
    change on some layers only is not: the layer Dynamo traced need not be the first (breaker
    helper-81: layer 0 did not read ``flag``, layer 1 was traced, and layers 0 and 2 changed it).

    ``groups``: per class, its marked layers as ``(path, layer)``, the first first."""

    def __init__(self, groups: list[list[tuple[str, nn.Module]]]) -> None:
        self._layers = [[(path, _watched_modules(layer)) for path, layer in group]
                        for group in groups]
        self._modules = [m for group in self._layers for _, mods in group for _, m in mods]
        self._dicts = [vars(m) for m in self._modules]
        self._refresh()

    def _refresh(self) -> None:
        """The keys watched per module (its own attributes and ``training``, not nn.Module's
        registries and hook dicts, whose changes ModelState sees), and the state now."""
        # Function objects the modules hold, whose state changes in place: a partial's keywords,
        # a function's defaults (breaker helper-81: layers[1].f.__defaults__ = (2.0,) and
        # layers[1].act.keywords["negative_slope"] = 0.7 after the first call went unseen).
        # Listed anew at each refresh: one replaced after the first call is watched from then on.
        self._functions = [(gi, li, rel, k, v) for gi, group in enumerate(self._layers)
                           for li, (_, mods) in enumerate(group) for rel, m in mods
                           for k, v in vars(m).items()
                           if isinstance(v, (functools.partial, types.FunctionType))]
        self._keys = [("training", "_parameters") + tuple(k for k in d if k not in _MODULE_STATE)
                      for d in self._dicts]
        self._getters = [operator.itemgetter(*keys) for keys in self._keys]
        self._seen = self._state()
        self._seen_functions = [_function_state(f[-1]) for f in self._functions]

    def _state(self) -> tuple | None:
        """Every module's class, ``__dict__`` size and watched values, in C loops (a Python loop
        per module took 480 us per call at 32 Hugging Face Llama layers); None where a watched
        key is gone."""
        try:
            values = tuple(chain.from_iterable(map(operator.call, self._getters, self._dicts)))
        except KeyError:
            return None
        return tuple(map(type, self._modules)), tuple(map(len, self._dicts)), values

    def changed_alone(self) -> str | None:
        """Where a layer's plain state changed since the last call in a way not every marked
        layer of its class changed, or None; either way the state now is the next call's
        baseline."""
        now, seen = self._state(), self._seen
        functions = [_function_state(f[-1]) for f in self._functions]
        if now is not None and now[0] == seen[0] and now[1] == seen[1] \
                and all(map(operator.is_, now[2], seen[2])) and functions == self._seen_functions:
            return None
        before = iter(self._before(seen))
        changes = [[(path, {(rel, k) for rel, m in mods for k in _changed_keys(*next(before), m)})
                    for path, mods in group] for group in self._layers]
        for (gi, li, rel, k, _), a, b in zip(self._functions, functions, self._seen_functions):
            if a != b:
                changes[gi][li][1].add((rel, k))
        self._refresh()
        for group in changes:
            every = set.union(*(keys for _, keys in group))
            for path, keys in group:
                if missing := sorted(every - keys):
                    rel, key = missing[0]
                    changed = next(p for p, k in group if (rel, key) in k)
                    attr = f"{rel}.{key}" if rel else key
                    return (f"{changed}.{attr} changed after the first call, and not on {path} "
                            "alike (Dynamo's reuse guards only the values of the layer it traced)")
        return None

    def _before(self, seen: tuple) -> Iterator[tuple]:
        """Per module, its class and watched keys and values as of ``seen``."""
        at = 0
        for cls, keys in zip(seen[0], self._keys):
            yield cls, keys, seen[2][at:at + len(keys)]
            at += len(keys)


def _function_state(fn: Any) -> tuple:
    """What a partial or a function reads besides its operands: the partial's function,
    arguments and keywords, the function's defaults and closure cells (numbers and strings by
    value, other objects by identity)."""
    if isinstance(fn, functools.partial):
        parts = (fn.func, *fn.args, *sorted(fn.keywords.items()))
    else:
        parts = (*(fn.__defaults__ or ()), *sorted((fn.__kwdefaults__ or {}).items()),
                 *(c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)))
    return tuple(_by_value(p) for p in parts)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _by_value(v: Any) -> Any:
    if isinstance(v, tuple):
        return tuple(_by_value(x) for x in v)
    return v if isinstance(v, _IMMUTABLE) else ("id", id(v))


def _changed_keys(cls: type, keys: tuple, values: tuple, m: nn.Module) -> Iterator[str]:
    """The attributes of ``m`` (its own, and ``training``) whose value is not the one in
    ``values`` (a number, string or flag by value, anything else by identity), or that were
    set or deleted since; and ``__class__`` where its class changed."""
    if type(m) is not cls:
        yield "__class__"
    old = dict(zip(keys, values))
    del old["_parameters"]  # watched only to make every getter return a tuple
    now = {k: v for k, v in vars(m).items() if k not in _MODULE_STATE or k == "training"}
    for k in sorted(set(old) | set(now)):
        a, b = old.get(k, _MISSING), now.get(k, _MISSING)
        if a is b:
            continue
        if isinstance(a, _IMMUTABLE) and type(a) is type(b) and a == b:
            continue
        yield k


_MISSING = object()
