"""The evidence in docs/coverage.md: for a few models, the ops at the Torch level (the graph
Dynamo captures, which autosp's SP pass reads) against pre-dispatch ATen (torch.export's
training IR): distinct ops, how many have a core rule or are pointwise, and what pre-dispatch
keeps. One process, no ranks: ``cd tests && python op_levels.py``."""
import collections
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import styles
from autosp import _core
from autosp.canon import canonicalize
from autosp.ops import is_pointwise
from transformers import AutoConfig, AutoModelForCausalLM

RULES = set(_core.registered_ops())

def hf(kind, **kw):
    cfg = AutoConfig.for_model(kind, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", **kw)
    m = AutoModelForCausalLM.from_config(cfg)
    class W(torch.nn.Module):
        def __init__(s): super().__init__(); s.m = m
        def forward(s, ids, labels, am): return s.m(input_ids=ids, labels=labels, attention_mask=am, use_cache=False).loss
    ids = torch.randint(0, 128, (2, 32)); am = torch.ones(2, 32, dtype=torch.long); am[1, 25:] = 0
    return W(), (ids, ids.clone(), am)

def style(name):
    st = styles.ALL[name]; torch.manual_seed(0)
    return st.build(), st.inputs(1, 32)

MODELS = {"hf-llama+padding": lambda: hf("llama"), "hf-mixtral": lambda: hf("mixtral", num_local_experts=4, num_experts_per_tok=2),
          "nanogpt": lambda: style("nanogpt"), "llama-scratch": lambda: style("llama-scratch-complex-rope"),
          "moe-index-add": lambda: style("moe-index-add-aux"), "mamba2-ssd": lambda: style("mamba2-chunked-ssd-hybrid")}

def main() -> None:
    for name, mk in MODELS.items():
        model, args = mk()
        torch_ops = collections.Counter(); ruled = set(); canon_names = set()
        def be(gm, ex):
            for n in gm.graph.nodes:
                if n.op in ("call_function", "call_method"):
                    t = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                    torch_ops[t] += 1
                    try:
                        c = canonicalize(n)[0]
                    except Exception:  # a row that refuses its arguments
                        c = "?"
                    canon_names.add(c)
                    if c in RULES or is_pointwise(c): ruled.add(c)
            return gm
        torch._dynamo.reset()
        torch.compile(model, backend=be, dynamic=True, fullgraph=True)(*args)
        try:
            ep = torch.export.export(model, args, strict=False)
            aten = collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
            with_trace = sum(1 for n in ep.graph.nodes if n.op == "call_function" and n.meta.get("stack_trace"))
            ncall = sum(aten.values())
            sdpa = any("scaled_dot_product" in k for k in aten)
            hops = sorted(k for k in aten if "aten." not in k)
            aten_s = f"{len(aten)} distinct ATen ops ({ncall} nodes, {with_trace} with a source line), sdpa kept: {sdpa}, non-ATen: {hops[:6]}"
        except Exception as e:
            aten_s = f"export failed: {type(e).__name__}: {str(e)[:150]}"
        print(f"{name}: Torch level {len(torch_ops)} distinct targets ({sum(torch_ops.values())} nodes) -> {len(canon_names)} canonical ops, {len(ruled)} with a rule or pointwise, without: {sorted(canon_names - ruled)[:12]}")
        print(f"   pre-dispatch ATen: {aten_s}")


if __name__ == "__main__":
    main()
