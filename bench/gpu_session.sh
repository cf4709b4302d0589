#!/usr/bin/env bash
# One GPU session's checks, in priority order, each under its own time limit, every log
# written to $OUT (or ./gpu-out). Meant for a lent single-GPU machine whose python3 holds
# PyTorch (and no network): the C++ core travels as a cp312 wheel built beforehand with
#     python3.12 -m pip wheel --no-deps . -w .whl
# and the Python sources are used from this checkout.
#
# What it measures:
#   1. gpu_exact.py: autosp on CUDA with Inductor's Triton kernels, 2 SP ranks sharing the
#      GPU over Gloo, loss and every gradient against the plain model (CPU suite tolerances).
#   2. bench_memory_gpu.py: the planner's predicted peak against torch.cuda.max_memory_allocated
#      for a Llama-3.2-1B-shaped model (4 layers), three remat policies, S 2048-8192.
#      Then, blind (the model was fitted to the fp32 GQA run of 2026-12-04): fp32 without GQA
#      (memory-efficient attention) and bf16 with GQA (flash), policy none, S 4096 and 8192.
#   (1 and 2 run side by side: both are short and neither is timed.)
#   0. gpu_sdpa_probe.py: the attention kernel PyTorch picks against autosp.cuda_kernels', and
#      what CUDA's softmax backward allocates.
#   3. compile_first_call.py --device cuda: first-call time of autosp against torch.compile of
#      the hand-written Ulysses model (issue 12), cold and warm, 2 and 16 layers, Triton;
#      autosp flat (regions=False) and with autosp.compile's default, regions="compile" (the
#      "-regions-every-layer" row; on torch 2.11 regions=True compiles the same, without reuse).
#
#     bash bench/gpu_session.sh checks     # 0-2, about 5 minutes on an H200
#     bash bench/gpu_session.sh compile    # 3, about 6 minutes
#     bash bench/gpu_session.sh            # both (over one call's 10 minutes: use two calls)
set -u
PART=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) $*" | tee -a "$OUT/session.log"; }

log "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee -a "$OUT/session.log"

log "install the C++ core"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/autosp-site .whl/autosp-*.whl \
    2>&1 | tail -3 | tee -a "$OUT/session.log"
cp /tmp/autosp-site/autosp/_core*.so python/autosp/ || exit 1
export PYTHONPATH=$PWD/python
python3 -c 'import autosp, autosp._core; print("autosp imports from", autosp.__file__)' \
    2>&1 | tee -a "$OUT/session.log" || exit 1

if [ "$PART" != compile ]; then
log "0: the attention kernel and the softmax backward's scratch"
timeout 90 python3 bench/gpu_sdpa_probe.py 2>&1 | tee "$OUT/sdpa_probe.log"

log "1+2: exactness on CUDA, and predicted vs measured peak memory (side by side)"
timeout 180 python3 bench/gpu_exact.py > "$OUT/exact.log" 2>&1 &
exact=$!
(timeout 180 python3 bench/bench_memory_gpu.py --seq 2048,4096,8192
 timeout 90 python3 bench/bench_memory_gpu.py --kv-heads 32 --seq 4096,8192 --policies none
 timeout 90 python3 bench/bench_memory_gpu.py --dtype bf16 --seq 4096,8192 --policies none
) > "$OUT/memory.log" 2>&1 &
memory=$!
wait $exact; echo "gpu_exact exit $?" | tee -a "$OUT/session.log"
wait $memory; echo "bench_memory_gpu exit $?" | tee -a "$OUT/session.log"
tail -n 14 "$OUT/exact.log"; cat "$OUT/memory.log"

fi

if [ "$PART" != checks ]; then
log "3: first-call compile time on CUDA, 2 layers"
timeout 220 python3 bench/compile_first_call.py --device cuda --layers 2 \
    --only handwritten-static,autosp-static,autosp-static-regions-every-layer 2>&1 | tee "$OUT/compile2.log"
log "3: first-call compile time on CUDA, 16 layers"
timeout 180 python3 bench/compile_first_call.py --device cuda --layers 16 \
    --only handwritten-static,autosp-static-regions-every-layer 2>&1 | tee "$OUT/compile16.log"
fi
log "done"
