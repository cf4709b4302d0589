"""What ``regions=True`` saves and recomputes against the flat compile, per layer.

Each compile runs as rank 0 of an SP group of ``--sp`` against a fake process group, in a
fresh process with a fresh Inductor cache directory, ``--backend`` (aot_eager by default), the
reference Llama (hidden 64), remat ``--remat``; it prints each run's saved bytes and recompute FLOPs from its
``RematReport``, per layer and in all, the storages the step really holds for its backward
(``autosp.measure.saved_bytes``: saved-tensor hooks, parameters excluded), the peak of a
training step with AdamW (``autosp.measure.train_step_memory``: the CPU allocator's events in
``torch.profiler``, parameters and optimizer state included), and regions / flat::

    .venv/bin/python bench/remat_regions_bytes.py --layers 16 --seq 512   # about 1 min on 2 cores
    .venv/bin/python bench/remat_regions_bytes.py --backend inductor      # about 2 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _child(regions: bool, layers: int, seq: int, sp: int, remat: str, frozen: str,
           backend: str, tanh: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM
    from autosp.remat_policy import RematReport

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=layers,
                      num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if tanh:  # every decoder layer returns tanh of its output: its backward reads that output
        from autosp.models.llama import DecoderLayer

        class TanhLayer(DecoderLayer):
            def forward(self, *args, **kwargs):
                return torch.tanh(super().forward(*args, **kwargs))

        for layer in model.layers:
            layer.__class__ = TanhLayer
    for name, p in model.named_parameters():  # frozen: parameters under these prefixes
        p.requires_grad_(not (frozen and name.startswith(tuple(frozen.split(",")))))
    report = RematReport()
    compiled = autosp.compile(model, mesh=autosp.init_mesh(sp),
                              check_inputs="never", regions=regions, backend=backend,
                              remat=remat, remat_report=report)
    compiled(ids, ids).backward()
    from autosp.measure import saved_bytes, train_step_memory

    held = saved_bytes(model, compiled, ids, ids)
    peak = train_step_memory(model, compiled, ids, ids).peak_bytes
    calls = {}  # a region's report names its first layer; every layer calling it counts
    for line in compiled.last_compile.outlined:
        layer, _, rest = line.partition(": calls ")
        if rest:
            calls.setdefault(rest.split()[0], []).append(layer)
    per_layer = {}
    for g in report.graphs:
        for row in g.layers:
            members = [row.layer]
            if g.calls:
                members = next((m for m in calls.values() if m[0] == row.layer), members)
            for layer in members:
                per_layer[layer] = row.recompute_flops
    print("RESULT " + json.dumps({
        "saved": report.saved_bytes, "held": held, "peak": peak,
        "recompute": sum(g.recompute_flops for g in report.graphs if not g.calls),
        "per_layer": per_layer, "outlined": compiled.last_compile.outlined}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--remat", default="sequence-aware")
    ap.add_argument("--frozen", default="", help="comma-separated parameter name prefixes "
                    "that take no gradient (e.g. embed_tokens,layers.0.,layers.1.)")
    from autosp.remat_policy import BACKENDS  # the backends' names, defined once

    ap.add_argument("--backend", default="aot_eager", choices=BACKENDS)
    ap.add_argument("--tanh", action="store_true",
                    help="every decoder layer ends in tanh (its backward reads its output)")
    ap.add_argument("--child", choices=("flat", "regions"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child == "regions", args.layers, args.seq, args.sp, args.remat, args.frozen,
               args.backend, args.tanh)
        return
    runs = {}
    for mode in ("flat", "regions"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="autosp-bytes-")}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode,
                              "--layers", str(args.layers), "--seq", str(args.seq),
                              "--sp", str(args.sp), "--remat", args.remat,
                              "--frozen", args.frozen, "--backend", args.backend]
                             + (["--tanh"] if args.tanh else []),
                             env=env, capture_output=True, text=True, check=False)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        runs[mode] = json.loads(line[len("RESULT "):])
    flat, reg = runs["flat"], runs["regions"]
    print(f"Llama {args.layers} layers{' ending in tanh' if args.tanh else ''}, S {args.seq}, rank 0 of sp {args.sp}, remat {args.remat}, "
          f"{args.backend}")
    print("regions=True: " + "; ".join(reg["outlined"]))
    print(f"{'layer':<12}{'flat MFLOP':>12}{'regions MFLOP':>15}")
    for layer in sorted(flat["per_layer"], key=lambda x: (len(x), x)):
        if layer.startswith("layers."):
            print(f"{layer:<12}{flat['per_layer'][layer] / 1e6:>12.2f}"
                  f"{reg['per_layer'].get(layer, float('nan')) / 1e6:>15.2f}")
    print(f"saved: flat {flat['saved'] / 1e6:.2f} MB, regions {reg['saved'] / 1e6:.2f} MB "
          f"({reg['saved'] / flat['saved']:.3f}x); recompute: flat {flat['recompute'] / 1e6:.1f}, "
          f"regions {reg['recompute'] / 1e6:.1f} MFLOP")
    print(f"held for backward (measured): flat {flat['held'] / 1e6:.3f} MB, regions "
          f"{reg['held'] / 1e6:.3f} MB ({reg['held'] / flat['held']:.3f}x)")
    print(f"peak of a training step (measured): flat {flat['peak'] / 1e6:.3f} MB, regions "
          f"{reg['peak'] / 1e6:.3f} MB ({reg['peak'] / flat['peak']:.3f}x)")


if __name__ == "__main__":
    main()
