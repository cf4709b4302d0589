"""The model a run trains: the built-in preset, a Hugging Face architecture from its
``config.json`` (random weights), or a local Hugging Face checkpoint folder (its weights).

Every model is called as ``model(input_ids, labels)`` and returns the mean next-token loss
(labels are the inputs; the model shifts them), which is what ``autosp.compile`` makes exact.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from autosp.errors import AutospError
from autosp.train.config import ModelConfig


class HFCausalLM(nn.Module):
    """A transformers causal LM as ``(input_ids, labels) -> loss`` (its own shifted
    cross-entropy, SDPA attention, no KV cache)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def _hf_folder(path: str, key: str) -> str:
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise AutospError(f"[autosp:train] model.{key} = {path!r}: found no config.json there; "
                          "expected a Hugging Face config.json or a folder holding one")
    return folder


def build_model(cfg: ModelConfig, seed: int) -> tuple[nn.Module, int]:
    """(model on the CPU in fp32, its vocabulary size). The same ``seed`` gives the same
    random weights on every rank."""
    torch.manual_seed(seed)
    if cfg.hf_config and cfg.hf_checkpoint:
        raise AutospError("[autosp:train] found both model.hf_config and model.hf_checkpoint; "
                          "expected one (hf_config: random weights, hf_checkpoint: trained ones)")
    if cfg.hf_config or cfg.hf_checkpoint:
        from transformers import AutoConfig, AutoModelForCausalLM

        if cfg.hf_checkpoint:
            folder = _hf_folder(cfg.hf_checkpoint, "hf_checkpoint")
            model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                         dtype=torch.float32)
        else:
            folder = _hf_folder(cfg.hf_config, "hf_config")
            config = AutoConfig.from_pretrained(folder, attn_implementation="sdpa")
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return HFCausalLM(model), int(model.config.vocab_size)
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_layers=cfg.layers,
                         num_heads=cfg.heads, num_kv_heads=cfg.kv_heads or cfg.heads)
    return LlamaForCausalLM(config), cfg.vocab_size
