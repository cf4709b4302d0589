"""Breaker helper-82 (round 13): ``regions="compile"`` (autosp.outline alone: Dynamo traces every
layer, alike layers call one compiled subgraph). torch 2.13 CPU, Gloo, world 2, aot_eager; loss
and every parameter gradient against one device. Model parts: tests/decoder_layer.py.

FOUND (silent; ``regions=False`` exact):

1. Gathering a layer's nodes into one run moved a pure node of another module (a helper the
   layer calls on a view of its input) from between the layer's nodes to before them, across
   the layer's ``x.mul_(2.0)``: the helper read the input before the write. The layer then
   stayed inline (it writes in place), but the graph stayed reordered: loss 40.1627884 against
   68.9559021, worst gradient 0.43 (``head.weight``). ``regions=True`` alike. FIXED: nothing is
   moved across a write in place (autosp.outline_gather.gather); the layer stays inline with
   that reason.
2. The same the other way: a helper's node reading a value of the layer (``y = helper(t)``)
   moved after the run, across the layer's later ``t.mul_(2.0)``: loss 50.7802582 against
   25.8193283, worst gradient 1.04. FIXED by the same rule.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import decoder_layer
from decoder_layer import H, VOCAB
from distributed import run_ranks


class Helper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3.0


class WriteThroughViewLayer(decoder_layer.Layer):
    def __init__(self) -> None:
        super().__init__()
        del self.qkv  # no attention

    def forward(self, x: torch.Tensor, xv: torch.Tensor,  # type: ignore[override]
                helper: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.n1(x + 1.0)
        x.mul_(2.0)  # writes the layer's input in place
        y = helper(xv)  # another module's node, reading that input through a view
        h = x + self.o(a)
        return h + self.down(F.gelu(self.up(self.n2(h)))), y


class WriteThroughViewModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(WriteThroughViewLayer() for _ in range(3))
        self.helper = Helper()
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * 1.0
        acc: Any = 0
        for layer in self.layers:
            x, y = layer(x, x.view(x.shape), self.helper)
            acc = acc + y
        return F.cross_entropy(self.head(x + acc).flatten(0, 1), labels.flatten())


class WriteAfterReadLayer(decoder_layer.Layer):
    def __init__(self) -> None:
        super().__init__()
        del self.qkv, self.o, self.n1  # no attention

    def forward(self, x: torch.Tensor,  # type: ignore[override]
                helper: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.up(self.n2(x))
        y = helper(t)  # reads the layer's value; nothing of the layer reads it
        t.mul_(2.0)  # the layer then writes that value in place
        return x + self.down(F.gelu(t)), y


class WriteAfterReadModel(WriteThroughViewModel):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(WriteAfterReadLayer() for _ in range(3))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * 1.0
        acc: Any = 0
        for layer in self.layers:
            x, y = layer(x, self.helper)
            acc = acc + y.sum(-1, keepdim=True)
        return F.cross_entropy(self.head(x + acc).flatten(0, 1), labels.flatten())


#: name -> the model
MODELS: dict[str, Callable[[], nn.Module]] = {
    "write-through-view": WriteThroughViewModel,
    "write-after-read": WriteAfterReadModel,
}


def _worker(rank: int, world: int, regions: bool | str) -> dict[str, Any]:
    import autosp

    mesh = autosp.init_mesh(world)
    out: dict[str, Any] = {}
    for name, make in MODELS.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        compiled = autosp.compile(model, mesh, backend="aot_eager", regions=regions)
        out[name] = [decoder_layer.step(compiled, model, ref, 1)]
    return out


@pytest.mark.parametrize("regions", ["compile", pytest.param(True, marks=pytest.mark.slow)])
def test_round_13_cases_are_exact_with_regions(regions: bool | str) -> None:
    decoder_layer.check_exact(run_ranks(2, _worker, regions))


@pytest.mark.slow
def test_guard_round_13_cases_are_exact_without_regions() -> None:
    decoder_layer.check_exact(run_ranks(2, _worker, False))
