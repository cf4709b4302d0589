"""``autosp.compile(remat="auto")`` (autosp.remat_auto): the combination of remat, tiled loss,
tiled MLP and offload with the least predicted overhead that fits the memory given, chosen
at the first call from the user's own model, exact, and chosen alike on every rank."""

from __future__ import annotations

from typing import Any

import torch

from distributed import assert_step_exact, make_batch, run_ranks, step_against_reference, tiny_config

VOCAB = 1024  # a vocabulary large against the hidden size: the logits dominate the peak
SEQ = 128


def _model() -> torch.nn.Module:
    from autosp.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(4, 2, vocab_size=VOCAB, hidden_size=32))


def _errors(fn: Any) -> str:
    import autosp

    try:
        fn()
    except autosp.AutospError as e:
        return str(e)
    return "no error"


def _worker(rank: int, world: int) -> dict[str, Any]:
    import autosp
    from autosp.remat import Auto

    mesh = autosp.init_mesh(world)
    ids, labels = make_batch(VOCAB, 2, SEQ, seed=1)
    out: dict[str, Any] = {}

    # Enough memory: the cheapest combination, exact. The embedding is frozen (no optimizer
    # state), and the first call is under no_grad (nothing chosen until one with gradients).
    model = _model()
    model.embed_tokens.weight.requires_grad_(False)
    roomy = autosp.compile(model, mesh, remat=Auto(memory="8GB"), backend="aot_eager")
    with torch.no_grad():
        out["no_grad"] = (roomy(ids, labels).item(), model(ids, labels).item(),
                          roomy.remat_choice)
    out["roomy"] = step_against_reference(model, roomy, ids, labels)
    choice = roomy.remat_choice
    out["trained"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["optimizer_state"] = choice.chosen.prediction.optimizer_state
    out["roomy_choice"] = (choice.chosen.name, choice.chosen.prediction.peak, choice.budget)
    cands = {c.name: c.prediction for c in choice.candidates}
    out["candidates"] = {n: (p.peak, p.overhead) for n, p in cands.items()}
    # One byte less than sequence-aware remat with the tiled MLP predicts: of the tiled MLP's
    # combinations (tile_mlp=True keeps only those), the tiled loss's fit.
    tight = cands["ulysses + sequence-aware + tiled mlp"].peak - 1
    model = _model()
    tiled = autosp.compile(model, mesh, remat=Auto(memory=tight), backend="aot_eager",
                           tile_mlp=True)
    out["tight"] = step_against_reference(model, tiled, ids, labels)
    c = tiled.remat_choice
    out["tight_choice"] = (c.chosen.name, c.chosen.prediction.peak, c.budget, c.loss_chunks,
                           tiled.loss_tiling, tiled.mlp_tiling, str(c), c.table())

    # Ranks given different memory must not train different graphs (or hang): all raise. One
    # rank with memory for nothing: all raise too. (tile_loss and tile_mlp on: one trace.)
    # The second with a Hugging Face Llama called with an attention mask (the mask's S is a
    # symbol of its own in the trace: one S to the memory model, or rank 0 could not choose).
    for label, memory in (("differ", "8GB" if rank == 0 else tight),
                          ("none fits", "8GB" if rank == 0 else 4096)):
        if label == "none fits":
            import hf_zoo

            model = hf_zoo.build_model("llama", "LlamaForCausalLM")
            mask = torch.ones_like(ids)
            mask[0, -5:] = 0
            call = {"input_ids": ids % 256, "labels": labels.clamp(max=255),
                    "attention_mask": mask}
        else:
            model, call = _model(), {"input_ids": ids, "labels": labels}
        m = autosp.compile(model, mesh, remat=Auto(memory=memory), backend="aot_eager",
                           tile_loss=True, tile_mlp=True)
        out[label] = _errors(lambda: m(**call))

    # Clear errors before any work.
    out["cpu without memory"] = _errors(lambda: autosp.compile(_model(), mesh, remat="auto"))
    out["raw backend"] = _errors(lambda: autosp.backend(mesh, remat="auto"))
    out["bad memory"] = _errors(lambda: Auto(memory="lots"))
    out["bad flag"] = _errors(lambda: Auto(offload_optimizer=1))
    return out


def test_remat_auto_picks_the_cheapest_fit_exactly_and_alike_on_every_rank() -> None:
    """World 2, the reference Llama with a 1024-token vocabulary (hidden 32), S 64, aot_eager.

    - With 8 GB, the choice is the least predicted overhead of all 36 combinations, and the
      step is exact against one device (loss 1e-5, gradients 1e-4). A first call under
      no_grad chooses nothing and is exact; the frozen embedding has no optimizer state in
      the prediction.
    - With tile_mlp=True and one byte less than sequence-aware remat with the tiled MLP
      predicts, the choice tiles the loss too (the loss and the MLPs are tiled in the compiled
      graph) rather than offload, its predicted peak is within the budget, and the step is
      exact.
    - Ranks given different memory raise on every rank, naming both choices; a rank for
      which nothing fits makes every rank raise (neither hangs; a Hugging Face Llama called
      with an attention mask, whose trace has two symbols for S).
    - remat="auto" on a CPU model without Auto(memory=...), with the raw backend, and bad
      Auto fields are clear errors."""
    results = run_ranks(2, _worker, timeout=400)  # 60 s on a quiet machine
    for rank, r in enumerate(results):
        where = f"rank {rank}"
        loss, ref_loss, chosen = r["no_grad"]
        assert abs(loss - ref_loss) <= 1e-5 and chosen is None, r["no_grad"]
        assert_step_exact(r["roomy"], f"{where}, 8GB")
        # AdamW's fp32 moments for the trained parameters only (8 bytes each).
        assert r["optimizer_state"] == 8 * r["trained"], (r["optimizer_state"], r["trained"])
        name, peak, budget = r["roomy_choice"]
        least = min(o for _, o in r["candidates"].values())
        assert len(r["candidates"]) == 36, sorted(r["candidates"])
        assert r["candidates"][name][1] == least and peak <= budget, (name, r["candidates"])
        assert_step_exact(r["tight"], f"{where}, tight")
        name, peak, budget, chunks, tiling, mlp, line, table = r["tight_choice"]
        assert "tiled loss" in name and "tiled mlp" in name and peak <= budget, (name, table)
        assert "offload" not in name, table  # the tiled loss costs less than offload
        assert tiling and all(t.startswith("tiled") for t in tiling), tiling
        assert mlp and all(t.startswith("tiled") for t in mlp), mlp
        assert name in line and "<- chosen" in table, (line, table)
        assert "choosing differently" in r["differ"] and "rank 1:" in r["differ"], r["differ"]
        if rank == 1:
            assert "found no combination" in r["none fits"], r["none fits"]
        else:
            assert "rank 1: no choice" in r["none fits"], r["none fits"]
        assert "Auto(memory=" in r["cpu without memory"], r["cpu without memory"]
        assert "found remat='auto'" in r["raw backend"], r["raw backend"]
        assert "memory 'lots'" in r["bad memory"], r["bad memory"]
        assert "offload_optimizer" in r["bad flag"], r["bad flag"]
    assert results[0]["tight_choice"][0] == results[1]["tight_choice"][0]
