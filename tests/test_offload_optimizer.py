"""autosp.OffloadOptimizer: the wrapped optimizer steps host master weights, and the device
parameters follow them exactly.

On CPU the "host" copies are separate CPU tensors, so the logic (what is copied where, in which
dtype, the state dict) is what these tests check; the memory it frees is the planner's
(tests/test_planner.py) and a GPU's to measure."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import autosp
from autosp import AutospError, OffloadOptimizer


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return m.to(dtype)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=g).to(next(model.parameters()).dtype)
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()


def _lambda(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1))


def test_fp32_steps_equal_the_plain_optimizer_bit_for_bit() -> None:
    ref, off = _model(), _model()
    groups = lambda m: [{"params": [m[0].weight, m[0].bias]},  # noqa: E731
                        {"params": m[2].parameters(), "weight_decay": 0.0}]
    a = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1)
    b = OffloadOptimizer(groups(off), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    sa, sb = _lambda(a), _lambda(b)
    for step in range(4):
        _step(ref, a, step)
        _step(off, b, step)
        sa.step()
        sb.step()
    for (name, p), q in zip(ref.named_parameters(), off.parameters()):
        assert torch.equal(p, q), name
    assert b.param_groups[0]["lr"] == a.param_groups[0]["lr"] == pytest.approx(1e-2 / 5)
    assert b.optimizer.param_groups[1]["weight_decay"] == 0.0
    # The device parameters are not the optimizer's tensors: the masters are separate copies.
    masters = [m for g in b.optimizer.param_groups for m in g["params"]]
    assert not any(m.data_ptr() == p.data_ptr() for m in masters for p in off.parameters())
    # To the code around it the groups are the model's parameters, with their state.
    assert [p for g in b.param_groups for p in g["params"]] == list(off.parameters())
    assert all(torch.equal(b.state[p]["exp_avg_sq"], a.state[q]["exp_avg_sq"])
               for p, q in zip(off.parameters(), ref.parameters()))
    moments = [s["exp_avg"] for s in a.state.values()]
    assert all(torch.equal(x, y) for x, y in zip(moments, [s["exp_avg"] for s in b.state.values()]))


def test_bf16_parameters_step_fp32_master_weights() -> None:
    off = _model(torch.bfloat16)
    opt = OffloadOptimizer(off.parameters(), lr=1e-2)  # AdamW by default
    masters = [m for g in opt.optimizer.param_groups for m in g["params"]]
    assert all(m.dtype == torch.float32 and m.device.type == "cpu" for m in masters)
    # The reference: torch's AdamW on fp32 copies, fed the bf16 gradients upcast.
    ref = [p.detach().float().clone().requires_grad_() for p in off.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    for step in range(3):
        _step(off, opt, step)
        for r, p in zip(ref, off.parameters()):
            r.grad = p.grad.float()
        ref_opt.step()
        for r, m, p in zip(ref, masters, off.parameters()):
            assert torch.equal(m, r.detach())  # the master weights are AdamW's fp32 result
            assert torch.equal(p, r.detach().to(torch.bfloat16))  # the device copy, rounded
    # Master weights, their gradients and two moments in fp32, and a 4-byte step per tensor.
    assert opt.host_bytes() == sum(m.numel() * 16 for m in masters) + 4 * len(masters)


def test_a_parameter_without_a_gradient_is_left_alone() -> None:
    off = _model()
    frozen = off[0].weight
    before = frozen.detach().clone()
    opt = OffloadOptimizer(off.parameters(), lr=1e-1, weight_decay=0.5)
    frozen.requires_grad_(False)
    _step(off, opt, 0)
    assert torch.equal(frozen, before)  # no gradient: no weight decay either, as in AdamW
    assert not torch.equal(off[2].weight, _model()[2].weight)


def test_state_dict_round_trip_resumes_exactly() -> None:
    ref, res = _model(), _model()
    a = OffloadOptimizer(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        _step(ref, a, step)
    saved = copy.deepcopy(a.state_dict())
    # A fresh optimizer over a model that has not trained: the state dict carries the master
    # weights and puts them into the device parameters.
    b = OffloadOptimizer(res.parameters(), lr=1e-2, weight_decay=0.1)
    b.init_state()  # what DCP loads into (tensors of the right shapes)
    assert set(b.state_dict()["state"]) == set(saved["state"])
    b.load_state_dict(saved)
    for p, q in zip(ref.parameters(), res.parameters()):
        assert torch.equal(p, q)
    _step(ref, a, 7)
    _step(res, b, 7)
    for p, q in zip(ref.parameters(), res.parameters()):
        assert torch.equal(p, q)


def test_init_state_changes_nothing() -> None:
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    opt = OffloadOptimizer(m.parameters(), lr=1e-2, weight_decay=0.1)
    opt.init_state()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert opt.param_groups[0]["lr"] == 1e-2


def test_closure_runs_before_the_copy() -> None:
    m = _model()
    opt = OffloadOptimizer(m.parameters(), lr=1e-2)
    x = torch.randn(3, 8)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss

    before = m[0].weight.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and not torch.equal(m[0].weight, before)


def test_what_the_code_around_an_optimizer_does_reaches_the_step() -> None:
    """Found by a breaker, each silently wrong before: weights loaded after the optimizer was
    built (the master is read again, its version counter changed), clipping through
    ``param_groups`` (they hold the device parameters, whose gradients the step copies), and
    ``GradScaler`` (unscales the device gradients, skips a step on inf)."""
    lin = torch.nn.Linear(2, 2)
    opt = OffloadOptimizer(lin.parameters(), torch.optim.SGD, lr=0.0)
    with torch.no_grad():
        lin.weight.fill_(7.0)  # e.g. model.load_state_dict(pretrained) after the optimizer
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert torch.equal(lin.weight, torch.full((2, 2), 7.0))
    moved = []
    for make in (torch.optim.SGD, lambda ps, lr: OffloadOptimizer(ps, torch.optim.SGD, lr=lr)):
        torch.manual_seed(0)
        lin = torch.nn.Linear(2, 2)
        before = lin.weight.detach().clone()
        opt = make(lin.parameters(), lr=1.0)
        lin(torch.ones(1, 2) * 100).sum().backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.01)
        opt.step()
        moved.append(lin.weight.detach() - before)
    assert torch.equal(moved[0], moved[1]) and moved[1].norm() < 0.011
    # GradScaler: unscale_ reaches the device gradients; an inf skips the step.
    for inf in (False, True):
        torch.manual_seed(0)
        ref, lin = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        lin.load_state_dict(ref.state_dict())
        steps = []
        for m, opt in ((ref, torch.optim.SGD(ref.parameters(), lr=0.1)),
                       (lin, OffloadOptimizer(lin.parameters(), torch.optim.SGD, lr=0.1))):
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            x = torch.ones(1, 2) * (float("inf") if inf else 1.0)
            scaler.scale(m(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
            steps.append(m.weight.detach().clone())
        assert torch.equal(steps[0], steps[1]), inf
    assert torch.equal(lin.weight, ref.weight)


def test_copies_and_pickles_without_breaking_others() -> None:
    """A deepcopy or a pickle of the optimizer used to break every OffloadOptimizer of the
    process (torch patches the class's step on unpickling). Hooks work as on any optimizer."""
    import io

    m = _model()
    opt = OffloadOptimizer(m.parameters(), lr=1e-2)
    _step(m, opt, 0)
    twin = copy.deepcopy(opt)
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(twin, OffloadOptimizer) and isinstance(loaded, OffloadOptimizer)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    _step(m, opt, 1)
    assert calls == ["pre", "post"]
    fresh = _model()
    other = OffloadOptimizer(fresh.parameters(), lr=1e-2)
    _step(fresh, other, 0)  # another instance still steps


def test_errors_name_what_was_found() -> None:
    with pytest.raises(AutospError, match=r"\[autosp:OffloadOptimizer\] found an empty"):
        OffloadOptimizer([], lr=1.0)
    with pytest.raises(AutospError, match="expected a torch.optim.Optimizer subclass"):
        OffloadOptimizer(_model().parameters(), "adamw")  # type: ignore[arg-type]
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(AutospError, match="a parameter given twice"):
        OffloadOptimizer([{"params": [p]}, {"params": [p]}], lr=1.0)
    # A plain AdamW's state of bf16 parameters has no fp32 masters: refused, not read from the
    # bf16 parameters (which would lose the masters' low bits).
    bf16 = _model(torch.bfloat16)
    plain = torch.optim.AdamW(bf16.parameters())
    _step(bf16, plain, 0)
    bad = OffloadOptimizer(_model(torch.bfloat16).parameters(), lr=1.0)
    with pytest.raises(AutospError, match=r"found the state of parameter 0 \(torch.bfloat16, "
                                          r"shape \(16, 8\)\) without its torch.float32 master"):
        bad.load_state_dict(plain.state_dict())
    with pytest.raises(AutospError, match="found a state dict with 3 master weights; expected 4"):
        bad.load_state_dict({**bad.state_dict(), "master_weights": {"0": 0, "1": 1, "2": 2}})
    with pytest.raises(AutospError, match=r"found a state dict with keys \['master_weights', "
                                          r"'param_groups'\]; expected a dict with 'state'"):
        bad.load_state_dict({k: v for k, v in bad.state_dict().items() if k != "state"})
    with pytest.raises(TypeError, match="found a single tensor of shape \\(3, 2\\) as params; "
                                        "params argument given to the optimizer should be an "
                                        "iterable of Tensors or dicts"):
        OffloadOptimizer(torch.nn.Parameter(torch.ones(3, 2)), torch.optim.SGD, lr=0.1)
    small = OffloadOptimizer([torch.nn.Parameter(torch.ones(1, 4))], torch.optim.SGD, lr=0.1)
    big = OffloadOptimizer([torch.nn.Parameter(torch.ones(3, 4))], torch.optim.SGD, lr=0.1)
    with pytest.raises(AutospError, match=r"found master weight 0 of shape \(1, 4\) in the state "
                                          r"dict; expected \(3, 4\)"):
        big.load_state_dict(small.state_dict())  # it broadcast silently before
    with pytest.raises(AutospError, match="found optimizer_class=LBFGS"):
        OffloadOptimizer(_model().parameters(), torch.optim.LBFGS)
    base = torch.nn.Parameter(torch.zeros(2, 2))
    row = base.detach()[1].requires_grad_()
    with pytest.raises(AutospError, match="found two parameters sharing memory"):
        OffloadOptimizer([base, row], torch.optim.SGD, lr=1.0)
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = OffloadOptimizer(emb.parameters(), torch.optim.SGD, lr=1.0)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(AutospError, match="found a sparse gradient"):
        opt.step()


def test_is_exported_and_typed() -> None:
    assert autosp.OffloadOptimizer is OffloadOptimizer
    assert isinstance(OffloadOptimizer(_model().parameters()), torch.optim.Optimizer)


def _train_offloaded(tmp_path: Any) -> list[dict]:
    """``autosp train --offload-optimizer`` at sp 2 (fp32, CPU), 4 steps, a checkpoint at
    step 2: its records."""
    from test_train_faults import _records, _train

    proc = _train(tmp_path / "off", "--steps", "4", "--lr", "0.05", "--offload-optimizer", "true",
                  "--checkpoint-every", "2")
    assert "optimizer offloaded to the host" in proc.stdout, proc.stdout
    off = _records(tmp_path / "off")
    assert [r["step"] for r in off] == [0, 1, 2, 3]
    return off


def test_train_with_the_optimizer_offloaded_matches(tmp_path: Any) -> None:
    """Every step's loss and gradient norm equal those of the run with a plain AdamW (to 1e-6
    relative; the host masters are the same fp32 numbers)."""
    from test_train_faults import _records, _train

    _train(tmp_path / "plain", "--steps", "4", "--lr", "0.05")
    plain, off = _records(tmp_path / "plain"), _train_offloaded(tmp_path)
    for a, b in zip(plain, off):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6), (a, b)
    assert plain[1]["loss"] != plain[3]["loss"]  # it trains


@pytest.mark.slow  # 20 s; the optimizer's own state round trip is checked by default above
def test_train_with_the_optimizer_offloaded_resumes(tmp_path: Any) -> None:
    """A run resumed from the offloaded run's step-2 checkpoint continues it exactly; resuming
    it without the flag says which setting wrote it (DCP's missing keys before)."""
    import subprocess

    from test_cli import _autosp_command
    from test_train_faults import ENV, TINY, _records, _train

    off = _train_offloaded(tmp_path)
    proc = _train(tmp_path / "resumed", "--steps", "4", "--lr", "0.05", "--offload-optimizer",
                  "true", "--resume", str(tmp_path / "off" / "checkpoints" / "step-2"))
    assert "2 steps done" in proc.stdout, proc.stdout
    resumed = _records(tmp_path / "resumed")
    proc = subprocess.run([*_autosp_command(), "train", *TINY, "--steps", "4", "--out-dir",
                           str(tmp_path / "plain2"), "--resume",
                           str(tmp_path / "off" / "checkpoints" / "step-2")],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode != 0
    assert "found a checkpoint written with training.offload_optimizer = true" in proc.stderr, \
        proc.stderr[-2000:]
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(off[2:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)


def test_writes_after_building_reach_the_master_and_keep_its_low_bits() -> None:
    """Found by a breaker, silently wrong before: a new tensor put in a parameter
    (``p.data = t``, which moves no version counter) was overwritten by the stale master at the
    next step; and any tracked write to a bf16 parameter, even of its own values
    (``model.load_state_dict(model.state_dict())``), reset the fp32 master to the bf16 value."""
    lin = torch.nn.Linear(3, 2)
    opt = OffloadOptimizer(lin.parameters(), torch.optim.SGD, lr=0.1)
    lin.weight.data = torch.full((2, 3), 5.0)  # a new storage, the same version
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert torch.equal(lin.weight, torch.full((2, 3), 4.9))  # as torch.optim.SGD steps it
    # An in-place write through .data moves nothing PyTorch tracks: lost, as documented.
    lin.weight.data.fill_(7.0)
    opt.step()
    assert torch.equal(lin.weight, torch.full((2, 3), 4.8))
    # bf16: the masters stay AdamW's fp32 numbers through writes of the parameters' own values,
    # and take the elements a write changed.
    model = _model(torch.bfloat16)
    opt = OffloadOptimizer(model.parameters(), lr=1e-2)
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    masters = [m for g in opt.optimizer.param_groups for m in g["params"]]
    for step in range(4):
        _step(model, opt, step)
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.float()
        ref_opt.step()
        if step == 1:
            model.load_state_dict(copy.deepcopy(model.state_dict()))
            with torch.no_grad():
                model[0].weight.copy_(model[0].weight.clone())
                model[0].bias.data = model[0].bias.data.clone()
        assert all(torch.equal(m, r.detach()) for m, r in zip(masters, ref)), step
        assert not all(torch.equal(m, m.bfloat16().float()) for m in masters)  # low bits used
    with torch.no_grad():
        model[2].bias[0] = 3.0
    opt.zero_grad()
    opt.step()  # no gradients: nothing steps, the write is read
    assert masters[3][0] == 3.0 and torch.equal(masters[3][1:], ref[3].detach()[1:])


def test_changed_groups_and_shapes_are_refused_before_anything_changes() -> None:
    """Found by a breaker: a parameter appended to ``param_groups[i]["params"]`` was never
    stepped (silently), and one replaced by a tensor of another shape raised torch's broadcast
    error after stepping the host optimizer."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = OffloadOptimizer([a], torch.optim.SGD, lr=0.1)
    opt.param_groups[0]["params"].append(b)
    (a.sum() + b.sum()).backward()
    with pytest.raises(AutospError, match=r"found parameter group 0 with 2 parameters, not the 1 "
                                          r"it was built with .*add_param_group"):
        opt.step()
    opt.param_groups[0]["params"].pop()
    opt.add_param_group({"params": [b]})  # the way to add one
    opt.step()
    assert torch.equal(b, torch.full((2,), -0.1)) and torch.equal(a, b)
    p = torch.nn.Parameter(torch.zeros(3, 4))
    opt = OffloadOptimizer([p], torch.optim.AdamW, lr=0.1)
    p.grad = torch.ones(3, 4)
    opt.step()
    before = copy.deepcopy(opt.optimizer.state_dict())
    p.data = torch.ones(1, 4)
    p.grad = torch.ones(1, 4)
    with pytest.raises(AutospError, match=r"found parameter 0 \(in param_groups' order\) of shape "
                                          r"\(1, 4\), built with shape \(3, 4\).*build a new "
                                          "OffloadOptimizer"):
        opt.step()
    after = opt.optimizer.state_dict()
    assert after["state"][0]["step"] == before["state"][0]["step"] == 1
    assert torch.equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])


def test_a_failed_add_param_group_changes_nothing() -> None:
    """Found by a breaker: it left the new parameter's master behind, so that ``state_dict()``
    carried one master more than the groups had parameters."""
    lin = torch.nn.Linear(2, 2)
    opt = OffloadOptimizer([lin.weight], torch.optim.SGD, lr=0.1)
    with pytest.raises(AutospError, match="a parameter given twice"):
        opt.add_param_group({"params": [lin.bias, lin.weight]})
    with pytest.raises(AutospError, match=r"found a non-leaf tensor of shape \(2,\)"):
        opt.add_param_group({"params": [lin.bias * 1]})
    assert len(opt.optimizer.param_groups) == len(opt.param_groups) == 1
    assert len(opt.state_dict()["master_weights"]) == 1
    fresh = OffloadOptimizer([torch.nn.Parameter(torch.zeros(2, 2))], torch.optim.SGD, lr=0.1)
    fresh.load_state_dict(opt.state_dict())
    opt.add_param_group({"params": [lin.bias], "lr": 0.5})
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.1, 0.5]


def test_dcp_state_dict_helpers_carry_the_master_weights() -> None:
    """Found by a breaker: ``torch.distributed.checkpoint.state_dict.get_state_dict`` keeps only
    ``state`` and ``param_groups``, and dropped the separate master weights (loading then
    failed). A bf16 parameter's fp32 master is now in its state entry; the older format, every
    master in ``master_weights``, still loads, and so does a dict without state for a
    parameter (whose state is then empty, as ``opt.state`` shows)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for dtype in (torch.float32, torch.bfloat16):
        ref = _model(dtype)
        a = OffloadOptimizer(ref.parameters(), lr=1e-2)
        for step in range(2):
            _step(ref, a, step)
        msd, osd = copy.deepcopy(get_state_dict(ref, a))
        assert set(osd) == {"state", "param_groups"}
        res = _model(dtype)
        torch.nn.init.zeros_(res[0].weight)
        b = OffloadOptimizer(res.parameters(), lr=1e-2)
        set_state_dict(res, b, model_state_dict=msd, optim_state_dict=osd)
        for step in range(2, 4):
            _step(ref, a, step)
            _step(res, b, step)
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), res.parameters())), dtype
        assert all(torch.equal(m, n) for m, n in zip(a._masters.values(), b._masters.values()))
    # The older format: all masters in master_weights, none in the state entries.
    sd = copy.deepcopy(a.state_dict())
    assert sd["master_weights"]["0"] == "state"
    sd["master_weights"] = {str(i): s.pop("master_weight") for i, s in sd["state"].items()}
    res = _model(torch.bfloat16)
    c = OffloadOptimizer(res.parameters(), lr=1e-2)
    c.load_state_dict(sd)
    assert all(torch.equal(m, n) for m, n in zip(a._masters.values(), c._masters.values()))
    # A state dict without state for a parameter: its state here is empty, as in torch.
    x, y = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = OffloadOptimizer([x, y], lr=0.1)
    (x.sum() + y.sum()).backward()
    opt.step()
    other = OffloadOptimizer([torch.nn.Parameter(torch.ones(2)), w := torch.nn.Parameter(
        torch.ones(2))], lr=0.1)
    w.sum().backward()
    other.step()
    opt.load_state_dict(other.state_dict())
    assert x not in opt.state and set(opt.state[y]) == {"step", "exp_avg", "exp_avg_sq"}
