"""``autosp train``'s configuration: one TOML file, overridden from the command line.

    autosp train --config run.toml --training.seq_len 131072 --parallel.sp 8
    autosp train --seq-len 512 --sp 4          # flat flags: each field's own name

Every field is declared once, in the dataclasses below (its type, default and help); the
command-line options are generated from them, as ``--<section>.<field>`` and, where the
field's name is unique across sections, a flat ``--<field-name>``. The effective config is
printed at start and saved as ``config.toml`` in the run's output folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from autosp.api import REGIONS
from autosp.errors import AutospError
from autosp.remat_policy import AUTO, BACKENDS, POLICIES

#: training.regions' values: autosp.compile's ``regions`` modes by name, False and True spelled
#: as TOML's booleans (a TOML ``true`` or ``false`` is taken as its name).
REGION_MODES: dict[str, bool | str] = {
    ("true" if mode is True else "false" if mode is False else str(mode)): mode for mode in REGIONS}


def _f(default: Any, help: str, choices: tuple | None = None, flat: str | None = None) -> Any:
    """A field: its default, help, allowed values, and its flat flag when not --<its-name>."""
    return field(default=default, metadata={"help": help, "choices": choices, "flat": flat})


@dataclass
class ModelConfig:
    preset: str = _f("tiny-llama", "the built-in model: autosp.models.llama sized by the fields "
                                   "below (used when neither hf_config nor hf_checkpoint is set)",
                     ("tiny-llama",))
    hf_config: str = _f("", "a Hugging Face config.json (file or folder): that architecture, "
                            "random weights")
    hf_checkpoint: str = _f("", "a local Hugging Face model folder (config.json and "
                                "safetensors): its weights")
    vocab_size: int = _f(256, "tiny-llama: vocabulary size")
    hidden_size: int = _f(64, "tiny-llama: model width")
    intermediate_size: int = _f(172, "tiny-llama: MLP width")
    layers: int = _f(2, "tiny-llama: decoder layers")
    heads: int = _f(4, "tiny-llama: query heads")
    kv_heads: int = _f(0, "tiny-llama: key/value heads (0: as many as query heads)")
    dtype: str = _f("float32", "parameter dtype; bfloat16 with parallel.fsdp or "
                               "training.offload_optimizer is mixed precision (fp32 master "
                               "weights), without them pure bf16",
                    ("float32", "bfloat16"))


@dataclass
class DataConfig:
    source: str = _f("synthetic", "'synthetic' (token sequences with a learnable structure), "
                                  "'sample' (built-in generated stories, packed like documents), "
                                  "or a file or folder of documents: .txt/.md (one document "
                                  "each), .jsonl, .parquet, a datasets folder")
    text_field: str = _f("text", "the field holding the text in .jsonl, .parquet and datasets rows")
    tokenizer: str = _f("bytes", "'bytes' (UTF-8, 257 ids) or a local Hugging Face tokenizer folder")
    streaming: bool = _f(False, "read the documents as they are needed instead of all at start")


@dataclass
class TrainingConfig:
    seq_len: int = _f(256, "sequence length S (full, per SP group)")
    batch_size: int = _f(2, "sequences per SP group per micro-batch")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    steps: int = _f(20, "optimizer steps")
    lr: float = _f(3e-3, "AdamW peak learning rate")
    warmup_steps: int = _f(0, "linear warmup from 0 to lr over this many steps")
    min_lr_ratio: float = _f(0.1, "cosine decay to lr * min_lr_ratio at the last step")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int = _f(0, "model and data seed")
    backend: str = _f("inductor", "compiler backend of the SP graph", BACKENDS)
    remat: str = _f("sequence-aware", "activation rematerialisation policy; auto: autosp plan "
                                      "picks remat, tile_loss, tile_mlp and offload, the "
                                      "cheapest combination predicted to fit memory_gib",
                    (*POLICIES, AUTO))
    memory_gib: float = _f(0.0, "with remat auto: the memory per rank to fit (0: the GPU's "
                                "total memory; needed on CPU)")
    host_memory_gib: float = _f(0.0, "with remat auto: the host memory per rank that offloaded "
                                     "activations and an offloaded optimizer may take (0: 80% "
                                     "of this machine's memory over its ranks)")
    remat_budget_gib: float = _f(0.0, "cap the activations saved for backward at this many GiB "
                                      "per rank (autosp.remat.MemoryBudget; 0: the remat policy "
                                      "decides)")
    offload: bool = _f(False, "keep the hidden states decoder layers hand to each other in host "
                              "memory between forward and backward (autosp.remat.Offload; "
                              "exact; frees device memory on CUDA, copies nothing on CPU)")
    offload_all: bool = _f(False, "offload every activation a decoder layer saves for its "
                                  "backward, not only the hidden states (autosp.remat.Offload("
                                  "saved='all'); implies offload)")
    offload_optimizer: bool = _f(False, "keep the master weights and AdamW's state in host memory "
                                        "and step on the host (autosp.OffloadOptimizer, "
                                        "ZeRO-Offload); the device holds parameters and "
                                        "gradients only. Not with parallel.fsdp")
    tile_loss: bool = _f(True, "compute the loss over lm_head a chunk of tokens at a time, so that "
                               "the [tokens, vocab] logits never exist whole (autosp.compile("
                               "tile_loss=True); exact)")
    loss_chunks: int = _f(0, "chunks of each rank's tokens per tiled loss (autosp.compile("
                             "loss_chunks=...); 0: ceil(vocab / hidden), or with remat auto the "
                             "fewest that fit memory_gib (fewer chunks are faster)")
    tile_mlp: bool = _f(False, "run each MLP a chunk of tokens at a time, recomputed in backward, "
                               "so that its [tokens, ffn] intermediates never exist whole "
                               "(autosp.compile(tile_mlp=True); exact)")
    regions: str = _f("compile", "how alike decoder layers compile (autosp.compile(regions=...)): "
                                 "'compile' compiles each class of alike layers once, so the "
                                 "first step's compile stops growing with depth (exact); 'true' "
                                 "also has Dynamo trace each class once (experimental); 'false' "
                                 "compiles every layer in one flat graph", tuple(REGION_MODES))
    check: bool = _f(False, "at the end, compare the first step's loss and the norm of its "
                            "gradient with the plain model on one device (exit 1 on mismatch)")
    check_atol: float = _f(1e-4, "tolerance of check on |loss_sp - loss_single_device|")


@dataclass
class ParallelConfig:
    nproc: int = _f(2, "processes to launch when not already under torchrun")
    sp: int = _f(0, "SP degree P (0: all processes); the rest is data parallel")
    fsdp: bool = _f(False, "shard parameters, gradients and AdamW state over all ranks "
                           "(autosp.fully_shard, ZeRO-3)")
    device: str = _f("auto", "cuda uses NCCL, cpu Gloo; auto picks cuda when available",
                     ("auto", "cpu", "cuda"))
    timeout_s: float = _f(600.0, "collective timeout in seconds: a rank that stops answering ends "
                                 "the run on every rank after this long")


@dataclass
class MetricsConfig:
    out_dir: str = _f("runs/autosp", "the run's folder: config.toml, metrics.jsonl, TensorBoard")
    log_every: int = _f(1, "print and record every this many steps")
    tensorboard: bool = _f(True, "also write TensorBoard events (when tensorboard is installed)")
    peak_tflops: float = _f(0.0, "the device's peak TFLOP/s, for MFU (0: looked up for known "
                                 "GPUs, bf16 dense; no MFU on CPU)")
    predict: bool = _f(True, "print autosp plan's predicted peak memory at start (rank 0, a few "
                             "seconds) and beside the measured peak at the end")


@dataclass
class CheckpointConfig:
    dir: str = _f("", "where checkpoints go ('': <metrics.out_dir>/checkpoints)",
                  flat="--checkpoint-dir")
    every: int = _f(0, "save every this many steps (0: only at the end and on SIGTERM)",
                    flat="--checkpoint-every")
    resume: str = _f("", "continue from a checkpoint: a step-<N> folder, or 'latest' (the newest "
                         "in dir; a fresh start when there is none)")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


SECTIONS: dict[str, type] = {f.name: f.type if isinstance(f.type, type) else get_type_hints(TrainConfig)[f.name]
                             for f in dataclasses.fields(TrainConfig)}


# The allowed range of each number: (lowest, highest), None for no bound; "> 0" fields use a
# tiny positive lowest. Checked after the file and the flags are applied.
_POSITIVE = 1e-300
RANGES: dict[str, tuple[float | None, float | None]] = {
    "model.vocab_size": (1, None), "model.hidden_size": (1, None),
    "model.intermediate_size": (1, None), "model.layers": (1, None), "model.heads": (1, None),
    "model.kv_heads": (0, None),
    "training.seq_len": (1, None), "training.batch_size": (1, None),
    "training.grad_accum": (1, None), "training.steps": (1, None),
    "training.lr": (_POSITIVE, None), "training.warmup_steps": (0, None),
    "training.min_lr_ratio": (0, 1), "training.weight_decay": (0, None),
    "training.max_grad_norm": (0, None), "training.remat_budget_gib": (0, None),
    "training.loss_chunks": (0, 2**31 - 1),  # autosp.tiled_loss.MAX_CHUNKS
    "training.memory_gib": (0, None),
    "training.host_memory_gib": (0, None),
    "training.check_atol": (0, None),
    "parallel.nproc": (1, None), "parallel.sp": (0, None), "parallel.timeout_s": (_POSITIVE, None),
    "metrics.log_every": (1, None), "metrics.peak_tflops": (0, None),
    "checkpoint.every": (0, None),
}


class ConfigError(AutospError):
    """A config file or override autosp cannot use: says which key, what was found and what
    was expected."""


def _fields() -> list[tuple[str, dataclasses.Field, type]]:
    out = []
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append((section, f, hints[f.name]))
    return out


def _flat_names() -> dict[str, tuple[str, str]]:
    """Flat flag -> (section, field) for the fields whose name no other section has."""
    seen: dict[str, list[tuple[str, str]]] = {}
    for section, f, _ in _fields():
        flag = f.metadata.get("flat") or "--" + f.name.replace("_", "-")
        seen.setdefault(flag, []).append((section, f.name))
    return {flag: where[0] for flag, where in seen.items() if len(where) == 1}


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, found {text!r}")


def _names_bools(f: dataclasses.Field) -> bool:
    """A str field whose choices include "true" and "false" (training.regions)."""
    return {"true", "false"} <= set(f.metadata.get("choices") or ())


def _bool_name(text: str) -> str:
    """A choice of such a field; a boolean's spellings are "true" or "false"."""
    try:
        return "true" if _parse_bool(text) else "false"
    except argparse.ArgumentTypeError:
        return text.lower()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every field as ``--section.field`` and (when unique) a flat ``--field-name``; the
    parsed values land in ``args.overrides`` as {(section, field): value}, set only when
    given."""
    flat = {where: flag for flag, where in _flat_names().items()}
    parser.add_argument("--config", default=None, help="a TOML file with [model], [data], "
                        "[training], [parallel], [metrics] and [checkpoint] tables; the options below "
                        "override it")
    for section, f, typ in _fields():
        group = next((g for g in parser._action_groups if g.title == section), None) or \
            parser.add_argument_group(section)
        names = [f"--{section}.{f.name}"]
        if (section, f.name) in flat:
            names.append(flat[(section, f.name)])
        kind = _parse_bool if typ is bool else typ
        extra: dict[str, Any] = {}
        if typ is bool:
            extra["nargs"] = "?"
            extra["const"] = True
        elif _names_bools(f):  # --regions alone, on, yes, 1 ... as when it was a bool
            kind = _bool_name
            extra["nargs"] = "?"
            extra["const"] = "true"
        group.add_argument(*names, dest=f"override:{section}.{f.name}", type=kind,
                           default=argparse.SUPPRESS, choices=f.metadata.get("choices"),
                           help=f"{f.metadata['help']} (default: {f.default!r})".replace("%", "%%"), **extra)


def overrides_of(args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    out = {}
    for key, value in vars(args).items():
        if key.startswith("override:"):
            section, name = key[len("override:"):].split(".", 1)
            out[(section, name)] = value
    return out


def load(path: str | None, overrides: dict[tuple[str, str], Any] | None = None) -> TrainConfig:
    """The config from ``path`` (or the defaults), with ``overrides`` applied; every key and
    type checked."""
    cfg = TrainConfig()
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"[autosp:train] config file {path!r} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"[autosp:train] config file {path!r} is not valid TOML: {e}") from None
        for section, table in data.items():
            if section not in SECTIONS:
                raise ConfigError(f"[autosp:train] {path}: found [{section}]; expected one of the "
                                  f"tables {sorted(SECTIONS)}")
            if not isinstance(table, dict):
                raise ConfigError(f"[autosp:train] {path}: found {section} = {table!r}; expected a "
                                  f"table [{section}] of keys")
            for name, value in table.items():
                _set(cfg, section, name, value, f"{path}: {section}.{name}")
    for (section, name), value in (overrides or {}).items():
        _set(cfg, section, name, value, f"--{section}.{name}")
    for key, (lo, hi) in RANGES.items():
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            want = ("> 0" if lo == _POSITIVE else f">= {lo:g}" if hi is None
                    else f"between {lo:g} and {hi}")
            raise ConfigError(f"[autosp:train] {key}: found {v!r}; expected a value {want}")
    t = cfg.training
    if t.loss_chunks and not t.tile_loss and t.remat != "auto":
        raise ConfigError(f"[autosp:train] training.loss_chunks = {t.loss_chunks} with "
                          "training.tile_loss = false; expected tile_loss true (the chunks are "
                          "the tiled loss's), or loss_chunks 0")
    if t.offload_optimizer and cfg.parallel.fsdp:
        raise ConfigError("[autosp:train] found training.offload_optimizer with parallel.fsdp; "
                          "expected one of them: fsdp splits the optimizer state over the ranks, "
                          "offload_optimizer keeps a rank's whole state in its host memory (their "
                          "combination is not built)")
    m = cfg.model
    if m.hidden_size % m.heads or (m.kv_heads and m.heads % m.kv_heads):
        raise ConfigError(f"[autosp:train] model.heads = {m.heads}, model.kv_heads = {m.kv_heads}: "
                          f"expected heads dividing hidden_size ({m.hidden_size}) and kv_heads "
                          "dividing heads")
    return cfg


def _set(cfg: TrainConfig, section: str, name: str, value: Any, where: str) -> None:
    sec = getattr(cfg, section)
    hints = get_type_hints(type(sec))
    if name not in hints:
        raise ConfigError(f"[autosp:train] {where}: no such key; [{section}] has "
                          f"{sorted(hints)}")
    typ = hints[name]
    f = next(f for f in dataclasses.fields(sec) if f.name == name)
    choices = f.metadata.get("choices")
    if typ is str and isinstance(value, bool) and _names_bools(f):
        value = "true" if value else "false"  # regions = true in TOML
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"[autosp:train] {where}: found {value!r} ({type(value).__name__}); "
                          f"expected {typ.__name__}")
    if choices and value not in choices:
        raise ConfigError(f"[autosp:train] {where}: found {value!r}; expected one of {list(choices)}")
    setattr(sec, name, value)


def to_toml(cfg: TrainConfig) -> str:
    """The config as TOML (every field, defaults included): what the run used."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            v = getattr(getattr(cfg, section), f.name)
            text = ("true" if v else "false") if isinstance(v, bool) else \
                json.dumps(v, ensure_ascii=False) if isinstance(v, str) else repr(v)
            lines.append(f"{f.name} = {text}")
        lines.append("")
    return "\n".join(lines)


def save(cfg: TrainConfig, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.toml")
    with open(path, "w") as fh:
        fh.write(to_toml(cfg))
    return path
