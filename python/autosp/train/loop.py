"""The training loop ``autosp train`` runs on every rank (under torchrun).

Each rank builds the same model from the seed, compiles it with ``autosp.compile`` on a
("dp", "sp") mesh (and shards it with ``autosp.fully_shard`` when asked), and trains it with
AdamW, warmup + cosine, gradient accumulation and global-norm clipping. Rank 0 prints a
progress line and writes the metrics (autosp.train.metrics); checkpoints are saved and
resumed by autosp.train.checkpoint.

Faults: SIGTERM (a scheduler's preemption) on any rank ends the run on every rank after the
current step, with a checkpoint, and exit status 0. A collective that fails or times out
(``parallel.timeout_s``), because another rank died, ends this rank with exit status 1 and a
message saying so, never a hang.
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from autosp.train import checkpoint as ckpt
from autosp.train import config as config_mod
from autosp.train.config import TrainConfig
from autosp.train.data import Batches, target_count, with_one_target
from autosp.errors import MESSAGE_MARK, AutospError
from autosp.remat import MemoryBudget, Offload, RematReport
from autosp.train.metrics import (MetricsLog, StepTimer, human_bytes, peak_memory_bytes, peak_tflops,
                                  progress_line, regions_line)
from autosp.train.predict import choose_strategy, predicted_peak
from autosp.train.model import (attention_note, build_model, check_attends_within_documents,
                                position_table_size)
from autosp.train.schedule import warmup_cosine


def use_cuda(device: str) -> bool:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("autosp train: parallel.device = cuda but CUDA is not available")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def run(cfg: TrainConfig) -> int:
    """Train on this rank; returns the exit status."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    sp_size = cfg.parallel.sp or world_size
    if world_size % sp_size != 0:
        raise SystemExit(f"autosp train: parallel.sp = {sp_size} must divide the number of "
                         f"processes {world_size}")
    if use_cuda(cfg.parallel.device):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s))
    try:
        return _loop(cfg, rank, world_size, sp_size, device)
    except AutospError as e:  # the model, data or config: said once, without a traceback
        if rank == 0 or "[autosp:train]" not in str(e):
            print(f"autosp train: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except (dist.DistError, RuntimeError) as e:
        if type(e) is RuntimeError and str(e).lstrip().startswith(MESSAGE_MARK):
            # autosp's check inside the compiled step (torch._assert_async on the CPU; on CUDA
            # it is a device-side assert, whose text PyTorch writes): its message, without
            # PyTorch's traceback. A RuntimeError that only wraps such a message is raised.
            print(f"autosp train: rank {rank}: {str(e).strip().splitlines()[0]}",
                  file=sys.stderr, flush=True)
            return 1
        if not _collective_failure(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"autosp train: rank {rank}: a collective failed or timed out "
              f"(parallel.timeout_s = {cfg.parallel.timeout_s:g}): {first}. Another rank has "
              "probably stopped (killed, out of memory, or an error it printed); this rank "
              "stops too.", file=sys.stderr, flush=True)
        os._exit(1)  # the process group cannot be torn down cleanly without the dead rank
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collective_failure(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(k in text for k in ("gloo", "nccl", "connection closed", "connection reset",
                                   "timed out", "broken pipe"))


class _Preemption:
    """SIGTERM or SIGINT (Ctrl-C under plain torchrun) sets a flag; the ranks agree on it at
    the end of each step."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def step_model_flops(report: Any, grad_accum: int, device: torch.device) -> float | None:
    """The step's model FLOPs summed over all ranks, from each rank's report of its compiled
    graph; None when some rank has none (its graph came from PyTorch's cache without the
    report autosp keeps beside it). A collective: every rank calls it alike, also one without a
    report (found by a breaker: only ranks with a report reduced, and the job hung)."""
    mine = report.graphs[-1].model_flops * grad_accum if report.graphs else 0.0
    flops = torch.tensor([mine, float(bool(report.graphs))], device=device, dtype=torch.float64)
    dist.all_reduce(flops)
    return float(flops[0].item()) if flops[1].item() == dist.get_world_size() else None


def _loop(cfg: TrainConfig, rank: int, world_size: int, sp_size: int, device: torch.device) -> int:
    import autosp

    t = cfg.training
    out = cfg.metrics.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise AutospError(f"[autosp:train] metrics.out_dir = {out!r}: found a file; expected a "
                          "folder (it is created when missing)")
    ckpt_dir = cfg.checkpoint.dir or os.path.join(cfg.metrics.out_dir, "checkpoints")
    resume_from = ckpt.resolve(cfg.checkpoint.resume, ckpt_dir)  # before the model: fail early
    dp_size = world_size // sp_size
    mesh = autosp.init_mesh(sp_size, dp_size=dp_size)
    dp_rank = mesh.get_local_rank("dp")
    batches = Batches(cfg.data, t.seq_len, t.batch_size, t.grad_accum, dp_size, t.seed)
    model, vocab = build_model(cfg.model, t.seed, batches.vocab_size)
    if batches.docs is not None:
        # the table first: its probe's last position may leave a dynamic rotary embedding's
        # state changed; the 8-position probe after it puts that back
        batches.docs.max_position = position_table_size(model)
        check_attends_within_documents(model, vocab)
    n_params = sum(p.numel() for p in model.parameters())
    bf16 = cfg.model.dtype == "bfloat16"
    model = model.to(device)
    if cfg.parallel.fsdp:
        mp = autosp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else None
        autosp.fully_shard(model, mesh, mp_policy=mp)
    elif bf16:
        model = model.to(torch.bfloat16)
    flops_report = RematReport()  # the compiled graph's FLOPs, for MFU
    if t.remat == "auto":  # every rank plans the same, and trains what it chose
        chose = choose_strategy(cfg, world_size, sp_size, vocab, device)
        if rank == 0:
            print(chose, flush=True)
    remat = MemoryBudget(bytes=int(t.remat_budget_gib * (1 << 30))) if t.remat_budget_gib > 0 \
        else t.remat
    if t.offload or t.offload_all:
        remat = Offload(remat, saved="all" if t.offload_all else "layer outputs")
    compiled = autosp.compile(model, mesh=mesh, seq_dim=1, remat=remat, backend=t.backend,
                              remat_report=flops_report, tile_loss=t.tile_loss,
                              tile_mlp=t.tile_mlp,
                              loss_chunks=t.loss_chunks if t.tile_loss and t.loss_chunks else None,
                              dynamic=False,  # every batch is [batch_size, seq_len]
                              regions=config_mod.REGION_MODES[t.regions])
    if t.offload_optimizer:  # fp32 master weights and AdamW's state on the host
        optimizer = autosp.OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=t.lr,
                                            weight_decay=t.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    scheduler = warmup_cosine(optimizer, steps=t.steps, warmup_steps=t.warmup_steps,
                              min_lr_ratio=t.min_lr_ratio)
    # What decides the data of step N (checked when resuming).
    layout = {"dp": dp_size, "batch_size": t.batch_size, "grad_accum": t.grad_accum,
              "seq_len": t.seq_len, "source": cfg.data.source, "tokenizer": cfg.data.tokenizer,
              "seed": t.seed}
    if batches.docs is not None:  # positions restart at the table's size (None: no table)
        layout["max_position"] = batches.docs.max_position
    start = 0
    if resume_from is not None:
        start = ckpt.load(resume_from, model, optimizer, scheduler, layout)
    log = None
    predicted = None
    if rank == 0:
        print(f"autosp train: world {world_size} = dp {dp_size} x sp {sp_size}, "
              f"{n_params / 1e6:.2f}M parameters{' sharded over all ranks' if cfg.parallel.fsdp else ''}, "
              f"seq_len {t.seq_len}, batch {t.batch_size} x {t.grad_accum} accumulated, backend "
              f"{t.backend}, remat {t.remat if t.remat_budget_gib <= 0 else f'budget {t.remat_budget_gib:g} GiB'}"
              f"{', offload all' if t.offload_all else ', offload' if t.offload else ''}{', tiled loss' if t.tile_loss else ''}{', tiled mlp' if t.tile_mlp else ''}{'' if t.regions == 'false' else f', regions {t.regions}'}"
              f"{', optimizer offloaded to the host' if t.offload_optimizer else ''}"
              f"{attention_note(model)}, "
              f"device {device.type}", flush=True)
        print("effective config:\n" + config_mod.to_toml(cfg), flush=True)
        config_mod.save(cfg, cfg.metrics.out_dir)
        log = MetricsLog(cfg.metrics.out_dir, tensorboard=cfg.metrics.tensorboard, start=start)
        if cfg.metrics.predict and t.remat_budget_gib > 0:
            print("autosp plan: no prediction for a memory budget (training.remat_budget_gib)",
                  flush=True)
        elif cfg.metrics.predict:
            predicted, line = predicted_peak(cfg, world_size, sp_size, vocab, device.type)
            print(line, flush=True)
        if resume_from is not None:
            print(f"resumed from {resume_from}: {start} steps done", flush=True)

    timer = StepTimer(device)
    peak_device = peak_tflops(device, cfg.metrics.peak_tflops)
    # The step's model FLOPs over all ranks, known after the first compile; None where a rank
    # has no report of its graph (compiled elsewhere and loaded from a cache without it).
    step_flops: float | None = None
    flops_reduced = False
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum * dp_size
    first_loss: float | None = None
    first_grad_norm: float | None = None
    status = 0
    preemption = _Preemption()
    peak = torch.zeros(1, dtype=torch.float64)
    for step in range(start, t.steps):
        timer.start()
        optimizer.zero_grad(set_to_none=True)
        # The step's loss is the mean over every target token of the step (all micro-batches,
        # all dp groups), whatever the split: each micro-batch's mean loss is weighted by its
        # share of the targets (x dp, since the gradients are averaged over dp groups).
        micro_args = [batches.micro_batch(step, m, dp_rank, vocab) for m in range(t.grad_accum)]
        counts = [target_count(a) for a in micro_args]
        n_targets = torch.tensor([float(sum(counts))], device=device, dtype=torch.float64)
        dist.all_reduce(n_targets)
        n_targets = n_targets.item() / sp_size  # the ranks of an SP group count the same batch
        if n_targets == 0:
            raise AutospError(f"[autosp:train] data.source: step {step} holds no target token "
                              "(its sequences are empty documents); expected text to train on")
        step_loss = torch.zeros((), device=device, dtype=torch.float64)
        for args, count in zip(micro_args, counts):
            # A micro-batch without targets would give a NaN mean; one target, weighted 0.
            loss = compiled(*(a.to(device) for a in (args if count else with_one_target(args))))
            (loss * (count * dp_size / n_targets)).backward()
            step_loss += loss.detach().double() * count
            if first_loss is None:
                first_loss = loss.detach().float().item()
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if first_grad_norm is None and rank == 0:  # before clipping: the step's own gradient
            first_grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                                    else grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        # Every rank of an SP group holds the same loss sum. The peak memory reported is the
        # largest rank's. One all-reduce: the loss summed over ranks, and whether any rank was
        # asked to stop.
        total = torch.stack([step_loss, torch.tensor(float(preemption.requested), device=device,
                                                     dtype=torch.float64)])
        dist.all_reduce(total)
        peak = torch.tensor([peak_memory_bytes(device)], device=device, dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if not flops_reduced:
            step_flops, flops_reduced = step_model_flops(flops_report, t.grad_accum, device), True
        seconds = timer.stop()
        mean_loss = total[0].item() / sp_size / n_targets
        if not math.isfinite(mean_loss):
            if rank == 0:
                print(f"autosp train: loss is not finite at step {step}", file=sys.stderr)
            status = 1
            break
        if log is not None and (step % cfg.metrics.log_every == 0 or step == t.steps - 1):
            gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            rec = {"step": step, "loss": mean_loss, "lr": lr, "grad_norm": float(gn),
                   "tokens": tokens_per_step, "step_ms": seconds * 1e3,
                   "tokens_per_s": tokens_per_step / seconds,
                   "tokens_per_s_per_device": tokens_per_step / seconds / world_size,
                   "peak_mem_bytes": int(peak.item()), "compiling": step == start,
                   "model_flops": step_flops,
                   "tflops_per_device": (None if step_flops is None
                                         else step_flops / seconds / world_size / 1e12)}
            rec["mfu"] = (rec["tflops_per_device"] / peak_device
                          if peak_device and step_flops is not None else None)
            log.write(rec)
            print(progress_line(rec, t.steps) + ("  (includes compilation)" if step == start else ""),
                  flush=True)
            if step == start and (said := regions_line(getattr(compiled.last_compile, "outlined",
                                                               None))):
                print(said, flush=True)
        stop = total[1].item() > 0
        every = cfg.checkpoint.every
        if stop or step == t.steps - 1 or (every and (step + 1) % every == 0):
            saved = ckpt.save(ckpt_dir, model, optimizer, scheduler, step + 1, layout)
            if rank == 0:
                print(f"checkpoint: {saved}", flush=True)
        if stop:
            if rank == 0:
                print(f"autosp train: stopped by SIGTERM after step {step} (of {t.steps}); "
                      f"continue with --resume latest --checkpoint-dir {ckpt_dir}", flush=True)
            break
    preemption.restore()
    if log is not None:
        log.close()
    if log is not None and peak.item() > 0:  # some step ran
        measured = "CUDA peak allocated" if device.type == "cuda" else "CPU peak resident set"
        line = f"peak memory: measured {human_bytes(peak.item())} per rank (largest rank, {measured})"
        if predicted is not None:
            line += f"; autosp plan predicted {human_bytes(predicted)}"
            if device.type != "cuda":
                line += " (device memory; the CPU figure also counts the process itself)"
        print(line, flush=True)
    if t.check and start > 0 and rank == 0:
        print("check: skipped (a resumed run; the check compares the first step of a run)",
              flush=True)
    if t.check and status == 0 and start == 0:
        if rank == 0 and first_loss is not None:
            status = _check_first_step(cfg, batches, first_loss, first_grad_norm, dp_size)
        # Rank 0 may fail the check; every rank exits with its status.
        flag = torch.tensor([status], device=device)
        dist.broadcast(flag, src=0)
        status = int(flag.item())
    return status


# bf16 keeps 8 bits of mantissa: SP and one device sum in other orders, so the bf16 check
# allows this relative difference (measured: about 1e-3 on the test models).
BF16_CHECK_RTOL = 1e-2
# fp32: SP and one device sum the gradient in other orders (measured: about 1e-7 relative).
GRAD_CHECK_RTOL = 1e-4


def _check_first_step(cfg: TrainConfig, batches: Batches, sp_loss: float,
                      sp_grad_norm: float | None, dp_size: int) -> int:
    """The first step against the plain model on one device (CPU), in the run's dtype: the
    first micro-batch's loss within training.check_atol (fp32) or BF16_CHECK_RTOL relative
    (bf16), and the norm of the step's gradient (every dp group's micro-batches, each mean loss
    weighted by its share of the step's targets, as the step weighs them) within
    GRAD_CHECK_RTOL (fp32) or BF16_CHECK_RTOL relative. A wrong gradient with a right loss is
    what the second catches."""
    t = cfg.training
    model, vocab = build_model(cfg.model, t.seed, batches.vocab_size)
    bf16 = cfg.model.dtype == "bfloat16"
    if bf16:
        model = model.to(torch.bfloat16)
    micro = [batches.micro_batch(0, m, d, vocab) for d in range(dp_size)
             for m in range(t.grad_accum)]
    counts = [target_count(a) for a in micro]
    ref_loss = None
    for args, count in zip(micro, counts):
        loss = model(*(args if count else with_one_target(args)))
        ref_loss = loss.detach().float().item() if ref_loss is None else ref_loss
        (loss * (count / sum(counts))).backward()
    diff = abs(sp_loss - ref_loss)
    tol = max(t.check_atol, BF16_CHECK_RTOL * abs(ref_loss)) if bf16 else t.check_atol
    ok = diff <= tol
    print(f"check: first-step loss sp {sp_loss:.8f} single-device{' (bf16)' if bf16 else ''} "
          f"{ref_loss:.8f} |diff| {diff:.3e} {'<=' if ok else '>'} {tol:.0e}: "
          f"{'OK' if ok else 'MISMATCH'}", flush=True)
    if sp_grad_norm is not None:
        ref_norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]).float().item()
        rel = abs(sp_grad_norm - ref_norm) / max(ref_norm, 1e-30)
        rtol = BF16_CHECK_RTOL if bf16 else GRAD_CHECK_RTOL
        grad_ok = rel <= rtol
        print(f"check: first-step gradient norm sp {sp_grad_norm:.8f} single-device "
              f"{ref_norm:.8f} relative diff {rel:.3e} {'<=' if grad_ok else '>'} {rtol:.0e}: "
              f"{'OK' if grad_ok else 'MISMATCH'}", flush=True)
        ok = ok and grad_ok
    return 0 if ok else 1
