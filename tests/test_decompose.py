"""Composite Torch functions taken apart by PyTorch's own decomposition (autosp.decompose),
in one process: which calls are taken apart, what they become, how an ATen op is read, and
that a decomposition the bridge cannot read leaves the call whole. Exactness against one
device at world 2 and 4 is in test_styles.py (nn-transformer-encoder and the other styles of
tests/styles_nn.py)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import styles_nn
from autosp import decompose
from autosp.canon import aten_torch_name, canonicalize


def _dynamo_graph(model: torch.nn.Module, *args: torch.Tensor) -> tuple[fx.GraphModule, list]:
    """The graph Dynamo gives autosp's backend, and the inputs it was called with."""
    got: list = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        # real values: the sizes Dynamo passes as symbols, at their traced values
        got.append((gm, [x.node.hint if isinstance(x, torch.SymInt) else x for x in example_inputs]))
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=True, fullgraph=True)(*args)
    return got[0]


def _calls(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) if isinstance(n.target, torch._ops.OpOverload) else getattr(n.target, "__name__", "")
            for n in gm.graph.nodes if n.op == "call_function"]


def test_multi_head_attention_forward_becomes_sdpa() -> None:
    """nn.TransformerEncoderLayer's attention (need_weights=False) becomes projections, head
    reshapes and one aten SDPA each, with the call's user stack trace; nothing else is taken
    apart, and the rewired graph computes what it computed before, to the last bit."""
    torch.manual_seed(0)
    model = styles_nn.TorchEncoderLM(n_layers=2)
    ids = torch.randint(0, styles_nn.VOCAB, (2, 16))
    gm, example_inputs = _dynamo_graph(model, ids, ids)
    assert _calls(gm).count("multi_head_attention_forward") == 2
    composite = [n for n in gm.graph.nodes if decompose.is_composite(n)]
    assert [getattr(n.target, "__name__", "") for n in composite] == ["multi_head_attention_forward"] * 2
    trace = composite[0].meta["stack_trace"]
    before = gm(*example_inputs)

    assert decompose.decompose_composites(gm) == ["multi_head_attention_forward"] * 2
    calls = _calls(gm)
    assert "multi_head_attention_forward" not in calls
    assert calls.count("aten.scaled_dot_product_attention.default") == 2
    sdpa = [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa[0].meta["stack_trace"] == trace and "styles_nn.py" in trace
    assert all(n.meta["autosp_decomposed"] == "multi_head_attention_forward" for n in sdpa)
    # read as the Torch-level SDPA, causal (PyTorch drops the mask when is_causal=True)
    op, operands, attrs = canonicalize(sdpa[0])
    assert op == "sdpa" and len(operands) == 3 and attrs["is_causal"] is True
    after = gm(*example_inputs)
    assert torch.equal(before[0], after[0]), (before[0], after[0])


def test_need_weights_stays_whole() -> None:
    """need_weights=True computes the attention by baddbmm, which the bridge does not read as
    a Torch function: the call stays whole (run on the gathered sequence, or refused with
    unsupported="error")."""
    model = styles_nn.MHANeedWeightsLM()
    ids = torch.randint(0, styles_nn.VOCAB, (2, 16))
    gm, _ = _dynamo_graph(model, ids, ids)
    node = next(n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "multi_head_attention_forward")
    assert decompose.is_composite(node)
    traced = decompose._trace(node)
    assert traced is not None and not decompose._readable(traced[0].graph)
    assert decompose.decompose_composites(gm) == []
    assert "multi_head_attention_forward" in _calls(gm)


@pytest.mark.parametrize("op, name", [
    (torch.ops.aten.linear.default, "linear"),
    (torch.ops.aten.scaled_dot_product_attention.default, "scaled_dot_product_attention"),
    (torch.ops.aten._to_copy.default, "to"),
    (torch.ops.aten.exp.default, "exp"),                   # pointwise by torch's tag
    # arguments not where the Torch function has them: never read as it
    (torch.ops.aten.embedding.default, "aten.embedding.default"),
    (torch.ops.aten.cross_entropy_loss.default, "aten.cross_entropy_loss.default"),
    # in-place: never read as the functional op
    (torch.ops.aten.add_.Tensor, "aten.add_.Tensor"),
    (torch.ops.aten.baddbmm.default, "aten.baddbmm.default"),
])
def test_aten_names(op: torch._ops.OpOverload, name: str) -> None:
    assert aten_torch_name(op) == name


def test_spliced_values_require_grad_like_dynamo() -> None:
    """make_fx's metadata says nothing requires grad; the bridge places gradient syncs by
    requires_grad, so the spliced values get it from their inputs. nn.Transformer's decoder
    cross-attention splits in_proj_weight into q and kv parts: those parts require grad
    (without it, autosp once gave wrong in_proj gradients with an exact loss)."""
    torch.manual_seed(0)
    model = styles_nn.TorchSeq2SeqLM()
    ids = torch.randint(0, styles_nn.VOCAB, (2, 16))
    gm, _ = _dynamo_graph(model, ids, ids)
    assert decompose.decompose_composites(gm) == ["multi_head_attention_forward"] * 3
    spliced = [n for n in gm.graph.nodes if "autosp_decomposed" in n.meta]
    splits = [n for n in spliced if n.target is torch.ops.aten.split_with_sizes.default
              or n.target is torch.ops.aten.split.Tensor]
    assert splits, "the cross-attention's in_proj split"
    assert all(t.requires_grad for n in splits for t in n.meta["example_value"])
    # an integer size computation never requires grad
    assert not any(isinstance(n.meta["example_value"], torch.Tensor) and n.meta["example_value"].requires_grad
                   and not n.meta["example_value"].is_floating_point() for n in spliced)
