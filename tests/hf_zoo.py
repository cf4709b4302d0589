"""The Hugging Face model zoo: every transformers causal-LM architecture that can be built
tiny on CPU, run through ``autosp.compile`` on real Gloo ranks and compared with the plain
model on one device.

    results = run_zoo(2)                 # list[ZooResult], one per architecture
    print(format_table(results))         # arch | outcome | detail, with counts

Outcomes (``ZooResult.outcome``):

- ``exact``: |loss - loss_ref| <= LOSS_ATOL and every gradient's
  max|g - g_ref| / max|g_ref| <= GRAD_RTOL, on every rank and both steps;
- ``error``: ``autosp.AutospError`` was raised (a clear refusal; detail is its first line),
  except autosp's own "internal error ... This is a bug in autosp", which counts as a crash;
- ``mismatch``: ran but not exact (the worst bug: a silently wrong gradient or loss);
- ``crash``: any other exception, a hang or a dead rank (detail: type and first line);
- ``skip``: the architecture cannot be built tiny on CPU at all, or the plain model does
  not train on one device (detail: why). Skips are decided in the parent process before
  any rank is spawned (:func:`precheck`).

Several architectures share one spawn. A rank that hangs is killed by a per-model
watchdog (``faulthandler.dump_traceback_later(exit=True)``); every rank writes one line
per model to a progress file as it goes, so when a spawn dies the finished models are
kept, the one in flight is recorded as a crash and the rest run in a fresh spawn.
After a non-AutospError exception a rank stops its batch (its peer may be out of step
in a collective) and the remaining models are respawned.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import tempfile
import time
import traceback
import warnings
from collections import Counter
from typing import Any

import torch

from distributed import make_batch, relative_grad_errors, run_ranks

LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-4
BATCH_SIZE = 2
MODEL_SEED = 1234
BATCH_SEEDS = (11, 12)
VOCAB = 256
SEQ_LEN = 16
MAX_PARAMS = 3_000_000
# Per model, per rank: build + reference + compile + two steps. Compilation of a 2-layer
# HF model with aot_eager takes ~5-30 s on a loaded 2-core machine.
MODEL_TIMEOUT_S = 300.0

# Extra forward kwargs per model_type, found by precheck (e.g. use_cache=False where the
# default cache breaks training of the plain model).
CALL_KWARGS: dict[str, dict[str, Any]] = {}

OUTCOMES = ("exact", "error", "mismatch", "crash", "skip")

# ------------------------------------------------------------------------------------
# Enumeration


def causal_lm_types() -> list[tuple[str, str]]:
    """``(model_type, causal-LM class name)`` for every entry of transformers'
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, sorted by model_type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


# Tiny sizes, applied to every key the default config has (directly or via attribute_map).
_TINY: dict[str, Any] = {
    # width / depth / heads
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "n_embed": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128, "ffn_hidden_size": 128, "d_ff": 128, "dim_feedforward": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "max_sequence_length": 64, "seq_length": 64,
    # mixture of experts
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2,
    "moe_intermediate_size": 32, "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "n_shared_experts": 1, "num_shared_experts": 1,
    "n_group": 1, "topk_group": 1,
    # multi-head latent attention (DeepSeek-V2/V3 style)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # decoder-only use of encoder-style classes
    "is_decoder": True,
    # dory: input/output layer counts default to 8 each, which 2 layers cannot hold (it would
    # run the same layers twice)
    "n_input_layers": 1, "n_output_layers": 0,
}

_DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate", "drop_prob", "dropout_rate")


def _default_keys(model_type: str) -> tuple[set[str], dict[str, Any]]:
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    keys = set(base.to_dict())
    keys |= set(getattr(base, "attribute_map", {}) or {})
    keys |= {k for k in vars(base) if not k.startswith("_")}
    return keys, base.to_dict()


def tiny_config(model_type: str) -> Any:
    """A tiny fp32 config for ``model_type``: width 64, 2 layers, 4 heads (2 KV heads),
    vocab 256, every dropout 0, SDPA attention, 4 experts (top-2) for MoE."""
    from transformers import AutoConfig

    keys, defaults = _default_keys(model_type)
    kwargs: dict[str, Any] = {k: v for k, v in _TINY.items() if k in keys}
    if "qk_rope_head_dim" in keys:  # MLA: head_dim is derived from the rope/nope split
        kwargs.pop("head_dim", None)
    if "rotary_dim" in keys and isinstance(defaults.get("rotary_dim"), int):
        kwargs["rotary_dim"] = 8
    for key, value in defaults.items():
        if isinstance(value, float) and any(w in key for w in _DROPOUT_WORDS):
            kwargs[key] = 0.0
    # Keep special token ids inside the small vocab.
    # (Deterministic: every rank must build the same model; e.g. the padding_idx row of the
    # embedding is initialised to zero.)
    for i, key in enumerate(("pad_token_id", "bos_token_id", "eos_token_id",
                             "decoder_start_token_id", "sep_token_id", "cls_token_id",
                             "mask_token_id")):
        value = defaults.get(key)
        if isinstance(value, int) and value >= VOCAB:
            kwargs[key] = VOCAB - 1 - i
        elif isinstance(value, list):
            kwargs[key] = [v if v < VOCAB else VOCAB - 1 for v in value]
    # Per-layer lists sized for the default depth.
    n_layers = 2
    for key, value in defaults.items():
        if key in ("layer_types", "layers_block_type", "block_types", "mlp_only_layers"):
            continue
    cfg = AutoConfig.for_model(model_type, **kwargs)
    for key in ("layer_types", "layers_block_type", "layer_type"):
        value = getattr(cfg, key, None)
        if isinstance(value, list) and len(value) != n_layers and len(value) > n_layers:
            try:
                setattr(cfg, key, value[:n_layers])
            except Exception:  # noqa: BLE001 - a validated field: leave it
                pass
    cfg._attn_implementation = "sdpa"
    return cfg


class Skip(Exception):
    """The architecture cannot be tried (the message says why)."""


def _from_config(model_cls: Any, cfg: Any) -> torch.nn.Module:
    """SDPA attention, and for MoE models transformers' "batched_mm" experts: every token's
    top-k expert weights gathered by index, with no data-dependent shapes (the default
    implementations loop over the experts a batch hits, or sort tokens by expert, which no
    fullgraph capture or per-token sharding takes)."""
    try:
        return model_cls._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32,
                                      experts_implementation="batched_mm")
    except (ValueError, TypeError, AttributeError):  # not an MoE model
        return model_cls._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def build_model(model_type: str, class_name: str) -> torch.nn.Module:
    """The tiny model with weights drawn from MODEL_SEED, fp32, in train mode."""
    import transformers

    cfg = tiny_config(model_type)
    model_cls = getattr(transformers, class_name)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(MODEL_SEED)
        model = _from_config(model_cls, cfg)
    model = model.float()
    model.train()
    return model


def _forward_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor,
                  call_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    out = model(input_ids=input_ids, labels=labels, **(call_kwargs or {}))
    loss = out.loss if hasattr(out, "loss") else out[0]
    return loss


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return line[:300]


# ------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass
class ZooResult:
    arch: str  # model_type
    outcome: str  # one of OUTCOMES
    detail: str = ""
    class_name: str = ""
    loss_err: float | None = None
    grad_err: float | None = None
    worst_param: str | None = None
    all_to_all: int | None = None
    gathered: int | None = None  # ops run on the all-gathered sequence (unsupported="gather")
    seconds: float | None = None


def _skip_reason(e: Exception) -> str:
    """Why an architecture that failed to build cannot be tried."""
    if isinstance(e, ImportError):
        return f"needs an extra package: {_first_line(e)}"
    msg = _first_line(e)
    if "sdpa" in msg.lower() or "scaled_dot_product" in msg.lower():
        return f"SDPA unsupported: {msg}"
    return f"cannot be built tiny: {type(e).__name__}: {msg}"


def precheck(model_type: str, class_name: str, seq_len: int = SEQ_LEN) -> str | None:
    """None if the plain tiny model builds and trains one step on this CPU, else the reason
    to skip the architecture."""
    import transformers

    if class_name.endswith("ForConditionalGeneration"):
        return "multimodal class (vision/audio inputs); a text-only entry covers the decoder"
    if not hasattr(transformers, class_name):
        return f"transformers has no {class_name} (needs an extra package)"
    try:
        tiny_config(model_type)
    except Exception as e:  # noqa: BLE001
        return f"no tiny config: {type(e).__name__}: {_first_line(e)}"
    try:
        cfg = tiny_config(model_type)
        subs = [k for k, v in vars(cfg).items()
                if hasattr(v, "to_dict") and hasattr(v, "model_type") and not k.startswith("_")]
        if subs:
            return f"composite config (sub-configs {subs}) cannot be made tiny generically"
        model_cls = getattr(transformers, class_name)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = model_cls._from_config(cfg, attn_implementation="sdpa")
        n_params = sum(p.numel() for p in meta.parameters())
        del meta
        if n_params > MAX_PARAMS:
            return f"not tiny after the overrides: {n_params / 1e6:.1f}M parameters"
    except Exception as e:  # noqa: BLE001
        return _skip_reason(e)
    try:
        model = build_model(model_type, class_name)
    except Exception as e:  # noqa: BLE001
        return _skip_reason(e)
    if not any(isinstance(m, torch.nn.Module) for m in model.modules()):
        return "no modules"
    input_ids, labels = make_batch(VOCAB, BATCH_SIZE, seq_len, BATCH_SEEDS[0])
    first = ""
    # As users call it; if the default KV cache breaks training, without the cache.
    for call_kwargs in ({}, {"use_cache": False}):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.zero_grad(set_to_none=True)
                loss = _forward_loss(model, input_ids, labels, call_kwargs)
                if loss is None or not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    return "the forward returns no scalar loss for labels="
                if not torch.isfinite(loss):
                    return f"non-finite single-device loss {loss.item()}"
                loss.backward()
        except Exception as e:  # noqa: BLE001
            first = first or f"plain model does not train on CPU: {type(e).__name__}: {_first_line(e)}"
            continue
        CALL_KWARGS[model_type] = call_kwargs
        return None
    return first


# A gradient that is analytically zero (e.g. the key bias under softmax, whose gradient
# cancels) is float noise on one device; relative to its own max it is noise over noise.
# Such a parameter is compared against GRAD_FLOOR x the largest gradient of the model.
GRAD_FLOOR = 1e-6


def _grad_errors(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    errs = relative_grad_errors(grads, ref)
    top = max((g.detach().abs().max().item() for g in ref.values() if g.numel()), default=0.0)
    floor = GRAD_FLOOR * top
    for name, g_ref in ref.items():
        scale = g_ref.detach().double().abs().max().item() if g_ref.numel() else 0.0
        if scale < floor:
            diff = (grads[name].detach().double() - g_ref.detach().double()).abs().max().item()
            errs[name] = diff / floor if math.isfinite(diff) else math.inf
    return errs


class _GradNames(Exception):
    """The compiled and the plain model have gradients for different parameters."""


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Like distributed.grads_of, but a parameter the loss does not reach (a decoder's
    cross-attention when there is no encoder) has no gradient on either side: it is left
    out here, and the name sets of the two models must still agree."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _progress_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.jsonl")


def _write(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _zoo_worker(rank: int, world_size: int, archs: list[tuple[str, str]], seq_len: int,
                out_dir: str, model_timeout: float, call_kwargs: dict[str, dict]) -> None:
    import faulthandler
    import sys

    import autosp

    mesh = autosp.init_mesh(world_size)
    path = _progress_path(out_dir, rank)
    for model_type, class_name in archs:
        _write(path, {"arch": model_type, "event": "start"})
        faulthandler.dump_traceback_later(model_timeout, exit=True, file=sys.stderr)
        t0 = time.monotonic()
        rec: dict[str, Any] = {"arch": model_type, "event": "done", "class_name": class_name}
        stop = False
        try:
            torch._dynamo.reset()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = build_model(model_type, class_name)
                ref_model = copy.deepcopy(model)
                # AUTOSP_ZOO_TILE_LOSS=1 (main's --tile-loss): the zoo with the tiled loss.
                tile = os.environ.get("AUTOSP_ZOO_TILE_LOSS") == "1"
                compiled = autosp.compile(model, mesh=mesh, seq_dim=1, remat="none",
                                          backend="aot_eager", tile_loss=tile)
                loss_err = 0.0
                worst: tuple[float, str] = (0.0, "")
                for batch_seed in BATCH_SEEDS:
                    input_ids, labels = make_batch(VOCAB, BATCH_SIZE, seq_len, batch_seed)
                    ref_model.zero_grad(set_to_none=True)
                    kw = call_kwargs.get(model_type, {})
                    ref_loss = _forward_loss(ref_model, input_ids, labels, kw)
                    ref_loss.backward()
                    model.zero_grad(set_to_none=True)
                    loss = _forward_loss(compiled, input_ids, labels, kw)
                    loss.backward()
                    err = abs(loss.item() - ref_loss.item())
                    loss_err = max(loss_err, err if math.isfinite(err) else math.inf)
                    got, want = _grads(model), _grads(ref_model)
                    if set(got) != set(want):  # a dropped (or extra) gradient: wrong, silently
                        missing = sorted(set(want) - set(got))
                        extra = sorted(set(got) - set(want))
                        raise _GradNames(f"{len(missing)} gradients missing (e.g. {missing[:2]}), "
                                         f"{len(extra)} unexpected (e.g. {extra[:2]})")
                    errs = _grad_errors(got, want)
                    for name, e in errs.items():
                        if not e <= worst[0]:
                            worst = (e if math.isfinite(e) else math.inf, name)
            rec.update(loss_err=loss_err, grad_err=worst[0], worst_param=worst[1])
            try:
                rec["all_to_all"] = int(
                    compiled.last_compile.collective_counts.get("sp.all_to_all", 0))
            except Exception:  # noqa: BLE001
                rec["all_to_all"] = None
            rec["gathered"] = len(compiled.gathered)
            if tile and rank == 0:
                print(f"[zoo tile_loss] {model_type}: {compiled.loss_tiling}", flush=True)
            if compiled.gathered:
                # "[autosp:pass] op 'pad' (F.pad) at file.py:282  code: found ..." -> op and line
                rec["gathered_first"] = compiled.gathered[0].split("] ", 1)[-1].split("  ")[0][:160]
            exact = loss_err <= LOSS_ATOL and worst[0] <= GRAD_RTOL
            rec["outcome"] = "exact" if exact else "mismatch"
            if not exact:
                rec["detail"] = (f"loss err {loss_err:.2e}, worst grad rel err {worst[0]:.2e} "
                                 f"({worst[1]})")
        except _GradNames as e:
            rec["outcome"] = "mismatch"
            rec["detail"] = f"ran, but {e}"
        except autosp.AutospError as e:
            # autosp wraps its own bugs as "[autosp:<pass>] internal error ... This is a bug in
            # autosp": that is a crash, not a clear refusal of the model.
            internal = "internal error" in _first_line(e)
            rec["outcome"] = "crash" if internal else "error"
            rec["detail"] = _first_line(e)
        except Exception as e:  # noqa: BLE001
            rec["outcome"] = "crash"
            rec["detail"] = f"{type(e).__name__}: {_first_line(e)}"
            rec["traceback"] = traceback.format_exc()[-4000:]
            stop = True
        finally:
            faulthandler.cancel_dump_traceback_later()
        rec["seconds"] = time.monotonic() - t0
        _write(path, rec)
        if stop:
            return


def _read_progress(out_dir: str, world_size: int) -> tuple[dict[str, list[dict]], list[str]]:
    """Finished records per arch (one per rank that finished it) and the archs started."""
    done: dict[str, list[dict]] = {}
    started: list[str] = []
    for rank in range(world_size):
        path = _progress_path(out_dir, rank)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if r["event"] == "start":
                    if r["arch"] not in started:
                        started.append(r["arch"])
                else:
                    r["rank"] = rank
                    done.setdefault(r["arch"], []).append(r)
    return done, started


_RANK_ORDER = {"crash": 0, "mismatch": 1, "error": 2, "exact": 3}


def _merge(arch: str, class_name: str, recs: list[dict], world_size: int) -> ZooResult:
    """One result from every rank's record: the worst outcome across ranks."""
    if len(recs) < world_size:
        have = sorted(r["rank"] for r in recs)
        worst = min(recs, key=lambda r: _RANK_ORDER[r["outcome"]]) if recs else None
        detail = f"only ranks {have} finished"
        if worst is not None and worst["outcome"] != "exact":
            detail += f"; {worst.get('detail', '')}"
        return ZooResult(arch, "crash", detail, class_name)
    worst = min(recs, key=lambda r: (_RANK_ORDER[r["outcome"]], -(r.get("grad_err") or 0)))
    outcome = worst["outcome"]
    res = ZooResult(arch, outcome, worst.get("detail", ""), class_name,
                    loss_err=max((r.get("loss_err") or 0.0) for r in recs)
                    if all("loss_err" in r for r in recs) else None,
                    grad_err=max((r.get("grad_err") or 0.0) for r in recs)
                    if all("grad_err" in r for r in recs) else None,
                    worst_param=worst.get("worst_param"),
                    all_to_all=worst.get("all_to_all"), gathered=worst.get("gathered"),
                    seconds=max(r.get("seconds", 0.0) for r in recs))
    if outcome == "exact":
        notes = []
        if res.gathered:
            notes.append(f"{res.gathered} ops on the gathered sequence, first at "
                         f"{worst.get('gathered_first', '?')}")
        if not res.all_to_all:
            notes.append("no all-to-all in the plan (no attention parallelised)")
        if notes:
            res.detail = "exact, but " + "; ".join(notes)
    if outcome == "crash" and "traceback" in worst:
        res.detail += "\n" + worst["traceback"]
    return res


def run_archs(world_size: int, archs: list[tuple[str, str]], *, seq_len: int = SEQ_LEN,
              batch: int = 8, model_timeout: float = MODEL_TIMEOUT_S,
              log: Any = None) -> list[ZooResult]:
    """Runs ``archs`` (already prechecked) at ``world_size`` ranks, ``batch`` per spawn,
    and returns one result per arch, in order."""
    results: dict[str, ZooResult] = {}
    names = dict(archs)
    pending = list(archs)
    while pending:
        group = pending[:batch]
        with tempfile.TemporaryDirectory(prefix="autosp-zoo-") as out_dir:
            spawn_error = ""
            try:
                run_ranks(world_size, _zoo_worker, group, seq_len, out_dir, model_timeout,
                          {a: CALL_KWARGS.get(a, {}) for a, _ in group},
                          timeout=model_timeout * len(group) + 120)
            except BaseException as e:  # noqa: BLE001 - a dead or hung rank: salvage progress
                if isinstance(e, KeyboardInterrupt):
                    raise
                spawn_error = f"{type(e).__name__}: {_first_line(e)}"
                cause = getattr(e, "__cause__", None)
                if cause is not None:
                    spawn_error += "\n" + str(cause)[-3000:]
            done, started = _read_progress(out_dir, world_size)
        progressed = False
        for model_type, class_name in group:
            recs = done.get(model_type, [])
            if len(recs) == world_size or (recs and model_type in started):
                res = _merge(model_type, class_name, recs, world_size)
                if len(recs) < world_size and spawn_error:
                    res.detail += f" (spawn: {spawn_error.splitlines()[0]})"
                results[model_type] = res
                progressed = True
            elif model_type in started and not recs:
                results[model_type] = ZooResult(
                    model_type, "crash",
                    f"rank died or hung: {spawn_error or 'no report'}", class_name)
                progressed = True
            else:
                continue
            if log is not None:
                log(_row(results[model_type]))
        pending = [a for a in pending if a[0] not in results]
        if not progressed:  # the spawn itself failed before any model started
            for model_type, class_name in group:
                results[model_type] = ZooResult(model_type, "crash",
                                                f"spawn failed: {spawn_error}", class_name)
            pending = [a for a in pending if a[0] not in results]
    return [results[a] for a, _ in archs if a in results] + [
        ZooResult(a, "crash", "not run", names[a]) for a, _ in archs if a not in results]


def run_zoo(world_size: int, only: list[str] | None = None, *, seq_len: int = SEQ_LEN,
            batch: int = 8, log: Any = None) -> list[ZooResult]:
    """Prechecks every causal-LM architecture (or ``only`` these model_types) in this
    process, then runs the buildable ones on ``world_size`` ranks."""
    todo: list[tuple[str, str]] = []
    skipped: list[ZooResult] = []
    seen_classes: dict[tuple[str, str], str] = {}
    for model_type, class_name in causal_lm_types():
        if only is not None and model_type not in only:
            continue
        reason = precheck(model_type, class_name, seq_len)
        if reason is None:
            # Two model_types with the same class and config class run the same code.
            try:
                from transformers import AutoConfig

                key = (class_name, type(AutoConfig.for_model(model_type)).__name__)
            except Exception:  # noqa: BLE001
                key = (class_name, model_type)
            if key in seen_classes and only is None:
                reason = f"same class and config as {seen_classes[key]}"
            else:
                seen_classes[key] = model_type
        if reason is not None:
            skipped.append(ZooResult(model_type, "skip", reason, class_name))
            if log is not None:
                log(_row(skipped[-1]))
        else:
            todo.append((model_type, class_name))
    ran = run_archs(world_size, todo, seq_len=seq_len, batch=batch, log=log)
    by_arch = {r.arch: r for r in ran + skipped}
    return [by_arch[a] for a, _ in causal_lm_types() if a in by_arch]


def _row(r: ZooResult) -> str:
    detail = r.detail.splitlines()[0] if r.detail else ""
    secs = f"{r.seconds:5.1f}s" if r.seconds is not None else "      "
    return f"{r.arch:<28} | {r.outcome:<8} | {secs} | {detail}"


def counts(results: list[ZooResult]) -> dict[str, int]:
    c = Counter(r.outcome for r in results)
    return {k: c.get(k, 0) for k in OUTCOMES}


def format_table(results: list[ZooResult], *, skips: bool = True) -> str:
    """``arch | outcome | seconds | detail`` per architecture, then the counts and the
    share of tried architectures that are exact."""
    lines = [f"{'arch':<28} | {'outcome':<8} | {'time':>6} | detail", "-" * 100]
    order = {o: i for i, o in enumerate(("mismatch", "crash", "error", "exact", "skip"))}
    for r in sorted(results, key=lambda r: (order[r.outcome], r.arch)):
        if r.outcome == "skip" and not skips:
            continue
        lines.append(_row(r))
    c = counts(results)
    tried = len(results) - c["skip"]
    lines.append("-" * 100)
    lines.append(" ".join(f"{k}={v}" for k, v in c.items()) + f" tried={tried} "
                 + (f"exact={100.0 * c['exact'] / tried:.1f}% of tried" if tried else ""))
    return "\n".join(lines)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--only", nargs="*")
    p.add_argument("--seq", type=int, default=SEQ_LEN)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--precheck-only", action="store_true")
    p.add_argument("--json")
    p.add_argument("--tile-loss", action="store_true",
                   help="compile with tile_loss=True (each result then says how its loss went)")
    args = p.parse_args()
    if args.tile_loss:
        os.environ["AUTOSP_ZOO_TILE_LOSS"] = "1"
    t0 = time.monotonic()
    if args.precheck_only:
        for model_type, class_name in causal_lm_types():
            if args.only and model_type not in args.only:
                continue
            t1 = time.monotonic()
            reason = precheck(model_type, class_name, args.seq)
            print(f"{model_type:<28} | {'ok' if reason is None else 'skip':<4} | "
                  f"{time.monotonic() - t1:5.1f}s | {reason or ''}", flush=True)
        return
    results = run_zoo(args.world, args.only, seq_len=args.seq, batch=args.batch,
                      log=lambda s: print(s, flush=True))
    print(format_table(results))
    print(f"wall {time.monotonic() - t0:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
