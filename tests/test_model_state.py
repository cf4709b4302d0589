"""The model's state beyond its inputs, across ranks and around the user's own compile.

- a parameter frozen, converted to another dtype, or replaced and frozen, on some ranks only:
  the same AutospError on every rank, where the ranks used to wait in different collectives
  until Gloo's timeout (found by breaker helper-66, 2026-12-06);
- with data parallelism across SP groups, a parameter frozen at the compile and unfrozen later,
  or replaced after it (``load_state_dict(assign=True)``, a new module, a parameter written
  straight into ``_parameters``: breakers helper-68 and helper-69), gets its gradient
  averaged over "dp" (it kept its own group's gradient, silently: relative error 1.03 against
  the data-parallel mean), and a parameter frozen on one rank is named alike on every rank of
  the mesh;
- a hook registered on one rank only is named (the ranks' losses were mixed, silently); with
  ``regions=True`` a hook registered after the compile on a submodule of a layer traced once
  takes effect (it was ignored: breaker helper-68), and a global module hook registered after
  the compile is warned of (Dynamo runs the graph without it);
- the compiled module called inside the user's own ``torch.compile`` (a compiled training step)
  is exact: a graph break, where it failed in Dynamo before (``mark_dynamic`` traced);
- ``copy.deepcopy`` of the compiled module copies the model and compiles the copy as the
  original was (it failed on the fake tensors of the compile records), and pickling it is
  refused with an AutospError (it failed on a weakref).

Gloo groups at world 2 and 4 (tests/distributed.py), tiny models, ``aot_eager``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

import autosp
from distributed import outcome as _outcome
from distributed import (assert_grads_close, assert_step_exact, build_model, dp_mean_reference,
                         grads_of, make_batch, run_ranks, step_against_reference, tiny_config)

TIMEOUT_S = 150.0  # a hang fails the test instead of blocking the suite


def _cfg() -> Any:
    return tiny_config(num_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64)


def _one_rank_differs_worker(rank: int, world: int) -> list[tuple[str, str]]:
    cfg = _cfg()
    out = []
    for change in ("freeze", "dtype", "freeze-before-compile", "replaced-then-frozen", "hook",
                   "shape", "mode"):
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
            if change == "replaced-then-frozen":  # new parameter objects on every rank (F3)
                model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()},
                                      assign=True)
                if rank == 0:
                    model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
            if rank == 0 and change == "hook":  # F6: the ranks' losses were mixed, silently
                model.norm.register_forward_hook(lambda m, i, o: o * 2.0)
            if rank == 1 and change == "mode":  # rank 0 waited in the graph (helper-71)
                from torch.utils._python_dispatch import TorchDispatchMode

                class Passing(TorchDispatchMode):
                    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                        return func(*args, **(kwargs or {}))

                with Passing():
                    compiled(ids, labels)
            if rank == 0 and change == "shape":  # another vocabulary: Gloo aborted (helper-70)
                model.lm_head.weight = torch.nn.Parameter(torch.randn(cfg.vocab_size + 8,
                                                                      cfg.hidden_size))
            compiled(ids, labels).backward()

        out.append(_outcome(steps))
    return out


def test_parameters_that_differ_across_ranks_are_named() -> None:
    outs = run_ranks(2, _one_rank_differs_worker, timeout=TIMEOUT_S)
    assert outs[0] == outs[1]  # every rank raises the same text
    *models, mode = outs[0]
    assert mode[0] == "AutospError" and mode[1].startswith(
        "[autosp:inputs] found a torch dispatch mode (FlopCounterMode, a TorchDispatchMode) "
        "active around the call on rank 1 only"), mode
    for (kind, msg), what in zip(models, ("11 of 12", "12 of 12", "11 of 12", "11 of 12",
                                          "12 of 12", "12 of 12"), strict=True):
        assert kind == "AutospError", (kind, msg)
        assert msg.startswith("[autosp:inputs] found the model's parameters or hooks set up "
                              "differently across the SP group (global ranks 0, 1): rank"), msg
        assert f"{what} parameters require gradients" in msg, msg
        assert "register hooks, on every rank alike" in msg


def _dp_worker(rank: int, world: int) -> dict[str, Any]:
    import io

    cfg = tiny_config(num_heads=4, num_kv_heads=2)
    model = build_model(cfg)
    model.embed_tokens.weight.requires_grad_(False)  # frozen at the compile
    mesh = autosp.init_mesh(2, dp_size=2)
    dp_rank = mesh.get_local_rank("dp")
    batches = [make_batch(cfg.vocab_size, 2, 16, seed=s) for s in (0, 1)]
    _, ref_grads = dp_mean_reference(cfg, batches)
    compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none")
    ids, labels = batches[dp_rank]
    out: dict[str, Any] = {"ref_grads": ref_grads}

    def step(name: str) -> None:
        model.zero_grad(set_to_none=True)
        compiled(ids, labels).backward()
        out[name] = grads_of(model)

    step("frozen")
    model.embed_tokens.weight.requires_grad_(True)  # unfrozen: its gradient is averaged too
    step("unfrozen")
    # New parameter objects (a checkpoint loaded with assign=True, F1) and a new module with
    # the same weights (F2): averaged as well.
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    step("assigned")
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head.weight.data.copy_(model.lm_head.weight.data)
    model.lm_head = head
    step("new module")
    # Written into the module's dict, past nn.Module.__setattr__ (as nn.Module._apply does with
    # torch.__future__.set_overwrite_module_params_on_conversion(True); found by helper-69).
    down = model.layers[0].mlp.down_proj
    down._parameters["weight"] = torch.nn.Parameter(down.weight.detach().clone())
    step("written into _parameters")
    # A layer loaded from a pickle: its parameters carry no hook (helper-70: a token carried in
    # their __dict__ made autosp skip them, silently).
    buf = io.BytesIO()
    torch.save(model.layers[0], buf)
    buf.seek(0)
    model.layers[0] = torch.load(buf, weights_only=False)
    step("loaded from a pickle")
    # Then frozen on the second SP group's rank 3 only: every rank of the mesh raises, alike.
    if rank == 3:
        model.lm_head.weight.requires_grad_(False)
    out["one_rank"] = _outcome(lambda: compiled(ids, labels).backward())
    return out


def test_parameters_unfrozen_or_replaced_after_the_compile_are_averaged_over_dp() -> None:
    outs = run_ranks(4, _dp_worker, timeout=TIMEOUT_S)
    for rank, r in enumerate(outs):
        ref = r["ref_grads"]
        assert "embed_tokens.weight" not in r["frozen"]
        assert_grads_close(r["frozen"], {k: ref[k] for k in r["frozen"]}, rtol=1e-4,
                           context=f"rank {rank}, frozen")
        for name in ("unfrozen", "assigned", "new module", "written into _parameters",
                     "loaded from a pickle"):
            assert set(r[name]) == set(ref), name
            assert_grads_close(r[name], ref, rtol=1e-4, context=f"rank {rank}, {name}")
        kind, msg = r["one_rank"]
        assert kind == "AutospError", r["one_rank"]
        assert msg.startswith("[autosp:inputs] found the model's parameters or hooks set up "
                              "differently across the mesh (its SP and data-parallel groups) "
                              "(global ranks 0, 1, 2, 3)"), msg
    assert len({r["one_rank"] for r in outs}) == 1  # the same text on every rank


def _regions_hook_worker(rank: int, world: int) -> list[Any]:
    import warnings

    import torch.nn.modules.module as module_globals

    cfg = tiny_config(num_layers=2, hidden_size=32, intermediate_size=64, vocab_size=64)
    model = build_model(cfg)
    compiled = autosp.compile(model, autosp.init_mesh(world), backend="aot_eager", remat="none",
                              regions=True)
    ids, labels = make_batch(cfg.vocab_size, 2, 16, seed=3)
    out: list[Any] = [step_against_reference(model, compiled, ids, labels)]
    # A hook on a submodule of the second layer traced once (F4: ignored, loss off by 0.04).
    model.layers[1].mlp.register_forward_hook(lambda m, i, o: o * 3.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out.append(step_against_reference(model, compiled, ids, labels))
    out.append([str(w.message) for w in seen])
    # A global hook registered after the compile (F5): Dynamo runs the graph without it; said.
    handle = module_globals.register_module_forward_hook(lambda m, i, o: None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled(ids, labels)
    handle.remove()
    out.append([(type(w.message).__name__, str(w.message)) for w in seen])
    return out


def test_a_hook_on_a_layer_traced_once_and_a_global_hook() -> None:
    for rank, out in enumerate(run_ranks(2, _regions_hook_worker, timeout=TIMEOUT_S)):
        assert_step_exact(out[0], f"rank {rank}, no hook")
        assert_step_exact(out[1], f"rank {rank}, a hook on layers.1.mlp")
        assert any("tracing every layer instead" in w and "layers.1 is no longer alike" in w
                   for w in out[2]), out[2]
        assert any(kind == "AutospHookWarning" and "found a global module hook" in text
                   for kind, text in out[3]), out[3]


def _inside_user_compile_worker(rank: int, world: int) -> list[dict[str, Any]]:
    cfg = _cfg()
    model = build_model(cfg)
    compiled = autosp.compile(model, autosp.init_mesh(world), backend="aot_eager")

    def train_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return compiled(ids, labels) * 1.0

    step = torch.compile(train_step, backend="aot_eager")
    out: list[Any] = [step_against_reference(model, step, *make_batch(cfg.vocab_size, 2, n, seed=n))
                      for n in (16, 24)]
    ids, labels = make_batch(cfg.vocab_size, 2, 16)
    def whole_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return compiled(ids, labels) * 1.0

    whole = torch.compile(whole_step, backend="aot_eager", fullgraph=True)
    out.append(_outcome(lambda: whole(ids, labels)))
    # A hook on the compiled model itself runs as a frame of its own (found by helper-68: the
    # error said to call mark_dynamic).
    from torch.utils.flop_counter import FlopCounterMode

    def counted() -> None:  # a raw RuntimeError from Dynamo before (helper-70)
        with FlopCounterMode(display=False):
            compiled(ids, labels)

    out.append(_outcome(counted))
    model.register_forward_hook(lambda m, i, o: o * 2.0)
    out.append(_outcome(lambda: compiled(ids, labels)))
    return out


def test_called_inside_the_users_torch_compile() -> None:
    for rank, out in enumerate(run_ranks(2, _inside_user_compile_worker, timeout=TIMEOUT_S)):
        for i, step in enumerate(out[:2]):
            assert_step_exact(step, f"rank {rank}, step {i}")
        kind, msg = out[2]  # fullgraph=True: Dynamo's error, with autosp's reason where it has one
        assert kind == "Unsupported" and "torch.compiler.disable" in msg, out[2]
        if "reason" in inspect.signature(torch.compiler.disable).parameters:
            assert "autosp.compile's module runs its own compiled graph" in msg, msg
        kind, msg = out[3]
        assert kind == "AutospError" and msg.startswith(
            "[autosp:compile] found a torch dispatch mode active around the call ("), out[3]
        assert "FlopCounterMode" in msg, msg
        kind, msg = out[4]
        assert kind == "AutospError" and msg.startswith(
            "[autosp:capture] found a hook on the compiled model itself"), out[4]


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
           "pickle": _outcome(lambda: torch.save(compiled, io.BytesIO())),
           "shallow": _outcome(lambda: copy.copy(compiled))}
    return out


def test_a_deep_copy_compiles_again_and_pickling_is_refused() -> None:
    for rank, r in enumerate(run_ranks(2, _copy_worker, timeout=TIMEOUT_S)):
        assert r["twin_is_new"] and r["same_weights"]
        assert_step_exact(r["twin_step"], f"rank {rank}, the copy")
        kind, msg = r["pickle"]
        assert kind == "AutospError" and msg.startswith(
            "[autosp:compile] found the compiled module pickled (pickle, torch.save)"), r["pickle"]
        assert r["shallow"][0] == "AutospError" and "found copy.copy" in r["shallow"][1]


def test_the_model_state_reads_any_hook_dict() -> None:
    """A hook dict keyed by a string (written directly, as some libraries do) is read like
    any other (helper-69: a raw TypeError from every call)."""
    from autosp.model_state import ModelState

    model = build_model(_cfg())
    state = ModelState(model)
    before, _ = state.state()
    model.norm._forward_hooks["log"] = lambda m, i, o: None
    after, changed = state.state()
    assert changed and after != before
    del model.norm._forward_hooks["log"]
    again, changed = state.state()
    assert changed and again == before


class _LazyLM(torch.nn.Module):
    """A model with an nn.LazyLinear, materialised by its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.lazy = torch.nn.LazyLinear(32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        logits = self.head(x + torch.tanh(self.lazy(x)))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64),
                                                 labels[:, 1:].reshape(-1))


def _lazy_and_user_hook_worker(rank: int, world: int) -> dict[str, Any]:
    import copy

    torch.manual_seed(0)
    model = _LazyLM()
    # A hook of the user's registered before the first call (as an optimizer step in backward
    # would be) reads the gradient averaged over dp (helper-71: it read the local one).
    seen: dict[str, torch.Tensor] = {}
    model.head.weight.register_post_accumulate_grad_hook(
        lambda p: seen.__setitem__("head.weight", p.grad.clone()))
    mesh = autosp.init_mesh(2, dp_size=2)
    batches = [make_batch(64, 2, 16, seed=s) for s in (0, 1)]
    compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none")
    compiled(*batches[mesh.get_local_rank("dp")]).backward()  # materialises the lazy layer
    ref: dict[str, torch.Tensor] = {}
    for batch in batches:
        twin = copy.deepcopy(model)
        twin.zero_grad(set_to_none=True)
        twin(*batch).backward()
        for name, g in grads_of(twin).items():
            ref[name] = ref.get(name, 0) + g / 2
    # autosp.fully_shard of a model not yet materialised: refused before anything is sharded
    # (helper-71: torch's ValueError halfway, the model left part sharded).
    fresh = _LazyLM()
    refused = _outcome(lambda: autosp.fully_shard(fresh, mesh))
    return {"grads": grads_of(model), "ref": ref, "seen": seen, "shard": refused,
            "untouched": all(type(p) in (torch.nn.Parameter, torch.nn.UninitializedParameter)
                             for p in fresh.parameters())}


def test_a_lazy_layer_and_a_users_hook_see_the_gradient_averaged_over_dp() -> None:
    for rank, r in enumerate(run_ranks(4, _lazy_and_user_hook_worker, timeout=TIMEOUT_S)):
        # The first step: the lazy layer was hooked only from the second before (helper-71).
        assert_grads_close(r["grads"], r["ref"], rtol=1e-4, context=f"rank {rank}")
        assert_grads_close(r["seen"], {"head.weight": r["ref"]["head.weight"]}, rtol=1e-4,
                           context=f"rank {rank}, the user's hook")
        assert r["shard"][0] == "AutospError" and "found parameters not yet materialised (lazy" \
            in r["shard"][1], r["shard"]
        assert r["untouched"]
