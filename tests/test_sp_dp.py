"""Data parallelism across SP groups: mesh (dp=2, sp=2) on 4 Gloo ranks. Each SP group
gets its own batch; after backward every rank holds the mean over the two groups of the
single-device gradients."""

from __future__ import annotations

from typing import Any

import pytest

from distributed import (assert_grads_close, build_model, dp_mean_reference, grads_of, make_batch,
                         run_ranks, tiny_config)


def _dp_worker(rank: int, world: int) -> dict[str, Any]:
    import autosp

    cfg = tiny_config(num_heads=4, num_kv_heads=2)
    model = build_model(cfg)
    mesh = autosp.init_mesh(2, dp_size=2)
    dp_rank = mesh.get_local_rank("dp")
    batches = [make_batch(cfg.vocab_size, 2, 16, seed=s) for s in (0, 1)]
    # The reference: mean over the two batches of the single-device gradients.
    ref_losses, ref_grads = dp_mean_reference(cfg, batches)
    cm = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none")
    ids, labels = batches[dp_rank]
    loss = cm(ids, labels)
    loss.backward()
    return {"loss": loss.item(), "ref_loss": ref_losses[dp_rank], "grads": grads_of(model),
            "ref_grads": ref_grads}


# The same sp 2 x dp 2 mesh, model, batches and reference run by default in
# test_model_state.py::test_parameters_unfrozen_or_replaced_after_the_compile_are_averaged_over_dp
# (its first step checks every gradient against the dp mean).
@pytest.mark.slow
def test_dp_times_sp_averages_over_dp() -> None:
    for r in run_ranks(4, _dp_worker):
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * max(1.0, abs(r["ref_loss"]))
        assert_grads_close(r["grads"], r["ref_grads"], rtol=1e-4)
