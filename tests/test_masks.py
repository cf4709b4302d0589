"""Attention masks are never materialised at [S, S] per rank (autosp.tiled_attention).

Under Ulysses every rank attends with all S queries of its heads, so a mask built in forward
as ``[B, 1, S, S]`` would cost O(S^2) on every rank. autosp replays the mask's chain of ops
on one tile of query rows at a time. Checked here:

- the tiled attention op against ``F.scaled_dot_product_attention`` with the whole mask,
  forward and backward, eager and through AOTAutograd, for bool and additive masks, GQA,
  tiles that do not divide S (one process, no ranks);
- a Hugging Face Llama called with a padding ``attention_mask`` (transformers builds a
  ``[B, 1, S, S]`` causal-and-padding mask in forward) at world 2: exact against one device,
  and, recording every tensor the compiled step produces, none has two dims of length S,
  while the same step with the whole mask as one tile does (so the probe would see one);
- the hand-written mask styles (``tril`` of ones, ``eye``, a padding mask ``&`` causal) with
  tiles smaller than a rank's chunk and a last tile that is shorter, under Inductor with the
  sequence-aware remat (-m slow); with ``aot_eager``, every style of tests/test_styles.py runs
  with tiles of 3 rows and checks which masks are tiled (``TILED_MASKS`` there).
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from distributed import assert_step_exact, run_ranks

RANK_TIMEOUT_S = 600.0


# -- the op, one process ------------------------------------------------------------------

def _recipe_for(mask: torch.Tensor) -> int:
    """A recipe that returns rows [start, end) of ``mask`` (a leaf read whole, sliced by the
    recipe graph itself as narrow(mask, -2, start, end - start))."""
    import operator

    import torch.fx as fx

    from autosp import tiled_attention

    g = fx.Graph()
    start, end, leaf = g.placeholder("start"), g.placeholder("end"), g.placeholder("leaf0")
    length = g.call_function(operator.sub, (end, start))
    g.output(g.call_function(torch.narrow, (leaf, mask.dim() - 2, start, length)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    key = hash((mask.shape, mask.dtype)) & ((1 << 56) - 1)
    tiled_attention._RECIPES[key] = gm
    return key


@pytest.mark.parametrize("tile", ["3", "100"])
@pytest.mark.parametrize("kind", ["bool-causal-pad", "float-bias", "gqa-bool"])
@pytest.mark.parametrize("compiled", [False, True])
def test_tiled_op_matches_sdpa(tile: str, kind: str, compiled: bool, monkeypatch) -> None:
    monkeypatch.setenv("AUTOSP_MASK_TILE_ROWS", tile)
    torch.manual_seed(0)
    B, H, S, D = 2, 4, 16, 8
    kv_heads = 2 if kind == "gqa-bool" else H
    q = torch.randn(B, H, S, D, requires_grad=True)
    k = torch.randn(B, kv_heads, S, D, requires_grad=True)
    v = torch.randn(B, kv_heads, S, D, requires_grad=True)
    pos = torch.arange(S)
    causal = pos[None, :] <= pos[:, None]
    if kind == "float-bias":
        mask = torch.where(causal, -0.1 * (pos[:, None] - pos[None, :]).float(), float("-inf"))[None, None]
    else:
        pad = torch.ones(B, S, dtype=torch.bool)
        pad[1, 11:] = False
        mask = causal[None, None] & pad[:, None, None, :]
        mask = mask | torch.eye(S, dtype=torch.bool)  # no empty row
    gqa = kv_heads != H
    key = _recipe_for(mask)

    def tiled(q, k, v, mask):
        return torch.ops.autosp.tiled_scaled_dot_product_attention(q, k, v, [mask], [], key, None, gqa)

    fn = torch.compile(tiled, backend="aot_eager", fullgraph=True) if compiled else tiled
    out = fn(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


# -- Hugging Face Llama with a padding mask, world 2 -------------------------------------

S_HF = 48  # no model dim is 48: a tensor with two dims of 48 is [S, S]-like


HF_TILE_ROWS = ["8"]  # tiles of 8 rows (the whole mask as one tile: -m slow)


def _worker(rank: int, world: int) -> dict[str, list[dict]]:
    """Every world-2 case of this file, in one spawn of two ranks."""
    import autosp

    mesh = autosp.init_mesh(world)
    hf = [_hf_case(mesh, t) for t in HF_TILE_ROWS]
    return {"hf": hf, "forms": _forms(mesh, list(MASKS))}


@functools.cache
def _results() -> tuple[dict[str, list[dict]], ...]:
    pytest.importorskip("transformers")
    return tuple(run_ranks(2, _worker, timeout=RANK_TIMEOUT_S))


def _hf_case(mesh, tile_rows: str | None) -> dict:
    import copy
    import warnings

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from transformers import AutoConfig, AutoModelForCausalLM

    import autosp
    from distributed import grads_of

    warnings.filterwarnings("ignore")
    if tile_rows is None:
        os.environ.pop("AUTOSP_MASK_TILE_ROWS", None)
    else:
        os.environ["AUTOSP_MASK_TILE_ROWS"] = tile_rows
    torch._dynamo.reset()
    cfg = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               attn_implementation="sdpa")
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, S_HF), generator=gen)
    attention_mask = torch.ones(2, S_HF, dtype=torch.long)
    attention_mask[1, 35:] = 0  # right padding within rank 1's chunk
    labels = ids.masked_fill(attention_mask == 0, -100)
    # Flat: the recorder below is a TorchDispatchMode, which PyTorch's invoke_subgraph (a
    # layer's region, regions="compile") refuses without a rule for it.
    compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none", regions=False)

    square: list[tuple] = []
    masks: set[tuple] = set()  # shapes of the 4-d boolean tensors (the masks' tiles)
    on = [False]
    from autosp import tiled_attention

    own_ops = {op._opoverload: op._init_fn
               for op in (tiled_attention.tiled_sdpa, tiled_attention.tiled_sdpa_backward)}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inner = own_ops.get(func)
            if inner is not None:  # autosp's own op: its Python body, recorded too (a
                with Record():     # mode is off while its handler runs)
                    out = inner(*args, **(kwargs or {}))
            else:
                out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and sum(int(s) == S_HF for s in t.shape) >= 2:
                    square.append((str(func), tuple(t.shape)))
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() == 4:
                    masks.add(tuple(t.shape))
            return out

    # Every op the compiled forward and backward graphs run (and the ops inside autosp's
    # custom ops), recorded from inside AOTAutograd's compiled functions (Dynamo does not
    # run compiled code under a dispatch mode entered outside it).
    backend_module = sys.modules["autosp.backend"]  # (autosp.backend is also a function)
    plain = backend_module.eager_graph

    def recorded(gm, example_inputs):
        run = plain(gm, example_inputs)

        def call(args):
            if not on[0]:
                return run(args)
            with Record():
                return run(args)

        call._boxed_call = True
        return call

    backend_module.eager_graph = recorded

    def loss_of(m):
        return m(input_ids=ids, labels=labels, attention_mask=attention_mask, use_cache=False).loss

    loss_of(compiled).backward()  # compiles
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    ref_loss = loss_of(ref)
    ref_loss.backward()
    model.zero_grad(set_to_none=True)
    on[0] = True
    loss = loss_of(compiled)
    loss.backward()
    on[0] = False
    backend_module.eager_graph = plain
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grads": grads_of(model),
            "ref_grads": grads_of(ref), "square": square, "masks": sorted(masks), "tiled": compiled.tiled_masks}


def test_hf_padding_mask_has_no_s_by_s_tensor() -> None:
    _check_hf(_results(), HF_TILE_ROWS)


@pytest.mark.slow
def test_hf_probe_sees_the_whole_mask_in_one_tile() -> None:
    """The recorder's own check: with the whole mask as one tile it must see [S, S] tensors."""
    _check_hf(tuple(run_ranks(2, _hf_only_worker, [None], timeout=RANK_TIMEOUT_S)), [None])


def _hf_only_worker(rank: int, world: int, tile_rows: list) -> dict[str, list[dict]]:
    import autosp

    mesh = autosp.init_mesh(world)
    return {"hf": [_hf_case(mesh, t) for t in tile_rows]}


def _check_hf(per_rank: tuple, settings: list) -> None:
    pytest.importorskip("transformers")
    for rank, results in enumerate(per_rank):
        for tile_rows, r in zip(settings, results["hf"]):
            where = f"rank {rank} (tile rows {tile_rows})"
            assert_step_exact(r, where)
            assert r["tiled"], f"{where}: the mask was not tiled"
            if tile_rows is None:
                # One tile holds the whole mask: the recorder must see it (the probe works).
                assert r["square"], f"{where}: the probe saw no [S, S] tensor even untiled"
            else:
                assert not r["square"], f"{where}: [S, S] tensors per rank: {r['square'][:5]}"
                # The probe saw the tiles: [B, 1, 8, S] (and the last, shorter one).
                assert (2, 1, 8, S_HF) in r["masks"], f"{where}: mask tiles seen: {r['masks']}"


# -- hand-written mask styles -------------------------------------------------------------

TILED_STYLES = ["llama-scratch-complex-rope", "llama-scratch-cos-sin-mha", "padded-causal-4d-mask"]


def _styles_worker(rank: int, world: int, names: list[str], inductor: bool = False) -> list[dict]:
    import warnings

    import autosp
    import styles

    warnings.filterwarnings("ignore")
    os.environ["AUTOSP_MASK_TILE_ROWS"] = "3"  # smaller than a chunk (8), the last tile short
    mesh = autosp.init_mesh(world)
    # Under Inductor (its fp32 reordering): the suite's Inductor tolerances.
    opts = (dict(backend="inductor", remat="sequence-aware", loss_atol=1e-4, grad_rtol=1e-3)
            if inductor else {})
    return [styles.run_case(n, styles.ALL[n].build, styles.ALL[n].inputs, world, 16, mesh=mesh, **opts)
            for n in names]


def _check_styles(inductor: bool) -> None:
    import styles

    names = TILED_STYLES[1:] if inductor else TILED_STYLES  # (one from-scratch Llama suffices)
    for rank, results in enumerate(run_ranks(2, _styles_worker, names, inductor, timeout=RANK_TIMEOUT_S)):
        for r in results:
            assert r["outcome"] == styles.EXACT, f"{r['name']} rank {rank}: {r['outcome']}: {r['detail']}"
            assert r["tiled_masks"], f"{r['name']} rank {rank}: its mask was not tiled"


@pytest.mark.slow
def test_styles_with_masks_exact_in_tiles_under_inductor() -> None:
    """The custom op through Inductor and the sequence-aware remat partitioner."""
    _check_styles(inductor=True)


# -- mask forms (found by a breaker review): exact, and tiled where the mask is O(S)-built ---

class _MaskedLM(torch.nn.Module):
    """One attention layer whose mask comes from ``MASKS[form](model, ids, am)``; padding
    positions' labels are ignored."""

    def __init__(self, form: str, vocab: int = 64, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.form, self.heads = form, heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.embed(ids)
        mask = MASKS[self.form](self, ids, am)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.out(x + o.transpose(1, 2).reshape(b, s, -1))
        if self.form == "mask-weighted-loss":  # a per-query weight read from the mask
            w = mask.float().sum(-1)[:, 0]
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            return (per_token * w).mean()
        labels = labels.masked_fill(am == 0, -100)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def _pos(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device)


def _causal_pad(ids: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
    p = _pos(ids)
    eye = torch.eye(ids.shape[1], dtype=torch.bool)  # no empty row
    return (p[:, None] >= p[None, :])[None, None] & am[:, None, None, :].bool() | eye


# form -> mask(model, ids, am); TILED: the forms whose mask is computed in tiles.
MASKS = {
    "where-float": lambda m, ids, am: torch.where(_causal_pad(ids, am), 0.0, float("-inf")),
    "sliding-window": lambda m, ids, am: ((_pos(ids)[None, :] <= _pos(ids)[:, None])
                                          & (_pos(ids)[None, :] > _pos(ids)[:, None] - 4))
    .unsqueeze(0).unsqueeze(0),
    "documents-from-ids": lambda m, ids, am: (
        (torch.cumsum((ids < 8).long(), 1)[:, :, None] == torch.cumsum((ids < 8).long(), 1)[:, None, :])
        & (_pos(ids)[:, None] >= _pos(ids)[None, :]))[:, None],
    "full-triu": lambda m, ids, am: torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1),
    "type-as-hidden": lambda m, ids, am: (1.0 - _causal_pad(ids, am).type_as(m.embed(ids))) * -1e9,
    "tril-view-expand": lambda m, ids, am: torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    .view(1, 1, ids.shape[1], ids.shape[1]).expand(ids.shape[0], 1, ids.shape[1], ids.shape[1]),
    "repeat-rows": lambda m, ids, am: am.bool()[:, None, None, :].repeat(1, 1, ids.shape[1], 1)
    & _causal_pad(ids, am),
    "expand-heads": lambda m, ids, am: _causal_pad(ids, am).expand(ids.shape[0], m.heads, ids.shape[1],
                                                                   ids.shape[1]),
    "mask-weighted-loss": lambda m, ids, am: _causal_pad(ids, am),
    # (found by a breaker review) squeeze of the query dim: a no-op at full length, but a tile
    # of one row would lose the dim, so the mask stays whole.
    "squeeze-query-dim": lambda m, ids, am: _causal_pad(ids, am).squeeze(2),
    # A write after the chain (an attention sink by setitem): the mask stays whole, with it.
    "setitem-sink": lambda m, ids, am: _sink(ids),
}


def _sink(ids: torch.Tensor) -> torch.Tensor:
    p = _pos(ids)
    m = torch.zeros(ids.shape[1], ids.shape[1]).masked_fill(
        ~((p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - 4)), float("-inf"))
    m[:, 0] = 0.0
    return m
TILED = {"where-float", "sliding-window", "documents-from-ids", "full-triu", "type-as-hidden", "tril-view-expand",
         "mask-weighted-loss"}


def _form_inputs(seed: int, seq_len: int) -> tuple:
    from distributed import make_batch

    ids, labels = make_batch(64, 2, seq_len, seed)
    am = torch.ones(2, seq_len, dtype=torch.long)
    am[1, seq_len // 2 + 1:] = 0
    return ids, labels, am


def _forms(mesh, forms: list[str]) -> list[dict]:
    import warnings

    import styles

    warnings.filterwarnings("ignore")
    os.environ["AUTOSP_MASK_TILE_ROWS"] = "5"
    out = [styles.run_case(f, lambda f=f: _MaskedLM(f), _form_inputs, 2, 24, mesh=mesh) for f in forms]
    out.append(_refilled_mask_case(mesh))
    return out


def _refilled_mask_case(mesh) -> dict:
    """The [B, S] padding mask refilled in place between forward and backward (a loader that
    reuses its buffer): one device's backward does not see it, nor may the tiles' recompute."""
    import copy

    import autosp
    from distributed import grads_of, relative_grad_errors

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _MaskedLM("where-float")
    ref = copy.deepcopy(model)
    ids, labels, am = _form_inputs(3, 24)
    ref_loss = ref(ids, labels, am.clone())
    ref_loss.backward()
    compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none")
    loss = compiled(ids, labels, am)
    am.fill_(1)
    loss.backward()
    errs = relative_grad_errors(grads_of(model), grads_of(ref))
    return {"name": "refilled-mask", "outcome": "exact" if abs(loss.item() - ref_loss.item()) <= 1e-5
            and max(errs.values()) <= 1e-4 else "mismatch", "detail": f"{loss.item()} {ref_loss.item()} {errs}",
            "tiled_masks": compiled.tiled_masks}


def test_mask_forms_exact_and_tiled_where_o_s() -> None:
    for rank, results in enumerate(_results()):
        for r in results["forms"]:
            where = f"{r['name']} rank {rank}"
            assert r["outcome"] == "exact", f"{where}: {r['outcome']}: {r['detail'][:3000]}"
            tiled = r["name"] in TILED or r["name"] == "refilled-mask"
            assert bool(r["tiled_masks"]) == tiled, f"{where}: tiled {r['tiled_masks']}, expected {tiled}"
