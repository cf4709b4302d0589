// plan_ulysses: golden tests (the input graph and the planned graph, printed), the plan's
// structure where it carries the answer, and the errors a user can hit.
//
// Golden files live in tests/cpp/golden/; after an intended change to the plan, rerun with
// AUTOSP_UPDATE_GOLDEN=1 and review the diff.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "analysis/placement.h"
#include "golden.h"
#include "graph_builder.h"
#include "llama_graph.h"
#include "plan/ulysses.h"
#include "plan_error.h"

namespace autosp {
namespace {

using testutil::C;
using testutil::contains;
using testutil::GraphBuilder;
using testutil::llama;
using testutil::LlamaSpec;
using testutil::S;

using Ints = std::vector<int64_t>;

// The golden text: the input graph and the plan, so a reader sees what the pass did.
std::string golden_text(const Graph& g, const SpConfig& cfg, const SpPlan& plan) {
  return "# input\n" + print_graph(g) + "\n# plan_ulysses sp_size=" + std::to_string(cfg.sp_size) +
         " fuse_qkv=" + (cfg.fuse_qkv ? "true" : "false") + "\n" + plan.str();
}

// The plan's nodes with op `op`, in order.
std::vector<const Node*> nodes_with_op(const SpPlan& plan, const std::string& op) {
  std::vector<const Node*> out;
  for (const Node& n : plan.graph.nodes)
    if (n.op == op) out.push_back(&n);
  return out;
}

const Node& producer(const SpPlan& plan, int value_id) {
  return plan.graph.nodes.at(static_cast<size_t>(plan.graph.producer(value_id)));
}

TEST(Golden, LineDiffShowsChangesWithContext) {
  EXPECT_EQ(testutil::line_diff("a\nb\nc\nd\ne\nf\n", "a\nb\nc\nD\ne\nf\n", 1),
            "  c\n- d\n+ D\n  e\n");
  EXPECT_EQ(testutil::line_diff("a\nb\nc\nd\ne\n", "A\nb\nc\nd\nE\n", 0),
            "- a\n+ A\n  ...\n- e\n+ E\n");
  EXPECT_EQ(testutil::line_diff("a\n", "a\nb\n"), "  a\n+ b\n");
}

// ---- Llama golden tests --------------------------------------------------------------------

TEST(UlyssesLlama, MhaP2) {
  const Graph g = llama({});
  const SpConfig cfg{.sp_size = 2};
  const SpPlan plan = plan_ulysses(g, cfg);
  EXPECT_GOLDEN("ulysses_llama_mha_p2", golden_text(g, cfg, plan));

  // Gradients bucketed per layer: one sync for layers.0, one for embed, norm and head.
  EXPECT_EQ(plan.collective_counts(), (std::map<std::string, int>{{"sp.all_to_all", 2},
                                                                  {"sp.count_valid", 1},
                                                                  {"sp.grad_sync", 2},
                                                                  {"sp.reduce_partial", 1}}));
  // One fused exchange in, one out.
  const auto a2a = nodes_with_op(plan, "sp.all_to_all");
  ASSERT_EQ(a2a.size(), 2u);
  EXPECT_EQ(a2a[0]->inputs.size(), 3u);
  EXPECT_EQ(a2a[0]->attrs, (Attrs{{"scatter_dim", int64_t{1}},
                                  {"gather_dim", int64_t{2}},
                                  {"gather_coef", int64_t{1}},
                                  {"gather_power", int64_t{1}}}));
  EXPECT_EQ(a2a[1]->attrs, (Attrs{{"scatter_dim", int64_t{2}},
                                  {"gather_dim", int64_t{1}},
                                  {"gather_coef", int64_t{4}},
                                  {"gather_power", int64_t{0}}}));
  // The sequence is sharded right after the embedding by slicing the ids, not the activation.
  const Node& emb = *nodes_with_op(plan, "embedding").at(0);
  EXPECT_EQ(producer(plan, emb.inputs[0]).op, "sp.slice");
  EXPECT_EQ(plan.placements[static_cast<size_t>(emb.outputs[0])], Placement::shard(1));
  // The loss returned to the user is whole on every rank.
  const Node& out = plan.graph.nodes.back();
  ASSERT_EQ(out.op, "output");
  EXPECT_EQ(producer(plan, out.inputs[0]).op, "sp.reduce_partial");
  EXPECT_EQ(plan.placements[static_cast<size_t>(out.inputs[0])], Placement::replicate());
}

TEST(UlyssesLlama, GqaOneKvHeadP4RepeatsHeads) {
  const Graph g = llama({.kv_heads = 1});
  const SpConfig cfg{.sp_size = 4};
  const SpPlan plan = plan_ulysses(g, cfg);
  EXPECT_GOLDEN("ulysses_llama_gqa_kv1_p4", golden_text(g, cfg, plan));

  const auto repeats = nodes_with_op(plan, "sp.repeat_heads");
  ASSERT_EQ(repeats.size(), 2u);  // k and v
  for (const Node* n : repeats) {
    EXPECT_EQ(n->attrs, (Attrs{{"dim", int64_t{1}}, {"repeats", int64_t{4}}}));
    EXPECT_EQ(plan.graph.value(n->outputs[0]).shape, (std::vector<Dim>{C(2), C(4), S(), C(16)}));
  }
  const auto a2a = nodes_with_op(plan, "sp.all_to_all");
  ASSERT_EQ(a2a.size(), 2u);
  EXPECT_EQ(a2a[0]->inputs.size(), 3u);
  EXPECT_EQ(a2a[0]->inputs[1], repeats[0]->outputs[0]);
  EXPECT_EQ(a2a[0]->inputs[2], repeats[1]->outputs[0]);
}

// Regression: emit_sdpa held a reference into the value table across the emits of
// sp.repeat_heads; when one of them grew the table, the query's sequence dim was read from
// freed memory (a crash in a 5-layer model). Some layer count in the sweep makes the table
// grow there; the ASan build of this test catches a dangling read.
TEST(UlyssesLlama, GqaRepeatHeadsAcrossManyLayers) {
  for (int layers = 1; layers <= 12; ++layers) {
    const SpPlan plan = plan_ulysses(llama({.kv_heads = 1, .layers = layers}), {.sp_size = 2});
    ASSERT_EQ(nodes_with_op(plan, "sp.repeat_heads").size(), 2u * layers);
    for (const Node* n : nodes_with_op(plan, "sp.all_to_all")) {
      if (n->inputs.size() != 3u) continue;  // the exchange after attention
      EXPECT_EQ(n->attrs.at("gather_coef"), (Attr{int64_t{1}})) << layers << " layers";
      EXPECT_EQ(n->attrs.at("gather_power"), (Attr{int64_t{1}})) << layers << " layers";
    }
  }
}

TEST(UlyssesLlama, GqaKvHeadsDivisibleByPNeedNoRepeat) {
  const SpPlan plan = plan_ulysses(llama({.kv_heads = 2}), {.sp_size = 2});
  EXPECT_TRUE(nodes_with_op(plan, "sp.repeat_heads").empty());
  EXPECT_EQ(plan.collective_counts().at("sp.all_to_all"), 2);
}

TEST(UlyssesLlama, UnfusedQkvExchangesThreeTimes) {
  const Graph g = llama({});
  const SpConfig cfg{.sp_size = 2, .fuse_qkv = false};
  const SpPlan plan = plan_ulysses(g, cfg);
  EXPECT_GOLDEN("ulysses_llama_mha_p2_unfused", golden_text(g, cfg, plan));

  // Three single-operand exchanges before sdpa, one after.
  std::vector<std::string> around;
  for (const Node& n : plan.graph.nodes)
    if (n.op == "sp.all_to_all" || n.op == "sdpa")
      around.push_back(n.op + "/" + std::to_string(n.inputs.size()));
  EXPECT_EQ(around, (std::vector<std::string>{"sp.all_to_all/1", "sp.all_to_all/1",
                                              "sp.all_to_all/1", "sdpa/3", "sp.all_to_all/1"}));
}

TEST(UlyssesLlama, TwoLayersCollectiveCounts) {
  const SpPlan plan = plan_ulysses(llama({.layers = 2}), {.sp_size = 2, .bucket_grad_sync = false});
  // 2 fused exchanges in + 2 out; one gradient sync per parameter (2 * 5 + embed, norm, head).
  EXPECT_EQ(plan.collective_counts(), (std::map<std::string, int>{{"sp.all_to_all", 4},
                                                                  {"sp.count_valid", 1},
                                                                  {"sp.grad_sync", 13},
                                                                  {"sp.reduce_partial", 1}}));
  // Bucketed (the default): one sync per layer (5 parameters each) and one for the embedding,
  // final norm and head, each placed where its first parameter is first used: the bucket of
  // the parameters outside layers before the embedding, each layer's before its first op.
  const SpPlan bucketed = plan_ulysses(llama({.layers = 2}), {.sp_size = 2});
  std::vector<std::string> order;  // grad syncs and the ops reading their first output
  for (const Node& n : bucketed.graph.nodes) {
    if (n.op == "sp.grad_sync") {
      std::string paths;
      for (int v : n.inputs) {
        const Node& p = producer(bucketed, v);
        paths += (paths.empty() ? "" : " ") + std::get<std::string>(p.attrs.at("path"));
      }
      order.push_back(paths);
    }
  }
  EXPECT_EQ(order, (std::vector<std::string>{
                       "embed.weight norm.weight lm_head.weight",
                       "layers.0.attn_norm.weight layers.0.wq.weight layers.0.wk.weight "
                       "layers.0.wv.weight layers.0.wo.weight",
                       "layers.1.attn_norm.weight layers.1.wq.weight layers.1.wk.weight "
                       "layers.1.wv.weight layers.1.wo.weight"}));
  for (const Node* sync : nodes_with_op(bucketed, "sp.grad_sync")) {
    // Right before the first op that reads one of its outputs.
    const Node& next = bucketed.graph.nodes[static_cast<size_t>(sync->id) + 1];
    bool reads = false;
    for (int v : next.inputs)
      for (int o : sync->outputs) reads = reads || v == o;
    EXPECT_TRUE(reads) << next.op;
  }
  // The RoPE tables are sliced once and shared by every layer.
  EXPECT_EQ(nodes_with_op(plan, "sp.slice").size(), 4u);  // ids, cos, sin, targets
}

TEST(UlyssesLlama, QueryHeadsNotDivisibleBySpDegree) {
  const Graph g = llama({.heads = 6, .kv_heads = 6});
  const std::string msg = plan_error([&] { plan_ulysses(g, {.sp_size = 4}); });
  EXPECT_TRUE(
      contains(msg,
               "[autosp:ulysses] op 'sdpa' (torch.nn.functional.scaled_dot_product_attention) "
               "at model.py:46  o = F.scaled_dot_product_attention(q, k, v, is_causal=True): "));
  EXPECT_TRUE(
      contains(msg,
               "found 6 query heads for an SP degree of 4; expected a number of query heads "
               "divisible by the SP degree (6 % 4 = 2)."));
  EXPECT_TRUE(contains(msg, "choose an SP degree that divides the number of heads"));
  // The same model plans at a degree that divides the heads.
  EXPECT_NO_THROW(plan_ulysses(g, {.sp_size = 3}));
  // With the gather fallback, attention runs on the all-gathered sequence: q, k and v are
  // all-gathered, nothing goes through an all-to-all, and the refusal is listed.
  const SpPlan gathered = plan_ulysses(g, {.sp_size = 4, .gather_unsupported = true});
  EXPECT_TRUE(nodes_with_op(gathered, "sp.all_to_all").empty());
  EXPECT_EQ(nodes_with_op(gathered, "sp.all_gather").size(), 3u);  // q, k and v
  ASSERT_EQ(gathered.gathered.size(), 1u);
  EXPECT_TRUE(contains(gathered.gathered[0], "found 6 query heads for an SP degree of 4"));
  EXPECT_TRUE(contains(gathered.gathered[0], "unsupported='gather'"));
}

TEST(UlyssesLlama, KvHeadsWithoutEnableGqa) {
  Graph g = llama({.kv_heads = 2});
  for (Node& n : g.nodes)
    if (n.op == "sdpa") n.attrs["enable_gqa"] = false;
  const std::string msg = plan_error([&] { plan_ulysses(g, {.sp_size = 2}); });
  EXPECT_TRUE(contains(msg,
                       "found 2 key/value heads for 4 query heads; expected equal heads, or "
                       "enable_gqa=True with query heads a multiple of key/value heads."));
}

TEST(UlyssesLlama, BadSpSize) {
  EXPECT_THROW(plan_ulysses(llama({}), {.sp_size = 0}), std::invalid_argument);
  try {
    plan_ulysses(llama({}), {.sp_size = 0});
  } catch (const PlanError&) {
    ADD_FAILURE() << "a bad configuration is not a PlanError";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "[plan_ulysses] sp_size must be >= 1, got 0");
  }
}

// ---- losses ------------------------------------------------------------------------------

// loss = mean((x @ w)^2) + mean(x) over the whole sequence (partials that add up), plus
// 0.01 * sum(w * w), a regulariser computed identically on every rank.
Graph regularised_mse() {
  GraphBuilder b;
  const int ids = b.input("ids", {C(2), S()}, "i64", "data");
  const int embed = b.param("embed.weight", {C(128), C(64)});
  const int w = b.param("head.weight", {C(1), C(64)});
  const int x = b.at(10, "x = self.embed(ids)").op("embedding", {ids, embed}, {C(2), S(), C(64)});
  const int y = b.at(11, "y = self.head(x)").op("linear", {x, w}, {C(2), S(), C(1)});
  const int sq = b.at(12, "mse = y.pow(2).mean()")
                     .op("pow", {y}, {C(2), S(), C(1)}, {{"exponent", 2.0}, {"pointwise", true}});
  const int mse = b.at(12).op("mean", {sq}, {});
  const int aux = b.at(13, "aux = x.mean()").op("mean", {x}, {});
  const int loss = b.at(14, "loss = mse + aux").op("add", {mse, aux}, {});
  const int w2 =
      b.at(15, "reg = 0.01 * (self.head.weight ** 2).sum()").op("mul", {w, w}, {C(1), C(64)});
  const int s = b.at(15).op("sum", {w2}, {});
  const int reg = b.at(15).op("mul", {s}, {}, {{"other", 0.01}});
  const int total = b.at(16, "return loss + reg").op("add", {loss, reg}, {});
  b.at(16).output({total});
  return b.graph;
}

TEST(UlyssesLoss, MeanOverSequenceAndReplicatedRegulariser) {
  const Graph g = regularised_mse();
  const SpConfig cfg{.sp_size = 2};
  const SpPlan plan = plan_ulysses(g, cfg);
  EXPECT_GOLDEN("ulysses_loss_regularised_mse_p2", golden_text(g, cfg, plan));

  // Each mean over the sequence became a local sum over the global count.
  const auto divs = nodes_with_op(plan, "div");
  ASSERT_EQ(divs.size(), 2u);
  EXPECT_EQ(divs[0]->attrs, (Attrs{{"divisor_coef", int64_t{2}}, {"divisor_power", int64_t{1}}}));
  EXPECT_EQ(divs[1]->attrs, (Attrs{{"divisor_coef", int64_t{128}}, {"divisor_power", int64_t{1}}}));
  for (const Node* d : divs) {
    const Node& sum = producer(plan, d->inputs[0]);
    EXPECT_EQ(sum.op, "sum");
    EXPECT_EQ(sum.str_attr("rewrite_target", ""), "sum");
    EXPECT_EQ(plan.placements[static_cast<size_t>(d->outputs[0])], Placement::partial());
  }

  // The two partial terms add up as partials; the sum is reduced once, before the replicated
  // regulariser is added, so that the regulariser counts once and not P times.
  const auto reduces = nodes_with_op(plan, "sp.reduce_partial");
  ASSERT_EQ(reduces.size(), 1u);
  const Node& partial_add = producer(plan, reduces[0]->inputs[0]);
  EXPECT_EQ(partial_add.op, "add");
  EXPECT_EQ(plan.placements[static_cast<size_t>(partial_add.outputs[0])], Placement::partial());
  const Node& total = plan.graph.nodes[plan.graph.nodes.size() - 2];
  ASSERT_EQ(total.op, "add");
  EXPECT_EQ(total.inputs[0], reduces[0]->outputs[0]);
  EXPECT_EQ(producer(plan, total.inputs[1]).op, "mul");
  EXPECT_EQ(plan.placements[static_cast<size_t>(total.inputs[1])], Placement::replicate());
  EXPECT_EQ(plan.placements[static_cast<size_t>(total.outputs[0])], Placement::replicate());
  EXPECT_EQ(plan.graph.nodes.back().inputs, std::vector<int>{total.outputs[0]});
}

// ---- ops without a rule --------------------------------------------------------------------

TEST(UlyssesNoRule, ShardedOperandIsAnError) {
  GraphBuilder b;
  const int ids = b.input("ids", {C(2), S()}, "i64", "data");
  const int embed = b.param("embed.weight", {C(128), C(64)});
  const int x = b.at(10, "x = self.embed(ids)").op("embedding", {ids, embed}, {C(2), S(), C(64)});
  const int f = b.at(12, "f = torch.fft.rfft(x, dim=-1)")
                    .target("torch.fft.rfft")
                    .op("rfft", {x}, {C(2), S(), C(33)});
  b.output({f});
  const Graph g = b.graph;
  EXPECT_EQ(plan_error([&] { plan_ulysses(g, {.sp_size = 2}); }),
            "[autosp:ulysses] op 'rfft' (torch.fft.rfft) at model.py:12  f = torch.fft.rfft(x, "
            "dim=-1): found input 0 placed S(1) ([2, S, 64]); expected an op with a "
            "sequence-parallel rule. autosp has no rule for 'rfft' on a sequence-sharded tensor; "
            "rather than guess, it stops here.");
}

TEST(UlyssesNoRule, ReplicatedOperandsAreFine) {
  GraphBuilder b;
  const int labels = b.input("labels", {C(2), S()}, "i64", "data");
  const int h = b.at(5).op("my_histogram", {labels}, {C(16)});
  b.output({h});
  const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 2});
  EXPECT_EQ(plan.str(),
            "%0: i64[2, S] R = input() {name=\"labels\", role=\"data\"}  # model.py:1\n"
            "%1: i64[16] R = my_histogram(%0)  # model.py:5\n"
            "() = output(%1)  # model.py:6\n");
  EXPECT_TRUE(plan.collective_counts().empty());
}

// ---- the gather fallback (SpConfig::gather_unsupported) -------------------------------------

// The op without a rule runs on the all-gathered sequence; its replicated result is sliced
// where it meets the sharded residual again (behind a gradient sync), and the plan lists it.
TEST(UlyssesGather, OpWithoutRuleRunsOnTheGatheredSequence) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int w = b.param("mix.weight", {C(8)});
  const int h = b.at(3).op("mul", {x, w}, {C(2), S(), C(8)});
  const int f = b.at(4, "f = my_scan(h)").op("my_scan", {h}, {C(2), S(), C(8)});
  const int y = b.at(5, "y = h + f").op("add", {h, f}, {C(2), S(), C(8)});
  const int loss = b.at(6).op("sum", {y}, {});
  b.at(7).output({loss});
  const Graph g = b.graph;
  const std::string refusal = plan_error([&] { plan_ulysses(g, {.sp_size = 2}); });
  EXPECT_TRUE(contains(refusal, "no rule for 'my_scan'"));
  const SpPlan plan = plan_ulysses(g, {.sp_size = 2, .gather_unsupported = true});
  EXPECT_EQ(plan.gathered, std::vector<std::string>{refusal});
  EXPECT_EQ(plan.str(),
            "%0: f32[2, S, 8] R = input() {name=\"inputs_embeds\", role=\"data\"}  # model.py:1\n"
            "%1: f32[2, S, 8] S(1) = sp.slice(%0) {dim=1, inner=1, outer=1}  # model.py:1\n"
            "%2: f32[8] R = input() {grad, name=\"mix.weight\", path=\"mix.weight\", "
            "role=\"param\"}  # model.py:2\n"
            "%3: f32[8] R = sp.grad_sync(%2) {grad}\n"
            "%4: f32[2, S, 8] S(1) = mul(%1, %3) {grad}  # model.py:3\n"
            "%5: f32[2, S, 8] R = sp.all_gather(%4) {grad, dim=1, inner=1}  # model.py:4\n"
            "%6: f32[2, S, 8] R = my_scan(%5) {grad}  # model.py:4\n"
            "%7: f32[2, S, 8] R = sp.grad_sync(%6) {grad}  # model.py:5\n"
            "%8: f32[2, S, 8] S(1) = sp.slice(%7) {grad, dim=1, inner=1, outer=1}  # model.py:5\n"
            "%9: f32[2, S, 8] S(1) = add(%4, %8) {grad}  # model.py:5\n"
            "%10: f32[] P = sum(%9) {grad}  # model.py:6\n"
            "%11: f32[] R = sp.reduce_partial(%10) {grad}  # model.py:7\n"
            "() = output(%11)  # model.py:7\n");
}

// Each refused op is listed; a value is gathered once however many refused ops read it. An
// in-place write into a sharded destination is not gathered (the write would land in the
// gathered copy): the plan still stops there.
TEST(UlyssesGather, EachRefusedOpIsListedAndInPlaceWritesAreNotGathered) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int f = b.at(4).op("my_scan", {x}, {C(2), S(), C(8)});
  const int f2 = b.at(4).op("my_other_scan", {x}, {C(2), S(), C(8)});
  const int y = b.at(5).op("add", {f2, f}, {C(2), S(), C(8)});
  const int g2 = b.at(6).op("my_scan", {y}, {C(2), S(), C(8)});
  const int z = b.at(7).op("mul", {g2, x}, {C(2), S(), C(8)});
  b.at(8).output({z});
  const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 2, .gather_unsupported = true});
  EXPECT_EQ(plan.gathered.size(), 2u);  // my_scan and my_other_scan; my_scan(y) is replicated
  // x once for both scans, and the output z (sharded, as mul slices g2) at the end.
  EXPECT_EQ(plan.collective_counts(), (std::map<std::string, int>{{"sp.all_gather", 2}}));

  // With local outputs, the gathered result is returned as this rank's chunk, like the
  // sharded value it stands in for.
  GraphBuilder l;
  const int lx = l.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int lf = l.at(4).op("my_scan", {lx}, {C(2), S(), C(8)});
  l.at(5).output({lf});
  const SpPlan local =
      plan_ulysses(l.graph, {.sp_size = 2, .gather_outputs = false, .gather_unsupported = true});
  const Node& out = local.graph.nodes.back();
  EXPECT_EQ(local.placements[static_cast<size_t>(out.inputs[0])], Placement::shard(1));

  // A view along the sequence written through later, or a setitem: a gathered copy would
  // take the write, not the tensor. Not gathered: still the error.
  GraphBuilder v;
  const int vx = v.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int vh = v.at(3).op("mul", {vx, vx}, {C(2), S(), C(8)});
  const int part = v.at(4, "part = h[:, 3:7]")
                       .op("index", {vh}, {C(2), C(4), C(8)},
                           {{"dim_map", Ints{0, 1, 2}}, {"sliced_dims", Ints{1}}});
  v.at(5, "part.mul_(2)").op("mul", {part}, {C(2), C(4), C(8)}, {{"inplace", true}});
  const int set = v.at(6, "h[..., :4] = 0").op("setitem", {vh}, {C(2), S(), C(8)});
  v.at(7).output({vh, set});
  const Graph views = v.graph;
  EXPECT_TRUE(
      contains(plan_error([&] { plan_ulysses(views, {.sp_size = 2, .gather_unsupported = true}); }),
               "op 'index' at model.py:4"));

  GraphBuilder w;
  const int a = w.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int c = w.at(3).op("mul", {a, a}, {C(2), S(), C(8)});
  const int d = w.at(4).op("my_fill_", {c}, {C(2), S(), C(8)}, {{"inplace", true}});
  w.at(5).output({d});
  const Graph inplace = w.graph;
  EXPECT_TRUE(contains(
      plan_error([&] { plan_ulysses(inplace, {.sp_size = 2, .gather_unsupported = true}); }),
      "no rule for 'my_fill_'"));
}

// Attention around gathered values: a query computed on the gathered sequence is sliced to
// this rank's chunk before the exchange, and a mask computed from sharded activations (a
// per-key bias) is gathered whole (listed); without the fallback both stay errors.
TEST(UlyssesGather, AttentionWithAGatheredQueryAndASharedMask) {
  GraphBuilder b;
  const Dim B = C(2), H = C(4), D = C(8);
  const int x = b.input("inputs_embeds", {B, H, S(), D}, "f32", "data");
  const int q = b.at(3, "q = my_router(x)").op("my_router", {x}, {B, H, S(), D});
  const int bias = b.at(4, "bias = x.sum(-1)").op("sum", {x}, {B, H, S()}, {{"dims", Ints{3}}});
  const int mask = b.at(5, "mask = bias[:, :, None, :]").op("reshape", {bias}, {B, H, C(1), S()});
  const int o = b.at(6, "o = F.scaled_dot_product_attention(q, x, x, attn_mask=mask)")
                    .target("torch.nn.functional.scaled_dot_product_attention")
                    .op("sdpa", {q, x, x, mask}, {B, H, S(), D});
  b.at(7).output({o});
  const Graph g = b.graph;
  EXPECT_TRUE(
      contains(plan_error([&] { plan_ulysses(g, {.sp_size = 2}); }), "no rule for 'my_router'"));
  const SpPlan plan = plan_ulysses(g, {.sp_size = 2, .gather_unsupported = true});
  ASSERT_EQ(plan.gathered.size(), 2u);
  EXPECT_TRUE(contains(plan.gathered[0], "no rule for 'my_router'"));
  EXPECT_TRUE(contains(plan.gathered[1], "found an attention mask placed S(3)"));
  const Node& sdpa = *nodes_with_op(plan, "sdpa").at(0);
  // The query reaches the exchange as this rank's chunk of the gathered router output.
  const Node& exchange = producer(plan, sdpa.inputs[0]);
  ASSERT_EQ(exchange.op, "sp.all_to_all");
  EXPECT_EQ(producer(plan, exchange.inputs[0]).op, "sp.slice");
  // The mask is this rank's heads of the gathered bias.
  const Node& heads = producer(plan, sdpa.inputs[3]);
  EXPECT_EQ(heads.op, "sp.slice");
  EXPECT_EQ(heads.int_attr("dim", -1), 1);
  EXPECT_EQ(producer(plan, heads.inputs[0]).op, "sp.all_gather");
  EXPECT_EQ(plan.collective_counts().at("sp.all_gather"), 3);  // x, the mask, the output
}

// A sharded value returned to the user is gathered back to full length.
TEST(UlyssesOutputs, ShardedOutputIsGathered) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int y = b.at(3).op("silu", {x}, {C(2), S(), C(8)}, {{"pointwise", true}});
  b.output({y});
  const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 4});
  EXPECT_EQ(plan.str(),
            "%0: f32[2, S, 8] R = input() {name=\"inputs_embeds\", role=\"data\"}  # model.py:1\n"
            "%1: f32[2, S, 8] S(1) = sp.slice(%0) {dim=1, inner=1, outer=1}  # model.py:1\n"
            "%2: f32[2, S, 8] S(1) = silu(%1) {pointwise=true}  # model.py:3\n"
            "%3: f32[2, S, 8] R = sp.all_gather(%2) {dim=1, inner=1}  # model.py:4\n"
            "() = output(%3)  # model.py:4\n");
  EXPECT_EQ(plan.graph.nodes[2].origin, 1);  // copied nodes remember where they came from
  EXPECT_EQ(plan.graph.nodes[1].origin, -1);
}

// gather_outputs = false: sharded outputs stay this rank's chunk; a partial (the loss) is
// still reduced.
TEST(UlyssesOutputs, LocalOutputsStaySharded) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int y = b.at(3).op("silu", {x}, {C(2), S(), C(8)}, {{"pointwise", true}});
  const int loss = b.at(4).op("sum", {y}, {});
  b.at(5).output({loss, y});
  const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 4, .gather_outputs = false});
  EXPECT_EQ(plan.collective_counts(), (std::map<std::string, int>{{"sp.reduce_partial", 1}}));
  const Node& out = plan.graph.nodes.back();
  ASSERT_EQ(out.op, "output");
  EXPECT_EQ(plan.placements[static_cast<size_t>(out.inputs[0])], Placement::replicate());
  EXPECT_EQ(plan.placements[static_cast<size_t>(out.inputs[1])], Placement::shard(1));
}

// A replicated operand built by cat along the dim the plan must slice cannot be sliced by
// slicing the cat's operands: the slice has to be taken on the cat's result. cat's dim may be
// given negative (rule_cat normalises it), so the plan must normalise it too.
TEST(UlyssesHoist, CatAlongTheSlicedDimGivenNegative) {
  for (const int64_t cat_dim : {int64_t{1}, int64_t{-1}}) {
    SCOPED_TRACE("cat dim " + std::to_string(cat_dim));
    GraphBuilder b;
    const int x = b.input("x", {C(2), S(), C(2)}, "f32", "data");
    const int a = b.buffer("a", {C(2), S()});
    const int c = b.buffer("c", {C(2), S()});
    const int xr = b.at(3, "xr = x.reshape(B, -1)").op("reshape", {x}, {C(2), S(2)});
    const int ac = b.at(4, "ac = torch.cat([a, c], dim=-1)")
                       .op("cat", {a, c}, {C(2), S(2)}, {{"dim", cat_dim}});
    const int y = b.at(5, "y = xr * ac").op("mul", {xr, ac}, {C(2), S(2)});
    b.output({y});
    const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 2});
    // xr is S(1, inner=2); `ac` is sliced as a whole with the same inner.
    const auto slices = nodes_with_op(plan, "sp.slice");
    ASSERT_EQ(slices.size(), 2u);
    EXPECT_EQ(slices[1]->attrs,
              (Attrs{{"dim", int64_t{1}}, {"inner", int64_t{2}}, {"outer", int64_t{1}}}));
    EXPECT_EQ(producer(plan, slices[1]->inputs[0]).op, "cat");
  }
}

// A replicated chain (positions -> cos) sliced where it meets the sharded activation is
// recomputed on the local chunk; with an in-place op anywhere in the graph that re-run could
// read a mutated tensor, so the chain is sliced at its end instead.
TEST(UlyssesHoist, ReplicatedChainIsHoistedUnlessTheGraphMutates) {
  for (const bool mutates : {false, true}) {
    SCOPED_TRACE(mutates ? "with an in-place op" : "pure");
    GraphBuilder b;
    const int x = b.input("x", {C(2), S(), C(8)}, "f32", "data");
    const int pos = b.at(2, "pos = torch.arange(S)").op("arange", {}, {S()}, {}, "i64");
    const int posf = b.at(3, "posf = pos.float()").op("to", {pos}, {S()});
    if (mutates) b.at(4, "pos.add_(1)").op("add", {pos}, {S()}, {{"inplace", true}}, "i64");
    const int col =
        b.at(5, "col = posf[:, None]")
            .op("index", {posf}, {S(), C(1)},
                {{"dim_map", std::vector<int64_t>{0}}, {"sliced_dims", std::vector<int64_t>{}}});
    const int y = b.at(6, "y = x + col").op("add", {x, col}, {C(2), S(), C(8)});
    b.output({y});
    const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 2});
    const auto slices = nodes_with_op(plan, "sp.slice");
    // x is sharded where it enters; then either arange's output or the chain's end.
    ASSERT_EQ(slices.size(), 2u);
    EXPECT_EQ(producer(plan, slices[1]->inputs[0]).op, mutates ? "index" : "arange");
  }
}

// A scan along the sequence is the local scan plus the prefix of the earlier ranks' totals,
// and a max over the sequence combines each rank's maximum.
TEST(UlyssesCrossRank, ScanAndCombine) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int c = b.at(3).op("cumsum", {x}, {C(2), S(), C(8)}, {{"dim", int64_t{1}}});
  const int m = b.at(4).op("amax", {c}, {C(2), C(8)}, {{"dims", std::vector<int64_t>{1}}});
  b.at(5).output({m});
  const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 2});
  EXPECT_EQ(plan.str(),
            "%0: f32[2, S, 8] R = input() {name=\"inputs_embeds\", role=\"data\"}  # model.py:1\n"
            "%1: f32[2, S, 8] S(1) = sp.slice(%0) {dim=1, inner=1, outer=1}  # model.py:1\n"
            "%2: f32[2, S, 8] S(1) = cumsum(%1) {dim=1}  # model.py:3\n"
            "%3: f32[2, S, 8] S(1) = sp.scan(%2) {dim=1, op=\"cumsum\"}  # model.py:3\n"
            "%4: f32[2, 8] P = amax(%3) {dims=[1]}  # model.py:4\n"
            "%5: f32[2, 8] R = sp.combine(%4) {op=\"amax\"}  # model.py:4\n"
            "() = output(%5)  # model.py:5\n");
  EXPECT_EQ(plan.collective_counts(),
            (std::map<std::string, int>{{"sp.combine", 1}, {"sp.scan", 1}}));
}

// Shifting inside the model (older Hugging Face): logits[:, :-1] against labels[:, 1:]. The
// logits' slice is an sp.shift (S-1 positions, split unevenly), the labels' slice stays
// replicated and is cut for each rank with offset -1, and the mean divides by the valid
// targets of the whole group.
Graph shift_inside_loss(int64_t logits_start) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int labels = b.input("labels", {C(2), S()}, "i64", "data");
  const Dim s1 = Dim::seq(1, 1, -1);
  auto slice = [&](int v, std::vector<Dim> shape, int64_t start) {
    std::vector<int64_t> dims(shape.size());
    std::iota(dims.begin(), dims.end(), 0);
    return b.op("index", {v}, std::move(shape),
                {{"dim_map", dims},
                 {"sliced_dims", std::vector<int64_t>{1}},
                 {"slice_starts", std::vector<int64_t>{start}}});
  };
  b.at(2, "shift_logits = logits[..., :-1, :]").target("getitem");
  const int lg = slice(x, {C(2), s1, C(8)}, logits_start);
  b.at(3, "shift_labels = labels[..., 1:]").target("getitem");
  const int tg = slice(labels, {C(2), s1}, 1);
  const int flat = b.at(4).op("reshape", {lg}, {Dim::seq(2, 1, -1), C(8)});
  const int flat_t = b.at(4).op("reshape", {tg}, {Dim::seq(2, 1, -1)});
  const int loss =
      b.at(4).op("cross_entropy", {flat, flat_t}, {},
                 {{"reduction", std::string("mean")}, {"ignore_index", int64_t{-100}}});
  b.at(5).output({loss});
  return b.graph;
}

TEST(UlyssesShift, ShiftInsideLoss) {
  const Graph g = shift_inside_loss(0);
  const SpConfig cfg{.sp_size = 2};
  const SpPlan plan = plan_ulysses(g, cfg);
  EXPECT_GOLDEN("ulysses_shift_inside_loss_p2", golden_text(g, cfg, plan));
  const auto shifts = nodes_with_op(plan, "sp.shift");
  ASSERT_EQ(shifts.size(), 1u);
  EXPECT_EQ(shifts[0]->attrs, (Attrs{{"dim", int64_t{1}},
                                     {"start", int64_t{0}},
                                     {"offset", int64_t{-1}},
                                     {"in_offset", int64_t{0}}}));
  bool labels_cut_unevenly = false;
  for (const Node* n : nodes_with_op(plan, "sp.slice"))
    labels_cut_unevenly = labels_cut_unevenly || n->int_attr("offset", 0) == -1;
  EXPECT_TRUE(labels_cut_unevenly);
  EXPECT_EQ(nodes_with_op(plan, "sp.count_valid").size(), 1u);
  // Dropping the last position exchanges nothing between ranks.
  EXPECT_EQ(plan.collective_counts().count("sp.shift"), 0u);
  EXPECT_EQ(plan_ulysses(shift_inside_loss(1), cfg).collective_counts().at("sp.shift"), 1);
}

// A slice starting past position 0 is a copy on each rank: an in-place write after it into
// anything aliasing it would be lost, so it is refused, naming the write.
TEST(UlyssesShift, InPlaceWriteAfterACopySliceIsRefused) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int y = b.at(2, "y = x[:, 1:]")
                    .op("index", {x}, {C(2), Dim::seq(1, 1, -1), C(8)},
                        {{"dim_map", std::vector<int64_t>{0, 1, 2}},
                         {"sliced_dims", std::vector<int64_t>{1}},
                         {"slice_starts", std::vector<int64_t>{1}}});
  const int w = b.at(3, "x.mul_(2.0)").op("mul", {x}, {C(2), S(), C(8)}, {{"inplace", true}});
  const int s1 = b.at(4).op("sum", {y}, {});
  const int s2 = b.at(4).op("sum", {w}, {});
  const int loss = b.at(4).op("add", {s1, s2}, {});
  b.at(5).output({loss});
  const std::string msg = plan_error([&] { plan_ulysses(b.graph, {.sp_size = 2}); });
  EXPECT_TRUE(contains(msg,
                       "op 'mul' at model.py:3  x.mul_(2.0): found an in-place "
                       "'mul' that writes, after it, into the sequence slice at "
                       "model.py:2"))
      << msg;
}

// A parameter first used inside torch.no_grad() (HRM's early cycles): its gradient sync goes
// where it is used with grad enabled, not into the no_grad region, where the sync's output
// would carry no gradient and, reused afterwards, cut the parameter's gradient.
TEST(UlyssesGradMode, NoGradRegionGetsNoGradSync) {
  GraphBuilder b;
  const int x = b.input("inputs_embeds", {C(2), S(), C(8)}, "f32", "data");
  const int w = b.param("layers.0.weight", {C(8), C(8)});
  b.symbol("nontensor", {}, {{"grad_enabled", false}});
  const int y0 = b.op("linear", {x, w}, {C(2), S(), C(8)});
  b.symbol("nontensor", {}, {{"grad_enabled", true}});
  const int y1 = b.op("linear", {y0, w}, {C(2), S(), C(8)});
  const int loss = b.op("sum", {y1}, {});
  b.output({loss});
  const SpPlan plan = plan_ulysses(b.graph, {.sp_size = 2});
  int no_grad_at = -1, sync_at = -1;
  for (const Node& n : plan.graph.nodes) {
    if (n.bool_attr("grad_enabled", true) == false && n.has_attr("grad_enabled")) no_grad_at = n.id;
    if (n.op == "sp.grad_sync") sync_at = n.id;
  }
  ASSERT_GE(sync_at, 0);
  EXPECT_GT(sync_at, no_grad_at + 2);  // after the no_grad linear and the grad_enabled=true node
  EXPECT_EQ(plan.collective_counts().at("sp.grad_sync"), 1);
}

}  // namespace
}  // namespace autosp
