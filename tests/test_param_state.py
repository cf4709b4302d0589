"""The model's state beyond its inputs, across ranks and around the user's own compile.

- a parameter frozen, or converted to another dtype, on some ranks only: the same AutospError
  on every rank, where the ranks used to wait in different collectives until Gloo's timeout
  (found by breaker helper-66, 2026-12-06);
- with data parallelism across SP groups, a parameter frozen at the compile and unfrozen later
  gets its gradient averaged over "dp" (it kept its own group's gradient, silently: relative
  error 1.03 against the data-parallel mean), and a parameter frozen on one SP group only is
  named on every rank of the mesh;
- the compiled module called inside the user's own ``torch.compile`` (a compiled training step)
  is exact: a graph break, where it failed in Dynamo before (``mark_dynamic`` traced);
- ``copy.deepcopy`` of the compiled module copies the model and compiles the copy as the
  original was (it failed on the fake tensors of the compile records), and pickling it is
  refused with an AutospError (it failed on a weakref).

Gloo groups at world 2 and 4 (tests/distributed.py), tiny models, ``aot_eager``.
"""

from __future__ import annotations

from typing import Any

import torch

import autosp
from distributed import (assert_grads_close, assert_step_exact, build_model, dp_mean_reference,
                         grads_of, make_batch, run_ranks, step_against_reference, tiny_config)

TIMEOUT_S = 150.0  # a hang fails the test instead of blocking the suite


def _cfg() -> Any:
    return tiny_config(num_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64)


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return type(e).__name__, str(e)
    return "ok", ""


def _one_rank_differs_worker(rank: int, world: int) -> list[tuple[str, str]]:
    cfg = _cfg()
    out = []
    for change in ("freeze", "dtype", "freeze-before-compile"):
        torch._dynamo.reset()
        model = build_model(cfg)
        if change == "freeze-before-compile" and rank == 1:
            model.embed_tokens.weight.requires_grad_(False)
        compiled = autosp.compile(model, autosp.init_mesh(world), backend="aot_eager", remat="none")
        ids, labels = make_batch(cfg.vocab_size, 1, 16)

        def steps() -> None:
            compiled(ids, labels).backward()
            if rank == 0 and change == "freeze":
                model.embed_tokens.weight.requires_grad_(False)
            if rank == 0 and change == "dtype":
                model.lm_head.to(torch.float64)
            compiled(ids, labels).backward()

        out.append(_outcome(steps))
    return out


def test_parameters_that_differ_across_ranks_are_named() -> None:
    outs = run_ranks(2, _one_rank_differs_worker, timeout=TIMEOUT_S)
    assert outs[0] == outs[1]  # every rank raises the same text
    for (kind, msg), what in zip(outs[0], ("11 of 12", "12 of 12", "11 of 12")):
        assert kind == "AutospError", (kind, msg)
        assert msg.startswith("[autosp:inputs] found the model's parameters set up differently "
                              "across the SP group (global ranks 0, 1): rank"), msg
        assert f"{what} parameters require gradients" in msg, msg
        assert "Freeze, unfreeze or convert parameters on every rank alike" in msg


def _dp_worker(rank: int, world: int) -> dict[str, Any]:
    cfg = tiny_config(num_heads=4, num_kv_heads=2)
    model = build_model(cfg)
    model.embed_tokens.weight.requires_grad_(False)  # frozen at the compile
    mesh = autosp.init_mesh(2, dp_size=2)
    dp_rank = mesh.get_local_rank("dp")
    batches = [make_batch(cfg.vocab_size, 2, 16, seed=s) for s in (0, 1)]
    _, ref_grads = dp_mean_reference(cfg, batches)
    compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none")
    ids, labels = batches[dp_rank]
    compiled(ids, labels).backward()
    first = grads_of(model)
    model.zero_grad(set_to_none=True)
    model.embed_tokens.weight.requires_grad_(True)  # unfrozen: its gradient is averaged too
    compiled(ids, labels).backward()
    out = {"first": first, "second": grads_of(model), "ref_grads": ref_grads}
    # Then frozen on the second SP group only: every rank of the mesh raises.
    if dp_rank == 1:
        model.lm_head.weight.requires_grad_(False)
    out["one_group"] = _outcome(lambda: compiled(ids, labels).backward())
    return out


def test_a_parameter_unfrozen_after_the_compile_is_averaged_over_dp() -> None:
    for rank, r in enumerate(run_ranks(4, _dp_worker, timeout=TIMEOUT_S)):
        ref = r["ref_grads"]
        assert "embed_tokens.weight" not in r["first"]
        assert_grads_close(r["first"], {k: ref[k] for k in r["first"]}, rtol=1e-4,
                           context=f"rank {rank}, frozen")
        assert set(r["second"]) == set(ref)
        assert_grads_close(r["second"], ref, rtol=1e-4, context=f"rank {rank}, unfrozen")
        kind, msg = r["one_group"]
        assert kind == "AutospError", r["one_group"]
        assert "found the model's parameters set up differently across the data-parallel " \
               "group" in msg, msg


def _inside_user_compile_worker(rank: int, world: int) -> list[dict[str, Any]]:
    cfg = _cfg()
    model = build_model(cfg)
    compiled = autosp.compile(model, autosp.init_mesh(world), backend="aot_eager")

    def train_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return compiled(ids, labels) * 1.0

    step = torch.compile(train_step, backend="aot_eager")
    return [step_against_reference(model, step, *make_batch(cfg.vocab_size, 2, n, seed=n))
            for n in (16, 24)]


def test_called_inside_the_users_torch_compile() -> None:
    for rank, out in enumerate(run_ranks(2, _inside_user_compile_worker, timeout=TIMEOUT_S)):
        for i, step in enumerate(out):
            assert_step_exact(step, f"rank {rank}, step {i}")


def _copy_worker(rank: int, world: int) -> dict[str, Any]:
    import copy
    import io

    cfg = _cfg()
    model = build_model(cfg)
    compiled = autosp.compile(model, autosp.init_mesh(world), backend="aot_eager", remat="none")
    ids, labels = make_batch(cfg.vocab_size, 1, 16)
    compiled(ids, labels).backward()
    twin = copy.deepcopy(compiled)  # after a compile: the model copied and compiled again
    out = {"twin_is_new": twin.module is not model and twin.sp_backend is not compiled.sp_backend,
           "same_weights": all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                                twin.module.parameters())),
           "twin_step": step_against_reference(twin.module, twin, ids, labels),
           "pickle": _outcome(lambda: torch.save(compiled, io.BytesIO()))}
    return out


def test_a_deep_copy_compiles_again_and_pickling_is_refused() -> None:
    for rank, r in enumerate(run_ranks(2, _copy_worker, timeout=TIMEOUT_S)):
        assert r["twin_is_new"] and r["same_weights"]
        assert_step_exact(r["twin_step"], f"rank {rank}, the copy")
        kind, msg = r["pickle"]
        assert kind == "AutospError" and msg.startswith(
            "[autosp:compile] found the compiled module pickled (pickle, torch.save)"), r["pickle"]
