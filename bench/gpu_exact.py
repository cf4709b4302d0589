"""Exactness of autosp on a GPU: Ulysses SP over 2 ranks sharing one GPU, Inductor's Triton
kernels, loss and every parameter's gradient against the plain model on the same GPU.

    python bench/gpu_exact.py                  # 2 ranks on cuda:0, Gloo, Inductor
    python bench/gpu_exact.py --device cpu --backend aot_eager   # the same check on a CPU

What it measures (nothing is tuned to pass): each rank builds the reference Llama from one
seed on the GPU, compiles it with ``autosp.compile`` (the variants below) and runs two
steps on different batches (labels ignored at both ends, across the middle and over one
rank's whole chunk of row 1: tests/distributed.py ``make_batch``); a copy of the model runs
the same batch eagerly on the same GPU. It prints, per variant, rank and step, |loss -
reference| and the worst parameter's max|g - g_ref| / max|g_ref|, and PASS when they are
within the CPU suite's tolerances (1e-5 and 1e-4, fp32, TF32 off); exit status 1 if any
row fails.

The two ranks share one GPU through a Gloo process group (Gloo stages CUDA tensors through
the host for all_to_all and all_gather): NCCL refuses two ranks on one device. So this
checks the compiled kernels and the plan on CUDA, not NCCL's transport.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-4
# (name, compile options)
VARIANTS = [
    ("default-remat dynamic", {"remat": "default", "dynamic": True}),
    ("sequence-aware static", {"remat": "sequence-aware", "dynamic": False}),
    ("sequence-aware tiled-loss", {"remat": "sequence-aware", "tile_loss": True}),
    ("regions static", {"remat": "sequence-aware", "dynamic": False, "regions": True}),
]


def _worker(rank: int, world_size: int, device: str, backend: str, seq: int) -> list[dict[str, Any]]:
    import autosp
    from distributed import build_model, grads_of, make_batch, relative_grad_errors, tiny_config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mesh = autosp.init_mesh(world_size)
    rows = []
    for name, options in VARIANTS:
        cfg = tiny_config(4, 2, num_layers=2)
        model = build_model(cfg, 1234).to(device)
        ref_model = copy.deepcopy(model)
        compiled = autosp.compile(model, mesh=mesh, backend=backend, **options)
        for step, seed in enumerate((11, 12)):
            ids, labels = (t.to(device) for t in make_batch(cfg.vocab_size, 2, seq, seed))
            ref_model.zero_grad(set_to_none=True)
            ref_loss = ref_model(ids, labels)
            ref_loss.backward()
            model.zero_grad(set_to_none=True)
            loss = compiled(ids, labels)
            loss.backward()
            errors = relative_grad_errors(grads_of(model), grads_of(ref_model))
            worst = max(errors, key=errors.get)
            rows.append({"variant": name, "rank": rank, "step": step,
                         "loss_diff": abs(loss.item() - ref_loss.item()),
                         "worst": worst, "grad_err": errors[worst],
                         "device": str(loss.device)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    from autosp.remat_policy import BACKENDS  # the backends' names, defined once

    ap.add_argument("--backend", default="inductor", choices=BACKENDS)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_exact: no CUDA device; run with --device cpu for the CPU check")
        return 2
    from distributed import run_ranks

    results = run_ranks(args.world, _worker, args.device, args.backend, args.seq, timeout=900)
    failed = 0
    print(f"{'variant':<28}{'rank':>5}{'step':>5}{'|loss diff|':>13}{'grad rel err':>14}  "
          f"worst parameter")
    for rows in results:
        for r in rows:
            ok = r["loss_diff"] <= LOSS_ATOL and r["grad_err"] <= GRAD_RTOL
            failed += not ok
            print(f"{r['variant']:<28}{r['rank']:>5}{r['step']:>5}{r['loss_diff']:>13.2e}"
                  f"{r['grad_err']:>14.2e}  {r['worst']} on {r['device']} "
                  f"{'PASS' if ok else 'FAIL'}")
    print(f"torch {torch.__version__}, backend {args.backend}, world {args.world}, S {args.seq}: "
          f"{'all rows within' if not failed else f'{failed} rows outside'} the tolerances "
          f"(loss {LOSS_ATOL:.0e}, grads {GRAD_RTOL:.0e})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
