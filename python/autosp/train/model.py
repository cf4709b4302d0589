"""The model a run trains: the built-in preset, a Hugging Face architecture from its
``config.json`` (random weights), or a local Hugging Face checkpoint folder (its weights).

Every model is called as ``model(input_ids, labels[, position_ids])`` and returns the mean
next-token loss (labels are the inputs; the model shifts them), which is what
``autosp.compile`` makes exact. ``position_ids`` of packed documents keep attention within
each document.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from autosp.errors import AutospError
from autosp.train.config import ModelConfig


class HFCausalLM(nn.Module):
    """A transformers causal LM as ``(input_ids, labels) -> loss`` (its own shifted
    cross-entropy, SDPA attention or, for a model that refuses SDPA, its eager attention, no
    KV cache). ``attention``: the attention implementation it was built with, "sdpa" or
    "eager"."""

    def __init__(self, model: nn.Module, attention: str = "sdpa") -> None:
        super().__init__()
        self.model = model
        self.attention = attention

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # With position_ids of packed documents (each counting from 0), transformers masks
        # attention to each document (its packed-sequence mask).
        return self.model(input_ids=input_ids, labels=labels, position_ids=position_ids,
                          use_cache=False).loss


def _hf_folder(path: str, key: str) -> str:
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise AutospError(f"[autosp:train] model.{key} = {path!r}: found no config.json there; "
                          "expected a Hugging Face config.json or a folder holding one")
    return folder


def _supports_sdpa(config: object) -> bool:
    """Whether the causal-LM class transformers builds for ``config`` runs SDPA attention,
    asked of the class before building it (its ``_supports_sdpa`` flag, which transformers'
    own check reads: False for Gemma 2, whose logit soft-capping SDPA cannot do). True when
    the class is not known here: the SDPA load then says."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return True
    return bool(getattr(cls, "_supports_sdpa", True))


def build_model(cfg: ModelConfig, seed: int, vocab_size: int = 0) -> tuple[nn.Module, int]:
    """(model on the CPU in fp32, its vocabulary size). The same ``seed`` gives the same
    random weights on every rank. ``vocab_size``: the tokenizer's, which the preset takes
    and a Hugging Face model must hold."""
    torch.manual_seed(seed)
    if cfg.hf_config and cfg.hf_checkpoint:
        raise AutospError("[autosp:train] found both model.hf_config and model.hf_checkpoint; "
                          "expected one (hf_config: random weights, hf_checkpoint: trained ones)")
    if cfg.hf_config or cfg.hf_checkpoint:
        from transformers import AutoConfig, AutoModelForCausalLM

        key = "hf_checkpoint" if cfg.hf_checkpoint else "hf_config"
        folder = _hf_folder(getattr(cfg, key), key)

        def load(attention: str) -> nn.Module:
            if cfg.hf_checkpoint:
                return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention,
                                                            dtype=torch.float32)
            config = AutoConfig.from_pretrained(folder, attn_implementation=attention)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

        # A model that refuses SDPA runs its attention written out, which autosp shards alike.
        attention = "sdpa" if _supports_sdpa(AutoConfig.from_pretrained(folder)) else "eager"
        try:
            model = load(attention)
        except ValueError as refused:
            if attention == "eager":
                raise
            # Refused although the class's flag allowed it (a sub-model's class, or a class not in
            # the mapping): SDPA was what failed if the same model builds with eager attention.
            torch.manual_seed(seed)  # the weights as if built so at once
            try:
                model, attention = load("eager"), "eager"
            except ValueError:
                raise refused from None
        if vocab_size > model.config.vocab_size:
            raise AutospError(f"[autosp:train] data.tokenizer: found {vocab_size} token ids; "
                              f"expected at most the model's vocab_size {model.config.vocab_size}")
        return HFCausalLM(model, attention), int(model.config.vocab_size)
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size or cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_layers=cfg.layers,
                         num_heads=cfg.heads, num_kv_heads=cfg.kv_heads or cfg.heads)
    return LlamaForCausalLM(config), config.vocab_size


def attention_note(model: nn.Module) -> str:
    """For the run's header: ", eager attention (...)" where a Hugging Face model refused SDPA
    and runs its attention written out; "" otherwise. Read from what build_model chose: the
    config keeps it only in the private ``_attn_implementation`` (transformers 5.25 has no
    public getter)."""
    if not isinstance(model, HFCausalLM) or model.attention != "eager":
        return ""
    return (f", eager attention ({type(model.model).__name__} refuses SDPA: each rank holds its heads' "
            "[batch, heads, S, S] scores)")


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode without gradients, every module's mode put back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def position_table_size(model: nn.Module) -> int | None:
    """How many positions ``model``'s position table holds, where it has one: a Hugging Face
    model whose ``config.max_position_embeddings`` is n, which takes positions 0 and n - 1 on
    one device and fails on position n with an index error (GPT-2's and OPT's learned
    positions). None where it takes position n (rotary positions, as in Llama or Qwen, go on
    past the length the model was trained at), fails otherwise, or declares no such length."""
    config = getattr(getattr(model, "model", model), "config", None)
    n = getattr(config, "max_position_embeddings", None)
    if type(n) is not int or n <= 1:
        return None
    ids = torch.zeros(1, 2, dtype=torch.long)

    def takes(last: int) -> bool | None:
        """Whether the model takes positions 0 and ``last``; None: it failed otherwise."""
        try:
            with _evaluating(model):
                model(ids, ids, torch.tensor([[0, last]]))
        except IndexError:  # a table's lookup, on the CPU
            return False
        except Exception:  # noqa: BLE001 - not a table's failure; training meets it
            return None
        return True

    return n if takes(n - 1) and takes(n) is False else None


def check_attends_within_documents(model: nn.Module, vocab_size: int) -> None:
    """Packed documents need a model that keeps attention within each document when given
    their ``position_ids``. Probe it once, on one device: two documents packed in one row,
    the first changed; the second's loss must not change. Raises AutospError when it does
    (the model ignores packed positions: it would attend across documents)."""
    g = torch.Generator().manual_seed(0)
    first, other, second = (torch.randint(0, vocab_size, (1, 8), generator=g) for _ in range(3))
    pos = torch.cat([torch.arange(8), torch.arange(8)])[None]
    labels = torch.cat([torch.full((1, 8), -100), second], dim=1)
    labels[0, 8] = -100  # the second document's first token is nobody's target
    with _evaluating(model):  # dropout would make the two losses differ by itself
        a = model(torch.cat([first, second], 1), labels, pos)
        b = model(torch.cat([other, second], 1), labels, pos)
    if not torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6):
        raise AutospError(
            f"[autosp:train] data.source: found a model ({type(getattr(model, 'model', model)).__name__}) "
            "whose loss on a packed document changes with the document before it "
            f"({a.item():.6f} vs {b.item():.6f}); expected attention to stay within each document "
            "given position_ids that restart at 0. This model ignores packed positions; "
            "packing would train across document boundaries.")
