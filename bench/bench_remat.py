"""Benchmark: autosp's remat solver against PyTorch's partitioner, measured in the same run.

1. Solver time. One joint graph of a 16-layer Llama is partitioned by PyTorch's
   min_cut_rematerialization_partition (its min-cut runs in networkx) and by autosp's
   partition function. Reported: networkx.minimum_cut on PyTorch's own flow network vs
   autosp's C++ max-flow on exactly that network (same cut value checked), PyTorch's whole
   solve_min_cut vs autosp's whole solve_remat (policy "default": same heuristics), and both
   end-to-end partition functions. 1b (``--part regions``): the partition work of a whole
   compile of that model, flat and with its decoder layers outlined (autosp.outline), with
   each partition function.
2. Memory and time. LlamaForCausalLM at S = 8k, 16k, 32k on CPU: bytes the forward saves for
   the backward (the forward graph's saved outputs, from their fake-tensor sizes; the same
   accounting for both partitioners) and the median training-step time, PyTorch's default
   partitioner vs autosp "sequence-aware", both through the same compiler backend.

Prints ratios; asserts nothing about absolute times. Example:

    .venv/bin/python bench/bench_remat.py                     # everything (minutes on 2 cores)
    .venv/bin/python bench/bench_remat.py --part solver
    .venv/bin/python bench/bench_remat.py --part regions   # the partition work of a whole compile
    .venv/bin/python bench/bench_remat.py --part memory --seqs 8192 --backend aot_eager
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch import partitioners
from torch._functorch.partitioners import _size_of, min_cut_rematerialization_partition

import autosp.remat as remat
from autosp import _core
from autosp.models.llama import LlamaConfig, LlamaForCausalLM
from autosp.remat_policy import BACKENDS


# ------------------------------------------------------------------------------------------
# 1. Solver time


class NetworkxTimer:
    """Wraps networkx.minimum_cut while PyTorch's partitioner runs, to time it and keep the
    network it solved (this benchmark only; autosp itself never touches networkx)."""

    def __init__(self) -> None:
        import networkx

        self.nx = networkx
        self.original = networkx.minimum_cut
        self.calls: list[tuple[Any, float, float]] = []  # (graph, seconds, cut value)

    def __enter__(self) -> "NetworkxTimer":
        def timed(graph, s, t, *args, **kwargs):
            start = time.perf_counter()
            value, partition = self.original(graph, s, t, *args, **kwargs)
            self.calls.append((graph.copy(), time.perf_counter() - start, value))
            return value, partition

        self.nx.minimum_cut = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        self.nx.minimum_cut = self.original


def _edges_of(graph) -> tuple[int, list[tuple[int, int, int]], int, int]:
    index = {v: i for i, v in enumerate(graph.nodes)}
    edges = []
    for u, v, data in graph.edges(data=True):
        cap = data.get("capacity", math.inf)
        cap = _core.INFINITE_CAPACITY if cap == math.inf else int(cap)
        edges.append((index[u], index[v], cap))
    return len(index), edges, index["source"], index["sink"]


def _best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def bench_solver(num_layers: int, seq: int, repeat: int) -> None:
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=num_layers,
        num_heads=4, num_kv_heads=4,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))

    captured: dict[str, Any] = {}

    def capture(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        captured["joint"] = joint
        captured["inputs"] = joint_inputs
        captured["kwargs"] = kwargs
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(
        model,
        backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=capture),
        fullgraph=True,
    )
    compiled(ids, ids).backward()
    joint, joint_inputs, kwargs = captured["joint"], captured["inputs"], captured["kwargs"]
    num_nodes = len(joint.graph.nodes)

    def fresh() -> fx.GraphModule:
        # Partitioners mutate the joint graph (DCE, CSE, tags): give each a copy.
        return fx.GraphModule(joint, joint.graph.__deepcopy__())

    def partition_seconds(partition_fn: Callable) -> float:
        # The copy is made outside the timed region. Dynamo and Inductor run AOTAutograd, and
        # so the partitioner, with lazily compiled graph modules (torch._dynamo.config.
        # use_lazy_graph_module): both partitioners are timed under that setting, as compiled.
        from torch._dynamo import config as dynamo_config
        from torch.fx._lazy_graph_module import _use_lazy_graph_module

        best = math.inf
        for _ in range(repeat):
            joint_copy = fresh()
            gc.collect()  # each run starts from the same collector state (a full collection
            # falling inside one run and not another was most of the spread between runs)
            with _use_lazy_graph_module(dynamo_config.use_lazy_graph_module):
                start = time.perf_counter()
                partition_fn(joint_copy, joint_inputs, **kwargs)
                best = min(best, time.perf_counter() - start)
        return best

    # End-to-end partition functions, alternated so that load from other processes hits both.
    report = remat.RematReport()
    ours = remat.make_partition_fn("default", report=report)
    t_torch_e2e, t_ours_e2e = math.inf, math.inf
    with NetworkxTimer() as nx_timer:
        for _ in range(2):
            t_torch_e2e = min(t_torch_e2e, partition_seconds(min_cut_rematerialization_partition))
            t_ours_e2e = min(t_ours_e2e, partition_seconds(ours))
    graph, t_nx, nx_value = min(nx_timer.calls, key=lambda c: c[1])

    # The max-flow alone, on PyTorch's own network.
    n, edges, source, sink = _edges_of(graph)
    t_cpp, cut = _best_of(lambda: _core.solve_min_cut(n, edges, source, sink), repeat)
    assert cut.value == nx_value, (cut.value, nx_value)

    # PyTorch's whole solve_min_cut (heuristics + networkx) vs autosp's whole solve_remat.
    prepared = fresh()
    prepared.graph.eliminate_dead_code()
    prepared.recompile()
    prepared.graph = partitioners.fx_graph_cse(prepared.graph)
    partitioners.force_save_collectives(prepared)
    node_info = partitioners.classify_nodes(
        prepared, kwargs.get("static_lifetime_input_indices") or [], kwargs["num_fwd_outputs"]
    )
    for node in reversed(prepared.graph.nodes):
        if node.op == "output":
            node.dist_from_bw = int(1e9)
        elif not node_info.is_required_fw(node):
            node.dist_from_bw = 0
        else:
            node.dist_from_bw = int(1e9)
            for user in node.users:
                node.dist_from_bw = min(node.dist_from_bw, user.dist_from_bw + 1)
    from torch._functorch import config as fconfig

    options = partitioners.MinCutOptions(
        ban_if_used_far_apart=fconfig.ban_recompute_used_far_apart,
        ban_if_long_fusible_chains=fconfig.ban_recompute_long_fusible_chains,
        ban_if_materialized_backward=fconfig.ban_recompute_materialized_backward,
        ban_if_not_in_allowlist=fconfig.ban_recompute_not_in_allowlist,
        ban_if_reduction=fconfig.ban_recompute_reductions,
    )
    t_torch_solve, _ = _best_of(
        lambda: partitioners.solve_min_cut(prepared.graph, node_info, options), repeat
    )
    nodes, facts = remat.gather_facts(prepared.graph, node_info)
    t_facts, _ = _best_of(lambda: remat.gather_facts(prepared.graph, node_info), repeat)
    core_options = remat._core_options("default", remat.DEFAULT_RECOMPUTE_FLOPS_RATIO)
    t_core, solution = _best_of(lambda: _core.solve_remat(facts, core_options), repeat)

    print(f"== 1. solver time: {num_layers}-layer Llama joint graph at S={seq}: "
          f"{num_nodes} FX nodes; flow network {n} vertices, {len(edges)} edges ==")
    print(f"max-flow on PyTorch's network   networkx {t_nx * 1e3:9.2f} ms   autosp C++ "
          f"{t_cpp * 1e3:7.2f} ms   speedup {t_nx / t_cpp:7.1f}x   (cut value {cut.value} both)")
    print(f"whole min-cut solve (heuristics  torch    {t_torch_solve * 1e3:9.2f} ms   autosp C++ "
          f"{t_core * 1e3:7.2f} ms   speedup {t_torch_solve / t_core:7.1f}x   "
          f"(autosp runs {solution.solves} max-flows: policy + 'none' baseline)")
    print(f"  + network + max-flow)          autosp fact gathering in Python: "
          f"{t_facts * 1e3:.2f} ms")
    print(f"end-to-end partition function   torch    {t_torch_e2e * 1e3:9.2f} ms   autosp     "
          f"{t_ours_e2e * 1e3:7.2f} ms   speedup {t_torch_e2e / t_ours_e2e:7.1f}x   "
          f"(ratio autosp/torch {t_ours_e2e / t_torch_e2e:.3f}; policy 'default', best of "
          f"{2 * repeat}, alternated)")
    print()


def bench_regions_partition(num_layers: int, seq: int, repeat: int) -> None:
    """The partition work of a whole compile of the model, not of one graph: flat (one joint
    graph of every layer) against ``regions`` (autosp.outline on Dynamo's graph: the decoder
    layer's joint graph is partitioned once, then the calling graph's), each with PyTorch's
    and autosp's partition function, in one run, best of ``repeat`` compiles each."""
    from torch._dynamo import config as dynamo_config
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    from autosp.outline import outline_layers

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172,
                      num_layers=num_layers, num_heads=4, num_kv_heads=4)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))

    def compile_once(regions: bool, partition_fn: Callable) -> tuple[float, list[int]]:
        seconds, sizes = [], []

        def timed(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
            sizes.append(len(joint.graph.nodes))
            with _use_lazy_graph_module(dynamo_config.use_lazy_graph_module):
                start = time.perf_counter()
                out = partition_fn(joint, joint_inputs, **kwargs)
                seconds.append(time.perf_counter() - start)
            return out

        aot = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=timed)

        def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
            if regions:
                outline_layers(gm)
            return aot(gm, example_inputs)

        torch._dynamo.reset()
        torch.compile(model, backend=backend, fullgraph=True)(ids, ids).backward()
        return sum(seconds), sizes

    ours = remat.make_partition_fn("default")
    rows = {}
    for _ in range(repeat):  # alternated, so that load from other processes hits all four
        for regions in (False, True):
            for name, fn in (("torch", min_cut_rematerialization_partition), ("autosp", ours)):
                t, sizes = compile_once(regions, fn)
                best = rows.get((regions, name), (math.inf, sizes))[0]
                rows[(regions, name)] = (min(best, t), sizes)
    print(f"== 1b. partition work of a whole compile: {num_layers}-layer Llama, S={seq}, best of "
          f"{repeat} compiles ==")
    for (regions, name), (t, sizes) in rows.items():
        print(f"{'regions' if regions else 'flat':<8} {name:<7} {t * 1e3:9.2f} ms   joint graphs "
              f"partitioned: {len(sizes)} ({' + '.join(map(str, sizes))} nodes)")
    flat_torch = rows[(False, "torch")][0]
    for regions, name in ((False, "autosp"), (True, "torch"), (True, "autosp")):
        print(f"PyTorch's flat / {'regions' if regions else 'flat'} {name}: "
              f"{flat_torch / rows[(regions, name)][0]:.1f}x")
    print()


# ------------------------------------------------------------------------------------------
# 2. Saved bytes and step time


class SavedOutputs:
    """Wraps a partition function; records the bytes of the values its forward graph returns
    for the backward (non-placeholder saved outputs, PyTorch's _size_of at real sizes)."""

    def __init__(self, partition_fn: Callable) -> None:
        self.partition_fn = partition_fn
        self.saved_bytes: int | None = None
        self.seconds: float | None = None

    def __call__(self, joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        kwargs.pop("compiler", None)
        start = time.perf_counter()
        fw, bw = self.partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        self.seconds = time.perf_counter() - start
        outputs = fw.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:]
        self.saved_bytes = sum(
            _size_of(o)
            for o in outputs
            if isinstance(o, fx.Node) and o.op != "placeholder" and isinstance(o.meta.get("val"), torch.Tensor)
        )
        return fw, bw


def _compile(model, saved: SavedOutputs, backend: str):
    if backend == "aot_eager":
        be = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=saved)
    else:
        from torch._functorch import config as fconfig
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        def be(gm, example_inputs):
            # Caches off: the wrapped partitioner must really run to measure.
            hook = remat.AutospRematPartitioner("default", 0.0, partition_fn=saved)
            with (
                inductor_config.patch(
                    custom_partitioner_fn=hook, fx_graph_cache=False, fx_graph_remote_cache=False
                ),
                fconfig.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False),
            ):
                return compile_fx(gm, example_inputs)

    return torch.compile(model, backend=be, fullgraph=True)


def bench_memory(seqs: list[int], backend: str, steps: int, cfg: LlamaConfig) -> None:
    print(f"== 2. saved-for-backward bytes and step time: LlamaForCausalLM hidden={cfg.hidden_size} "
          f"heads={cfg.num_heads} ffn={cfg.intermediate_size} layers={cfg.num_layers} "
          f"vocab={cfg.vocab_size}, batch 1, fp32, backend {backend}, "
          f"{torch.get_num_threads()} threads, median of {steps} interleaved steps ==")
    print(f"{'S':>6} {'torch saved MiB':>16} {'autosp MiB':>11} {'bytes ratio':>12} "
          f"{'torch step s':>13} {'autosp step s':>14} {'time ratio':>11} "
          f"{'compile+2 steps s (t/a)':>24}")
    for seq in seqs:
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
        runs = {}
        for name, partition_fn in (
            ("torch", min_cut_rematerialization_partition),
            ("autosp", remat.make_partition_fn("sequence-aware")),
        ):
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
            saved = SavedOutputs(partition_fn)
            torch._dynamo.reset()
            compiled = _compile(model, saved, backend)
            start = time.perf_counter()
            compiled(ids, ids).backward()  # compiles, then one warm-up step
            compiled(ids, ids).backward()
            runs[name] = (model, compiled, saved, time.perf_counter() - start)
        # Alternate the timed steps so that load from other processes hits both alike.
        times: dict[str, list[float]] = {"torch": [], "autosp": []}
        for _ in range(steps):
            for name, (model, compiled, _, _) in runs.items():
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                compiled(ids, ids).backward()
                times[name].append(time.perf_counter() - start)
        tb, ab = runs["torch"][2].saved_bytes, runs["autosp"][2].saved_bytes
        tt, at = statistics.median(times["torch"]), statistics.median(times["autosp"])
        tc, ac = runs["torch"][3], runs["autosp"][3]
        mib = 1 << 20
        print(f"{seq:>6} {tb / mib:>16.2f} {ab / mib:>11.2f} {tb / ab:>11.2f}x "
              f"{tt:>13.3f} {at:>14.3f} {at / tt:>10.3f}x {tc:>7.1f}/{ac:<7.1f}", flush=True)
        del runs
    print("bytes ratio = torch / autosp (higher is better); time ratio = autosp / torch "
          "(lower is better)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "solver", "regions", "memory"), default="all")
    parser.add_argument("--solver-layers", type=int, default=16)
    parser.add_argument("--solver-seq", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--backend", choices=BACKENDS, default="inductor")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=172)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args()
    if args.part in ("all", "solver"):
        bench_solver(args.solver_layers, args.solver_seq, args.repeat)
    if args.part in ("all", "regions"):
        bench_regions_partition(args.solver_layers, args.solver_seq, min(args.repeat, 3))
    if args.part in ("all", "memory"):
        cfg = LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
            num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.heads,
        )
        bench_memory(args.seqs, args.backend, args.steps, cfg)


if __name__ == "__main__":
    main()
