#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/remat.h"

namespace autosp {
namespace {

bool fusible_kind(RematOpKind kind) {
  return kind == RematOpKind::kCheap || kind == RematOpKind::kView || kind == RematOpKind::kRandom;
}

// Builds a RematGraph the way the Python partition function does: users, fusible_user and
// args derived from each node's inputs.
class GraphBuilder {
 public:
  struct Spec {
    std::string name;
    RematOpKind kind = RematOpKind::kCheap;
    int64_t bytes = 0;
    double flops = 0;
    std::vector<int32_t> inputs;
    bool fw = true;        // required_fw (false: a backward node)
    bool tangent = false;  // depends on a tangent (backward nodes)
    bool primal = false;
    bool param = false;
    bool parameter_collective = false;
    RematSaveCost save_cost = RematSaveCost::kTensor;
    bool output = false;  // one of the forward's outputs
  };

  int32_t add(const Spec& s) {
    RematNode node;
    node.name = s.name;
    node.target = s.name;
    node.layer = s.fw ? "fw" : "bw";
    node.kind = s.kind;
    node.save_cost = s.save_cost;
    node.bytes = s.bytes;
    node.flops = s.flops;
    node.required_fw = s.fw;
    node.required_bw = !s.fw;
    node.tangents_closure = s.tangent;
    node.primal_input = s.primal;
    node.static_lifetime = s.param;
    node.parameter_collective = s.parameter_collective;
    node.forward_output = s.output;
    node.fusible = fusible_kind(s.kind);
    node.args = s.inputs;
    const auto id = static_cast<int32_t>(graph.nodes.size());
    for (int32_t in : s.inputs) {
      RematNode& producer = graph.nodes[in];
      if (std::find(producer.users.begin(), producer.users.end(), id) != producer.users.end()) {
        continue;
      }
      producer.users.push_back(id);
      producer.fusible_user.push_back(producer.fusible && node.fusible);
    }
    graph.nodes.push_back(node);
    return id;
  }

  RematGraph graph;
};

// A 2-op forward (x @ w -> attention) and its backward:
//   x (primal, 1000 B), w (parameter), mm = x @ w (4000 B, 1 MFLOP),
//   attn = attention(mm) (4000 B, 100 MFLOP), backward attention (200 MFLOP) reads mm and attn,
//   backward matmul reads x.
struct TwoOpModel {
  GraphBuilder b;
  int32_t x, w, mm, attn, tangent, attn_bwd, mm_bwd;
  TwoOpModel() {
    using K = RematOpKind;
    x = b.add({.name = "x", .kind = K::kInput, .bytes = 1000, .primal = true});
    w = b.add({.name = "w", .kind = K::kInput, .bytes = 4000, .primal = true, .param = true});
    mm = b.add({.name = "mm", .kind = K::kMatmul, .bytes = 4000, .flops = 1e6, .inputs = {x, w}});
    attn =
        b.add({.name = "attn", .kind = K::kAttention, .bytes = 4000, .flops = 1e8, .inputs = {mm}});
    tangent = b.add(
        {.name = "tangents_1", .kind = K::kInput, .bytes = 4000, .fw = false, .tangent = true});
    attn_bwd = b.add({.name = "attn_bwd",
                      .kind = K::kAttention,
                      .bytes = 4000,
                      .flops = 2e8,
                      .inputs = {tangent, mm, attn},
                      .fw = false,
                      .tangent = true});
    mm_bwd = b.add({.name = "mm_bwd",
                    .kind = K::kMatmul,
                    .bytes = 4000,
                    .flops = 1e6,
                    .inputs = {attn_bwd, x},
                    .fw = false,
                    .tangent = true});
  }
};

// Checks that the backward can be computed from what is saved: every forward value a
// backward or recomputed node reads is saved or recomputed, and nothing banned is recomputed.
void expect_valid_partition(const RematGraph& graph, const RematSolution& s) {
  const auto n = static_cast<int32_t>(graph.nodes.size());
  ASSERT_EQ(static_cast<int32_t>(s.fate.size()), n);
  for (int32_t i : s.recomputed) {
    EXPECT_TRUE(s.ban_reason[i].empty())
        << graph.nodes[i].name << " recomputed despite ban: " << s.ban_reason[i];
    EXPECT_NE(graph.nodes[i].kind, RematOpKind::kInput);
  }
  for (int32_t i = 0; i < n; ++i) {
    const bool reads_in_backward =
        !graph.nodes[i].required_fw || s.fate[i] == RematFate::kRecomputed;
    const bool computed_by_backward_itself =
        graph.nodes[i].required_bw && s.fate[i] != RematFate::kSaved;
    if (!reads_in_backward && !computed_by_backward_itself) continue;
    if (s.fate[i] == RematFate::kSaved) continue;
    for (int32_t p = 0; p < i; ++p) {
      const auto& users = graph.nodes[p].users;
      if (std::find(users.begin(), users.end(), i) == users.end()) continue;
      if (!graph.nodes[p].required_fw) continue;
      EXPECT_TRUE(s.fate[p] == RematFate::kSaved || s.fate[p] == RematFate::kRecomputed)
          << graph.nodes[i].name << " reads " << graph.nodes[p].name << " which is "
          << to_string(s.fate[p]);
    }
  }
}

std::vector<std::string> names(const RematGraph& graph, const std::vector<int32_t>& ids) {
  std::vector<std::string> out;
  for (int32_t i : ids) out.push_back(graph.nodes[i].name);
  return out;
}

TEST(Remat, NoneSavesWhatBackwardReads) {
  TwoOpModel m;
  const RematSolution s = solve_remat(m.b.graph, {.policy = RematPolicy::kNone});
  EXPECT_EQ(names(m.b.graph, s.saved), (std::vector<std::string>{"x", "mm", "attn"}));
  EXPECT_TRUE(s.recomputed.empty());
  EXPECT_EQ(s.saved_bytes, 9000);
  EXPECT_EQ(s.none_saved_bytes, 9000);
  EXPECT_EQ(s.ban_reason[m.mm], "policy 'none'");
  expect_valid_partition(m.b.graph, s);
}

// The saved bytes count each storage once (RematNode::aliases; kinds kept cheap so that 'none'
// saves the aliases themselves): attention's output saved with a view of it (a detach, as a
// region hands both on) is one storage; a transposed weight is the parameter's
// (free); a broadcast view of a small value holds only that value.
TEST(Remat, SavedBytesCountEachStorageOnce) {
  using K = RematOpKind;
  GraphBuilder b;
  const int32_t x = b.add({.name = "x", .kind = K::kInput, .bytes = 1000, .primal = true});
  const int32_t w =
      b.add({.name = "w", .kind = K::kInput, .bytes = 4000, .primal = true, .param = true});
  const int32_t wt = b.add({.name = "wt", .kind = K::kCheap, .bytes = 4000, .inputs = {w}});
  const int32_t mm =
      b.add({.name = "mm", .kind = K::kMatmul, .bytes = 4000, .flops = 1e6, .inputs = {x, wt}});
  const int32_t attn =
      b.add({.name = "attn", .kind = K::kAttention, .bytes = 4000, .flops = 1e8, .inputs = {mm}});
  const int32_t held = b.add({.name = "held", .kind = K::kCheap, .bytes = 4000, .inputs = {attn}});
  const int32_t scale = b.add({.name = "scale", .kind = K::kCheap, .bytes = 40, .inputs = {x}});
  const int32_t wide = b.add({.name = "wide", .kind = K::kCheap, .bytes = 4000, .inputs = {scale}});
  const int32_t tangent =
      b.add({.name = "tangents_1", .kind = K::kInput, .bytes = 4000, .fw = false, .tangent = true});
  b.add({.name = "bwd",
         .kind = K::kAttention,
         .bytes = 4000,
         .flops = 2e8,
         .inputs = {tangent, wt, mm, attn, held, wide},
         .fw = false,
         .tangent = true});
  b.graph.nodes[wt].aliases = w;
  b.graph.nodes[held].aliases = attn;
  b.graph.nodes[wide].aliases = scale;
  const RematSolution s = solve_remat(b.graph, {.policy = RematPolicy::kNone});
  ASSERT_EQ(names(b.graph, s.saved),
            (std::vector<std::string>{"wt", "mm", "attn", "held", "wide"}));
  EXPECT_EQ(s.saved_bytes, 4000 + 4000 + 40);  // mm, attn (held shares it), scale (wide's)
  EXPECT_EQ(s.none_saved_bytes, s.saved_bytes);
  ASSERT_EQ(s.layers.size(), 1u);
  EXPECT_EQ(s.layers[0].saved_bytes, s.saved_bytes);
  EXPECT_EQ(s.layers[0].saved_count, 5);
  (void)x;
}

// One rule of storage ownership: a chain of views ends at the value that aliases nothing; an
// index outside the list, or a cycle (never made, but bounded), ends it too.
TEST(Remat, StorageOwnersFollowAliasChains) {
  EXPECT_EQ(storage_owners({-1, 0, 1, -1, 3, 9}), (std::vector<int32_t>{0, 0, 0, 3, 3, 5}));
  EXPECT_EQ(storage_owner({1, 0}, 0), 0);  // a cycle stops after n steps
  EXPECT_TRUE(storage_owners({}).empty());
}

// A layer ending in tanh, as Inductor decomposes its backward: y = tanh(x) is the forward's
// output, y2 = y * y is computable in the forward, and the backward reads y2 alone. Saving y
// or y2 costs the same; the caller holds y anyway, so sequence-aware saves y and recomputes y2
// (a region saved y2 beside the y its caller held: 1.11x flat's held bytes, compile_time.md).
TEST(Remat, SequenceAwarePrefersAForwardOutputAmongEqualCuts) {
  using K = RematOpKind;
  for (bool output : {false, true}) {
    GraphBuilder b;
    const int32_t x = b.add({.name = "x", .kind = K::kInput, .bytes = 1000, .primal = true});
    const int32_t y = b.add({.name = "y", .bytes = 1000, .inputs = {x}, .output = output});
    const int32_t y2 = b.add({.name = "y2", .bytes = 1000, .inputs = {y, y}});
    const int32_t t = b.add(
        {.name = "tangents_1", .kind = K::kInput, .bytes = 1000, .fw = false, .tangent = true});
    b.add({.name = "grad", .bytes = 1000, .inputs = {t, y2}, .fw = false, .tangent = true});
    const RematSolution s = solve_remat(b.graph, {.policy = RematPolicy::kSequenceAware});
    expect_valid_partition(b.graph, s);
    const std::string chosen = output ? "y" : "y2";
    EXPECT_EQ(names(b.graph, s.saved), std::vector<std::string>{chosen}) << "output " << output;
    EXPECT_EQ(s.saved_bytes, 1000);
  }
}

TEST(Remat, DefaultNeverRecomputesMatmul) {
  TwoOpModel m;
  const RematSolution s = solve_remat(m.b.graph, {.policy = RematPolicy::kDefault});
  EXPECT_EQ(names(m.b.graph, s.saved), (std::vector<std::string>{"x", "mm", "attn"}));
  EXPECT_EQ(s.saved_bytes, 9000);
  EXPECT_EQ(s.ban_reason[m.mm], "not in recomputable allowlist (matmul)");
  EXPECT_EQ(s.ban_reason[m.attn], "not in recomputable allowlist (attention)");
  EXPECT_EQ(s.ban_reason[m.x], "primal input");
  expect_valid_partition(m.b.graph, s);
}

TEST(Remat, SequenceAwareRecomputesCheapMatmul) {
  TwoOpModel m;
  // Step attention FLOPs 3e8; 10% allowance 3e7 admits the 1e6-FLOP matmul.
  const RematSolution s =
      solve_remat(m.b.graph, {.policy = RematPolicy::kSequenceAware, .recompute_flops_ratio = 0.1});
  // w is a parameter: saving it is free (saved_bytes excludes it).
  EXPECT_EQ(names(m.b.graph, s.saved), (std::vector<std::string>{"x", "w", "attn"}));
  EXPECT_EQ(names(m.b.graph, s.recomputed), (std::vector<std::string>{"mm"}));
  EXPECT_EQ(s.saved_bytes, 5000);
  EXPECT_EQ(s.none_saved_bytes, 9000);
  EXPECT_DOUBLE_EQ(s.attention_flops, 3e8);
  EXPECT_DOUBLE_EQ(s.recompute_flops, 1e6);
  EXPECT_EQ(s.admitted_matmuls, 1);
  EXPECT_EQ(s.ban_reason[m.attn], "attention");
  EXPECT_EQ(s.fate[m.mm], RematFate::kRecomputed);
  EXPECT_EQ(s.fate[m.attn_bwd], RematFate::kBackwardOnly);
  ASSERT_EQ(s.layers.size(), 1u);
  EXPECT_EQ(s.layers[0], (RematLayerSummary{.layer = "fw",
                                            .saved_bytes = 5000,
                                            .saved_count = 2,
                                            .recomputed_count = 1,
                                            .recomputed_bytes = 4000,
                                            .recompute_flops = 1e6}));
  expect_valid_partition(m.b.graph, s);
}

TEST(Remat, SequenceAwareKeepsMatmulOverAllowance) {
  TwoOpModel m;
  // 0.1% of 3e8 is 3e5 < 1e6: the matmul stays banned, as at short sequence lengths.
  const RematSolution s = solve_remat(
      m.b.graph, {.policy = RematPolicy::kSequenceAware, .recompute_flops_ratio = 0.001});
  EXPECT_EQ(names(m.b.graph, s.saved), (std::vector<std::string>{"x", "mm", "attn"}));
  EXPECT_EQ(s.ban_reason[m.mm], "matmul over the recompute FLOP allowance");
  EXPECT_EQ(s.admitted_matmuls, 0);
}

TEST(Remat, AdmittedMatmulsGivenOverrideTheAllowance) {
  TwoOpModel m;
  // The allowance (0.1% of 3e8) admits nothing; a choice made over a larger graph (a region's
  // every call, python/autosp/remat_regions.py) admits the matmul all the same, and vice versa.
  RematOptions options{.policy = RematPolicy::kSequenceAware, .recompute_flops_ratio = 0.001};
  options.admitted = std::vector<int32_t>{m.mm};
  RematSolution s = solve_remat(m.b.graph, options);
  EXPECT_EQ(names(m.b.graph, s.recomputed), (std::vector<std::string>{"mm"}));
  EXPECT_EQ(s.admitted, (std::vector<int32_t>{m.mm}));
  options.recompute_flops_ratio = 0.1;
  options.admitted = std::vector<int32_t>{};
  s = solve_remat(m.b.graph, options);
  EXPECT_EQ(names(m.b.graph, s.saved), (std::vector<std::string>{"x", "mm", "attn"}));
  EXPECT_EQ(s.admitted_matmuls, 0);
  options.admitted = std::vector<int32_t>{m.attn};  // not a candidate
  EXPECT_THROW(solve_remat(m.b.graph, options), std::invalid_argument);
  options.admitted = std::vector<int32_t>{m.mm};
  options.budget_bytes = 9000;  // a budget makes its own choice
  EXPECT_THROW(solve_remat(m.b.graph, options), std::invalid_argument);
}

TEST(Remat, AdmitMatmulsTakesMostBytesPerFlopFirstWhileTheyFit) {
  // bytes/FLOP: 10, 5, 10, 1. Order: 2 (ties with 0: the larger first), 0, 1, 3.
  const std::vector<double> flops{1, 2, 3, 1};
  const std::vector<int64_t> bytes{10, 10, 30, 1};
  EXPECT_EQ(admit_matmuls(flops, bytes, 3.5), (std::vector<bool>{false, false, true, false}));
  EXPECT_EQ(admit_matmuls(flops, bytes, 4), (std::vector<bool>{true, false, true, false}));
  // 2 does not fit, 0 does, 1 then does not, 3 does.
  EXPECT_EQ(admit_matmuls(flops, bytes, 2.5), (std::vector<bool>{true, false, false, true}));
  // Equal ties go in graph order.
  EXPECT_EQ(admit_matmuls({1, 1}, {10, 10}, 1), (std::vector<bool>{true, false}));
  EXPECT_EQ(admit_matmuls(flops, bytes, 7), (std::vector<bool>{true, true, true, true}));
  EXPECT_EQ(admit_matmuls(flops, bytes, 0), (std::vector<bool>{false, false, false, false}));
  EXPECT_THROW(admit_matmuls(flops, {1}, 1), std::invalid_argument);
}

TEST(Remat, OnlyMatmulsWhoseRecomputationCanSpareASavedValueAreCandidates) {
  using K = RematOpKind;
  GraphBuilder b;
  const int32_t x = b.add({.name = "x", .kind = K::kInput, .bytes = 100, .primal = true});
  const int32_t w =
      b.add({.name = "w", .kind = K::kInput, .bytes = 100, .primal = true, .param = true});
  // read by the backward through a cheap op and a view
  const int32_t read =
      b.add({.name = "read", .kind = K::kMatmul, .bytes = 100, .flops = 1e3, .inputs = {x, w}});
  const int32_t act = b.add({.name = "act", .kind = K::kCheap, .bytes = 100, .inputs = {read}});
  const int32_t view = b.add({.name = "view", .kind = K::kView, .bytes = 100, .inputs = {act}});
  // its output only summed into a value the backward never reads
  const int32_t unread = b.add(
      {.name = "unread", .kind = K::kMatmul, .bytes = 100, .flops = 1e3, .inputs = {view, w}});
  const int32_t sum =
      b.add({.name = "sum", .kind = K::kCheap, .bytes = 100, .inputs = {unread, x}});
  // read by the backward only past a non-cheap op
  const int32_t past =
      b.add({.name = "past", .kind = K::kMatmul, .bytes = 100, .flops = 1e3, .inputs = {sum, w}});
  const int32_t other = b.add({.name = "other", .kind = K::kOther, .bytes = 100, .inputs = {past}});
  const int32_t tangent =
      b.add({.name = "tangent", .kind = K::kInput, .bytes = 100, .fw = false, .tangent = true});
  b.add({.name = "bw",
         .kind = K::kMatmul,
         .bytes = 100,
         .flops = 1e3,
         .inputs = {view, other, tangent},
         .fw = false,
         .tangent = true});
  EXPECT_EQ(matmul_candidates_in_graph_order(b.graph), (std::vector<int32_t>{read}));
  // A backward node need not depend on a tangent (pow's backward computes pow(x, 1) from the
  // forward's x alone, and runs in the backward).
  GraphBuilder more = b;
  const int32_t late =
      more.add({.name = "late", .kind = K::kMatmul, .bytes = 100, .flops = 1e3, .inputs = {x, w}});
  more.add({.name = "pow_bw", .kind = K::kCheap, .bytes = 100, .inputs = {late}, .fw = false});
  EXPECT_EQ(matmul_candidates_in_graph_order(more.graph), (std::vector<int32_t>{read, late}));
  // A numbered layer's output to the next layer is never recomputed: not a candidate either.
  GraphBuilder layered = b;
  for (RematNode& node : layered.graph.nodes) node.layer = node.required_fw ? "layers.0" : "";
  layered.graph.nodes[act].layer = "layers.1";
  EXPECT_EQ(matmul_candidates_in_graph_order(layered.graph), std::vector<int32_t>{});
}

TEST(Remat, AdmitMatmulsAdmitsAMatmulInEveryAlikeLayerOrInNone) {
  // Two alike layers of two matmuls, and a head. bytes/FLOP 10, 5, 10, 5, 1.
  const std::vector<double> flops{1, 2, 1, 2, 4};
  const std::vector<int64_t> bytes{10, 10, 10, 10, 4};
  const std::vector<std::string> layers{"model.layers.8", "model.layers.8", "model.layers.10",
                                        "model.layers.10", "lm_head"};
  // Each matmul alone: layer 8's second matmul fits and layer 10's does not.
  EXPECT_EQ(admit_matmuls(flops, bytes, 5), (std::vector<bool>{true, true, true, false, false}));
  // By class: the second matmuls cost 4 together, which does not fit beside the first (2).
  EXPECT_EQ(admit_matmuls(flops, bytes, 5, layers),
            (std::vector<bool>{true, false, true, false, false}));
  EXPECT_EQ(admit_matmuls(flops, bytes, 6, layers),
            (std::vector<bool>{true, true, true, true, false}));
  // A class that does not fit is passed over, and a later one that does is admitted.
  EXPECT_EQ(admit_matmuls({1, 2, 1, 2, 2}, {10, 10, 10, 10, 2}, 4.5, layers),
            (std::vector<bool>{true, false, true, false, true}));
  // Layers of another stack, or a matmul of other FLOPs at the same place, are decided apart.
  const std::vector<std::string> two_stacks{"encoder.layers.0", "encoder.layers.0",
                                            "decoder.layers.0", "decoder.layers.0", "lm_head"};
  EXPECT_EQ(admit_matmuls(flops, bytes, 5, two_stacks),
            (std::vector<bool>{true, true, true, false, false}));
  // (Layer 10's second matmul, 3 FLOPs, ties with layer 8's, 2, and goes first.)
  const std::vector<double> other_width{1, 2, 1, 3, 4};
  EXPECT_EQ(admit_matmuls(other_width, {10, 10, 10, 15, 4}, 5, layers),
            (std::vector<bool>{true, false, true, true, false}));
  // Outside numbered layers, each matmul is its own class, as without layers.
  EXPECT_EQ(admit_matmuls(flops, bytes, 5, {"", "", "embed", "embed", "lm_head"}),
            admit_matmuls(flops, bytes, 5));
  EXPECT_THROW(admit_matmuls(flops, bytes, 5, {"layers.0"}), std::invalid_argument);
}

TEST(Remat, SolverAdmitsAsAdmitMatmulsOverItsCandidates) {
  TwoOpModel m;
  const RematGraph& g = m.b.graph;
  EXPECT_EQ(matmul_candidates_in_graph_order(g), (std::vector<int32_t>{m.mm}));
  EXPECT_DOUBLE_EQ(attention_flops(g), 3e8);
  for (double ratio : {0.001, 0.1}) {
    const RematSolution s =
        solve_remat(g, {.policy = RematPolicy::kSequenceAware, .recompute_flops_ratio = ratio});
    const std::vector<bool> chosen =
        admit_matmuls({g.nodes[m.mm].flops}, {g.nodes[m.mm].bytes}, ratio * attention_flops(g));
    EXPECT_EQ(s.admitted_matmuls, chosen[0] ? 1 : 0) << ratio;
  }
}

TEST(Remat, BudgetPicksFewestRecomputations) {
  TwoOpModel m;
  RematOptions options{.policy = RematPolicy::kSequenceAware, .budget_bytes = 9000};
  RematSolution s = solve_remat(m.b.graph, options);
  EXPECT_EQ(s.admitted_matmuls, 0);
  EXPECT_EQ(s.saved_bytes, 9000);
  options.budget_bytes = 5000;
  s = solve_remat(m.b.graph, options);
  EXPECT_EQ(s.admitted_matmuls, 1);
  EXPECT_EQ(s.saved_bytes, 5000);
  EXPECT_EQ(s.budget_bytes, 5000);
  options.budget_bytes.reset();
  options.budget_fraction = 0.6;  // 0.6 * 9000 = 5400
  s = solve_remat(m.b.graph, options);
  EXPECT_EQ(s.budget_bytes, 5400);
  EXPECT_EQ(s.saved_bytes, 5000);
  expect_valid_partition(m.b.graph, s);
}

TEST(Remat, UnreachableBudgetIsAClearError) {
  TwoOpModel m;
  try {
    solve_remat(m.b.graph, {.policy = RematPolicy::kSequenceAware, .budget_bytes = 4999});
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat] memory budget of 4999 bytes cannot be met: recomputing everything the "
              "sequence-aware policy allows (all 1 matmuls; attention, collectives and random "
              "ops are never recomputed) still saves 5000 bytes for backward (policy 'none' "
              "saves 9000)");
  }
}

TEST(Remat, CollectivesAndRandomOpsAreNeverRecomputed) {
  using K = RematOpKind;
  GraphBuilder b;
  const int32_t x = b.add({.name = "x", .kind = K::kInput, .bytes = 100, .primal = true});
  // A huge cheap chain behind small collective/random outputs: recomputing them would save
  // bytes, but both are banned.
  const int32_t big = b.add({.name = "big", .kind = K::kCheap, .bytes = 100, .inputs = {x}});
  const int32_t gather =
      b.add({.name = "all_gather", .kind = K::kCollective, .bytes = 800, .inputs = {big}});
  const int32_t wait =
      b.add({.name = "wait_tensor", .kind = K::kCollective, .bytes = 800, .inputs = {gather}});
  const int32_t rand = b.add({.name = "rand", .kind = K::kRandom, .bytes = 800, .inputs = {x}});
  const int32_t mul =
      b.add({.name = "mul", .kind = K::kCheap, .bytes = 800, .inputs = {wait, rand}});
  const int32_t t =
      b.add({.name = "tangents_1", .kind = K::kInput, .bytes = 800, .fw = false, .tangent = true});
  b.add({.name = "mul_bwd",
         .kind = K::kCheap,
         .bytes = 800,
         .inputs = {t, wait, rand, mul},
         .fw = false,
         .tangent = true});
  const RematSolution s = solve_remat(b.graph, {.policy = RematPolicy::kSequenceAware});
  EXPECT_EQ(s.ban_reason[gather], "collective");
  EXPECT_EQ(s.ban_reason[wait], "collective");
  EXPECT_EQ(s.ban_reason[rand], "random op");
  for (int32_t i : s.recomputed) {
    EXPECT_NE(b.graph.nodes[i].kind, K::kCollective) << b.graph.nodes[i].name;
    EXPECT_NE(b.graph.nodes[i].kind, K::kRandom) << b.graph.nodes[i].name;
  }
  EXPECT_EQ(names(b.graph, s.saved), (std::vector<std::string>{"wait_tensor", "rand"}));
  EXPECT_EQ(names(b.graph, s.recomputed), (std::vector<std::string>{"mul"}));
  expect_valid_partition(b.graph, s);
}

// ZeRO-3: a parameter all-gathered from its shard (and its wait and view) is recomputed for the
// backward under every policy, never saved; an activation's all-gather in the same graph is
// still saved.
TEST(Remat, GatheredParametersAreRecomputedActivationCollectivesSaved) {
  using K = RematOpKind;
  for (const RematPolicy policy :
       {RematPolicy::kNone, RematPolicy::kDefault, RematPolicy::kSequenceAware}) {
    GraphBuilder b;
    const int32_t x = b.add({.name = "x", .kind = K::kInput, .bytes = 100, .primal = true});
    const int32_t shard =
        b.add({.name = "w_shard", .kind = K::kInput, .bytes = 400, .primal = true});
    const int32_t gather = b.add({.name = "w_gather",
                                  .kind = K::kCollective,
                                  .bytes = 800,
                                  .inputs = {shard},
                                  .parameter_collective = true});
    const int32_t wait = b.add({.name = "w_wait",
                                .kind = K::kCollective,
                                .bytes = 800,
                                .inputs = {gather},
                                .parameter_collective = true});
    const int32_t w = b.add({.name = "w_view", .kind = K::kView, .bytes = 800, .inputs = {wait}});
    const int32_t xg =
        b.add({.name = "x_gather", .kind = K::kCollective, .bytes = 200, .inputs = {x}});
    const int32_t xw =
        b.add({.name = "x_wait", .kind = K::kCollective, .bytes = 200, .inputs = {xg}});
    const int32_t mm =
        b.add({.name = "mm", .kind = K::kMatmul, .bytes = 200, .flops = 1e6, .inputs = {xw, w}});
    const int32_t t = b.add(
        {.name = "tangents_1", .kind = K::kInput, .bytes = 200, .fw = false, .tangent = true});
    b.add({.name = "mm_bwd",
           .kind = K::kMatmul,
           .bytes = 200,
           .flops = 2e6,
           .inputs = {t, xw, w, mm},
           .fw = false,
           .tangent = true});
    const RematSolution s = solve_remat(b.graph, {.policy = policy});
    EXPECT_EQ(s.fate[gather], RematFate::kRecomputed) << to_string(policy);
    EXPECT_EQ(s.fate[wait], RematFate::kRecomputed) << to_string(policy);
    EXPECT_EQ(s.fate[w], RematFate::kRecomputed) << to_string(policy);
    EXPECT_EQ(s.fate[xw], RematFate::kSaved) << to_string(policy);
    const std::vector<std::string> saved = names(b.graph, s.saved);
    EXPECT_EQ(std::count(saved.begin(), saved.end(), "w_shard"), 1) << to_string(policy);
    expect_valid_partition(b.graph, s);
  }
}

TEST(Remat, NoFiniteCutNamesThePath) {
  using K = RematOpKind;
  GraphBuilder b;
  const int32_t x = b.add({.name = "x", .kind = K::kInput, .bytes = 8, .primal = true});
  // A tuple-valued op that cannot be saved nor recomputed, read by the backward directly.
  b.add({.name = "opaque",
         .kind = K::kOther,
         .bytes = 8,
         .inputs = {x},
         .save_cost = RematSaveCost::kUnsaveable});
  const int32_t t =
      b.add({.name = "tangents_1", .kind = K::kInput, .bytes = 8, .fw = false, .tangent = true});
  b.add({.name = "bwd",
         .kind = K::kCheap,
         .bytes = 8,
         .inputs = {t, 1},
         .fw = false,
         .tangent = true});
  try {
    solve_remat(b.graph, {.policy = RematPolicy::kSequenceAware});
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat] no valid partition: a value the backward needs can be neither saved nor "
              "recomputed. Path of infinite edges:\n"
              "  source -> opaque_in (cannot recompute: op without a recompute rule)\n"
              "  opaque_in -> opaque_out (cannot save: non-tensor value)\n"
              "  opaque_out -> bwd_in (data dependency)\n"
              "  bwd_in -> sink (backward computes 'bwd')");
  }
}

TEST(Remat, MalformedInputsAreRejected) {
  TwoOpModel m;
  RematGraph bad = m.b.graph;
  bad.nodes[m.attn].users.push_back(m.x);
  bad.nodes[m.attn].fusible_user.push_back(0);
  try {
    solve_remat(bad, {});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat] node 'attn' (index 3) lists user index 0; expected an index in (3, 7): "
              "nodes must be in topological order");
  }
  bad = m.b.graph;
  bad.nodes[m.mm].fusible_user.clear();
  EXPECT_THROW(solve_remat(bad, {}), std::invalid_argument);
  EXPECT_THROW(solve_remat(m.b.graph, {.budget_bytes = 1, .budget_fraction = 0.5}),
               std::invalid_argument);
  EXPECT_THROW(solve_remat(m.b.graph, {.policy = RematPolicy::kDefault, .budget_bytes = 1}),
               std::invalid_argument);
  EXPECT_THROW(solve_remat(m.b.graph, {.budget_fraction = 1.5}), std::invalid_argument);
  EXPECT_THROW(solve_remat(m.b.graph, {.recompute_flops_ratio = -1}), std::invalid_argument);
}

// Brute force: the fewest saved bytes over every saved set from which the backward can be
// computed, given the solver's own bans.
int64_t brute_force_saved_bytes(const RematGraph& graph, const RematSolution& s) {
  const auto n = static_cast<int32_t>(graph.nodes.size());
  std::vector<std::vector<int32_t>> preds(n);
  for (int32_t i = 0; i < n; ++i) {
    for (int32_t u : graph.nodes[i].users) preds[u].push_back(i);
  }
  std::vector<int32_t> fw;
  for (int32_t i = 0; i < n; ++i) {
    if (graph.nodes[i].required_fw) fw.push_back(i);
  }
  int64_t best = -1;
  for (uint32_t mask = 0; mask < (1u << fw.size()); ++mask) {
    std::vector<bool> saved(n, false);
    int64_t bytes = 0;
    for (size_t k = 0; k < fw.size(); ++k) {
      if (mask >> k & 1) {
        saved[fw[k]] = true;
        bytes += graph.nodes[fw[k]].bytes;
      }
    }
    // available[i]: the backward can have node i (forward nodes in topological order).
    std::vector<bool> available(n, false);
    bool ok = true;
    for (int32_t i = 0; i < n && ok; ++i) {
      const RematNode& node = graph.nodes[i];
      bool inputs_ok = true;
      for (int32_t p : preds[i]) inputs_ok = inputs_ok && available[p];
      if (node.required_fw) {
        const bool recomputable =
            node.kind != RematOpKind::kInput && s.ban_reason[i].empty() && inputs_ok;
        available[i] = saved[i] || recomputable;
      } else {
        available[i] = inputs_ok || node.kind == RematOpKind::kInput;
        ok = available[i];
      }
    }
    if (ok && (best < 0 || bytes < best)) best = bytes;
  }
  return best;
}

TEST(Remat, RandomGraphsAreOptimalAndValid) {
  using K = RematOpKind;
  std::mt19937 rng(7);
  const K kinds[] = {K::kCheap, K::kCheap, K::kMatmul, K::kAttention, K::kView, K::kRandom};
  for (int trial = 0; trial < 300; ++trial) {
    GraphBuilder b;
    const int num_inputs = 1 + static_cast<int>(rng() % 2);
    const int num_fw = 3 + static_cast<int>(rng() % 6);
    for (int i = 0; i < num_inputs; ++i) {
      b.add({.name = "in" + std::to_string(i),
             .kind = K::kInput,
             .bytes = 1000 * (1 + static_cast<int64_t>(rng() % 4)),
             .primal = true});
    }
    for (int i = 0; i < num_fw; ++i) {
      const auto id = static_cast<int32_t>(b.graph.nodes.size());
      std::vector<int32_t> inputs{static_cast<int32_t>(rng() % id)};
      if (rng() % 2) inputs.push_back(static_cast<int32_t>(rng() % id));
      b.add({.name = "f" + std::to_string(i),
             .kind = kinds[rng() % 6],
             .bytes = 1000 * (1 + static_cast<int64_t>(rng() % 8)),
             .flops = 1e6 * (1 + static_cast<double>(rng() % 5)),
             .inputs = inputs});
    }
    const auto fw_end = static_cast<int32_t>(b.graph.nodes.size());
    const int32_t t = b.add(
        {.name = "tangents_1", .kind = K::kInput, .bytes = 1000, .fw = false, .tangent = true});
    for (int i = 0; i < 3; ++i) {
      std::vector<int32_t> inputs{t, static_cast<int32_t>(rng() % fw_end)};
      if (rng() % 2) inputs.push_back(static_cast<int32_t>(rng() % fw_end));
      b.add({.name = "b" + std::to_string(i),
             .kind = K::kCheap,
             .bytes = 1000,
             .inputs = inputs,
             .fw = false,
             .tangent = true});
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    for (RematPolicy policy :
         {RematPolicy::kNone, RematPolicy::kDefault, RematPolicy::kSequenceAware}) {
      const RematSolution s =
          solve_remat(b.graph, {.policy = policy, .recompute_flops_ratio = 10.0});
      expect_valid_partition(b.graph, s);
      if (policy != RematPolicy::kDefault) {  // default weights are not plain bytes
        EXPECT_EQ(s.saved_bytes, brute_force_saved_bytes(b.graph, s)) << to_string(policy);
      }
      // PyTorch's default weights (distance bias, unmaterialised x2) may save more than 'none'.
      if (policy != RematPolicy::kDefault) {
        EXPECT_LE(s.saved_bytes, s.none_saved_bytes) << to_string(policy);
      }
    }
  }
}

}  // namespace
}  // namespace autosp
