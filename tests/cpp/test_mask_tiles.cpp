// Attention masks computed from O(S) operands are replayed per tile of query rows, never
// materialised at [S, S] (plan/mask_tiles.cpp); masks that are not such a chain stay whole.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "graph_builder.h"
#include "plan/ulysses.h"

namespace autosp {
namespace {

using testutil::C;
using testutil::contains;
using testutil::GraphBuilder;
using testutil::S;
using Ints = std::vector<int64_t>;

const Dim B = C(2), H = C(4), D = C(8);

// q, k, v sharded along the sequence ([B, H, S, D] inputs), attention with `mask`.
struct Attn {
  GraphBuilder b;
  int q = b.input("q", {B, H, S(), D}, "f32", "data");
  int k = b.input("k", {B, H, S(), D}, "f32", "data");
  int v = b.input("v", {B, H, S(), D}, "f32", "data");

  SpPlan plan_with(int mask) {
    const int o = b.at(20).op("sdpa", {q, k, v, mask}, {B, H, S(), D});
    b.at(21).output({o});
    return plan_ulysses(b.graph, {.sp_size = 2});
  }
};

const Node& sdpa_of(const SpPlan& plan) {
  for (const Node& n : plan.graph.nodes)
    if (n.op == "sdpa") return n;
  throw std::runtime_error("no sdpa in the plan");
}

// Values of the plan with two sequence dims: what tiling is there to avoid.
std::vector<std::string> square_values(const SpPlan& plan) {
  std::vector<std::string> found;
  for (const Node& n : plan.graph.nodes)
    for (int o : n.outputs) {
      const Value& v = plan.graph.value(o);
      int seq = 0;
      for (const Dim& d : v.shape) seq += d.has_seq() ? 1 : 0;
      if (seq >= 2) found.push_back(n.op + " %" + std::to_string(o));
    }
  return found;
}

// transformers' sdpa_mask: kv_idx <= q_idx from two aranges, and a [B, S] padding mask read
// at kv_idx: the mask's rows come from the q positions, so its chain is tiled and its leaves
// are the aranges and the padding mask, each O(S).
TEST(MaskTiles, CausalAndPaddingFromPositionsIsTiled) {
  Attn a;
  GraphBuilder& b = a.b;
  const int pad = b.input("attention_mask", {B, S()}, "bool", "data");
  const int ar = b.at(3, "arange = torch.arange(S)").op("arange", {}, {S()}, {}, "i64");
  const int qi = b.at(4).op("index", {ar}, {C(1), C(1), S(), C(1)},
                            {{"dim_map", Ints{2}}, {"sliced_dims", Ints{}}});
  const int ki = b.at(5).op("index", {ar}, {C(1), C(1), C(1), S()},
                            {{"dim_map", Ints{3}}, {"sliced_dims", Ints{}}});
  const int le = b.at(6).op("le", {ki, qi}, {C(1), C(1), S(), S()}, {{"pointwise", true}}, "bool");
  const int pk = b.at(7).op("index", {pad}, {B, C(1), C(1), S()},
                            {{"dim_map", Ints{0, 3}}, {"sliced_dims", Ints{}}});
  const int mask = b.at(8).op("and", {le, pk}, {B, C(1), S(), S()}, {{"pointwise", true}}, "bool");
  const SpPlan plan = a.plan_with(mask);
  const Node& sdpa = sdpa_of(plan);
  ASSERT_TRUE(sdpa.has_attr("mask_tiles")) << plan.str();
  // q, k, v (after the exchange), then the leaves in the order the chain reads them: kv_idx
  // ([1, 1, 1, S], no query dim: whole), the arange sliced by rows (for q_idx), the padding
  // mask at kv_idx ([B, 1, 1, S]: whole).
  ASSERT_EQ(sdpa.inputs.size(), 6u) << plan.str();
  EXPECT_EQ(sdpa.ints_attr("mask_leaf_dims"), (Ints{-1, 0, -1}));
  EXPECT_EQ(plan.graph.value(sdpa.inputs[4]).shape, (std::vector<Dim>{S()}));
  // The chain: the q index, le, and; each entry [origin, how, qdim, n, (vid, dim)*n, out].
  const Ints chain = sdpa.ints_attr("mask_tiles");
  std::vector<int64_t> origins;
  for (size_t i = 0; i < chain.size(); i += 5 + 2 * static_cast<size_t>(chain[i + 3]))
    origins.push_back(chain[i]);
  EXPECT_EQ(origins.size(), 3u);
  EXPECT_EQ(square_values(plan), std::vector<std::string>{}) << plan.str();
}

// A hand-written causal mask, torch.tril(torch.ones(S, S)): ones is replayed at the tile's
// size, tril with its diagonal shifted by the tile's start. No leaf at all.
TEST(MaskTiles, TrilOfOnesIsReplayedPerTile) {
  Attn a;
  const int ones = a.b.at(3).op("ones", {}, {S(), S()}, {}, "bool");
  const int tril = a.b.at(4).op("tril", {ones}, {S(), S()}, {}, "bool");
  const SpPlan plan = a.plan_with(tril);
  const Node& sdpa = sdpa_of(plan);
  ASSERT_TRUE(sdpa.has_attr("mask_tiles")) << plan.str();
  EXPECT_EQ(sdpa.inputs.size(), 3u);
  const Ints chain = sdpa.ints_attr("mask_tiles");
  // ones: how 2 (factory size), qdim 0, no input; tril: how 3 (rows), qdim 0, one input.
  ASSERT_EQ(chain.size(), 5u + 7u);
  EXPECT_EQ((Ints{chain[1], chain[2], chain[3]}), (Ints{2, 0, 0}));
  EXPECT_EQ((Ints{chain[6], chain[7], chain[8]}), (Ints{3, 0, 1}));
  EXPECT_EQ(square_values(plan), std::vector<std::string>{}) << plan.str();
}

// A reshape that keeps the query dim whole is replayed per tile: view(1, 1, S, S) with the
// tile's length as its size argument (how 6), unsqueeze as written (how 0). A reshape whose
// size arguments are unknown (attribute neither size_args nor size_free), or that merges the
// query dim, leaves the mask whole.
TEST(MaskTiles, ReshapesKeepingTheQueryDimAreReplayed) {
  for (const char* kind : {"size_args", "size_free"}) {
    SCOPED_TRACE(kind);
    Attn a;
    const int ones = a.b.at(3).op("ones", {}, {S(), S()}, {}, "bool");
    const int tril = a.b.at(4).op("tril", {ones}, {S(), S()}, {}, "bool");
    const int m = a.b.at(5).op("reshape", {tril}, {C(1), C(1), S(), S()}, {{kind, true}}, "bool");
    const SpPlan plan = a.plan_with(m);
    const Node& sdpa = sdpa_of(plan);
    ASSERT_TRUE(sdpa.has_attr("mask_tiles")) << plan.str();
    const Ints chain = sdpa.ints_attr("mask_tiles");
    ASSERT_EQ(chain.size(), 5u + 7u + 7u);
    // The reshape: how, its query dim (2), its operand's query dim (0).
    EXPECT_EQ((Ints{chain[13], chain[14], chain[17]}),
              (Ints{std::string(kind) == "size_args" ? 6 : 0, 2, 0}));
    EXPECT_EQ(square_values(plan), std::vector<std::string>{}) << plan.str();
  }
  {  // no attribute: which argument holds the size is unknown
    Attn a;
    const int ones = a.b.op("ones", {}, {S(), S()}, {}, "bool");
    const int m = a.b.op("reshape", {ones}, {C(1), C(1), S(), S()}, {}, "bool");
    EXPECT_FALSE(sdpa_of(a.plan_with(m)).has_attr("mask_tiles"));
  }
  {  // squeeze(0) of [S, S]: a no-op at full length, but not on a tile of one row
    Attn a;
    const int ones = a.b.op("ones", {}, {S(), S()}, {}, "bool");
    const int m = a.b.op("reshape", {ones}, {S(), S()},
                         {{"size_free", true}, {"squeeze_dims", Ints{0}}}, "bool");
    EXPECT_FALSE(sdpa_of(a.plan_with(m)).has_attr("mask_tiles"));
  }
  {  // [S * S] -> [S, S]: the query dim is made by the reshape
    Attn a;
    const int flat = a.b.op("ones", {}, {S(1, 2)}, {}, "bool");
    const int m = a.b.op("reshape", {flat}, {S(), S()}, {{"size_args", true}}, "bool");
    EXPECT_FALSE(sdpa_of(a.plan_with(m)).has_attr("mask_tiles"));
  }
}

// Masks that are not a chain from O(S) operands keep today's plan: the whole mask.
TEST(MaskTiles, OtherMasksStayWhole) {
  {  // passed in as [B, 1, S, S]: already materialised by the caller
    Attn a;
    const int m = a.b.input("mask", {B, C(1), S(), S()}, "bool", "data");
    EXPECT_FALSE(sdpa_of(a.plan_with(m)).has_attr("mask_tiles"));
  }
  {  // an additive bias that needs a gradient (built from a parameter)
    Attn a;
    const int w = a.b.param("bias", {S(), S()});
    const int m = a.b.op("mul", {w, w}, {S(), S()}, {{"pointwise", true}});
    EXPECT_FALSE(sdpa_of(a.plan_with(m)).has_attr("mask_tiles"));
  }
  {  // a per-head mask [1, H, S, S]: sliced by heads as before
    Attn a;
    const int ones = a.b.op("ones", {}, {C(1), H, S(), S()}, {}, "bool");
    const int m = a.b.op("tril", {ones}, {C(1), H, S(), S()}, {}, "bool");
    EXPECT_FALSE(sdpa_of(a.plan_with(m)).has_attr("mask_tiles"));
  }
  {  // m[:, 0] = 0 (setitem) after the chain: the replay would miss the write
    Attn a;
    const int ones = a.b.op("ones", {}, {S(), S()}, {}, "bool");
    const int m = a.b.op("tril", {ones}, {S(), S()}, {}, "bool");
    a.b.op("setitem", {m}, {}, {}, "bool");
    EXPECT_FALSE(sdpa_of(a.plan_with(m)).has_attr("mask_tiles"));
  }
  {  // a graph with an in-place op: replaying the chain later could read a changed tensor
    Attn a;
    const int ones = a.b.op("ones", {}, {S(), S()}, {}, "bool");
    const int m = a.b.op("tril", {ones}, {S(), S()}, {}, "bool");
    const int x = a.b.input("x", {B, S()}, "f32", "data");
    a.b.op("mul", {x, x}, {B, S()}, {{"inplace", true}, {"pointwise", true}});
    EXPECT_FALSE(sdpa_of(a.plan_with(m)).has_attr("mask_tiles"));
  }
}

}  // namespace
}  // namespace autosp
