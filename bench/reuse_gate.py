"""First-call time of a model whose forward stores its own attribute before the layers (Meta's
reference Llama: ``self.freqs_cis = self.freqs_cis.to(h.device)``), with ``regions=True``:
autosp's reuse gate as it is (autosp.dynamo_reuse: such a store is tolerated, Dynamo traces
one layer and stamps it out for the others) against the strict rule it replaced (every store
refuses Dynamo's reuse, so every layer is traced), each in a fresh process.

    .venv/bin/python bench/reuse_gate.py                    # 8 layers, aot_eager, about 2 minutes
    .venv/bin/python bench/reuse_gate.py --layers 16 --backend inductor

Runs as rank 0 of an SP group of ``--sp`` against a fake process group (collectives allocate,
do not communicate), like bench/compile_first_call.py. Prints the first-call seconds, Dynamo's
reuse hits, and the ratio strict / tolerant (runs alternated; best of ``--repeat``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

RULES = ("tolerant", "strict")


def _child(rule: str, layers: int, seq: int, sp: int, backend: str) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.variables import invoke_subgraph
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    class StoresItsTable(LlamaForCausalLM):
        """The forward first stores an attribute of the model no layer reads."""

        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.table = self.table.to(args[0].device)
            return super().forward(*args, **kwargs)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=layers,
                      num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = StoresItsTable(cfg)
    model.register_buffer("table", torch.ones(8), persistent=False)
    hits = [0]
    find = invoke_subgraph.find_reuse_match

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        match = find(*args, **kwargs)
        hits[0] += match is not None
        return match

    invoke_subgraph.find_reuse_match = counting
    start = time.perf_counter()
    compiled = autosp.compile(model, mesh=autosp.init_mesh(sp), check_inputs="never",
                              backend=backend, regions=True)
    if rule == "strict":  # no module tolerated: the rule before (every store refuses reuse)
        compiled._holders = ()
    compiled(ids, ids).backward()
    print(f"RESULT {time.perf_counter() - start:.3f} {hits[0]}", flush=True)


def _run(rule: str, args: argparse.Namespace, cache: str) -> tuple[float, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", rule,
                          "--layers", str(args.layers), "--seq", str(args.seq),
                          "--sp", str(args.sp), "--backend", args.backend],
                         env=env, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            seconds, hits = line.split()[1:]
            return float(seconds), int(hits)
    raise RuntimeError(f"{rule} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--sp", type=int, default=2)
    from autosp.remat_policy import BACKENDS  # the backends' names, defined once

    ap.add_argument("--backend", default="aot_eager", choices=BACKENDS)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child", default=None, choices=RULES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        _child(args.child, args.layers, args.seq, args.sp, args.backend)
        return
    best = {rule: (float("inf"), -1) for rule in RULES}
    for _ in range(args.repeat):
        for rule in RULES:
            with tempfile.TemporaryDirectory() as cache:  # cold every time
                seconds, hits = _run(rule, args, cache)
            best[rule] = min(best[rule], (seconds, hits))
    print(f"{args.layers} layers, S={args.seq}, sp={args.sp}, {args.backend}, regions=True, "
          f"best of {args.repeat} cold first calls")
    for rule in RULES:
        print(f"  {rule:9s} {best[rule][0]:8.2f} s   Dynamo reuse hits {best[rule][1]}")
    print(f"  strict / tolerant: {best['strict'][0] / best['tolerant'][0]:.2f}x")


if __name__ == "__main__":
    main()
