// The tiled loss's decision (SpConfig::tile_loss, plan/loss.cpp): which cross-entropies take
// the projection's operands instead of the logits, and why the others do not.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "golden.h"
#include "graph_builder.h"
#include "plan/ulysses.h"

namespace autosp {
namespace {

using testutil::C;
using testutil::contains;
using testutil::GraphBuilder;
using testutil::S;
using Ints = std::vector<int64_t>;

constexpr int64_t B = 2, V = 64, D = 16;

// h = embedding(ids); logits = lm_head(h) (+ `extra` ops between); loss = cross_entropy of
// logits.float().view(-1, V). `also`: what else reads a value of the chain.
enum class Also { Nothing, ReturnLogits, ReadFloatLogits, AddTensor };

struct Built {
  Graph graph;
  int linear_node = -1, cast_node = -1, view_node = -1;
};

Built head_model(Also also, bool bias = false) {
  GraphBuilder b;
  const int ids = b.input("ids", {C(B), S()}, "i64", "data");
  const int targets = b.input("targets", {C(B), S()}, "i64", "data");
  const int wte = b.param("wte.weight", {C(V), C(D)});
  const int w = b.param("lm_head.weight", {C(V), C(D)});
  const int bias_v = bias ? b.param("lm_head.bias", {C(V)}) : -1;
  const int h = b.at(10, "h = self.wte(ids)").op("embedding", {ids, wte}, {C(B), S(), C(D)});
  Built out;
  const int logits =
      b.at(11, "logits = self.lm_head(h)").op("linear", {h, w, bias_v}, {C(B), S(), C(V)});
  out.linear_node = b.graph.producer(logits);
  int x = logits;
  if (also == Also::AddTensor) {
    const int shift = b.param("logit_bias", {C(V)});
    x = b.at(12, "logits = logits + self.logit_bias").op("add", {x, shift}, {C(B), S(), C(V)});
  }
  const int f = b.at(13, "logits = logits.float()").op("to", {x}, {C(B), S(), C(V)});
  out.cast_node = b.graph.producer(f);
  const int flat = b.at(14, "loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))")
                       .op("reshape", {f}, {S(B), C(V)});
  out.view_node = b.graph.producer(flat);
  const int t = b.at(14).op("reshape", {targets}, {S(B)});
  const int loss =
      b.at(14).op("cross_entropy", {flat, t}, {},
                  {{"reduction", std::string("mean")}, {"ignore_index", int64_t{-100}}});
  std::vector<int> outs{loss};
  if (also == Also::ReturnLogits) outs.push_back(logits);
  if (also == Also::ReadFloatLogits)
    outs.push_back(b.at(15, "z = torch.logsumexp(logits, -1)")
                       .op("logsumexp", {f}, {C(B), S()}, {{"dims", Ints{2}}}));
  b.at(16).output(outs);
  out.graph = b.graph;
  return out;
}

const Node& loss_node(const SpPlan& plan) {
  for (const Node& n : plan.graph.nodes)
    if (n.op == "cross_entropy") return n;
  throw std::runtime_error("no cross_entropy in the plan");
}

bool has_linear(const SpPlan& plan) {
  for (const Node& n : plan.graph.nodes)
    if (n.op == "linear") return true;
  return false;
}

TEST(LossTiles, ProjectionCastAndViewAreTiled) {
  const Built m = head_model(Also::Nothing, /*bias=*/true);
  const SpPlan plan = plan_ulysses(m.graph, {.sp_size = 2, .tile_loss = true});
  EXPECT_GOLDEN("placements_tiled_loss_p2", print_placements(m.graph, plan));
  const Node& ce = loss_node(plan);
  EXPECT_EQ(ce.ints_attr("head_chain"), (Ints{m.linear_node, m.cast_node, m.view_node}));
  EXPECT_EQ(ce.ints_attr("head_regroup"), (Ints{0, 0, 1}));  // the view is skipped per chunk
  ASSERT_EQ(ce.inputs.size(), 5u);                           // (-1, targets, h, weight, bias)
  EXPECT_EQ(ce.inputs[0], -1);
  for (size_t i = 1; i < 5; ++i) EXPECT_GE(ce.inputs[i], 0) << i;
  // Sharded like the tokens it covers; the replicated weight behind a gradient sync.
  EXPECT_EQ(plan.placements.at(static_cast<size_t>(ce.inputs[2])), Placement::shard(1));
  EXPECT_EQ(plan.placements.at(static_cast<size_t>(ce.inputs[1])), Placement::shard(0));
  const int w = ce.inputs[3];
  EXPECT_EQ(plan.graph.nodes.at(static_cast<size_t>(plan.graph.producer(w))).op, "sp.grad_sync");
  EXPECT_EQ(ce.str_attr("reduction", ""), "sum");  // / sp.count_valid, as untiled
  EXPECT_FALSE(has_linear(plan));                  // the logits are never made
  ASSERT_EQ(plan.loss_tiling.size(), 1u);
  EXPECT_TRUE(contains(plan.loss_tiling[0],
                       "tiled: cross_entropy 'cross_entropy' at model.py:14 "
                       "over the projection 'linear' at model.py:11 (2 "
                       "row-wise ops between)"));
}

TEST(LossTiles, OneRankIsTiledToo) {
  const SpPlan plan =
      plan_ulysses(head_model(Also::Nothing).graph, {.sp_size = 1, .tile_loss = true});
  EXPECT_TRUE(loss_node(plan).has_attr("head_chain"));
  EXPECT_EQ(loss_node(plan).str_attr("reduction", ""), "sum");  // / sp.count_valid, as at P > 1
  EXPECT_FALSE(has_linear(plan));
}

TEST(LossTiles, ReturnedLogitsStayAndTheLossRecomputesThem) {
  const SpPlan plan =
      plan_ulysses(head_model(Also::ReturnLogits).graph, {.sp_size = 2, .tile_loss = true});
  EXPECT_TRUE(loss_node(plan).has_attr("head_chain"));
  EXPECT_TRUE(has_linear(plan));
  EXPECT_TRUE(contains(plan.loss_tiling.at(0), "also read elsewhere"));
}

TEST(LossTiles, FloatLogitsReadElsewhereStayAndTheLossIsTiled) {
  const SpPlan plan =
      plan_ulysses(head_model(Also::ReadFloatLogits).graph, {.sp_size = 2, .tile_loss = true});
  EXPECT_TRUE(loss_node(plan).has_attr("head_chain"));
  EXPECT_TRUE(has_linear(plan));  // the z-loss reads the float logits
  EXPECT_TRUE(contains(plan.loss_tiling.at(0), "also read elsewhere"));
}

TEST(LossTiles, LogitsMixedWithTensorsAreNotTiled) {
  for (Also also : {Also::AddTensor}) {
    const SpPlan plan = plan_ulysses(head_model(also).graph, {.sp_size = 2, .tile_loss = true});
    EXPECT_FALSE(loss_node(plan).has_attr("head_chain"));
    EXPECT_GE(loss_node(plan).inputs.at(0), 0);
    ASSERT_EQ(plan.loss_tiling.size(), 1u);
    EXPECT_TRUE(contains(plan.loss_tiling[0],
                         "not tiled: cross_entropy 'cross_entropy' at "
                         "model.py:14: "));
    EXPECT_TRUE(contains(plan.loss_tiling[0],
                         "the op 'add' at model.py:12 between the projection and the loss is "
                         "not a row-wise op"));
  }
}

TEST(LossTiles, OffByDefault) {
  const SpPlan plan = plan_ulysses(head_model(Also::Nothing).graph, {.sp_size = 2});
  EXPECT_FALSE(loss_node(plan).has_attr("head_chain"));
  EXPECT_TRUE(plan.loss_tiling.empty());
  EXPECT_TRUE(has_linear(plan));
}

}  // namespace
}  // namespace autosp
