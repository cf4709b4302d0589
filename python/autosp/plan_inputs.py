"""``autosp plan``'s inputs: published model configurations, a model given as a preset name,
a Hugging Face config.json or a LlamaConfig, and byte sizes written as text ("80GB")."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from autosp.errors import AutospError
from autosp.models.llama import LlamaConfig


#: Published configurations (Hugging Face config.json of each model).
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-3.2-3b": LlamaConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
        num_heads=24, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "llama-2-13b": LlamaConfig(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
        num_heads=40, num_kv_heads=40, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}

REMAT_STRATEGIES = ("none", "default", "sequence-aware", "full")
SP_MODES = ("no-sp", "ulysses")
DTYPES = ("bf16", "fp32")
OPTIMIZER_SHARDING = ("none", "dp", "world")

# Inputs


#: The largest size parse_bytes takes (4 EiB): sizes are int64 in the core, with room to add.
MAX_BYTES = 1 << 62


def parse_bytes(text: str | int | float, what: str = "GPU memory") -> int:
    """``"80GB"`` -> 80 GiB (``what`` names the value in errors). GPU vendors' "GB" are binary (an A100 80GB has 81920 MiB), so
    GB/GiB, MB/MiB, TB/TiB and KB/KiB are all powers of 1024; a bare number is bytes."""
    if isinstance(text, bool):
        raise AutospError(f"[plan] found {what} {text!r}; expected a size such as '80GB'")
    if isinstance(text, (int, float)):
        if not 0 < text <= MAX_BYTES:  # NaN too
            raise AutospError(f"[plan] found {what} {text!r}; expected a positive size up to "
                              f"{MAX_BYTES} bytes")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise AutospError(
            f"[plan] found {what} {text!r}; expected a positive size such as '80GB', "
            "'96GiB' or a number of bytes"
        )
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    value = float(m.group(1)) * scale
    if value > MAX_BYTES:
        raise AutospError(f"[plan] found {what} {text!r}; expected a size up to {MAX_BYTES} "
                          "bytes (4 EiB)")
    return int(value)


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit under which they are at least 1 (parse_bytes reads
    the result back): 1536 -> '1.50 KiB', 20 << 20 -> '20.00 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def _config_from_hf(data: dict[str, Any], where: str) -> LlamaConfig:
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in data]
    if missing:
        raise AutospError(
            f"[plan] config {where} lacks {', '.join(missing)}; expected a Llama-style Hugging "
            f"Face config.json with {', '.join(required)}"
        )
    model_type = data.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise AutospError(
            f"[plan] config {where} has model_type {model_type!r}; expected 'llama' (the planner "
            "traces autosp.models.llama, a Llama-architecture decoder)"
        )
    try:
        return LlamaConfig(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=int(data["num_attention_heads"]),
            num_kv_heads=int(data.get("num_key_value_heads") or data["num_attention_heads"]),
            rope_theta=float(data.get("rope_theta", 10000.0)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )
    except (TypeError, ValueError) as e:
        raise AutospError(f"[plan] config {where} is not a valid Llama configuration: {e}") from None


def load_model_config(model: str | LlamaConfig) -> tuple[str, LlamaConfig]:
    """``(name, config)`` for a preset name (case-insensitive), a path to a Hugging Face
    config.json (or a directory holding one), or a LlamaConfig."""
    if isinstance(model, LlamaConfig):
        return "custom", model
    key = str(model).strip().lower()
    if key in PRESETS:
        return key, PRESETS[key]
    path = Path(str(model)).expanduser()
    looks_like_path = path.suffix == ".json" or "/" in str(model) or path.exists()
    if not looks_like_path:
        raise AutospError(
            f"[plan] unknown model {model!r}; expected a preset ({', '.join(PRESETS)}) or a path "
            "to a Hugging Face config.json"
        )
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise AutospError(
            f"[plan] cannot read config {str(path)!r}: {e.strerror if isinstance(e, OSError) else e}; "
            "expected a readable Hugging Face config.json"
        ) from None
    except json.JSONDecodeError as e:
        raise AutospError(
            f"[plan] config {str(path)!r} is not valid JSON ({e}); expected a Hugging Face "
            "config.json"
        ) from None
    if not isinstance(data, dict):
        raise AutospError(
            f"[plan] config {str(path)!r} holds a {type(data).__name__}; expected a JSON object"
        )
    return path.parent.name or path.stem, _config_from_hf(data, repr(str(path)))
