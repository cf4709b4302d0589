"""Adversarial checks of autosp.cuda_kernels and trace_step(device="cuda") (breaker 37).

Failing tests are findings; passing ones are cheap guards of what held."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import autosp
from autosp import _core, cuda_kernels, planner
from autosp.cuda_kernels import MATH
from autosp.models.llama import LlamaConfig
from autosp.plan_memory_graph import _graph_device

SOFTMAX_BWD = "aten._softmax_backward_data.default"
GQA = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=1,
                  num_heads=4, num_kv_heads=2)


# --- findings -------------------------------------------------------------------------------

def test_bench_longest_seq_predicts_for_the_cpu_it_measures(monkeypatch) -> None:
    """bench/bench_longest_seq.py measures each step on a CPU and prints autosp.plan's peak
    beside it (docs/longest_seq.md: "peak / predicted at the longest S"). autosp.plan now
    predicts for "cuda" by default, so for the bench's own model (4 query heads, 1 KV head,
    fp32) the no-SP row is predicted with the math attention and the softmax backward's
    scratch, which the CPU it measures does not run (at its longest S 768: 1.905 GiB against
    1.885 before; at S 4096: 7.29 against 6.78). Fix: pass device="cpu" in _predicted_peak."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_longest_seq as bench

    monkeypatch.setenv("AUTOSP_LOSS_TILE_ROWS", "")  # _predicted_peak sets both; restored after
    monkeypatch.setenv("AUTOSP_LOSS_RECOMPUTE", "")
    cfg = bench._config(argparse.Namespace(vocab=256, hidden=256, layers=1, sp=4))
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 1)
    no_sp = next(s for s in bench.STRATEGIES if s.name == "no-sp + default")
    seq = 1024
    printed = bench._predicted_peak(no_sp, cfg, 1, seq)
    on_cpu = autosp.plan(cfg, gpus=1, sp=1, dtype="fp32", gpu_memory=1 << 40,
                         strategies=["no-sp+default"], optimizer_sharding="none", seq_multiple=1,
                         seq_len=seq, max_seq=seq, curve_points=2,
                         device="cpu").strategies[0].at_seq.peak
    assert printed == on_cpu


def test_masked_half_gqa_is_not_math_on_an_h200() -> None:
    """sdpa_kernel says it follows "PyTorch's default backend order" on compute capability
    8.0+, as flash -> efficient -> math. On sm90/sm100 (H100, H200, B200) PyTorch >= 2.10 puts
    cuDNN attention first when the runtime cuDNN is newer than 9.15.0
    (check_prefer_cudnn_attention in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp),
    which the wheels from 2.11 on ship; cuDNN takes bf16/fp16 with an explicit mask and with
    grouped-query heads (check_attn_mask_shape, check_batch_size_and_num_heads_dense<true,
    ...>), so a masked bf16 GQA call runs cuDNN (memory linear in S) on the project's own GPU,
    not math ([B, H, S, S]). (Unmasked bf16 runs cuDNN too, not flash: same memory, but
    bench/gpu_sdpa_probe.py will print a mismatch.) The planner's traces hold no mask, so only
    the rule (and the test row ("bf16", 32, 8, 64, True, MATH)) is wrong today. Fix: take the
    GPU's compute capability (cuDNN first on 9.x/10.x) or state the rule for sm80/sm86/sm89."""
    assert cuda_kernels.sdpa_kernel("bf16", 32, 8, 64, mask=True) != MATH


# --- guards (held) --------------------------------------------------------------------------

def test_bf16_plan_is_the_same_for_cuda_and_cpu() -> None:
    """bf16 runs flash on a GPU: autosp.plan's numbers for "cuda" (the new default) are those
    of the CPU trace, as before the change (checked against ee97f65 for llama-3.2-1b on 8
    GPUs, every default strategy)."""
    kw = dict(gpus=2, sp=2, dtype="bf16", gpu_memory="1GiB", seq_multiple=256,
              strategies=["no-sp+none", "ulysses+sequence-aware"], curve_points=2)
    gpu = planner.plan(GQA, device="cuda", **kw)
    cpu = planner.plan(GQA, device="cpu", **kw)
    for g, c in zip(gpu.strategies, cpu.strategies):
        assert (g.longest_seq, g.at_seq.peak, g.curve) == (c.longest_seq, c.at_seq.peak, c.curve)


def test_bf16_math_attention_keeps_an_fp32_softmax() -> None:
    """bf16 with GQA and head_dim > 256 runs math on CUDA; PyTorch's math kernel upcasts half
    inputs to fp32 on every device (unless allow_fp16_bf16_reduction_math_sdp), so the CPU's
    math trace holds the [B, H, S, S] softmax in fp32, as the GPU does, and its backward
    counts one output-sized scratch."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=256, num_layers=1,
                      num_heads=2, num_kv_heads=1)
    assert cuda_kernels.sdpa_kernel("bf16", 2, 1, 512) == MATH
    traced = planner.trace_step(cfg, sp_size=1, dtype="bf16", batch_size=1, device="cuda")
    bwd = [n for n in traced.graph.nodes if n.facts.target == SOFTMAX_BWD]
    assert len(bwd) == 1
    s = 2048
    assert bwd[0].alloc_bytes.at(s) == bwd[0].scratch_bytes.at(s) == 2 * s * s * 4


@pytest.mark.slow
def test_replicated_layers_equal_a_full_trace_under_math() -> None:
    """The CUDA math re-trace goes through _core.replicate_layers like the CPU trace: 4 layers
    built from 3 predict exactly what all 4 traced give, for every policy."""
    cfg = dataclasses.replace(GQA, num_layers=4)
    full = planner.trace_step(cfg, sp_size=1, dtype="fp32", batch_size=1, replicate=False,
                              device="cuda")
    built = planner.trace_step(cfg, sp_size=1, dtype="fp32", batch_size=1, device="cuda")
    assert built.replicated and not full.replicated
    for policy in ("none", "default", "sequence-aware", "full"):
        o = planner.core_plan_options(policy, "fp32", full.num_params, 1)
        for s in (1024, 8192):
            assert (_core.simulate_peak_memory(built.graph, s, o).peak
                    == _core.simulate_peak_memory(full.graph, s, o).peak), (policy, s)


def test_graph_device_inference() -> None:
    """remat="auto" leaves device to _memory_graph: a graph with a CUDA tensor is "cuda"; one
    of CPU tensors, or with no tensor meta at all, is "cpu" (no scratch counted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_gpu = torch.empty(2, 3, device="cuda")
        on_cpu = torch.empty(2, 3)
    node = lambda val: SimpleNamespace(meta={} if val is None else {"val": val})  # noqa: E731
    assert _graph_device([node(None), node((on_gpu,)), node(on_cpu), node(on_gpu)]) == "cuda"
    assert _graph_device([node(on_cpu), node(None), node(3)]) == "cpu"
    assert _graph_device([]) == "cpu"
