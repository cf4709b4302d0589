"""Breakers for ``autosp.compile(regions=True)`` (autosp.outline): layer sets that compile
flat but break when outlined."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from distributed import assert_step_exact, make_batch, run_ranks


class _Record(torch.fx.Interpreter):
    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        n.meta["val"] = value
        return value


def _tag(n: fx.Node, path: str) -> fx.Node:
    n.meta["nn_module_stack"] = {path: (path, torch.nn.Module)}
    return n


def _residual_layers(acts: list[Any], widths: list[int]) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """h = h + act(h @ w_i) @ v_i per layer i, w_i [8, widths[i]]."""
    g = fx.Graph()
    h = g.placeholder("x")
    ws = [(g.placeholder(f"w{i}"), g.placeholder(f"v{i}")) for i in range(len(acts))]
    for i, (act, (w, v)) in enumerate(zip(acts, ws)):
        a = _tag(g.call_function(torch.matmul, (h, w)), f"layers.{i}.mlp")
        b = _tag(g.call_function(act, (a,)), f"layers.{i}.mlp")
        c = _tag(g.call_function(torch.matmul, (b, v)), f"layers.{i}.mlp")
        h = _tag(g.call_function(torch.add, (h, c)), f"layers.{i}")
    g.output(h)
    gm = fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(4, 8)]
    for width in widths:
        args += [torch.randn(8, width), torch.randn(width, 8)]
    _Record(gm).run(*args)
    return gm, args


def test_two_interleaved_classes_of_layers() -> None:
    """Layers 0 and 2 alike, 1 and 3 alike (e.g. alternating dropout / no dropout, dense /
    MoE): both classes are outlined and the result is unchanged. Found: outline_layers raised
    KeyError (the first member of the second class still named an output of a layer the first
    class had already replaced, when its subgraph was copied)."""
    from autosp.outline import outline_layers

    gm, args = _residual_layers([torch.relu, torch.sigmoid, torch.relu, torch.sigmoid], [16] * 4)
    expected = gm(*args)
    lines = outline_layers(gm)
    assert lines.count("layers.0: calls autosp_layer_0") == 1, lines
    assert "layers.1: calls autosp_layer_1" in lines and "layers.3: calls autosp_layer_1" in lines, lines
    torch.testing.assert_close(gm(*args), expected, rtol=0, atol=0)


def test_layers_with_different_weight_shapes_do_not_share_a_subgraph() -> None:
    """Two layers alike but for their MLP width: AOTAutograd traces a subgraph once, with the
    first call's shapes, so they may not call the same one. Found: both called autosp_layer_0,
    and compiling failed with "shape '[128, 32]' is invalid for input of size 2048"."""
    from autosp.outline import outline_layers

    gm, args = _residual_layers([torch.relu, torch.relu, torch.relu], [16, 32, 16])
    expected = gm(*args)
    lines = outline_layers(gm)
    sub = {line.split(":")[0]: line.split("calls ")[-1] for line in lines if "calls" in line}
    assert sub.get("layers.1") is None or sub["layers.1"] != sub.get("layers.0"), lines
    torch.testing.assert_close(gm(*args), expected, rtol=0, atol=0)


# End to end, world 2, aot_eager.

class _Block(nn.Module):
    def __init__(self, hidden: int, inner: int, pdrop: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.proj = nn.Linear(hidden, inner), nn.Linear(inner, hidden)
        self.pdrop = pdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, 4, C // 4).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + F.dropout(self.o(y), self.pdrop, self.training)
        return x + F.dropout(self.proj(F.gelu(self.fc(self.ln2(x)))), self.pdrop, self.training)


class _LM(nn.Module):
    def __init__(self, blocks: list[tuple[int, float]], hidden: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.h = nn.ModuleList([_Block(hidden, inner, p) for inner, p in blocks])
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for b in self.h:
            x = b(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), labels.flatten())


def _lm_worker(rank: int, world: int, blocks: list[tuple[int, float]]) -> dict[str, Any]:
    import copy

    import autosp
    from distributed import grads_of

    mesh = autosp.init_mesh(world)
    torch.manual_seed(0)
    model = _LM(blocks)
    ids, labels = make_batch(64, 2, 64, seed=1)
    compiled = autosp.compile(model, mesh, remat="none", backend="aot_eager", regions=True)
    ref = copy.deepcopy(model)
    torch.manual_seed(5)  # with aot_eager, dropout masks are bitwise one device's
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    torch.manual_seed(5)
    loss = compiled(ids, labels)
    loss.backward()
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grads": grads_of(model),
            "ref_grads": grads_of(ref), "outlined": compiled.last_compile.outlined}


@pytest.mark.slow  # ~40 s each on 2 cores
@pytest.mark.parametrize("blocks", [
    [(128, 0.0), (64, 0.0)],  # different MLP widths
    [(128, 0.1), (128, 0.0), (128, 0.1), (128, 0.0)],  # alternating dropout
], ids=["widths", "alternating-dropout"])
def test_unlike_layers_compile_and_stay_exact(blocks: list[tuple[int, float]]) -> None:
    """Found: widths -> AutospError "[autosp:compile] internal error: RuntimeError: shape
    '[128, 32]' is invalid for input of size 2048"; alternating dropout -> "[autosp:outline]
    internal error: KeyError: getitem_81". Both compile flat and are exact."""
    for rank, r in enumerate(run_ranks(2, _lm_worker, blocks)):
        assert_step_exact(r, f"rank {rank}, {r['outlined']}")
