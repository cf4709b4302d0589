#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "memory_builder.h"
#include "plan/memory.h"

namespace autosp {
namespace {

MemoryOptions fp32_options(RematStrategy strategy, int64_t num_params) {
  MemoryOptions o;
  o.strategy = strategy;
  o.training = TrainingConfig{.num_params = num_params, .dtype = DtypePolicy::kFp32};
  return o;
}

// x -> a = mm(x, p) -> b = relu(a) -> loss = sum(b); backward: gb = relu_bw(t, b) and, if
// `p_grad`, gp = mm(x, gb) (p's gradient). Sizes in bytes: p `p_bytes`, x 8*S, a and b 16*S,
// loss 4.
MemoryGraph mm_relu_layer(int64_t p_bytes, bool p_grad) {
  using S = MemoryGraphBuilder::Spec;
  MemoryGraphBuilder g;
  const int p =
      g.add(S{.name = "p", .role = MemoryRole::kParameter, .bytes = SeqBytes::constant(p_bytes)});
  const int x = g.add(S{.name = "x", .role = MemoryRole::kInput, .bytes = SeqBytes::term(8, 1)});
  const int a = g.add(S{
      .name = "a", .kind = RematOpKind::kMatmul, .bytes = SeqBytes::term(16, 1), .inputs = {x, p}});
  const int b = g.add(S{.name = "b", .bytes = SeqBytes::term(16, 1), .inputs = {a}});
  g.add(S{.name = "loss", .bytes = SeqBytes::constant(4), .inputs = {b}, .forward_output = true});
  const int t = g.add(S{.name = "t",
                        .role = MemoryRole::kTangent,
                        .bytes = SeqBytes::constant(4),
                        .fw = false,
                        .tangent = true});
  const int gb = g.add(S{.name = "gb",
                         .bytes = SeqBytes::term(16, 1),
                         .inputs = {t, b},
                         .fw = false,
                         .tangent = true});
  if (p_grad) {
    g.add(S{.name = "gp",
            .kind = RematOpKind::kMatmul,
            .bytes = SeqBytes::constant(p_bytes),
            .inputs = {x, gb},
            .fw = false,
            .tangent = true,
            .gradient = true});
  }
  return g.graph;
}

MemoryGraph one_layer() { return mm_relu_layer(100, true); }

TEST(MemorySizes, EvaluatesTermsAndPrints) {
  const SeqBytes b{{{64, 1, 2}, {16, 0, 1}}};
  EXPECT_EQ(b.at(8), 64 * 8 / 2 + 16);
  EXPECT_EQ(b.str(), "64*S/2 + 16");
  EXPECT_EQ(SeqBytes::term(3, 2).at(1000), 3'000'000);
  EXPECT_EQ(SeqBytes{}.at(7), 0);
  EXPECT_DOUBLE_EQ((SeqFlops{2.5, 2}.at(4)), 40.0);
}

TEST(MemorySizes, RejectsSequenceNotMultipleOfShard) {
  try {
    SeqBytes::term(16, 1, 3).at(10);
    FAIL() << "expected invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected S a multiple of 3"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(SeqBytes::term(int64_t{1} << 40, 3).at(int64_t{1} << 20), std::overflow_error);
}

TEST(MemoryOptimizer, StateAndWorkspacePerDtypeAndSharding) {
  EXPECT_EQ(optimizer_state_bytes({.num_params = 1000, .dtype = DtypePolicy::kFp32}), 8000);
  EXPECT_EQ(optimizer_workspace_bytes({.num_params = 1000, .dtype = DtypePolicy::kFp32}), 4000);
  const TrainingConfig bf16{
      .num_params = 1000, .dtype = DtypePolicy::kBf16Mixed, .optimizer_shards = 4};
  EXPECT_EQ(optimizer_state_bytes(bf16), 4000);
  EXPECT_EQ(optimizer_workspace_bytes(bf16), 1000);
  EXPECT_EQ(optimizer_workspace_bytes({.num_params = 1000, .optimizer_foreach = false}), 0);
  // ZeRO-3: the fp32 parameter and gradient shards are the master weights; moments sharded.
  const TrainingConfig zero3{.num_params = 1000,
                             .dtype = DtypePolicy::kBf16Mixed,
                             .optimizer_shards = 2,
                             .param_shards = 4};
  EXPECT_EQ(optimizer_state_bytes(zero3), 2000);
  EXPECT_EQ(optimizer_workspace_bytes(zero3), 1000);
  EXPECT_EQ(host_optimizer_bytes(zero3), 0);
  // ZeRO-Offload: the whole state on the host, nothing of it (nor step temporaries) on the device.
  const TrainingConfig offload{
      .num_params = 1000, .dtype = DtypePolicy::kBf16Mixed, .optimizer_offload = true};
  EXPECT_EQ(optimizer_state_bytes(offload), 0);
  EXPECT_EQ(optimizer_workspace_bytes(offload), 0);
  EXPECT_EQ(host_optimizer_bytes(offload), 16000);
  EXPECT_EQ(host_optimizer_bytes({.num_params = 1000, .optimizer_offload = true}), 16000);
}

// Worked by hand at S = 10 (policy none saves b): persistent params 100 + optimizer 200 +
// input x 80. Forward peak while b is computed: + a 160 + b 160 = 700. Backward, while gb is
// computed: saved b 160, loss 4, tangent 4, gb 160 -> 708. Optimizer: gp 100 + loss 4 +
// workspace 100 -> 584.
TEST(MemorySimulator, OneLayerPeakByHand) {
  const MemoryGraph g = one_layer();
  const MemoryBreakdown b = simulate_peak_memory(g, 10, fp32_options(RematStrategy::kNone, 25));
  EXPECT_EQ(b, (MemoryBreakdown{.seq_len = 10,
                                .parameters = 100,
                                .gradients = 0,
                                .optimizer_state = 200,
                                .saved_activations = 160,
                                .transient = 168,
                                .communication = 0,
                                .inputs = 80,
                                .peak = 708,
                                .phase = "backward",
                                .peak_node = "gb",
                                .saved_bytes = b.saved_bytes,
                                .saved_count = b.saved_count,
                                .recomputed_count = 0}));
  // b is saved; x (an input the backward reads) is saved too and counted once, as an input.
  EXPECT_EQ(b.saved_bytes, 160 + 80);
}

TEST(MemorySimulator, OptimizerPhaseWhenActivationsAreSmall) {
  const MemoryGraph g = one_layer();
  // S = 1: forward 300 + 8 + 32 = 340, backward 308 + 40 = 348; optimizer with 1000 params:
  // optimizer state 8000 + workspace 4000 + params 100 + grads 100 + loss 4 + x 8.
  const MemoryBreakdown b = simulate_peak_memory(g, 1, fp32_options(RematStrategy::kNone, 1000));
  EXPECT_EQ(b.phase, "optimizer");
  EXPECT_EQ(b.peak, 8000 + 4000 + 100 + 100 + 4 + 8);
  EXPECT_EQ(b.gradients, 100);
  EXPECT_EQ(b.optimizer_state, 12000);
}

// The same step with the optimizer offloaded: the device keeps params 100 + grads 100 + loss 4
// + x 8 = 212 in the step. The backward, at gp: params 100 + x 8 + gb 16 + gp 100 + loss 4 =
// 228, the peak (without offload it was 8000 + 4000 + 212 in the step).
TEST(MemorySimulator, OffloadedOptimizerLeavesOnlyParamsAndGradients) {
  const MemoryGraph g = one_layer();
  MemoryOptions o = fp32_options(RematStrategy::kNone, 1000);
  o.training.optimizer_offload = true;
  const MemoryBreakdown b = simulate_peak_memory(g, 1, o);
  EXPECT_EQ(b.phase, "backward");
  EXPECT_EQ(b.peak, 228);
  EXPECT_EQ(b.optimizer_state, 0);
}

// ZeRO-3 over 4 ranks, S = 10, policy none: persistent shard 250 and AdamW moments
// 8 * 250 / 4 = 500, input x 80. Forward, at a: + gathered p 1000 + a 160 = 1990 (p is freed
// after its last use, a). Backward, at gp: p's full gradient 1000, gb 160, loss 4 -> 1994, the
// peak; then only its shard (250) is kept.
TEST(MemorySimulator, ShardedParametersAreGatheredWhereUsed) {
  MemoryOptions o = fp32_options(RematStrategy::kNone, 250);
  o.training.param_shards = 4;
  const MemoryBreakdown b = simulate_peak_memory(mm_relu_layer(1000, true), 10, o);
  EXPECT_EQ(b.peak, 1994);
  EXPECT_EQ(b.phase, "backward");
  EXPECT_EQ(b.peak_node, "gp");
  EXPECT_EQ(b.parameters, 250);
  EXPECT_EQ(b.gradients, 1000);
  EXPECT_EQ(b.optimizer_state, 500);
  // Without p's gradient the forward's gather is the peak: at a, 250 + 500 + x 80 + 1000 + 160.
  const MemoryBreakdown f = simulate_peak_memory(mm_relu_layer(1000, false), 10, o);
  EXPECT_EQ(f.phase, "forward");
  EXPECT_EQ(f.peak_node, "a");
  EXPECT_EQ(f.peak, 1990);
  EXPECT_EQ(f.communication, 1000);
}

TEST(MemorySimulator, ViewsShareTheirBaseStorage) {
  using S = MemoryGraphBuilder::Spec;
  MemoryGraphBuilder g;
  const int x = g.add(S{.name = "x", .role = MemoryRole::kInput, .bytes = SeqBytes::term(8, 1)});
  const int a = g.add(S{.name = "a", .bytes = SeqBytes::term(16, 1), .inputs = {x}});
  const int v = g.add(S{.name = "v",
                        .kind = RematOpKind::kView,
                        .bytes = SeqBytes::term(16, 1),
                        .inputs = {a},
                        .alias_of = a});
  g.add(S{.name = "loss", .bytes = SeqBytes::constant(4), .inputs = {v}, .forward_output = true});
  const MemoryBreakdown b =
      simulate_peak_memory(g.graph, 10, fp32_options(RematStrategy::kNone, 0));
  EXPECT_EQ(b.peak, 80 + 160 + 4);  // the view allocates nothing and keeps a alive to loss
}

MemoryGraph two_layers() {
  using S = MemoryGraphBuilder::Spec;
  MemoryGraphBuilder g;
  const int p =
      g.add(S{.name = "p", .role = MemoryRole::kParameter, .bytes = SeqBytes::constant(64)});
  const int x = g.add(S{.name = "x", .role = MemoryRole::kInput, .bytes = SeqBytes::term(8, 1)});
  const int a0 = g.add(S{.name = "a0",
                         .kind = RematOpKind::kMatmul,
                         .bytes = SeqBytes::term(16, 1),
                         .inputs = {x, p},
                         .layer = "layers.0"});
  const int b0 =
      g.add(S{.name = "b0", .bytes = SeqBytes::term(16, 1), .inputs = {a0}, .layer = "layers.0"});
  const int a1 = g.add(S{.name = "a1",
                         .kind = RematOpKind::kMatmul,
                         .bytes = SeqBytes::term(16, 1),
                         .inputs = {b0, p},
                         .layer = "layers.1"});
  const int b1 =
      g.add(S{.name = "b1", .bytes = SeqBytes::term(16, 1), .inputs = {a1}, .layer = "layers.1"});
  g.add(S{.name = "loss", .bytes = SeqBytes::constant(4), .inputs = {b1}, .forward_output = true});
  const int t = g.add(S{.name = "t",
                        .role = MemoryRole::kTangent,
                        .bytes = SeqBytes::constant(4),
                        .fw = false,
                        .tangent = true});
  const int g1 = g.add(S{.name = "g1",
                         .bytes = SeqBytes::term(16, 1),
                         .inputs = {t, a1},
                         .fw = false,
                         .tangent = true,
                         .layer = "layers.1"});
  const int g0 = g.add(S{.name = "g0",
                         .kind = RematOpKind::kMatmul,
                         .bytes = SeqBytes::term(16, 1),
                         .inputs = {g1, p},
                         .fw = false,
                         .tangent = true,
                         .layer = "layers.0"});
  const int h0 = g.add(S{.name = "h0",
                         .bytes = SeqBytes::term(16, 1),
                         .inputs = {g0, a0},
                         .fw = false,
                         .tangent = true,
                         .layer = "layers.0"});
  g.add(S{.name = "gp",
          .kind = RematOpKind::kMatmul,
          .bytes = SeqBytes::constant(64),
          .inputs = {x, h0, b0},
          .fw = false,
          .tangent = true,
          .gradient = true});
  return g.graph;
}

TEST(MemoryFullCheckpoint, SavesOnlyLayerInputsAndRecomputesTheRest) {
  const MemoryGraph g = two_layers();
  const auto none = decide_fates(g, 10, fp32_options(RematStrategy::kNone, 16));
  const auto full = decide_fates(g, 10, fp32_options(RematStrategy::kFullCheckpoint, 16));
  // a0 (inside layers.0, read by the backward) is saved by policy none, recomputed by full
  // checkpointing; b0 leaves layers.0 (a1 in layers.1 reads it), so full saves it.
  EXPECT_EQ(none[2], RematFate::kSaved);
  EXPECT_EQ(full[2], RematFate::kRecomputed);
  EXPECT_EQ(full[3], RematFate::kSaved);
  // a1 is read by the backward and stays inside layers.1: recomputed from b0.
  EXPECT_EQ(none[4], RematFate::kSaved);
  EXPECT_EQ(full[4], RematFate::kRecomputed);
  const MemoryBreakdown bn = simulate_peak_memory(g, 1000, fp32_options(RematStrategy::kNone, 16));
  const MemoryBreakdown bf =
      simulate_peak_memory(g, 1000, fp32_options(RematStrategy::kFullCheckpoint, 16));
  EXPECT_LT(bf.saved_bytes, bn.saved_bytes);
  EXPECT_EQ(bf.recomputed_count, 2);
}

// FLOPs: every compute node once (step_flops), plus what is computed again (recompute_flops):
// the nodes the strategy recomputes and each op's own inner recomputation.
TEST(MemoryFlops, StepAndRecomputedFlopsPerStrategy) {
  MemoryGraph g = two_layers();
  double step = 0;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.nodes[i].role != MemoryRole::kCompute) continue;
    g.nodes[i].flops = SeqFlops{static_cast<double>(i + 1), 1};  // (i + 1) * S
    step += static_cast<double>(i + 1) * 1000;
  }
  const MemoryBreakdown bn = simulate_peak_memory(g, 1000, fp32_options(RematStrategy::kNone, 16));
  EXPECT_DOUBLE_EQ(bn.step_flops, step);
  EXPECT_DOUBLE_EQ(bn.recompute_flops, 0);
  const auto fates = decide_fates(g, 1000, fp32_options(RematStrategy::kFullCheckpoint, 16));
  double recomputed = 0;
  for (size_t i = 0; i < fates.size(); ++i)
    if (fates[i] == RematFate::kRecomputed) recomputed += static_cast<double>(i + 1) * 1000;
  ASSERT_GT(recomputed, 0);
  const MemoryBreakdown bf =
      simulate_peak_memory(g, 1000, fp32_options(RematStrategy::kFullCheckpoint, 16));
  EXPECT_DOUBLE_EQ(bf.step_flops, step);
  EXPECT_DOUBLE_EQ(bf.recompute_flops, recomputed);  // a0 (3 * S) and a1 (5 * S)
  EXPECT_DOUBLE_EQ(recomputed, (3 + 5) * 1000);
  // An op's inner recomputation counts under every strategy, at S^power.
  g.nodes[8].inner_recompute_flops = SeqFlops{2, 2};  // g1, a backward op
  const MemoryBreakdown bi = simulate_peak_memory(g, 1000, fp32_options(RematStrategy::kNone, 16));
  EXPECT_DOUBLE_EQ(bi.recompute_flops, 2.0 * 1000 * 1000);
  EXPECT_DOUBLE_EQ(bi.step_flops, step);
}

// Sequence-aware remat keeps the hidden state a layer hands to the next: otherwise the cheapest
// cut saves the small input and recomputes every layer from it at the start of the backward,
// where all of it stays live until each layer's backward runs.
TEST(MemorySequenceAware, KeepsTheHiddenStateBetweenLayers) {
  using S = MemoryGraphBuilder::Spec;
  MemoryGraphBuilder g;
  const int x = g.add(S{.name = "x", .role = MemoryRole::kInput, .bytes = SeqBytes::term(1, 1)});
  const int h0 =
      g.add(S{.name = "h0", .bytes = SeqBytes::term(4, 1), .inputs = {x}, .layer = "layers.0"});
  const int h1 =
      g.add(S{.name = "h1", .bytes = SeqBytes::term(4, 1), .inputs = {h0}, .layer = "layers.1"});
  const int y =
      g.add(S{.name = "y", .bytes = SeqBytes::term(4, 1), .inputs = {h1}, .layer = "layers.1"});
  g.add(S{.name = "loss", .bytes = SeqBytes::constant(4), .inputs = {y}, .forward_output = true});
  const int t = g.add(S{.name = "t",
                        .role = MemoryRole::kTangent,
                        .bytes = SeqBytes::constant(4),
                        .fw = false,
                        .tangent = true});
  const int g1 = g.add(S{.name = "g1",
                         .bytes = SeqBytes::term(4, 1),
                         .inputs = {t, y},
                         .fw = false,
                         .tangent = true,
                         .layer = "layers.1"});
  g.add(S{.name = "g0",
          .bytes = SeqBytes::term(4, 1),
          .inputs = {g1, h0},
          .fw = false,
          .tangent = true,
          .layer = "layers.0"});
  RematGraph facts;
  for (const MemoryNode& m : g.graph.nodes) facts.nodes.push_back(m.facts);
  RematOptions o;
  o.policy = RematPolicy::kSequenceAware;
  const RematSolution sol = solve_remat(facts, o);
  EXPECT_EQ(sol.ban_reason[h0], "a layer's output to the next layer");
  EXPECT_EQ(sol.ban_reason[y], "a layer's output to the next layer");  // the last, to the loss
  EXPECT_TRUE(sol.ban_reason[h1].empty());  // read inside its own layer only
  // Without the ban the cut is x alone (1 byte per position against 4): h0, h1 and y all
  // recomputed at the start of the backward.
  EXPECT_EQ(sol.fate[h0], RematFate::kSaved);
  EXPECT_EQ(sol.fate[y], RematFate::kSaved);
  EXPECT_NE(sol.fate[h1], RematFate::kRecomputed);
  EXPECT_TRUE(sol.offloaded.empty());  // offload is off by default
  // With activation offload, exactly those layer outputs go to host memory (x, an input, and
  // h1, read inside its layer, stay).
  o.offload_layer_outputs = true;
  for (size_t i = 0; i < facts.nodes.size(); ++i)  // sizes at S = 100
    facts.nodes[i].bytes = g.graph.nodes[i].save_bytes.at(100);
  const RematSolution off = solve_remat(facts, o);
  EXPECT_EQ(off.saved, sol.saved);
  EXPECT_EQ(off.offloaded, (std::vector<int32_t>{h0, y}));
  EXPECT_EQ(off.offloaded_bytes, facts.nodes[h0].bytes + facts.nodes[y].bytes);
  EXPECT_GT(off.offloaded_bytes, 0);
  // The memory model decides the same (it calls the solver).
  const auto fates = decide_fates(g.graph, 100, fp32_options(RematStrategy::kSequenceAware, 0));
  EXPECT_EQ(fates[h0], RematFate::kSaved);
}

// Activation offload: the hidden states layers hand to each other leave the device after their
// last forward use and come back for the backward, one ahead of use. Four layers: without
// offload, the backward starts with all four hidden states live; with it, at most the one
// being read and the one prefetched.
TEST(MemoryOffload, LayerOutputsLeaveTheDeviceBetweenForwardAndBackward) {
  using S = MemoryGraphBuilder::Spec;
  MemoryGraphBuilder g;
  int prev = g.add(S{.name = "x", .role = MemoryRole::kInput, .bytes = SeqBytes::term(1, 1)});
  std::vector<int> h;
  for (int k = 0; k < 4; ++k) {
    const std::string layer = "layers." + std::to_string(k);
    prev = g.add(S{.name = "h" + std::to_string(k),
                   .bytes = SeqBytes::term(8, 1),
                   .inputs = {prev},
                   .layer = layer});
    h.push_back(prev);
  }
  g.add(
      S{.name = "loss", .bytes = SeqBytes::constant(4), .inputs = {prev}, .forward_output = true});
  int grad = g.add(S{.name = "t",
                     .role = MemoryRole::kTangent,
                     .bytes = SeqBytes::constant(4),
                     .fw = false,
                     .tangent = true});
  for (int k = 3; k >= 0; --k)
    grad = g.add(S{.name = "g" + std::to_string(k),
                   .bytes = SeqBytes::term(8, 1),
                   .inputs = {grad, h[static_cast<size_t>(k)]},
                   .fw = false,
                   .tangent = true,
                   .layer = "layers." + std::to_string(k)});
  MemoryOptions plain = fp32_options(RematStrategy::kSequenceAware, 0);
  MemoryOptions offload = plain;
  offload.offload_layer_outputs = true;
  const int64_t seq = 1000;
  const MemoryBreakdown a = simulate_peak_memory(g.graph, seq, plain);
  const MemoryBreakdown b = simulate_peak_memory(g.graph, seq, offload);
  EXPECT_EQ(a.offloaded_bytes, 0);
  EXPECT_EQ(b.saved_bytes, a.saved_bytes);  // the same saved set, kept elsewhere
  EXPECT_EQ(b.offloaded_bytes, 4 * 8 * seq);
  // Plain, at g3 (the backward's first op): x, the four hidden states, g3, t and the loss.
  EXPECT_EQ(a.peak, 1 * seq + 4 * 8 * seq + 8 * seq + 4 + 4);
  // Offload, at g2: x, two hidden states (h2 read, h1 prefetched), g3 and g2, the loss.
  EXPECT_EQ(b.peak, 1 * seq + 2 * 8 * seq + 2 * 8 * seq + 4);
  EXPECT_EQ(b.peak_node, "g2");
  EXPECT_EQ(b.host_bytes, b.offloaded_bytes);
  // A host budget bounds the longest S too: 32 bytes per position offloaded, so 32,000 bytes
  // of host memory stop the search at S = 1000 however much device memory there is.
  const TrainabilityQuery roomy{
      .budget_bytes = int64_t{1} << 40, .seq_multiple = 100, .max_seq = 100'000};
  EXPECT_EQ(longest_trainable_seq(g.graph, offload, roomy).longest_seq, 100'000);
  TrainabilityQuery host = roomy;
  host.host_budget_bytes = 32 * 1000;
  const Trainability t = longest_trainable_seq(g.graph, offload, host);
  EXPECT_EQ(t.longest_seq, 1000);
  EXPECT_EQ(t.at_longest.host_bytes, 32 * 1000);
  EXPECT_GT(t.first_oom.host_bytes, host.host_budget_bytes);
  EXPECT_LE(t.first_oom.peak, roomy.budget_bytes);  // the device would have had room
  // The offloaded optimizer's host state counts too.
  MemoryOptions both = offload;
  both.training.num_params = 100;
  both.training.optimizer_offload = true;
  EXPECT_EQ(simulate_peak_memory(g.graph, seq, both).host_bytes, 4 * 8 * seq + 1600);
  // Full checkpointing (no solver) offloads nothing.
  MemoryOptions full = fp32_options(RematStrategy::kFullCheckpoint, 0);
  full.offload_layer_outputs = true;
  full.offload_layer_saved = true;
  EXPECT_EQ(simulate_peak_memory(g.graph, seq, full).offloaded_bytes, 0);
}

// Offloading every saved tensor of a layer (RematOptions::offload_layer_saved), as ALST offloads
// each layer's checkpoint: four layers that each save an inner value a_k (which the solver
// must keep: it is not recomputable) besides the hidden state h_k they hand on. Layer outputs
// alone leave the a_k on the device for the whole backward; all saved tensors leave only the
// ones being read and prefetched.
TEST(MemoryOffload, EverySavedTensorOfALayerLeavesTheDevice) {
  using S = MemoryGraphBuilder::Spec;
  MemoryGraphBuilder g;
  int prev = g.add(S{.name = "x", .role = MemoryRole::kInput, .bytes = SeqBytes::term(1, 1)});
  std::vector<int> a, h;
  for (int k = 0; k < 4; ++k) {
    const std::string layer = "layers." + std::to_string(k);
    a.push_back(g.add(S{.name = "a" + std::to_string(k),
                        .kind = RematOpKind::kOther,
                        .bytes = SeqBytes::term(8, 1),
                        .inputs = {prev},
                        .layer = layer}));
    prev = g.add(S{.name = "h" + std::to_string(k),
                   .bytes = SeqBytes::term(8, 1),
                   .inputs = {a.back()},
                   .layer = layer});
    h.push_back(prev);
  }
  g.add(
      S{.name = "loss", .bytes = SeqBytes::constant(4), .inputs = {prev}, .forward_output = true});
  int grad = g.add(S{.name = "t",
                     .role = MemoryRole::kTangent,
                     .bytes = SeqBytes::constant(4),
                     .fw = false,
                     .tangent = true});
  for (int k = 3; k >= 0; --k)
    grad = g.add(S{.name = "g" + std::to_string(k),
                   .bytes = SeqBytes::term(8, 1),
                   .inputs = {grad, a[static_cast<size_t>(k)]},
                   .fw = false,
                   .tangent = true,
                   .layer = "layers." + std::to_string(k)});
  const int64_t seq = 1000;
  MemoryOptions outputs = fp32_options(RematStrategy::kSequenceAware, 0);
  outputs.offload_layer_outputs = true;
  MemoryOptions all = outputs;
  all.offload_layer_saved = true;
  const RematDecision d = decide_remat(g.graph, seq, all);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(d.fate[a[static_cast<size_t>(k)]], RematFate::kSaved);
  const MemoryBreakdown o = simulate_peak_memory(g.graph, seq, outputs);
  const MemoryBreakdown b = simulate_peak_memory(g.graph, seq, all);
  EXPECT_EQ(b.saved_bytes, o.saved_bytes);
  EXPECT_TRUE(decide_remat(g.graph, seq, outputs).offloaded.empty());
  // As PyTorch's offloading pass: a tensor not known to be contiguous stays on the device.
  MemoryGraph strided = g.graph;
  strided.nodes[static_cast<size_t>(a[1])].facts.contiguous = false;
  const RematDecision d1 = decide_remat(strided, seq, all);
  EXPECT_EQ(std::find(d1.offloaded.begin(), d1.offloaded.end(), a[1]), d1.offloaded.end());
  EXPECT_EQ(d1.offloaded.size(), d.offloaded.size() - 1);
  for (int k = 0; k < 4; ++k) {
    EXPECT_NE(std::find(d.offloaded.begin(), d.offloaded.end(), a[static_cast<size_t>(k)]),
              d.offloaded.end());
  }
  // The backward reads the a_k only: the saved set is the four a_k, all offloaded (the layer
  // outputs h_k are not saved, so offloading only those moves nothing).
  EXPECT_EQ(b.offloaded_bytes, b.saved_bytes);
  EXPECT_EQ(b.saved_bytes, 4 * 8 * seq);
  EXPECT_EQ(o.offloaded_bytes, 0);
  // Layer outputs only, at g3: x, the four a_k, g3, t and the loss.
  EXPECT_EQ(o.peak, 1 * seq + 4 * 8 * seq + 8 * seq + 4 + 4);
  // All saved, at g2: x, two a_k (a2 read, a1 prefetched), g3 and g2, the loss.
  EXPECT_EQ(b.peak, 1 * seq + 2 * 8 * seq + 2 * 8 * seq + 4);
  EXPECT_EQ(b.peak_node, "g2");
}

// Offload reaches a saved view (q_proj's output viewed as heads, SDPA's output through a
// getitem): the partitioner hands PyTorch's pass a copy of it, so what it views leaves the
// device as a saved tensor of its own would. The graph of EverySavedTensorOfALayerLeavesTheDevice
// with each layer's backward reading v_k, a contiguous view of a_k.
TEST(MemoryOffload, ASavedViewLeavesTheDeviceThroughACopy) {
  using S = MemoryGraphBuilder::Spec;
  auto build = [](bool strided_view, bool second_alias) {
    MemoryGraphBuilder g;
    int prev = g.add(S{.name = "x", .role = MemoryRole::kInput, .bytes = SeqBytes::term(1, 1)});
    std::vector<int> v, w;
    for (int k = 0; k < 4; ++k) {
      const std::string layer = "layers." + std::to_string(k);
      const int a = g.add(S{.name = "a" + std::to_string(k),
                            .kind = RematOpKind::kOther,
                            .bytes = SeqBytes::term(8, 1),
                            .inputs = {prev},
                            .layer = layer});
      auto view_of_a = [&](const std::string& name, bool strided) {
        return g.add(S{.name = name + std::to_string(k),
                       .kind = RematOpKind::kView,
                       .bytes = SeqBytes::term(8, 1),
                       .inputs = {a},
                       .layer = layer,
                       .alias_of = a,
                       .non_contiguous = strided});
      };
      v.push_back(view_of_a("v", strided_view));
      // A transposed view of the same storage, also read by the backward.
      if (second_alias) w.push_back(view_of_a("w", true));
      prev = g.add(S{.name = "h" + std::to_string(k),
                     .bytes = SeqBytes::term(8, 1),
                     .inputs = {v.back()},
                     .layer = layer});
    }
    g.add(S{
        .name = "loss", .bytes = SeqBytes::constant(4), .inputs = {prev}, .forward_output = true});
    int grad = g.add(S{.name = "t",
                       .role = MemoryRole::kTangent,
                       .bytes = SeqBytes::constant(4),
                       .fw = false,
                       .tangent = true});
    for (int k = 3; k >= 0; --k) {
      std::vector<int32_t> in{grad, v[static_cast<size_t>(k)]};
      if (second_alias) in.push_back(w[static_cast<size_t>(k)]);
      grad = g.add(S{.name = "g" + std::to_string(k),
                     .bytes = SeqBytes::term(8, 1),
                     .inputs = in,
                     .fw = false,
                     .tangent = true,
                     .layer = "layers." + std::to_string(k)});
    }
    return std::pair{g.graph, v};
  };
  const int64_t seq = 1000;
  MemoryOptions all = fp32_options(RematStrategy::kSequenceAware, 0);
  all.offload_layer_outputs = true;
  all.offload_layer_saved = true;
  const auto [graph, v] = build(false, false);
  const RematDecision d = decide_remat(graph, seq, all);
  for (int k = 0; k < 4; ++k) {
    const int32_t vk = v[static_cast<size_t>(k)];
    EXPECT_EQ(d.fate[vk], RematFate::kSaved) << k;
    EXPECT_NE(std::find(d.offloaded.begin(), d.offloaded.end(), vk), d.offloaded.end()) << k;
  }
  // As EverySavedTensorOfALayerLeavesTheDevice, at g2: x, two views' storages (read and
  // prefetched), g3 and g2, the loss.
  const MemoryBreakdown b = simulate_peak_memory(graph, seq, all);
  EXPECT_EQ(b.offloaded_bytes, 4 * 8 * seq);
  EXPECT_EQ(b.peak, 1 * seq + 2 * 8 * seq + 2 * 8 * seq + 4);
  // A strided view is not copied: its storage stays, as all four do without offload.
  const MemoryBreakdown strided = simulate_peak_memory(build(true, false).first, seq, all);
  EXPECT_EQ(strided.offloaded_bytes, 0);
  EXPECT_EQ(strided.peak, 1 * seq + 4 * 8 * seq + 8 * seq + 4 + 4);
  // Read through a second, strided view as well, a_k itself is saved (both views are
  // recomputed from it) and offloaded whole: the same peak, no copy.
  const auto [graph2, v2] = build(false, true);
  const RematDecision d2 = decide_remat(graph2, seq, all);
  for (int k = 0; k < 4; ++k) {
    const int32_t ak = v2[static_cast<size_t>(k)] - 1;
    EXPECT_EQ(d2.fate[ak], RematFate::kSaved) << k;
    EXPECT_NE(std::find(d2.offloaded.begin(), d2.offloaded.end(), ak), d2.offloaded.end()) << k;
  }
  const MemoryBreakdown twice = simulate_peak_memory(graph2, seq, all);
  EXPECT_EQ(twice.offloaded_bytes, 4 * 8 * seq);
  EXPECT_EQ(twice.peak, b.peak);
}

TEST(MemoryTiledLoss, WorkspaceOfTheTiledLossOp) {
  // ceil(classes / hidden) chunks: k * classes per row of h over 100 chunks (k * hidden per
  // row), and one row of logits for the rounding up of a chunk's rows.
  EXPECT_EQ(tiled_loss_workspace(TiledLossPass::kForward, 1000, 10, 4, 0, 0),
            (TiledLossWorkspace{8000, 0, 8000, 100}));
  // The backward adds the weight gradient's fp32 accumulator and one chunk's (bf16: 2 bytes).
  EXPECT_EQ(tiled_loss_workspace(TiledLossPass::kBackward, 1000, 10, 2, 0, 0),
            (TiledLossWorkspace{12000, 0, 12000 + 1000 * 10 * 6, 100}));
  // A fixed number of rows per chunk: k * classes per row, capped at one chunk.
  EXPECT_EQ(tiled_loss_workspace(TiledLossPass::kBackward, 1000, 10, 4, 16, 7),
            (TiledLossWorkspace{12000, 192000, 80000, 0}));
  // The forward that computes the gradients holds the backward's 12 bytes per element and one
  // chunk's weight gradient; its fp32 accumulator is an output of the op, not scratch.
  EXPECT_EQ(tiled_loss_workspace(TiledLossPass::kForwardWithGrads, 1000, 10, 2, 0, 4),
            (TiledLossWorkspace{12000, 0, 12000 + 1000 * 10 * 2, 4}));
}

TEST(MemoryTiledLoss, ChunksOfTheRule) {
  EXPECT_EQ(tiled_loss_chunks(128256, 4096, 0), 32);  // Llama-3-8B's lm_head
  EXPECT_EQ(tiled_loss_chunks(128256, 2048, 0), 63);  // Llama-3.2-1B's
  EXPECT_EQ(tiled_loss_chunks(1000, 10, 4), 4);
  EXPECT_EQ(tiled_loss_chunks(10, 1000, 0), 1);  // classes fewer than hidden: one chunk
}

// one_layer with a tiled loss at "loss" (node 4) holding 1000 bytes per token were all rows
// one chunk. At S = 10, policy none: the forward peaks at the loss with params 100, optimizer
// 200, x 80, the saved b 160, the loss 4 and the chunk: 544 + 10000 / chunks; the backward
// peaks at 708 (OneLayerPeakByHand).
TEST(MemoryTiledLoss, ChunksSplitTheWorkspaceAndTheFewestThatFitArePicked) {
  MemoryGraph g = one_layer();
  g.nodes[4].chunked_bytes = SeqBytes::term(1000, 1);
  g.nodes[4].chunks = 10;
  MemoryOptions o = fp32_options(RematStrategy::kNone, 25);
  MemoryBreakdown b = simulate_peak_memory(g, 10, o);
  EXPECT_EQ(b.peak, 544 + 1000);
  EXPECT_EQ(b.peak_node, "loss");
  o.loss_chunks = 4;  // in place of the node's 10
  EXPECT_EQ(simulate_peak_memory(g, 10, o).peak, 544 + 2500);
  o.loss_chunks = 3;  // rounded up
  EXPECT_EQ(simulate_peak_memory(g, 10, o).peak, 544 + 3334);
  o.loss_chunks = 0;
  // The fewest chunks whose peak fits: 4 fit 3044 bytes, 3 do not.
  EXPECT_EQ(fewest_loss_chunks(g, 10, o, 544 + 2500, 100), 4);
  EXPECT_EQ(fewest_loss_chunks(g, 10, o, 544 + 2499, 100), 5);
  EXPECT_EQ(fewest_loss_chunks(g, 10, o, 1 << 20, 100), 1);
  // Not even max_chunks fits (2), or nothing does (the backward's 708): 0.
  EXPECT_EQ(fewest_loss_chunks(g, 10, o, 544 + 2500, 2), 0);
  EXPECT_EQ(fewest_loss_chunks(g, 10, o, 700, 100), 0);
  // No tiled loss in the graph: 0.
  EXPECT_EQ(fewest_loss_chunks(one_layer(), 10, o, 1 << 20, 100), 0);
}

TEST(MemoryTrainability, LongestMultipleUnderBudget) {
  const MemoryGraph g = one_layer();
  const MemoryOptions o = fp32_options(RematStrategy::kNone, 25);
  // peak(S) = 308 + 40 * S for S >= 1 (backward), see OneLayerPeakByHand.
  const Trainability t = longest_trainable_seq(
      g, o, {.budget_bytes = 308 + 40 * 100, .seq_multiple = 10, .max_seq = 1 << 20});
  EXPECT_EQ(t.longest_seq, 100);
  EXPECT_EQ(t.at_longest.peak, 308 + 40 * 100);
  EXPECT_EQ(t.first_oom.seq_len, 110);
  EXPECT_FALSE(t.capped);
  const Trainability t2 = longest_trainable_seq(
      g, o, {.budget_bytes = 308 + 40 * 100 - 1, .seq_multiple = 10, .max_seq = 1 << 20});
  EXPECT_EQ(t2.longest_seq, 90);
  const Trainability capped =
      longest_trainable_seq(g, o, {.budget_bytes = 1 << 30, .seq_multiple = 10, .max_seq = 1000});
  EXPECT_EQ(capped.longest_seq, 1000);
  EXPECT_TRUE(capped.capped);
  // Above the parameters but below the persistent state: nothing fits, not an error.
  const Trainability none =
      longest_trainable_seq(g, o, {.budget_bytes = 200, .seq_multiple = 10, .max_seq = 1000});
  EXPECT_EQ(none.longest_seq, 0);
  EXPECT_EQ(none.first_oom.seq_len, 10);
}

TEST(MemoryTrainability, BudgetBelowParametersIsAnError) {
  const MemoryGraph g = one_layer();
  try {
    longest_trainable_seq(g, fp32_options(RematStrategy::kNone, 25),
                          {.budget_bytes = 99, .seq_multiple = 10, .max_seq = 1000});
    FAIL() << "expected invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("budget of 99 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("below the parameters' own 100 bytes"), std::string::npos) << msg;
  }
  EXPECT_THROW(longest_trainable_seq(g, fp32_options(RematStrategy::kNone, 25),
                                     {.budget_bytes = 1000, .seq_multiple = 0, .max_seq = 10}),
               std::invalid_argument);
}

TEST(MemoryGraphChecks, RejectsAliasOfLaterNode) {
  MemoryGraph g = one_layer();
  g.nodes[2].alias_of = 5;
  EXPECT_THROW(simulate_peak_memory(g, 10, fp32_options(RematStrategy::kNone, 25)),
               std::invalid_argument);
}

}  // namespace
}  // namespace autosp

namespace autosp {
namespace {

// A capped term (a buffer of one chunk of rows, as the tiled loss holds): it grows with S
// until it reaches its cap, then stays; replicated layers scale the cap with the term.
TEST(SeqBytesCap, GrowsUntilTheCapThenStays) {
  const SeqBytes b{{SeqTerm{.coef = 64, .power = 1, .shard = 2, .cap = 1024}, SeqTerm{16, 0, 1}}};
  EXPECT_EQ(b.at(8), 64 * 8 / 2 + 16);
  EXPECT_EQ(b.at(32), 1024 + 16);
  EXPECT_EQ(b.at(1 << 20), 1024 + 16);
  EXPECT_EQ(b.str(), "min(64*S/2, 1024) + 16");
}

}  // namespace
}  // namespace autosp
