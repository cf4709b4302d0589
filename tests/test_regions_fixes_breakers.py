"""Breakers for the regions=True fixes (0bee5ad, a655dcb, c03970b).

Found (c03970b, sp_module.forward): with layers marked for Dynamo to trace once, ANY exception
that is not an AutospError -- including a genuine user error at run time -- is taken for a
failure of the trace-once path: the layers are unmarked for good, a misleading
"[autosp:capture] Dynamo could not trace the repeated layers ... once per class" warning is
emitted, the model is compiled a second time (63 s against 13.5 s without regions on 2 cores)
and run again, and only then does the user's error surface. Later good calls run without
regions (compiled.traced_once == []). Reproduced with autosp's own bad-index check (a
RuntimeError from torch._assert_async, ids outside the vocabulary): without regions the same
error is raised at once, with no warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from distributed import make_batch, run_ranks, tiny_config

# regions=True is opt-in: its breaker rounds run with the slow tests
# (`pytest -m "slow or not slow" tests/test_regions_*breakers.py`); the default suite keeps
# its fast guards (test_dynamo_reuse, test_dynamo_regions, test_outline, test_regions_styles).
pytestmark = pytest.mark.slow



def _worker(rank: int, world: int, regions: bool) -> dict[str, Any]:
    import autosp
    from autosp.models.llama import LlamaForCausalLM

    mesh = autosp.init_mesh(world)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(4, 2, num_layers=2))
    ids, labels = make_batch(128, 2, 32, seed=1)
    compiled = autosp.compile(model, mesh, remat="none", backend="aot_eager", regions=regions)
    marked = list(compiled.traced_once)
    bad = ids.clone()
    bad[0, 0] = 10_000  # outside the vocabulary, on every rank alike
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled(bad, labels)
            error = ""
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
    compiled(ids, labels).backward()  # a good call afterwards still works
    return {"marked": marked, "error": error, "traced_once_after": list(compiled.traced_once),
            "warnings": [str(w.message) for w in caught if "[autosp:" in str(w.message)]}


def test_bad_input_without_regions_is_reported_at_once() -> None:
    """Guard (held): without regions the bad index is raised on both ranks, with no warning."""
    for rank, r in enumerate(run_ranks(2, _worker, False, timeout=300.0)):
        assert "found an index outside [0, 128)" in r["error"], (rank, r)
        assert not r["warnings"], (rank, r["warnings"])


def test_bad_input_with_regions_is_reported_like_without() -> None:
    """FAILS at 81b1913: with regions=True the user's bad input is taken for a trace-once
    failure: warned about as Dynamo failing to trace the layers once per class, compiled a
    second time, and the layers stay unmarked for every later call."""
    for rank, r in enumerate(run_ranks(2, _worker, True, timeout=300.0)):
        assert r["marked"] == ["layers.0", "layers.1"], (rank, r)
        assert "found an index outside [0, 128)" in r["error"], (rank, r)
        assert not r["warnings"], (rank, r["warnings"])
        assert r["traced_once_after"] == r["marked"], (rank, r)


class _TokenLocalLayer(torch.nn.Module):
    """A pre-norm MLP block: nothing in it mixes tokens, so after the SP rewrite every operand
    of its region is [B, S//P, H] (no attention, so none of size S)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class _TokenLocalModel(torch.nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(_TokenLocalLayer(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                 ignore_index=-100)


def _token_local_worker(rank: int, world: int) -> dict[str, Any]:
    import autosp
    from distributed import step_against_reference

    torch.manual_seed(0)
    model = _TokenLocalModel()
    compiled = autosp.compile(model, autosp.init_mesh(world), remat="sequence-aware",
                              backend="inductor", regions=True, dynamic=True)
    out = {}
    for seq in (64, 96):  # a second length: the same symbolic graph
        ids, labels = make_batch(128, 2, seq, seed=seq)
        out[seq] = step_against_reference(model, compiled, ids, labels)
    out["outlined"] = compiled.last_compile.outlined
    return out


@pytest.mark.slow  # about 90 s on 2 cores: Inductor at world 2
def test_token_local_layers_outline_with_a_dynamic_s_under_inductor() -> None:
    """FAILED before (breaker helper-43): layers with no attention, Inductor, dynamic S,
    regions=True: "[autosp:compile] internal error: ... For (s27//2), expected [s27] to have
    been codegen-ed". Every operand of the region was [B, S//2, H] after the SP rewrite, and
    Inductor cannot bind S from S//2; the region is now handed S itself (Dynamo's placeholder).
    Exact against one device at two lengths."""
    from distributed import assert_step_exact

    for rank, r in enumerate(run_ranks(2, _token_local_worker, timeout=600.0)):
        assert r["outlined"] == ["layers.0: calls autosp_layer_0",
                                 "layers.1: calls autosp_layer_0"], (rank, r["outlined"])
        for seq in (64, 96):
            assert_step_exact(r[seq], f"rank {rank}, S {seq}")


def _hf_packed_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    import autosp
    from autosp.train.config import TrainConfig
    from autosp.train.data import Batches
    from autosp.train.model import build_model
    from distributed import step_against_reference

    cfg = TrainConfig()
    cfg.model.hf_config, cfg.data.source = folder, "sample"
    model, vocab = build_model(cfg.model, 0, 0)
    args = Batches(cfg.data, 128, 2, 1, 1, 0).micro_batch(0, 0, 0, vocab)  # packed documents
    compiled = autosp.compile(model, autosp.init_mesh(world), seq_dim=1, remat="sequence-aware",
                              backend="inductor", tile_loss=True, dynamic=False, regions=True)
    out = step_against_reference(model, compiled, *args)
    out["outlined"] = compiled.last_compile.outlined
    return out


@pytest.mark.slow  # about 70 s on 2 cores: Inductor at world 2
def test_hf_llama_with_an_inline_layer_is_exact_under_inductor(tmp_path: Any) -> None:
    """FAILED before (breaker helper-43, through `autosp train --regions true`): a Hugging Face
    Llama whose layer 0 stays inline while layers 1-3 call one subgraph, sequence-aware,
    Inductor, the trainer's packed sample batch: the loss exact, the gradients of layer 0 and
    the embedding 50-110% off. The backward, which AOTAutograd compiles at the first backward,
    reused buffers: the patch that turns reuse off for a graph with regions covered only the
    forward's compile (now compile_fx's config_patches, which reach the backward)."""
    import json

    from distributed import assert_step_exact

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
        "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True}))
    for rank, r in enumerate(run_ranks(2, _hf_packed_worker, str(tmp_path), timeout=600.0)):
        assert r["outlined"][1:] == [f"model.model.layers.{i}: calls autosp_layer_0"
                                     for i in (1, 2, 3)], (rank, r["outlined"])
        assert_step_exact(r, f"rank {rank}")
