"""Cold first call of models whose layers read the rank or return their keys and values, with
regions="compile" (autosp.compile's default) against regions=False (flat), each in a fresh
process with a fresh Inductor cache: seconds, kernels and layers outlined.

    .venv/bin/python bench/outline_forms.py                 # about 5 minutes on 2 cores
    .venv/bin/python bench/outline_forms.py --layers 16 --models nanogpt

Models (tests/styles.py, tests/hf_zoo.py): ``nanogpt``, nanoGPT with its attention by hand (the
causal mask sliced from a buffer, which each rank reads at its offset: the rank); ``hf-cache``,
a Hugging Face Llama called with its default ``use_cache=True`` (every layer's keys and values
returned). Rank 0 of sp 2 on a fake process group, Inductor on CPU, S 256, static S. The ratio
is regions="compile" / flat, measured in the same run. docs/compile_time.md has the results.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")


def _child(model_name: str, regions: str, layers: int, seq: int) -> None:
    sys.path.insert(0, TESTS)
    import torch
    import torch.distributed as dist
    from torch._inductor import metrics
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp
    import styles

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.manual_seed(0)
    kwargs: dict = {}
    args: tuple = ()
    if model_name == "nanogpt":  # block_size above S: at S == block_size Dynamo fixes S
        model = styles.NanoGPT(n_layer=layers, flash=False, block_size=2 * seq)
        args = styles.nanogpt_inputs(1, seq)
    else:
        import transformers
        from distributed import make_batch
        from hf_zoo import _from_config, tiny_config

        cfg = tiny_config("llama")
        cfg.num_hidden_layers = layers
        model = _from_config(transformers.LlamaForCausalLM, cfg).train()
        ids, labels = make_batch(cfg.vocab_size, 2, seq, seed=1)
        kwargs = {"input_ids": ids, "labels": labels}  # use_cache: the config's, True
    compiled = autosp.compile(model, mesh=autosp.init_mesh(2), backend="inductor",
                              check_inputs="never", dynamic=False,
                              regions=False if regions == "false" else regions)
    start = time.perf_counter()
    out = compiled(*args, **kwargs)
    (out if isinstance(out, torch.Tensor) else out.loss).backward()
    seconds = time.perf_counter() - start
    lines = compiled.last_compile.outlined
    print(f"RESULT {seconds:.3f} {metrics.generated_kernel_count} "
          f"{sum('calls' in line for line in lines)}", flush=True)


def _run(model_name: str, regions: str, layers: int, seq: int) -> tuple[float, int, int]:
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model_name,
                              regions, "--layers", str(layers), "--seq", str(seq)],
                             env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                             capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            seconds, kernels, outlined = line.split()[1:]
            return float(seconds), int(kernels), int(outlined)
    raise RuntimeError(f"{model_name} regions={regions} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="nanogpt,hf-cache")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.layers, args.seq)
        return
    print(f"{args.layers} layers, S {args.seq}, Inductor, rank 0 of sp 2, cold")
    print(f"{'model':10} {'regions':>9} {'seconds':>8} {'kernels':>8} {'outlined':>9}")
    for name in args.models.split(","):
        got = {}
        for regions in ("false", "compile"):
            got[regions] = _run(name, regions, args.layers, args.seq)
            s, k, o = got[regions]
            print(f"{name:10} {regions:>9} {s:8.1f} {k:8d} {o:>5d}/{args.layers}", flush=True)
        print(f"{name:10} compile / flat: {got['compile'][0] / got['false'][0]:.2f}x seconds, "
              f"{got['compile'][1] / got['false'][1]:.2f}x kernels")


if __name__ == "__main__":
    main()
