// Placement propagation (plan/propagate.h), the plan's first stage, run alone and printed: for
// each model, every input node with the placements of the operands it reads (and the SP steps
// that make each so) and of its results, as print_placements writes them. A change in how any
// op is placed shows up here as a line diff. Each model is also planned whole, and its plan
// must carry the same decisions out (emission checks every value it makes against them).
//
// Golden files live in tests/cpp/golden/placements_*.txt; after an intended change, rerun with
// AUTOSP_UPDATE_GOLDEN=1 and review the diff.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "golden.h"
#include "graph_builder.h"
#include "llama_graph.h"
#include "plan/plan_builder.h"
#include "plan/propagate.h"
#include "plan/ulysses.h"
#include "plan_error.h"

namespace autosp {
namespace {

using testutil::C;
using testutil::contains;
using testutil::GraphBuilder;
using testutil::S;
using Ints = std::vector<int64_t>;

std::string placements(const Graph& g, const SpConfig& cfg) {
  const std::string alone = print_placements(g, propagate_placements(g, cfg));
  EXPECT_EQ(alone, print_placements(g, plan_ulysses(g, cfg)));
  return alone;
}

TEST(Placements, LlamaMhaP2) {
  EXPECT_GOLDEN("placements_llama_mha_p2", placements(testutil::llama({}), {.sp_size = 2}));
}

TEST(Placements, LlamaOneKvHeadP4) {
  EXPECT_GOLDEN("placements_llama_gqa_kv1_p4",
                placements(testutil::llama({.kv_heads = 1}), {.sp_size = 4}));
}

// nanoGPT: learned positions from arange, LayerNorm, tied head, and the loss on
// logits.view(-1, V) with ignore_index=-1.
TEST(Placements, NanoGptP2) {
  const int64_t B = 2, V = 64, D = 16;
  GraphBuilder b;
  const int idx = b.input("idx", {C(B), S()}, "i64", "data");
  const int targets = b.input("targets", {C(B), S()}, "i64", "data");
  const int wte = b.param("transformer.wte.weight", {C(V), C(D)});
  const int wpe = b.param("transformer.wpe.weight", {C(256), C(D)});
  const int lnw = b.param("transformer.ln_f.weight", {C(D)});
  const int pos =
      b.at(10, "pos = torch.arange(0, t, dtype=torch.long)").op("arange", {}, {S()}, {}, "i64");
  const int tok = b.at(11, "tok_emb = self.transformer.wte(idx)")
                      .op("embedding", {idx, wte}, {C(B), S(), C(D)});
  const int pe =
      b.at(12, "pos_emb = self.transformer.wpe(pos)").op("embedding", {pos, wpe}, {S(), C(D)});
  const int x = b.at(13, "x = self.transformer.drop(tok_emb + pos_emb)")
                    .op("add", {tok, pe}, {C(B), S(), C(D)});
  const int h = b.at(14, "x = self.transformer.ln_f(x)")
                    .op("layer_norm", {x, lnw}, {C(B), S(), C(D)}, {{"norm_dims", int64_t{1}}});
  const int logits = b.at(15, "logits = self.lm_head(x)").op("linear", {h, wte}, {C(B), S(), C(V)});
  const int flat = b.at(16, "loss = F.cross_entropy(logits.view(-1, logits.size(-1)), ...)")
                       .op("reshape", {logits}, {S(B), C(V)});
  const int t = b.at(16).op("reshape", {targets}, {S(B)});
  const int loss = b.at(16).op("cross_entropy", {flat, t}, {},
                               {{"reduction", std::string("mean")}, {"ignore_index", int64_t{-1}}});
  b.at(17).output({loss});
  EXPECT_GOLDEN("placements_nanogpt_p2", placements(b.graph, {.sp_size = 2}));
}

// Attention written by hand (nanoGPT without flash attention): q @ k^T exchanges q and k to
// groups of heads, the scores [B, H, S, S] are split by heads through the scale, the mask and
// softmax, and probs @ v exchanges v and sends the result back to the sequence layout.
TEST(Placements, AttentionByHandP2) {
  const Dim B = C(2), H = C(4), D = C(8);
  GraphBuilder b;
  const int x = b.input("x", {B, S(), C(32)}, "f32", "data");
  const int wq = b.param("q.weight", {C(32), C(32)});
  const int mask = b.buffer("bias", {C(1), C(1), C(64), C(64)});
  auto heads = [&](int w, int line) {
    const int t = b.at(line).op("linear", {x, w}, {B, S(), C(32)});
    const int r = b.at(line).op("reshape", {t}, {B, S(), H, D});
    return b.at(line).op("permute", {r}, {B, H, S(), D}, {{"perm", Ints{0, 2, 1, 3}}});
  };
  const int q = heads(wq, 10), k = heads(wq, 11), v = heads(wq, 12);
  const int kt = b.at(13, "att = (q @ k.transpose(-2, -1)) * scale")
                     .op("permute", {k}, {B, H, D, S()}, {{"perm", Ints{0, 1, 3, 2}}});
  const int att = b.at(13).op("matmul", {q, kt}, {B, H, S(), S()});
  const int scaled = b.at(13).op("mul", {att}, {B, H, S(), S()}, {{"other", 0.35}});
  const int m = b.at(14, "att = att.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)")
                    .op("index", {mask}, {C(1), C(1), S(), S()},
                        {{"dim_map", Ints{0, 1, 2, 3}}, {"sliced_dims", Ints{2, 3}}});
  const int is0 = b.at(14).op("eq", {m}, {C(1), C(1), S(), S()}, {{"pointwise", true}}, "bool");
  const int filled = b.at(14).op("masked_fill", {scaled, is0}, {B, H, S(), S()});
  const int p = b.at(15, "att = F.softmax(att, dim=-1)")
                    .op("softmax", {filled}, {B, H, S(), S()}, {{"dim", int64_t{3}}});
  const int y = b.at(16, "y = att @ v").op("matmul", {p, v}, {B, H, S(), D});
  const int yt = b.at(17).op("permute", {y}, {B, S(), H, D}, {{"perm", Ints{0, 2, 1, 3}}});
  const int y2 = b.at(17).op("reshape", {yt}, {B, S(), C(32)});
  const int loss = b.at(18).op("sum", {y2}, {});
  b.at(19).output({loss});
  const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 2});
  EXPECT_TRUE(plan.gathered.empty());
  EXPECT_EQ(plan.collective_counts().at("sp.all_to_all"), 4);  // q, k, v, and y back
  EXPECT_GOLDEN("placements_attention_by_hand_p2", print_placements(b.graph, plan));
}

// One graph with each way the plan expands an op: a replicated chain hoisted onto the local
// chunk, a scan and a reduction across ranks, a mean over the sequence (partial), a partial
// value scaled and reduced at the output, and an op without a rule run on the gathered
// sequence.
TEST(Placements, ExpansionsP2) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int w = b.param("mix.weight", {C(8)});
  const int pos = b.at(2, "pos = torch.arange(S)").op("arange", {}, {S()}, {}, "i64");
  const int posf = b.at(3, "posf = pos.float()").op("to", {pos}, {S()});
  const int col =
      b.at(4, "col = posf[:, None]")
          .op("index", {posf}, {S(), C(1)}, {{"dim_map", Ints{0}}, {"sliced_dims", Ints{}}});
  const int h = b.at(5, "h = x * self.mix + col").op("mul", {x, w}, {C(2), S(), C(8)});
  const int hc = b.at(5).op("add", {h, col}, {C(2), S(), C(8)});
  const int c =
      b.at(6, "c = h.cumsum(1)").op("cumsum", {hc}, {C(2), S(), C(8)}, {{"dim", int64_t{1}}});
  const int f = b.at(7, "f = my_scan(c)").op("my_scan", {c}, {C(2), S(), C(8)});
  const int y = b.at(8, "y = c + f").op("add", {c, f}, {C(2), S(), C(8)});
  const int m = b.at(9, "m = y.amax(1)").op("amax", {y}, {C(2), C(8)}, {{"dims", Ints{1}}});
  const int mean = b.at(10, "mu = y.mean(1)")
                       .op("mean", {y}, {C(2), C(8)}, {{"dims", Ints{1}}, {"keepdim", false}});
  const int s = b.at(11, "s = mu.sum() * 0.5").op("sum", {mean}, {});
  const int half = b.at(11).op("mul", {s}, {}, {{"other", 0.5}});
  const int ms = b.at(12, "loss = half + m.sum()").op("sum", {m}, {});
  const int loss = b.at(12).op("add", {half, ms}, {});
  b.at(13).output({loss});
  const SpConfig cfg{.sp_size = 2, .gather_unsupported = true};
  const SpPlan plan = plan_ulysses(b.graph, cfg);
  EXPECT_EQ(plan.gathered.size(), 1u);
  EXPECT_TRUE(contains(plan.gathered.at(0), "my_scan"));
  EXPECT_EQ(propagate_placements(b.graph, cfg).gathered, plan.gathered);
  EXPECT_GOLDEN("placements_expansions_p2", placements(b.graph, cfg));
}

// The stage alone refuses what the plan refuses, with the same error: an op without a rule on
// a sharded value (the gather fallback off).
TEST(Placements, StageAloneRefusesAnOpWithoutARule) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int f = b.at(7, "f = my_scan(x)").op("my_scan", {x}, {C(2), S(), C(8)});
  b.at(8).output({f});
  const SpConfig cfg{.sp_size = 2};
  const std::string alone = plan_error([&] { propagate_placements(b.graph, cfg); });
  EXPECT_TRUE(contains(alone, "no rule for 'my_scan'")) << alone;
  EXPECT_EQ(alone, plan_error([&] { plan_ulysses(b.graph, cfg); }));
}

// Emission carries the decisions out and checks them: a plan value whose placement differs
// from the decided one is an internal error, not a silently different plan.
TEST(Placements, EmissionChecksEveryValueAgainstTheDecision) {
  const Graph g = testutil::llama({});
  const SpConfig cfg{.sp_size = 2};
  Propagation prop = propagate_placements(g, cfg);
  int sharded = -1;  // the first value decided S(1): pretend it was decided S(2)
  for (size_t v = 0; v < prop.values.size() && sharded < 0; ++v)
    if (prop.values[v] == Placement::shard(1)) sharded = static_cast<int>(v);
  ASSERT_GE(sharded, 0);
  EXPECT_NO_THROW(plan_detail::PlanBuilder(g, cfg, prop).run());
  prop.values[static_cast<size_t>(sharded)] = Placement::shard(2);
  try {
    plan_detail::PlanBuilder(g, cfg, prop).run();
    FAIL() << "no error for a value placed unlike its decision";
  } catch (const std::logic_error& e) {
    EXPECT_TRUE(contains(e.what(), "internal error")) << e.what();
    EXPECT_TRUE(contains(e.what(), "propagation decided S(2)")) << e.what();
  }
}

}  // namespace
}  // namespace autosp
