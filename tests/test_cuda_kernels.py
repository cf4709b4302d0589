"""autosp.cuda_kernels: the planner predicts a GPU's attention kernel and its kernels' scratch
from a CPU trace, and so matches what an H200 measured."""

from __future__ import annotations

import dataclasses

import pytest

from autosp import cuda_kernels, planner
from autosp.cuda_kernels import CUDNN, EFFICIENT, FLASH, MATH
from autosp.models.llama import LlamaConfig

GQA = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=1,
                  num_heads=4, num_kv_heads=2)
SOFTMAX_BWD = "aten._softmax_backward_data.default"


AMPERE, HOPPER = (8, 0), (9, 0)


@pytest.mark.parametrize("dtype, heads, kv, head_dim, mask, gpu, kernel", [
    ("bf16", 32, 8, 64, False, AMPERE, FLASH),       # Llama-3 in bf16 on an A100
    ("bf16", 32, 8, 64, False, HOPPER, CUDNN),       # ... on an H100 (cuDNN first)
    ("fp16", 32, 32, 128, False, AMPERE, FLASH),
    ("fp32", 32, 8, 64, False, AMPERE, MATH),        # flash is half only, efficient has no GQA
    ("fp32", 32, 8, 64, False, HOPPER, MATH),        # and cuDNN half only
    ("fp32", 32, 32, 64, False, HOPPER, EFFICIENT),
    ("bf16", 32, 8, 64, True, AMPERE, MATH),         # flash takes no explicit mask
    ("bf16", 32, 8, 64, True, HOPPER, CUDNN),        # cuDNN does, grouped heads too
    ("bf16", 32, 32, 64, True, AMPERE, EFFICIENT),
    ("bf16", 16, 16, 512, False, HOPPER, EFFICIENT),  # flash stops at 256, cuDNN at 128
    ("bf16", 16, 8, 256, False, HOPPER, FLASH),
    ("fp32", 8, 8, 66, False, HOPPER, MATH),         # efficient needs head_dim % 4 in fp32
])
def test_sdpa_kernel(dtype, heads, kv, head_dim, mask, gpu, kernel) -> None:
    assert cuda_kernels.sdpa_kernel(dtype, heads, kv, head_dim, mask=mask,
                                    capability=gpu) == kernel


def _targets(traced) -> list[str]:
    return [n.facts.target for n in traced.graph.nodes]


def test_fp32_gqa_is_traced_as_the_math_kernel_for_a_gpu() -> None:
    """For "cuda" the trace holds the math attention (its softmax and the softmax backward,
    with one output-sized scratch); for "cpu" the fused kernel, as before."""
    on_cpu = planner.trace_step(GQA, sp_size=1, dtype="fp32", batch_size=2, device="cpu")
    on_gpu = planner.trace_step(GQA, sp_size=1, dtype="fp32", batch_size=2, device="cuda")
    assert SOFTMAX_BWD not in _targets(on_cpu)
    assert any("flash_attention" in t for t in _targets(on_cpu))
    assert not any("flash_attention" in t for t in _targets(on_gpu))
    softmax_bwd = [n for n in on_gpu.graph.nodes if n.facts.target == SOFTMAX_BWD]
    assert len(softmax_bwd) == GQA.num_layers
    s = 4096
    for n in softmax_bwd:  # [B, H, S, S] fp32: the output and one scratch of its size
        assert n.alloc_bytes.at(s) == n.scratch_bytes.at(s) == 2 * GQA.num_heads * s * s * 4
    # In bf16 a GPU runs flash: the same graph as the CPU's.
    bf16_gpu = planner.trace_step(GQA, sp_size=1, dtype="bf16", batch_size=2, device="cuda")
    bf16_cpu = planner.trace_step(GQA, sp_size=1, dtype="bf16", batch_size=2, device="cpu")
    assert _targets(bf16_gpu) == _targets(bf16_cpu)


@pytest.mark.parametrize("sp, math", [(2, True), (4, False)])
def test_the_heads_a_rank_holds_decide(sp: int, math: bool) -> None:
    """Under Ulysses a rank runs attention on its share of the heads: 4 query and 2 KV heads
    over 2 ranks leave 2 and 1 (grouped: math in fp32), over 4 ranks the KV heads are
    replicated and each rank holds 1 and 1 (memory-efficient attention)."""
    traced = planner.trace_step(GQA, sp_size=sp, dtype="fp32", batch_size=2, device="cuda")
    assert (SOFTMAX_BWD in _targets(traced)) == math
    assert any("flash_attention" in t for t in _targets(traced)) != math


def test_an_unknown_device_is_refused() -> None:
    from autosp.errors import AutospError

    with pytest.raises(AutospError, match=r"device='mps'; expected 'cpu' or 'cuda'"):
        planner.trace_step(GQA, sp_size=1, dtype="fp32", batch_size=2, device="mps")


# Measured on one NVIDIA H200, torch 2.11.0+cu130, 2026-12-04: `python bench/bench_memory_gpu.py`
# (Llama-3.2-1B shape with 4 layers, fp32, AdamW, batch 1, aot_eager), torch.cuda.
# max_memory_allocated over the second step, GiB. Before autosp.cuda_kernels the prediction was
# 0.31x-0.83x of these (the CPU trace's fused attention).
H200_MEASURED_GIB = {
    "none": {2048: 12.326, 4096: 23.557, 8192: 68.215},
    "default": {2048: 11.934, 4096: 22.962, 8192: 67.026},
    "sequence-aware": {2048: 11.497, 4096: 22.298, 8192: 65.698},
}


def test_prediction_matches_the_h200_measurement() -> None:
    from autosp import _core

    config = dataclasses.replace(planner.PRESETS["llama-3.2-1b"], num_layers=4)
    traced = planner.trace_step(config, sp_size=1, dtype="fp32", batch_size=1, device="cuda")
    for policy, measured in H200_MEASURED_GIB.items():
        options = planner.core_plan_options(policy, "fp32", traced.num_params, 1)
        for s, gib in measured.items():
            predicted = _core.simulate_peak_memory(traced.graph, s, options).peak / 2**30
            assert abs(predicted / gib - 1) < 0.01, (policy, s, predicted, gib)
