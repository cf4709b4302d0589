"""Breaker helper-51: ``regions=True`` after autosp.dynamo_reuse's new rule (a trace is kept
and stamped out while the calling trace has written only a tensor, number, string or None as
an attribute or buffer of a module holding every marked layer, and entered autocast/grad modes
only before the first layer). torch 2.13 CPU, world 2 Gloo, aot_eager; loss and every
parameter gradient against one device. Model: embed, 3 token-local layers (hidden 32), head;
B=2, S=32; each layer holds a back-reference to the model (``self._root = [model]``, a plain
list) and a registered buffer ``gain`` that differs per layer. Both ranks alike throughout.

FOUND (caused by the change; the old rule, HEAD's gate, refused these and is exact):

1. A tensor stored on the model that Dynamo knows by a source under the FIRST layer, read by
   every layer through the model: ``self.gain = self.layers[0].gain`` (plain attribute, or a
   registered buffer of the model: the ``_buffers`` path, or ``setattr`` with a computed name,
   or stored on the ModuleList), or a tied parameter ``object.__setattr__(self, "shared_bias",
   self.layers[0].lin.bias)``. The new rule keeps the reuse (a tensor on a holder of every
   layer; 2 hits of 2), and Dynamo's stamp-out re-roots the captured source: its source
   replacement maps the first call's ``self`` (``layers[0]``) to each later call's, so the
   free variable ``L['self'].layers[0].gain`` becomes ``layers[i].gain``: layer i reads its
   OWN buffer where eager reads layer 0's.
   - layer0_buffer / layer0_regbuf: loss 4.888774 against 4.831603, 20/20 gradients off
     (embed.weight 6.6e-01, layers.0.lin.bias 7.5e-01).
   - tied_bias: loss 4.826866 against 4.827112, 20/20 off (layers.0.lin.bias 5.4e-01).
   regions=False: exact. HEAD's gate: exact, 0 hits. Ungated: as wrong.
2. ``torch.set_autocast_dtype("cpu", torch.float16)`` before layer 1 inside a
   ``torch.autocast("cpu", torch.bfloat16)`` entered before the first layer, layers branching
   on ``torch.get_autocast_dtype``: the set emits no MODE_NODES node, the outer autocast is
   now tolerated, so layers 1-2 are stamped out with layer 0's bf16 branch (2 hits). Loss
   4.827413 against 4.853511, 20/20 gradients off (up to 4.1e-01). HEAD's gate: 4.853373
   (bf16 noise, gradients <= 8.7e-03), regions=False 4.853512. The root (``set_autocast_dtype``
   not in autosp.ops.MODE_NODES) is older: without the outer autocast HEAD's gate is as wrong
   (PRE-EXISTING b).

PRE-EXISTING (regions=True wrong with HEAD's gate as well; not this change's):

a. The same re-rooting with no store at all: a layer reading layer 0's buffer through the
   model (``self._root[0].layers[0].gain``) or through a back-reference to the first layer
   (``self._first[0].gain``): Dynamo knows the model / layer 0 by their one tracker, so the
   source is ``L['self'].layers[0].gain`` and is re-rooted. Loss 4.888774 against 4.831603,
   20/20 off; HEAD's gate the same (2 hits).
b. ``torch.set_autocast_dtype`` between layers with no outer autocast: loss 4.827365 against
   4.853494, 20/20 off, HEAD's gate the same.

FIXED after this round, each test below failed before and passes:
- 1: a stored value that Dynamo knows by a source (it was read from somewhere, not made by the
  trace) is not tolerated (autosp.dynamo_reuse._plain).
- 2 and b: the autocast setters (``set_autocast_dtype`` and kin) are mode nodes
  (autosp.ops.AUTOCAST_SETTERS), for the gate and for autosp.outline's region key.
- a: a layer that holds the model, a module on the way to the layers or another layer (or a
  part of one) in a plain attribute, or registers one, is not marked
  (autosp.dynamo_regions.back_reference): Dynamo traces every layer. OPEN (strict xfail): the
  same read through a global, which no check of the layers' attributes sees; Dynamo's, as
  wrong at e3000c6.
The models come two ways since: with the back-references above (now unmarked), and with a
``_viaglobal`` suffix, reaching the model through a global (marked, so the gate is tested).

HELD: see the HELD tests at the end and the report.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import tempfile
import types
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autosp import dynamo_regions
from distributed import assert_errors_within, make_batch, run_ranks
from test_outline import _count_reuse_hits
from test_regions_round7_breakers import _errors

pytestmark = pytest.mark.skipif(not dynamo_regions.reuse_supported(),
                                reason="this PyTorch's Dynamo does not reuse a traced region")

VOCAB, HIDDEN = 128, 32
#: The model, for a wiring ending in ``_viaglobal``: the layers reach it through this global,
#: not through a back-reference (autosp.dynamo_regions leaves layers holding one unmarked).
_ROOT: list[nn.Module] = []


class _Layer(nn.Module):
    """Token-local; reads state of the model through a back-reference (a plain list, so the
    model is not registered as the layer's submodule)."""

    def __init__(self, k: int, wiring: str) -> None:
        super().__init__()
        self.wiring = wiring
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, HIDDEN) * float(k + 1))
        self._root: list[nn.Module] = []  # the model
        self._first: list[nn.Module] = []  # the first layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root = self._root[0] if self._root else _ROOT[0]
        h = F.layer_norm(x, (HIDDEN,))
        w = self.wiring.removesuffix("_viaglobal")
        if w in ("layer0_buffer", "layer0_regbuf", "layer0_setattr", "layer0_modlist"):
            h = h * (root.layers.gain if w == "layer0_modlist" else root.gain)
        elif w == "tied_bias":
            h = h + root.shared_bias
        elif w.startswith("sym_store"):
            h = h * (root.half / 16.0)
        elif w == "direct_first":  # no store: layer 0's table read through the model
            h = h * root.layers[0].gain
        elif w == "share_first":  # no store: layer 0's table through a back-reference
            h = h * self._first[0].gain
        elif w.startswith("amp_set_dtype") and torch.get_autocast_dtype("cpu") == torch.float16:
            h = h * 2.0
        return x + self.down(F.gelu(self.up(self.lin(h))))


class _Model(nn.Module):
    def __init__(self, wiring: str, layers: int = 3) -> None:
        super().__init__()
        self.wiring = wiring
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(_Layer(k, wiring) for k in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if wiring.endswith("_viaglobal"):
            _ROOT[:] = [self]
        else:
            for layer in self.layers:
                layer._root.append(self)
                layer._first.append(self.layers[0])
        wiring = wiring.removesuffix("_viaglobal")
        if wiring == "layer0_regbuf":
            self.register_buffer("gain", torch.ones(HIDDEN), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        w = self.wiring.removesuffix("_viaglobal")
        if w in ("layer0_buffer", "layer0_regbuf"):  # every layer scales by layer 0's table
            self.gain = self.layers[0].gain
        elif w == "layer0_setattr":
            setattr(self, "ga" + "in", self.layers[0].gain)
        elif w == "layer0_modlist":
            self.layers.gain = self.layers[0].gain
        elif w == "tied_bias":  # every layer adds layer 0's bias (a tied parameter)
            object.__setattr__(self, "shared_bias", self.layers[0].lin.bias)
        elif w == "sym_store":
            self.half = ids.shape[1] // 2
        elif w == "sym_store_plain":
            self.half = ids.shape[1]
        elif w == "sym_store_plus":
            self.half = ids.shape[1] + 1
        elif w == "sym_store_numel":
            self.half = ids.numel()
        x = self.embed(ids) * 0.5
        amp = w in ("amp_set_dtype",)
        with torch.autocast("cpu", torch.bfloat16) if amp else contextlib.nullcontext():
            for i, layer in enumerate(self.layers):
                if w.startswith("amp_set_dtype") and i == 1:  # layers 1, 2 in float16
                    torch.set_autocast_dtype("cpu", torch.float16)
                x = layer(x).float()
            if w.startswith("amp_set_dtype"):
                torch.set_autocast_dtype("cpu", torch.bfloat16)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _old_gate() -> Any:
    """autosp.dynamo_reuse.gated as it was before this change (e3000c6): no reuse at all once the
    calling trace wrote any outer state or entered any mode."""
    here = os.path.dirname(os.path.abspath(__file__))
    text = subprocess.run(["git", "show", "e3000c6:python/autosp/dynamo_reuse.py"], cwd=here,
                          check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("_old_dynamo_reuse")
    exec(compile(text, "_old_dynamo_reuse.py", "exec"), mod.__dict__)
    return lambda *a, **k: mod.gated()


def _worker(rank: int, world: int, wiring: str, opts: dict[str, Any]) -> dict[str, Any]:
    import autosp
    from autosp import dynamo_reuse

    gate = opts.get("gate", "new")
    if opts.get("mark", True) is False:  # Dynamo traces every layer; autosp.outline still runs
        from autosp import dynamo_regions as regions

        regions.reuse_supported = lambda: False
    if gate == "none":
        dynamo_reuse.gated = lambda *a, **k: contextlib.nullcontext()
    elif gate == "old":
        dynamo_reuse.gated = _old_gate()
    hits = _count_reuse_hits()
    torch.manual_seed(0)
    model = opts.get("factory", _Model)(wiring)
    ref = copy.deepcopy(model)
    compiled = autosp.compile(model, autosp.init_mesh(world), remat="sequence-aware",
                              backend=opts.get("backend", "aot_eager"),
                              regions=opts.get("regions", True),
                              dynamic=opts.get("dynamic", False))
    ids, labels = make_batch(VOCAB, 2, opts.get("seq", 32), seed=1)
    if wiring.endswith("_viaglobal"):
        _ROOT[:] = [ref]
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    if wiring.endswith("_viaglobal"):
        _ROOT[:] = [model]
    model.zero_grad(set_to_none=True)
    loss = compiled(ids, labels)
    loss.backward()
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "errors": _errors(model, ref),
            "hits": hits[0], "outlined": list(compiled.last_compile.outlined)}


def _run(wiring: str, **opts: Any) -> list[dict[str, Any]]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="b51ind")
    return run_ranks(2, _worker, wiring, opts, timeout=600.0)


def _check(wiring: str, *, loss_atol: float = 1e-5, grad_rtol: float = 1e-4,
           **opts: Any) -> list[dict[str, Any]]:
    results = _run(wiring, **opts)
    for rank, r in enumerate(results):
        where = f"rank {rank} {wiring} {opts} hits={r['hits']} outlined={r['outlined']}"
        assert_errors_within(r, where, loss_atol=loss_atol, grad_rtol=grad_rtol)
    return results


# --- FOUND (caused by the change); FIXED ------------------------------------------------------
# Each model comes two ways: the layers reach the model through a back-reference (now left
# unmarked by autosp.dynamo_regions.back_reference: traced every layer, 0 hits), or through a
# global (``_viaglobal``: marked; the gate refuses the stored tensor that has a source).

@pytest.mark.parametrize("wiring", [
    "layer0_buffer_viaglobal",
    pytest.param("layer0_buffer", marks=pytest.mark.slow),
    pytest.param("layer0_regbuf_viaglobal", marks=pytest.mark.slow),
    pytest.param("tied_bias_viaglobal", marks=pytest.mark.slow),
    pytest.param("tied_bias", marks=pytest.mark.slow),
    pytest.param("layer0_setattr_viaglobal", marks=pytest.mark.slow),
    pytest.param("layer0_modlist_viaglobal", marks=pytest.mark.slow)])
def test_first_layer_tensor_stored_on_the_model_is_exact(wiring: str) -> None:
    """FAILED before the fix (about 20 s each): FOUND 1. The model stores layer 0's buffer (or,
    tied_bias, layer 0's bias) on itself before the layers; every layer reads it through the
    model. regions=True re-rooted it to each layer's own: loss 4.888774 against 4.831603
    (tied_bias 4.826866 against 4.827112), every gradient off; 2 reuse hits. Fixed: a stored
    value Dynamo knows by a source is not tolerated (autosp.dynamo_reuse._plain): 0 hits."""
    r = _check(wiring)
    assert r[0]["hits"] == 0


@pytest.mark.parametrize("wiring", ["amp_set_dtype_viaglobal",
                                    pytest.param("amp_set_dtype", marks=pytest.mark.slow)])
def test_autocast_dtype_set_under_an_outer_autocast_is_exact(wiring: str) -> None:
    """FAILED before the fix (about 20 s): FOUND 2. bf16 autocast entered before the first
    layer, ``torch.set_autocast_dtype("cpu", torch.float16)`` before layer 1, layers branching
    on the autocast dtype: loss 4.827413 against 4.853511, gradients off up to 4.1e-01 (bf16
    noise is about 1e-02). Fixed: the autocast setters are mode nodes (autosp.ops.MODE_NODES),
    for the gate and for autosp.outline's region key."""
    _check(wiring, loss_atol=1e-3, grad_rtol=2e-2)


# --- PRE-EXISTING (HEAD's gate as wrong; not this change's); FIXED ------------------------------

@pytest.mark.parametrize("wiring", ["direct_first", pytest.param("share_first",
                                                                 marks=pytest.mark.slow)])
def test_first_layer_state_read_through_a_back_reference_is_exact(wiring: str) -> None:
    """FAILED before the fix, at e3000c6 too (about 20 s): PRE-EXISTING a. No store; each layer
    reads layer 0's buffer through the model or a back-reference to layer 0: loss 4.888774
    against 4.831603. Fixed: a layer holding such a reference is not marked
    (autosp.dynamo_regions.back_reference), so Dynamo traces every layer: 0 hits."""
    r = _check(wiring)
    assert r[0]["hits"] == 0


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="OPEN, Dynamo's: a layer reading layer 0's state through "
                   "a global reference to the model is stamped out reading its own (the global "
                   "resolves to the model's tracker, whose sources the stamp-out re-roots)")
def test_first_layer_state_read_through_a_global_is_exact() -> None:
    """FAILS (about 20 s), at e3000c6 too: the same read through a global
    (``_ROOT[0].layers[0].gain``), which no structural check of the layers can see: loss
    4.888774 against 4.831603, 20/20 gradients off, 2 hits. Dynamo's graph of the region reads
    ``L['self'].layers[0].gain`` as a lifted input, and the later calls get ``layers[i]``'s.
    Exact with the layers unmarked (``test_..._exact_when_not_marked``)."""
    _check("direct_first_viaglobal")


@pytest.mark.slow
def test_first_layer_state_read_through_a_global_is_exact_when_not_marked() -> None:
    """GUARD: that model with Dynamo tracing every layer (autosp.outline still outlines): exact."""
    _check("direct_first_viaglobal", mark=False)


@pytest.mark.slow
@pytest.mark.parametrize("wiring", ["amp_set_dtype_noamp_viaglobal", "amp_set_dtype_noamp"])
def test_autocast_dtype_set_without_an_outer_autocast_is_exact(wiring: str) -> None:
    """FAILED before the fix, at e3000c6 too (about 20 s): PRE-EXISTING b. Loss 4.827365
    against 4.853494. Fixed with FOUND 2."""
    _check(wiring, loss_atol=1e-3, grad_rtol=2e-2)


# --- GUARDS (pass) -----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("wiring", ["layer0_buffer", pytest.param("tied_bias",
                                                                  marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", [{"regions": False}, {"gate": "old"}])
def test_guard_found_1_exact_without_regions_or_with_the_old_gate(
        wiring: str, how: dict[str, Any]) -> None:
    """GUARD (held, about 20 s): FOUND 1's models with regions=False, and with HEAD's gate
    (0 hits): exact."""
    r = _check(wiring, **how)
    assert r[0]["hits"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", [{"regions": False}, {"gate": "old"}])
def test_guard_found_2_exact_without_regions_or_with_the_old_gate(how: dict[str, Any]) -> None:
    """GUARD (held): FOUND 2's model with regions=False (4.853512) and HEAD's gate (4.853373):
    within bf16 noise."""
    _check("amp_set_dtype", loss_atol=1e-3, grad_rtol=2e-2, **how)


# --- HELD ----------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("wiring", ["sym_store", "sym_store_plain", "sym_store_plus",
                                    "sym_store_numel"])
def test_held_symbolic_size_stored_on_the_model(wiring: str) -> None:
    """HELD (about 20 s each): a symbolic size stored on the model before the layers
    (``self.half = ids.shape[1] // 2``, ``ids.shape[1]``, ``+ 1``, ``ids.numel()``) and read by
    every layer. At Dynamo level the stamp-out raises torch's internal ``KeyError: (s27//2)``
    (a compound symbol is not in ``bound_symbols``); autosp catches it and traces every layer
    (a UserWarning), exact."""
    _check(wiring, dynamic=True)


if __name__ == "__main__":  # python tests/test_regions_round8_breakers.py WIRING [k=v ...]
    import sys

    kw: dict[str, Any] = {}
    for a in sys.argv[2:]:
        k, v = a.split("=")
        kw[k] = {"True": True, "False": False}.get(v, int(v) if v.isdigit() else v)
    for r in _run(sys.argv[1], **kw):
        bad = {k: f"{v:.1e}" for k, v in r["errors"].items() if not v <= 1e-4}
        print(f"loss {r['loss']:.6f} ref {r['ref_loss']:.6f} hits {r['hits']} "
              f"bad {len(bad)}/{len(r['errors'])} {dict(list(bad.items())[:3])}")
