// The core IR graph of a Llama-like causal LM, as the bridge hands it over from Dynamo (for
// the plan's golden tests).
//
//   const Graph g = testutil::llama({.kv_heads = 1, .layers = 2});
#pragma once

#include <string>
#include <vector>

#include "graph_builder.h"
#include "ir/graph.h"

namespace autosp::testutil {

// A Llama-like causal LM, as the bridge would hand it over from Dynamo: token ids and labels
// at full length, RMSNorm written out, RoPE with rotate_half, SDPA, and labels shifted on the
// full sequence before the loss.
using Ints = std::vector<int64_t>;

struct LlamaSpec {
  int64_t batch = 2;
  int64_t vocab = 128;
  int64_t heads = 4;
  int64_t kv_heads = 4;
  int64_t head_dim = 16;
  int layers = 1;
};

class Llama {
 public:
  explicit Llama(const LlamaSpec& spec) : m_(spec), D_(spec.heads * spec.head_dim) {}

  Graph build() {
    const int64_t B = m_.batch, V = m_.vocab, hd = m_.head_dim, KV = m_.kv_heads * hd;
    const int ids = b_.input("ids", {C(B), S()}, "i64", "data");
    const int labels = b_.input("labels", {C(B), S()}, "i64", "data");
    const int embed = b_.param("embed.weight", {C(V), C(D_)});
    const int cos_cache = b_.buffer("rope.cos", {C(4096), C(hd)});
    const int sin_cache = b_.buffer("rope.sin", {C(4096), C(hd)});
    struct Layer {
      int norm, wq, wk, wv, wo;
    };
    std::vector<Layer> layers;
    for (int l = 0; l < m_.layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      layers.push_back(
          {b_.param(p + "attn_norm.weight", {C(D_)}), b_.param(p + "wq.weight", {C(D_), C(D_)}),
           b_.param(p + "wk.weight", {C(KV), C(D_)}), b_.param(p + "wv.weight", {C(KV), C(D_)}),
           b_.param(p + "wo.weight", {C(D_), C(D_)})});
    }
    const int final_norm = b_.param("norm.weight", {C(D_)});
    const int lm_head = b_.param("lm_head.weight", {C(V), C(D_)});

    int x = b_.at(80, "x = self.embed(ids)").op("embedding", {ids, embed}, act(D_));
    b_.at(81, "T = x.shape[1]").symbol("sym_size", {x}, {{"dim", int64_t{1}}});
    const Attrs first_t = {{"dim_map", Ints{0, 1}}, {"sliced_dims", Ints{0}}};
    cos_ = b_.at(82, "cos = self.cos[:T]").op("index", {cos_cache}, {S(), C(hd)}, first_t);
    sin_ = b_.at(83, "sin = self.sin[:T]").op("index", {sin_cache}, {S(), C(hd)}, first_t);
    for (const Layer& l : layers) {
      const int h = rms_norm(x, l.norm);
      const int o = attention(h, l.wq, l.wk, l.wv, l.wo);
      x = b_.at(86, "x = x + self.attn(self.attn_norm(x))").op("add", {x, o}, act(D_));
    }
    const int h = rms_norm(x, final_norm);
    const int logits = b_.at(88, "logits = self.lm_head(self.norm(x))")
                           .target("torch.nn.functional.linear")
                           .op("linear", {h, lm_head}, act(V));
    const int flat = b_.at(89, "loss = F.cross_entropy(logits.view(-1, V), shifted.view(-1))")
                         .op("reshape", {logits}, {S(B), C(V)});
    const int padded = b_.at(90, "padded = F.pad(labels, (0, 1), value=-100)")
                           .op("pad", {labels}, {C(B), Dim::expr("s0 + 1")},
                               {{"pad", Ints{0, 1}}, {"value", int64_t{-100}}});
    const int shifted = b_.at(91, "shifted = padded[:, 1:]")
                            .target("getitem")
                            .op("index", {padded}, {C(B), S()},
                                {{"dim_map", Ints{0, 1}}, {"sliced_dims", Ints{1}}});
    const int targets = b_.at(89).op("reshape", {shifted}, {S(B)});
    const int loss = b_.at(89)
                         .target("torch.nn.functional.cross_entropy")
                         .op("cross_entropy", {flat, targets}, {},
                             {{"reduction", std::string("mean")}, {"ignore_index", int64_t{-100}}});
    b_.at(92, "return loss").output({loss});
    return b_.graph;
  }

 private:
  LlamaSpec m_;
  int64_t D_;
  GraphBuilder b_;
  int cos_ = -1, sin_ = -1;

  std::vector<Dim> act(int64_t width) const { return {C(m_.batch), S(), C(width)}; }
  std::vector<Dim> heads(int64_t h, int64_t d) const { return {C(m_.batch), C(h), S(), C(d)}; }

  int rms_norm(int x, int weight) {
    const int64_t B = m_.batch;
    const int sq = b_.at(20, "var = x.pow(2).mean(-1, keepdim=True)")
                       .op("pow", {x}, act(D_), {{"exponent", 2.0}, {"pointwise", true}});
    const int var =
        b_.at(20).op("mean", {sq}, {C(B), S(), C(1)}, {{"dims", Ints{2}}, {"keepdim", true}});
    const int eps = b_.at(21, "x = x * torch.rsqrt(var + self.eps)")
                        .op("add", {var}, {C(B), S(), C(1)}, {{"other", 1e-6}});
    const int r = b_.at(21).op("rsqrt", {eps}, {C(B), S(), C(1)}, {{"pointwise", true}});
    const int n = b_.at(21).op("mul", {x, r}, act(D_));
    return b_.at(22, "return self.weight * x").op("mul", {weight, n}, act(D_));
  }

  // rotate_half RoPE on [B, H, S, hd].
  int rope(int t, int64_t h) {
    const int64_t half = m_.head_dim / 2;
    const int t1 = b_.at(30, "x1, x2 = x[..., :d // 2], x[..., d // 2:]")
                       .op("index", {t}, heads(h, half),
                           {{"dim_map", Ints{0, 1, 2, 3}}, {"sliced_dims", Ints{3}}});
    const int t2 = b_.at(30).op("index", {t}, heads(h, half),
                                {{"dim_map", Ints{0, 1, 2, 3}}, {"sliced_dims", Ints{3}}});
    const int n2 = b_.at(31, "rot = torch.cat((-x2, x1), dim=-1)").op("neg", {t2}, heads(h, half));
    const int rot = b_.at(31).op("cat", {n2, t1}, heads(h, m_.head_dim), {{"dim", int64_t{3}}});
    const int tc =
        b_.at(32, "return x * cos + rot * sin").op("mul", {t, cos_}, heads(h, m_.head_dim));
    const int ts = b_.at(32).op("mul", {rot, sin_}, heads(h, m_.head_dim));
    return b_.at(32).op("add", {tc, ts}, heads(h, m_.head_dim));
  }

  // [B, S, H*hd] -> [B, H, S, hd]
  int split_heads(int t, int64_t h, int line, const std::string& code) {
    const int v = b_.at(line, code).op("reshape", {t}, {C(m_.batch), S(), C(h), C(m_.head_dim)});
    return b_.at(line).op("permute", {v}, heads(h, m_.head_dim), {{"perm", Ints{0, 2, 1, 3}}});
  }

  int attention(int h, int wq, int wk, int wv, int wo) {
    const int64_t H = m_.heads, KV = m_.kv_heads, hd = m_.head_dim;
    const int q = b_.at(40, "q = self.wq(x)").op("linear", {h, wq}, act(D_));
    const int k = b_.at(41, "k = self.wk(x)").op("linear", {h, wk}, act(KV * hd));
    const int v = b_.at(42, "v = self.wv(x)").op("linear", {h, wv}, act(KV * hd));
    const int q4 = split_heads(q, H, 43, "q = q.view(B, T, H, hd).transpose(1, 2)");
    const int k4 = split_heads(k, KV, 44, "k = k.view(B, T, KV, hd).transpose(1, 2)");
    const int v4 = split_heads(v, KV, 45, "v = v.view(B, T, KV, hd).transpose(1, 2)");
    const int qr = rope(q4, H);
    const int kr = rope(k4, KV);
    const int o =
        b_.at(46, "o = F.scaled_dot_product_attention(q, k, v, is_causal=True)")
            .target("torch.nn.functional.scaled_dot_product_attention")
            .op("sdpa", {qr, kr, v4}, heads(H, hd), {{"is_causal", true}, {"enable_gqa", KV != H}});
    const int ot =
        b_.at(47, "o = o.transpose(1, 2).reshape(B, T, D)")
            .op("permute", {o}, {C(m_.batch), S(), C(H), C(hd)}, {{"perm", Ints{0, 2, 1, 3}}});
    const int o2 = b_.at(47).op("reshape", {ot}, act(D_));
    return b_.at(48, "return self.wo(o)").op("linear", {o2, wo}, act(D_));
  }
};

inline Graph llama(LlamaSpec spec) { return Llama(spec).build(); }

}  // namespace autosp::testutil
