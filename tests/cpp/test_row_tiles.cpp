// The tiled MLP's decision (SpConfig::tile_mlp, plan/tiled_rows.cpp): which row-wise blocks
// become one tiled_rows node, with what operands, and which do not.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "graph_builder.h"
#include "plan/memory.h"
#include "plan/ulysses.h"

namespace autosp {
namespace {

using testutil::C;
using testutil::contains;
using testutil::GraphBuilder;
using testutil::S;
using Ints = std::vector<int64_t>;

constexpr int64_t B = 2, V = 64, D = 16, F = 40;
const Attrs kPointwise{{"pointwise", true}};  // as the bridge marks torch.Tag.pointwise ops

// h = embedding(ids); y = h + down(act(gate(h)) * up(h)); returns y (and `extra`).
enum class Variant { SwiGlu, ReturnGate, DropoutInside, OneLinear, GeluMlp, AutocastDown };

struct Built {
  Graph graph;
  std::vector<int> block;  // the block's node ids, in order
  int h = -1, gate = -1;
};

Built mlp_model(Variant variant) {
  GraphBuilder b;
  const int ids = b.input("ids", {C(B), S()}, "i64", "data");
  const int wte = b.param("wte.weight", {C(V), C(D)});
  const int wg = b.param("layers.0.mlp.gate.weight", {C(F), C(D)});
  const int wu = b.param("layers.0.mlp.up.weight", {C(F), C(D)});
  const int bu = b.param("layers.0.mlp.up.bias", {C(F)});
  const int wd = b.param("layers.0.mlp.down.weight", {C(D), C(F)});
  Built out;
  const int h = b.at(10).op("embedding", {ids, wte}, {C(B), S(), C(D)});
  out.h = h;
  auto node = [&](int v) { return b.graph.producer(v); };
  int act = -1;
  std::vector<int> outs;
  if (variant == Variant::OneLinear) {
    act = h;
  } else if (variant == Variant::GeluMlp || variant == Variant::DropoutInside) {
    const int u = b.at(11).op("linear", {h, wu, bu}, {C(B), S(), C(F)});
    const int g = b.at(12).op("gelu", {u}, {C(B), S(), C(F)}, kPointwise);
    out.block = {node(u), node(g)};
    act = g;
    if (variant == Variant::DropoutInside) {
      act = b.at(13).op("dropout", {g}, {C(B), S(), C(F)}, {{"p", 0.1}});
      out.block.push_back(node(act));
    }
  } else {
    const int g = b.at(11).op("linear", {h, wg, -1}, {C(B), S(), C(F)});
    out.gate = g;
    const int u = b.at(12).op("linear", {h, wu, bu}, {C(B), S(), C(F)});
    const int s = b.at(13).op("silu", {g}, {C(B), S(), C(F)}, kPointwise);
    const int m = b.at(14).op("mul", {s, u}, {C(B), S(), C(F)});
    out.block = {node(g), node(u), node(s), node(m)};
    act = m;
    if (variant == Variant::ReturnGate) outs.push_back(g);
  }
  if (variant == Variant::AutocastDown) b.symbol("nontensor", {}, {{"autocast", int64_t{1}}});
  const int y = b.at(20).op("linear", {act, wd, -1}, {C(B), S(), C(D)});
  if (variant == Variant::AutocastDown) b.symbol("nontensor", {}, {{"autocast", int64_t{-1}}});
  out.block.push_back(node(y));
  const int r = b.at(21).op("add", {h, y}, {C(B), S(), C(D)});
  outs.insert(outs.begin(), r);
  b.at(22).output(outs);
  out.graph = b.graph;
  return out;
}

const Node* tiled(const SpPlan& plan) {
  const Node* found = nullptr;
  for (const Node& n : plan.graph.nodes)
    if (n.op == "tiled_rows") {
      EXPECT_EQ(found, nullptr) << "more than one tiled_rows node";
      found = &n;
    }
  return found;
}

int count(const SpPlan& plan, const std::string& op) {
  int k = 0;
  for (const Node& n : plan.graph.nodes) k += n.op == op ? 1 : 0;
  return k;
}

TEST(RowTiles, SwiGluBecomesOneNode) {
  for (int64_t p : {1, 2}) {
    const Built m = mlp_model(Variant::SwiGlu);
    const SpPlan plan = plan_ulysses(m.graph, {.sp_size = p, .tile_mlp = true});
    const Node* t = tiled(plan);
    ASSERT_NE(t, nullptr) << "P=" << p;
    Ints block(m.block.begin(), m.block.end());
    EXPECT_EQ(t->ints_attr("row_nodes"), block);
    EXPECT_EQ(t->int_attr("row_inputs", -1), 1);  // h alone is cut into chunks
    EXPECT_EQ(t->int_attr("row_dim", -1), 1);
    EXPECT_EQ(t->int_attr("row_in_bytes", 0), D * 4);
    EXPECT_EQ(t->int_attr("row_inner_bytes", 0), 4 * F * 4);  // gate, up, silu, mul
    // Operands: h (sharded like the tokens), then gate, up (+bias), down weights read whole.
    ASSERT_EQ(t->inputs.size(), 5u);
    EXPECT_EQ(plan.placements.at(static_cast<size_t>(t->inputs[0])), Placement::shard(1));
    for (size_t i = 1; i < 5; ++i)
      EXPECT_TRUE(plan.placements.at(static_cast<size_t>(t->inputs[i])).is_replicate()) << i;
    // gate: (h, w, absent); up: (h, w, b); silu(gate); mul(silu, up); down(mul, w, absent)
    EXPECT_EQ(t->ints_attr("row_args"),
              (Ints{3, 0, 1, -1, 3, 0, 2, 3, 1, -2, 2, -4, -3, 3, -5, 4, -1}));
    EXPECT_EQ(count(plan, "linear"), 0);  // all three are inside the block
    EXPECT_EQ(count(plan, "silu"), 0);
    ASSERT_EQ(plan.mlp_tiling.size(), 1u);
    EXPECT_TRUE(contains(plan.mlp_tiling[0],
                         "tiled: the row-wise block ending at 'linear' at model.py:20 (5 ops, 3 "
                         "linears, 1 row operands), in chunks along dim 1"));
  }
}

TEST(RowTiles, OffByDefault) {
  const SpPlan plan = plan_ulysses(mlp_model(Variant::SwiGlu).graph, {.sp_size = 2});
  EXPECT_EQ(count(plan, "tiled_rows"), 0);
  EXPECT_EQ(count(plan, "linear"), 3);
  EXPECT_TRUE(plan.mlp_tiling.empty());
}

TEST(RowTiles, AnIntermediateReadElsewhereBecomesAnOperand) {
  // The model also returns gate(h): gate stays outside, and the block reads its result.
  const Built m = mlp_model(Variant::ReturnGate);
  const SpPlan plan = plan_ulysses(m.graph, {.sp_size = 2, .tile_mlp = true});
  const Node* t = tiled(plan);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->int_attr("row_inputs", -1), 2);  // gate's result and h
  for (int64_t origin : t->ints_attr("row_nodes")) EXPECT_NE(origin, m.block[0]);
  EXPECT_EQ(count(plan, "linear"), 1);  // gate, made once for the model's output
}

TEST(RowTiles, GeluMlpWithBias) {
  const Built m = mlp_model(Variant::GeluMlp);
  const SpPlan plan = plan_ulysses(m.graph, {.sp_size = 2, .tile_mlp = true});
  const Node* t = tiled(plan);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->ints_attr("row_nodes"), Ints(m.block.begin(), m.block.end()));
}

TEST(RowTiles, RandomOpsAutocastAndSingleLinearsAreNotTiled) {
  // Dropout inside: a recomputed chunk would draw another mask, so the block stops at it and
  // what is left holds one linear on each side. A down projection under torch.autocast (a
  // breaker's finding: tiled once, its chunks ran in fp32) cannot end a block.
  for (Variant v : {Variant::DropoutInside, Variant::OneLinear, Variant::AutocastDown}) {
    const SpPlan plan = plan_ulysses(mlp_model(v).graph, {.sp_size = 2, .tile_mlp = true});
    EXPECT_EQ(count(plan, "tiled_rows"), 0);
    EXPECT_TRUE(plan.mlp_tiling.empty());
  }
}

TEST(RowTiles, ChunkRows) {
  // Llama-3-8B's SwiGLU in bf16: h is 8192 bytes per row, gate/up/silu/mul 4 * 14336 * 2.
  EXPECT_EQ(tiled_rows_chunk(16384, 8192, 114688, 0), 1171);
  EXPECT_EQ(tiled_rows_chunk(2048, 8192, 114688, 0), kMinTiledRows);
  EXPECT_EQ(tiled_rows_chunk(100, 8192, 114688, 0), 100);  // never more than the rows
  EXPECT_EQ(tiled_rows_chunk(100, 8192, 114688, 5), 5);
  EXPECT_EQ(tiled_rows_chunk(3, 8192, 114688, 5), 3);
}

TEST(RowTiles, Workspace) {
  // in 260, inner 4868, out 256 bytes per token; weights 3 x 64 x 256 fp32; batch 2.
  const int64_t whole = 3 * 64 * 256;
  // Forward, default chunks: the even split's share per token, 1024 rows' worth at most of
  // the rest, one row of rounding.
  EXPECT_EQ(
      tiled_rows_workspace(false, 260, 4868, 256, whole * 4, whole, 2, 0),
      (TiledRowsWorkspace{(5124 * 260 + 4867) / 4868, 5124, 5124 * 2 * kMinTiledRows, 5124 * 2}));
  // Backward, 256 rows per chunk: 3/2 x inner per token of one chunk, and the weights' fp32
  // accumulators with one chunk's gradient.
  EXPECT_EQ(tiled_rows_workspace(true, 260, 4868, 256, whole * 4, whole, 2, 256),
            (TiledRowsWorkspace{0, 7302, 7302 * 2 * 256, whole * 8}));
}

}  // namespace
}  // namespace autosp
