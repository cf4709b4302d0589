"""Multi-rank test harness: real Gloo process groups on CPU, and the helpers that
build the same model and batch on every rank and compare against one device.

    def check(rank: int, world_size: int, seq_len: int) -> float:
        ...                               # torch.distributed is initialised here
        return loss.item()

    losses = run_ranks(2, check, 32)      # [loss on rank 0, loss on rank 1]

``fn`` must be importable by name from a fresh interpreter (a module-level function in a
test module or here), and its return value must pickle. Ranks are forked from a fork
server that has imported torch and autosp (``_context``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import math
import os
import pickle
import queue as queue_lib
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:  # imported lazily: the harness must work even if autosp does not import
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

DEFAULT_TIMEOUT_S = 180.0

# Environment given to every rank. One intra-op thread per rank: the CI machines have
# two cores and a test may run four ranks. Inductor compiles in-process for the same
# reason.
_RANK_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}


class RankError(RuntimeError):
    """A rank failed in a way that cannot be re-raised as its own exception
    (the exception did not pickle, or the process died without reporting)."""


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback; chained as ``__cause__`` of the
    re-raised exception so pytest prints it."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` spawned CPU processes
    that share one Gloo process group, and returns their results in rank order.

    If a rank raises, its exception is re-raised here (same type when it pickles,
    else ``RankError``) with the rank's traceback chained as its cause, and the
    other ranks are terminated (they may be blocked in a collective with the failed
    rank). When several ranks fail, the root cause is chosen: a rank that died
    without reporting, else the earliest failure that is not a peer-disconnect echo
    ("Connection closed by peer"); the others are summarised in the traceback. If not every rank has reported after ``timeout``
    seconds, all ranks are killed and ``TimeoutError`` names the missing ones.
    The Gloo group uses the same timeout, so a stuck collective fails rather than
    hangs.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results: dict[int, Any] = {}
    errors: list[_RankFailure] = []
    with tempfile.TemporaryDirectory(prefix="autosp-ranks-") as tmp:
        store_path = os.path.join(tmp, "filestore")
        result_queue = ctx.Queue()
        procs = []
        with _patched_environ(_RANK_ENV):
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_rank_main,
                    args=(rank, world_size, store_path, timeout, fn, args, result_queue,
                          dict(os.environ)),
                    name=f"autosp-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                procs.append(proc)
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        try:
            while len(results) + len(errors) < world_size:
                now = time.monotonic()
                if grace_deadline is not None and now > grace_deadline:
                    break
                try:
                    rank, ok, payload, tb_text, failed_at = result_queue.get(timeout=0.2)
                except queue_lib.Empty:
                    _check_for_dead_ranks(procs, results, errors)
                    if errors and grace_deadline is None:
                        grace_deadline = time.monotonic() + _ERROR_GRACE_S
                    if not errors and time.monotonic() > deadline:
                        reported = set(results)
                        missing = [r for r in range(world_size) if r not in reported]
                        raise TimeoutError(
                            f"run_ranks({_name_of(fn)}): ranks {missing} of {world_size} "
                            f"did not finish within {timeout:.0f}s"
                        ) from None
                    continue
                if ok:
                    results[rank] = pickle.loads(payload)
                else:
                    errors.append(_RankFailure(rank, payload, tb_text, failed_at))
                    if grace_deadline is None:
                        grace_deadline = time.monotonic() + _ERROR_GRACE_S
            if errors:
                _check_for_dead_ranks(procs, results, errors)
                _raise_rank_error(fn, errors)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
            result_queue.close()
    return [results[r] for r in range(world_size)]


@dataclasses.dataclass
class _RankFailure:
    rank: int
    exc_payload: bytes | None  # the pickled exception, None if it did not pickle
    traceback: str
    failed_at: float  # time.time() in the rank when it failed

    @property
    def is_secondary(self) -> bool:
        return _SECONDARY_FAILURE.search(self.traceback) is not None


# After the first failure, wait this long for the other ranks' reports so that the
# root cause can be told apart from its echoes (a peer's "Connection closed").
_ERROR_GRACE_S = 2.0
# How a rank fails when a peer died or left a collective: an echo, not the cause.
_SECONDARY_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|connectFullMesh"
    r"|Socket Timeout|Timed out waiting|ECONNRESET|EPIPE",
    re.IGNORECASE,
)


def _name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _check_for_dead_ranks(
    procs: list[Any], results: dict[int, Any], errors: list[_RankFailure]
) -> None:
    # A rank that segfaults, calls os._exit or is OOM-killed never reports; notice it
    # instead of waiting for the timeout.
    for rank, proc in enumerate(procs):
        if rank in results or any(rank == e.rank for e in errors):
            continue
        if proc.exitcode is not None and proc.exitcode != 0:
            errors.append(
                _RankFailure(
                    rank,
                    None,
                    f"rank {rank} exited with code {proc.exitcode} without reporting",
                    time.time(),
                )
            )


def _raise_rank_error(fn: Callable[..., Any], errors: list[_RankFailure]) -> None:
    # The root cause: a rank that died, else the earliest failure that is not an echo
    # of another rank's failure, else the earliest failure.
    died = [e for e in errors if e.exc_payload is None and "without reporting" in e.traceback]
    primary = [e for e in errors if not e.is_secondary]
    pool = died or primary or errors
    cause = min(pool, key=lambda e: e.failed_at)
    others = "".join(
        f"\n  rank {e.rank}: {e.traceback.strip().splitlines()[-1]}"
        for e in sorted(errors, key=lambda e: e.rank)
        if e is not cause
    )
    header = f"rank {cause.rank} failed in {_name_of(fn)}:\n{cause.traceback}"
    if others:
        header += f"\nother ranks that failed:{others}"
    exc: BaseException | None = None
    if cause.exc_payload is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(cause.exc_payload)
    if isinstance(exc, BaseException):
        raise exc from RemoteTraceback(header)
    raise RankError(header)


def _context() -> Any:
    """The ranks' start method: a fork server that has imported torch and autosp once, and what
    a first compile imports (``WARM_IMPORTS``). Each rank is forked from it, a fresh process in
    which nothing has run: a rank group that does nothing starts in 0.1 s against 4.5 s for spawned interpreters importing both anew, and
    the suite starts some 300. Where the platform has no fork server, spawn. The environment
    is handed to each rank (:func:`_rank_main`): the server's is the one it started with.
    autosp reads its ``AUTOSP_*`` variables when called, not when imported; a variable torch
    reads at import (``TORCH_LOGS``, ``TORCHDYNAMO_*``) is the server's, so a test that sets
    one must set it inside the rank. The ranks share the server's string-hash seed, which
    spawned ranks (and torchrun's) do not: ``AUTOSP_TEST_START=spawn`` starts them as before,
    where a rank-dependent iteration order is the suspect. Linux only; spawn elsewhere."""
    global _CONTEXT
    if _CONTEXT is None:
        spawn = os.environ.get("AUTOSP_TEST_START", "") == "spawn"
        if not spawn and sys.platform.startswith("linux") \
                and "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(["torch", "autosp", *_importable(WARM_IMPORTS),
                                             "forkserver_warm"])
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


_CONTEXT: Any = None

# What a rank's first compile imports, imported once by the fork server rather than by every
# rank: AOTAutograd, PyTorch's partitioner (and networkx, which it imports), Inductor, sympy
# and transformers. A first compile of a tiny model under aot_eager then takes 0.4 s in a rank
# instead of 1.3 s on a 2-core machine. Imports only, and Inductor's pick of the CPU's vector
# instructions (forkserver_warm, preloaded last): the server compiles nothing of a test, so
# Dynamo's counters and caches start empty in every rank, and it starts no thread.
WARM_IMPORTS = ("torch._functorch.aot_autograd", "torch._functorch.partitioners", "networkx",
                "torch._inductor.compile_fx", "torch._inductor.codegen.cpp", "sympy",
                "transformers")


def _importable(names: tuple[str, ...]) -> list[str]:
    """The modules of ``names`` this interpreter imports without an error (imported here too).
    The fork server skips a preload that raises ImportError, and dies of any other error."""
    importable = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # a missing or broken optional package: the ranks import it themselves
            continue
        importable.append(name)
    return importable


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    result_queue: Any,
    environ: Mapping[str, str] | None = None,
) -> None:
    if environ is not None:  # the caller's environment at the start, as a spawned rank has it
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    # Loopback is the one interface every sandbox has; hostname resolution is not.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend="gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, *args)
        payload = pickle.dumps(result)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        tb_text = traceback.format_exc()
        try:
            exc_payload: bytes | None = pickle.dumps(exc)
            pickle.loads(exc_payload)
        except Exception:  # noqa: BLE001 - an exception that does not round-trip
            exc_payload = None
        result_queue.put((rank, False, exc_payload, tb_text, time.time()))
    else:
        result_queue.put((rank, True, payload, "", 0.0))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    # Flush the queue's feeder thread before the interpreter exits.
    result_queue.close()
    result_queue.join_thread()


@contextlib.contextmanager
def _patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# --------------------------------------------------------------------------------------
# Comparing against the single-device model.


def relative_grad_errors(
    model_grads: Mapping[str, torch.Tensor], ref_grads: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """max|g - g_ref| / max|g_ref| for every parameter name in ``ref_grads``.

    A reference gradient that is exactly zero is compared absolutely (the error is
    max|g|), so an all-zero reference still demands an all-zero gradient.
    """
    if set(model_grads) != set(ref_grads):
        missing = sorted(set(ref_grads) - set(model_grads))
        extra = sorted(set(model_grads) - set(ref_grads))
        raise AssertionError(f"gradient names differ: missing {missing}, unexpected {extra}")
    errors: dict[str, float] = {}
    for name, ref in ref_grads.items():
        got = model_grads[name]
        if got is None or ref is None:
            raise AssertionError(f"{name}: gradient is None (got {got is None}, ref {ref is None})")
        if got.shape != ref.shape:
            raise AssertionError(f"{name}: gradient shape {tuple(got.shape)} != {tuple(ref.shape)}")
        got64 = got.detach().double()
        ref64 = ref.detach().double()
        diff = (got64 - ref64).abs().max().item()
        scale = ref64.abs().max().item()
        err = diff / scale if scale > 0 else diff
        errors[name] = err if math.isfinite(err) else math.inf
    return errors


def assert_grads_close(
    model_grads: Mapping[str, torch.Tensor],
    ref_grads: Mapping[str, torch.Tensor],
    rtol: float = 1e-4,
    *,
    context: str = "",
) -> None:
    """Asserts max|g - g_ref| / max|g_ref| <= rtol for every parameter.

    The failure message names the worst parameter and lists every parameter over
    the tolerance, e.g. ``worst: layers.0.self_attn.k_proj.weight rel err 3.1e-02 > 1e-04``.
    """
    errors = relative_grad_errors(model_grads, ref_grads)
    failing = {name: err for name, err in errors.items() if not err <= rtol}
    if failing:
        worst = max(failing, key=lambda n: failing[n])
        prefix = f"{context}: " if context else ""
        lines = "\n".join(
            f"  {name}: {err:.3e}" for name, err in sorted(failing.items(), key=lambda kv: -kv[1])
        )
        raise AssertionError(
            f"{prefix}worst: {worst} rel err {failing[worst]:.3e} > {rtol:.0e}; "
            f"{len(failing)} of {len(errors)} parameters over tolerance:\n{lines}"
        )


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter's ``.grad``, by parameter name.

    Raises if a parameter that requires grad has none (a compiler that drops a
    gradient must fail loudly, not compare as zero). A sharded gradient (a DTensor, from
    autosp.fully_shard) is gathered in full: every rank must call this alike.
    """
    from torch.distributed.tensor import DTensor

    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            raise AssertionError(f"{name}: .grad is None after backward")
        g = param.grad.detach()
        grads[name] = g.full_tensor() if isinstance(g, DTensor) else g.clone()
    return grads


# --------------------------------------------------------------------------------------
# Same-seed model and batch construction.


def tiny_config(
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 128,
    intermediate_size: int = 172,
) -> LlamaConfig:
    """A LlamaConfig small enough for multi-rank CPU tests."""
    from autosp.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
    )


def build_model(cfg: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """The reference Llama with weights drawn from ``seed``: identical on every rank."""
    from autosp.models.llama import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)


def make_batch(
    vocab_size: int, batch_size: int, seq_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of shape [batch_size, seq_len], identical for a given seed.

    Labels equal the input ids (the model shifts them) with -100 at awkward places:
    the first and last positions of every row, a run across the middle of the
    sequence (so it straddles the boundary between SP chunks), a few random
    positions, and, in row 1, the whole first quarter and one more token (so with
    P <= 4 some rank's chunk of that row has no valid token at all).
    """
    if seq_len < 8:
        raise ValueError(f"seq_len must be >= 8 for the ignore pattern, got {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    labels = input_ids.clone()
    labels[:, :1] = -100
    labels[:, -2:] = -100
    mid = seq_len // 2
    labels[0, mid - 1 : mid + 2] = -100
    random_pos = torch.randint(0, seq_len, (batch_size, 2), generator=gen)
    labels.scatter_(1, random_pos, -100)
    if batch_size > 1:
        labels[1, : seq_len // 4 + 2] = -100
    return input_ids, labels


def dp_mean_reference(cfg: LlamaConfig, batches: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device reference of data parallelism over ``batches`` (one per dp group):
    each batch's loss, and the mean over the batches of the single-device gradients."""
    ref_grads: dict[str, torch.Tensor] = {}
    ref_losses = []
    for ids, labels in batches:
        ref = build_model(cfg)
        loss = ref(ids, labels)
        loss.backward()
        ref_losses.append(loss.item())
        for name, g in grads_of(ref).items():
            ref_grads[name] = ref_grads.get(name, 0) + g / len(batches)
    return ref_losses, ref_grads


def reference_loss_and_grads(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the plain model on one device (this process), leaving
    ``model``'s own ``.grad`` fields untouched."""
    import copy

    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss = ref(input_ids, labels)
    loss.backward()
    return loss.item(), grads_of(ref)


def step_against_reference(model: torch.nn.Module, compiled: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """One step of ``compiled`` (``model`` compiled) and of a copy of ``model`` on one device,
    on the same arguments: ``{"loss", "ref_loss", "grads", "ref_grads"}``. Both start from
    cleared gradients; ``model``'s own ``.grad`` fields hold the compiled step's."""
    import copy

    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    ref_loss = ref(*args)
    ref_loss.backward()
    model.zero_grad(set_to_none=True)
    loss = compiled(*args)
    loss.backward()
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grads": grads_of(model),
            "ref_grads": grads_of(ref)}


def assert_errors_within(step: Mapping[str, Any], where: str, *, loss_atol: float = 1e-5,
                         grad_rtol: float = 1e-4) -> None:
    """For a step summarised as ``{"loss", "ref_loss", "errors"}`` (``errors``: what
    relative_grad_errors gives, by parameter; the breaker files' workers return these): the
    loss within ``loss_atol`` of one device's and every gradient error at most ``grad_rtol``."""
    assert abs(step["loss"] - step["ref_loss"]) <= loss_atol, (where, step["loss"], step["ref_loss"])
    bad = {k: f"{v:.2e}" for k, v in step["errors"].items() if not v <= grad_rtol}
    assert not bad, f"{where}: {bad}"


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """("ok", "") or (exception type name, message) of calling ``fn``: ranks report what they
    raised instead of raising, so that a test compares every rank's error."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return type(e).__name__, str(e)
    return "ok", ""


def exact_or_autosp_error(check: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``check(*args, **kwargs)`` passes, or a rank raised an AutospError. torch's internal
    "Freevar has no source" (Dynamo's region reuse with a free variable) fails the test."""
    import pytest

    try:
        check(*args, **kwargs)
    except Exception as e:  # run_ranks re-raises it (RankError when it won't pickle)
        if "Freevar has no source" in str(e):
            pytest.fail("raw Dynamo AssertionError ('Freevar has no source') instead of an "
                        "exact result or an AutospError")
        if "AutospError" not in f"{type(e).__name__} {e}":
            raise


def assert_step_exact(result: Mapping[str, Any], where: str, *, loss_atol: float = 1e-5,
                      grad_rtol: float = 1e-4) -> None:
    """The loss within ``loss_atol`` of one device's and every gradient within ``grad_rtol``
    (max|g - g_ref| / max|g_ref|), for a result of step_against_reference."""
    diff = abs(result["loss"] - result["ref_loss"])
    assert diff <= loss_atol, f"{where}: loss {result['loss']!r} vs single-device {result['ref_loss']!r}"
    assert_grads_close(result["grads"], result["ref_grads"], rtol=grad_rtol, context=where)
