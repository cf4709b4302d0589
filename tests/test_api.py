"""The public API's checks that need no process group."""

from __future__ import annotations

import pytest
import torch

import autosp
from autosp.api import SequenceParallelModule
from autosp.backend import SequenceParallelBackend
from autosp.models.llama import LlamaConfig, LlamaForCausalLM


def _model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(num_layers=1))


def test_state_dict_and_parameters_are_the_models() -> None:
    model = _model()
    wrapped = SequenceParallelModule(
        model, SequenceParallelBackend(rank=0, world=2, group="unused", backend="aot_eager"), seq_dim=1
    )
    assert list(wrapped.state_dict()) == [f"module.{k}" for k in model.state_dict()]
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in model.parameters()]


def test_sequence_length_not_divisible_is_refused_before_compiling() -> None:
    wrapped = SequenceParallelModule(
        _model(), SequenceParallelBackend(rank=0, world=4, group="unused", backend="aot_eager"), seq_dim=1
    )
    ids = torch.zeros(2, 30, dtype=torch.long)
    with pytest.raises(autosp.AutospError, match=r"sequence length 30 not divisible by the SP degree 4"):
        wrapped(ids, ids)


def test_bad_arguments() -> None:
    with pytest.raises(autosp.AutospError, match=r"\[autosp:compile\] found backend='tvm'"):
        autosp.compile(_model(), mesh=None, backend="tvm")  # type: ignore[arg-type]
    with pytest.raises(autosp.AutospError, match=r"found remat='sometimes'"):
        autosp.compile(_model(), mesh=None, remat="sometimes")  # type: ignore[arg-type]
    with pytest.raises(autosp.AutospError, match=r"found outputs='gathered'; expected one of "
                                                 r"\('full', 'local'\)"):
        autosp.compile(_model(), mesh=None, outputs="gathered")  # type: ignore[arg-type]
    with pytest.raises(autosp.AutospError, match=r"found unsupported='skip'; expected one of "
                                                 r"\('gather', 'error'\)"):
        autosp.compile(_model(), mesh=None, unsupported="skip")  # type: ignore[arg-type]
    with pytest.raises(autosp.AutospError, match=r"\[autosp:init_mesh\] found torch.distributed not initialised"):
        autosp.init_mesh(2)


def test_raw_backend_arguments() -> None:
    with pytest.raises(autosp.AutospError, match=r"\[autosp:compile\] found backend='tvm'"):
        SequenceParallelBackend(rank=0, world=2, group="unused", backend="tvm")
    with pytest.raises(autosp.AutospError, match=r"\[autosp:compile\] found seq_dim=0; expected an int >= 1"):
        autosp.backend(None, seq_dim=0)  # type: ignore[arg-type]
    with pytest.raises(autosp.AutospError, match=r"\[autosp:compile\] found mesh=None \(NoneType\)"):
        autosp.backend(None)  # type: ignore[arg-type]
