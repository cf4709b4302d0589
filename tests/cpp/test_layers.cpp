// Layer replication (plan/layers.h): the graph built from a 3-layer trace must be the graph of
// the full model, node for node, and so must its predictions; traces that do not have the
// structure replication assumes are refused with the reason.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "memory_builder.h"
#include "plan/layers.h"
#include "plan/memory.h"

namespace autosp {
namespace {

using Spec = MemoryGraphBuilder::Spec;

struct StackOptions {
  bool bucket = true;                // gradients all-reduced through one cat (autosp's grad sync)
  bool read_two_back = false;        // each layer also reads the previous layer's matmul output
  bool shared_reads_layers = false;  // a value outside layers adds every layer's activation
};

// A decoder-like stack in the order AOTAutograd traces one: parameters; embedding; per layer
// a = mm(h, p), b = relu(a), h' = h + b; loss; the backward from the last layer to the first;
// then the gradient bucket (views of every gradient, one cat, its all-reduce and wait, a split
// and one getitem + view per parameter, the views being the returned gradients).
// Sizes: p 100 B, emb 50 B, activations 16*S/2 (sharded over 2 ranks), ids 8*S.
MemoryGraph stack(int layers, StackOptions o = {}) {
  MemoryGraphBuilder g;
  const SeqBytes act = SeqBytes::term(16, 1, 2);
  auto lname = [](int k) { return "layers." + std::to_string(k); };
  std::vector<int32_t> p(layers);
  for (int k = 0; k < layers; ++k) {
    p[k] = g.add(Spec{.name = "p" + std::to_string(k),
                      .target = "placeholder",
                      .role = MemoryRole::kParameter,
                      .bytes = SeqBytes::constant(100),
                      .layer_index = k});
  }
  const int emb = g.add(Spec{.name = "emb",
                             .role = MemoryRole::kParameter,
                             .bytes = SeqBytes::constant(50),
                             .layer_index = kNoLayer});
  const int ids = g.add(Spec{.name = "ids",
                             .role = MemoryRole::kInput,
                             .bytes = SeqBytes::term(8, 1),
                             .layer_index = kNoLayer});
  std::vector<int32_t> h(layers + 1), a(layers), b(layers);
  h[0] = g.add(Spec{.name = "h_in",
                    .target = "aten.embedding",
                    .kind = RematOpKind::kOther,
                    .bytes = act,
                    .inputs = {emb, ids},
                    .layer_index = kNoLayer});
  for (int k = 0; k < layers; ++k) {
    const std::string s = std::to_string(k);
    a[k] = g.add(Spec{.name = "a" + s,
                      .target = "aten.mm",
                      .kind = RematOpKind::kMatmul,
                      .bytes = act,
                      .inputs = {h[k], p[k]},
                      .layer = lname(k),
                      .layer_index = k});
    std::vector<int32_t> relu_in = {a[k]};
    if (o.read_two_back && k > 0) relu_in.push_back(a[k - 1]);
    b[k] = g.add(Spec{.name = "b" + s,
                      .target = "aten.relu",
                      .bytes = act,
                      .inputs = relu_in,
                      .layer = lname(k),
                      .layer_index = k});
    h[k + 1] = g.add(Spec{.name = "h" + s,
                          .target = "aten.add",
                          .bytes = act,
                          .inputs = {h[k], b[k]},
                          .layer = lname(k),
                          .layer_index = k});
  }
  std::vector<int32_t> loss_in = {h[layers]};
  if (o.shared_reads_layers) {
    loss_in = {h[layers]};
    for (int k = 0; k < layers; ++k) loss_in.push_back(b[k]);
  }
  g.add(Spec{.name = "loss",
             .target = "aten.sum",
             .bytes = SeqBytes::constant(4),
             .inputs = loss_in,
             .layer_index = kNoLayer,
             .forward_output = true});
  const int t = g.add(Spec{.name = "t",
                           .role = MemoryRole::kTangent,
                           .bytes = SeqBytes::constant(4),
                           .fw = false,
                           .tangent = true,
                           .layer_index = kNoLayer});
  auto backward = [&](Spec s) {
    s.fw = false;
    s.tangent = true;
    return g.add(s);
  };
  std::vector<int32_t> gh(layers + 1), gp(layers);
  gh[layers] = backward(Spec{.name = "gh_out",
                             .target = "aten.expand",
                             .bytes = act,
                             .inputs = {t},
                             .layer_index = kNoLayer});
  for (int k = layers - 1; k >= 0; --k) {
    const std::string s = std::to_string(k);
    const int gb = backward(Spec{.name = "gb" + s,
                                 .target = "aten.threshold_backward",
                                 .bytes = act,
                                 .inputs = {gh[k + 1], b[k]},
                                 .layer_index = k});
    gp[k] = backward(Spec{.name = "gp" + s,
                          .target = "aten.mm",
                          .kind = RematOpKind::kMatmul,
                          .bytes = SeqBytes::constant(100),
                          .inputs = {h[k], gb},
                          .layer_index = k,
                          .gradient = !o.bucket});
    const int gx = backward(Spec{.name = "gx" + s,
                                 .target = "aten.mm",
                                 .kind = RematOpKind::kMatmul,
                                 .bytes = act,
                                 .inputs = {gb, p[k]},
                                 .layer_index = k});
    // The gradient of the layer's input (the trace labels it through the forward add).
    gh[k] = backward(Spec{.name = "gh" + s,
                          .target = "aten.add",
                          .bytes = act,
                          .inputs = {gh[k + 1], gx},
                          .layer_index = k});
  }
  const int gemb = backward(Spec{.name = "gemb",
                                 .target = "aten.embedding_dense_backward",
                                 .kind = RematOpKind::kOther,
                                 .bytes = SeqBytes::constant(50),
                                 .inputs = {gh[0], ids},
                                 .layer_index = kNoLayer,
                                 .gradient = !o.bucket});
  if (!o.bucket) return g.graph;
  // The bucket: flattened views (unlabelled), cat, all-reduce, wait, split, getitem + view.
  std::vector<int32_t> flat;
  flat.push_back(backward(Spec{.name = "flat_emb",
                               .target = "aten.view",
                               .kind = RematOpKind::kView,
                               .bytes = SeqBytes::constant(50),
                               .inputs = {gemb},
                               .alias_of = gemb}));
  for (int k = 0; k < layers; ++k) {
    flat.push_back(backward(Spec{.name = "flat" + std::to_string(k),
                                 .target = "aten.view",
                                 .kind = RematOpKind::kView,
                                 .bytes = SeqBytes::constant(100),
                                 .inputs = {gp[k]},
                                 .alias_of = gp[k]}));
  }
  const SeqBytes bucket = SeqBytes::constant(50 + 100 * layers);
  const int cat =
      backward(Spec{.name = "cat", .target = "aten.cat.default", .bytes = bucket, .inputs = flat});
  const int ar = backward(Spec{.name = "all_reduce",
                               .target = "_c10d_functional.all_reduce.default",
                               .kind = RematOpKind::kCollective,
                               .bytes = bucket,
                               .inputs = {cat}});
  const int wait = backward(Spec{.name = "wait",
                                 .target = "_c10d_functional.wait_tensor.default",
                                 .kind = RematOpKind::kCollective,
                                 .bytes = bucket,
                                 .inputs = {ar},
                                 .alias_of = ar});
  const int split = backward(Spec{.name = "split",
                                  .target = "aten.split_with_sizes.default",
                                  .kind = RematOpKind::kView,
                                  .bytes = bucket,
                                  .inputs = {wait},
                                  .alias_of = wait});
  std::vector<int32_t> pieces;
  pieces.push_back(backward(Spec{.name = "piece_emb",
                                 .target = "getitem",
                                 .kind = RematOpKind::kView,
                                 .bytes = SeqBytes::constant(50),
                                 .inputs = {split},
                                 .alias_of = wait}));
  for (int k = 0; k < layers; ++k) {
    pieces.push_back(backward(Spec{.name = "piece" + std::to_string(k),
                                   .target = "getitem",
                                   .kind = RematOpKind::kView,
                                   .bytes = SeqBytes::constant(100),
                                   .inputs = {split},
                                   .alias_of = wait}));
  }
  for (int k = -1; k < layers; ++k) {
    // The returned gradients: seeded with their parameter's layer, as the planner does.
    const int piece = pieces[static_cast<size_t>(k + 1)];
    backward(Spec{.name = "grad" + (k < 0 ? std::string("_emb") : std::to_string(k)),
                  .target = "aten.view",
                  .kind = RematOpKind::kView,
                  .bytes = SeqBytes::constant(k < 0 ? 50 : 100),
                  .inputs = {piece},
                  .layer_index = k < 0 ? kNoLayer : k,
                  .alias_of = wait,
                  .gradient = true});
  }
  return g.graph;
}

MemoryOptions options(RematStrategy strategy) {
  MemoryOptions o;
  o.strategy = strategy;
  o.training = TrainingConfig{.num_params = 1000, .dtype = DtypePolicy::kFp32};
  return o;
}

TEST(LayerLabels, UnlabelledNodesTakeTheirLayer) {
  const MemoryGraph g = stack(3);
  const std::vector<int32_t> label = label_layers(g);
  auto at = [&](const std::string& name) {
    for (size_t i = 0; i < g.nodes.size(); ++i)
      if (g.nodes[i].facts.name == name) return label[i];
    ADD_FAILURE() << "no node " << name;
    return kLayerUnknown;
  };
  EXPECT_EQ(at("flat2"), 2);       // a view of layer 2's gradient
  EXPECT_EQ(at("piece0"), 0);      // no labelled input; its user is layer 0's gradient
  EXPECT_EQ(at("cat"), kNoLayer);  // reads every layer
  EXPECT_EQ(at("split"), kNoLayer);
  EXPECT_EQ(at("gh_out"), kNoLayer);
  EXPECT_EQ(std::count(label.begin(), label.end(), kLayerUnknown), 0);
}

// The replicated graph is the full graph: same nodes in the same order with the same sizes,
// edges, aliases, flags and layers (only the copies' names differ), so every prediction is
// equal too.
TEST(LayerReplication, EqualsTheFullGraph) {
  for (bool bucket : {true, false}) {
    const MemoryGraph traced = stack(3, {.bucket = bucket});
    for (int layers : {3, 4, 7}) {
      SCOPED_TRACE("bucket " + std::to_string(bucket) + ", " + std::to_string(layers) + " layers");
      const MemoryGraph full = stack(layers, {.bucket = bucket});
      const MemoryGraph built = replicate_layers(traced, layers);
      const std::vector<int32_t> full_labels = label_layers(full);
      ASSERT_EQ(built.nodes.size(), full.nodes.size());
      for (size_t i = 0; i < full.nodes.size(); ++i) {
        const MemoryNode& x = built.nodes[i];
        const MemoryNode& y = full.nodes[i];
        SCOPED_TRACE("node " + std::to_string(i) + ": " + x.facts.name + " vs " + y.facts.name);
        EXPECT_EQ(x.facts.target, y.facts.target);
        EXPECT_EQ(x.facts.layer, y.facts.layer);
        EXPECT_EQ(x.layer, full_labels[i]);
        EXPECT_EQ(x.role, y.role);
        EXPECT_EQ(x.facts.users, y.facts.users);
        EXPECT_EQ(x.facts.fusible_user, y.facts.fusible_user);
        EXPECT_EQ(x.alias_of, y.alias_of);
        EXPECT_EQ(x.gradient, y.gradient);
        EXPECT_EQ(x.forward_output, y.forward_output);
        for (int64_t s : {2, 64, 4096}) {
          EXPECT_EQ(x.save_bytes.at(s), y.save_bytes.at(s));
          EXPECT_EQ(x.alloc_bytes.at(s), y.alloc_bytes.at(s));
        }
      }
      for (RematStrategy strategy :
           {RematStrategy::kNone, RematStrategy::kDefault, RematStrategy::kSequenceAware,
            RematStrategy::kFullCheckpoint}) {
        for (int64_t s : {2, 1024, 1 << 20}) {
          MemoryBreakdown want = simulate_peak_memory(full, s, options(strategy));
          MemoryBreakdown got = simulate_peak_memory(built, s, options(strategy));
          got.peak_node = want.peak_node;  // copies are named "<name>#<layer>"
          EXPECT_EQ(got, want) << to_string(strategy) << " at S=" << s;
        }
      }
    }
  }
}

TEST(LayerReplication, CopiesAreNamedAndRenumbered) {
  const MemoryGraph built = replicate_layers(stack(3), 5);
  std::vector<std::string> forward;
  for (const MemoryNode& n : built.nodes)
    if (n.facts.target == "aten.mm" && n.facts.required_fw)
      forward.push_back(n.facts.name + "@" + n.facts.layer);
  EXPECT_EQ(forward, (std::vector<std::string>{"a0@layers.0", "a1@layers.1", "a1#2@layers.2",
                                               "a1#3@layers.3", "a2@layers.4"}));
}

void expect_refused(const MemoryGraph& g, int layers, const std::string& why) {
  try {
    replicate_layers(g, layers);
    ADD_FAILURE() << "expected invalid_argument containing: " << why;
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("[memory] cannot replicate layers: "), std::string::npos) << what;
    EXPECT_NE(what.find(why), std::string::npos) << what;
  }
}

TEST(LayerReplication, RefusesWhatItCannotCopy) {
  expect_refused(stack(2), 8, "the trace has 2 labelled layers; expected 3 or more");
  expect_refused(stack(4), 3, "asked for 3 layers from a trace of 4");
  expect_refused(stack(3, {.read_two_back = true}), 6,
                 "layer 1 reads 2 values of layer 0 (a0 (aten.mm), h0 (aten.add)); expected one, "
                 "the hidden state");
  expect_refused(stack(3, {.shared_reads_layers = true}), 6,
                 "loss (aten.sum) outside layers reads b1 (aten.relu) of layer 1; expected only a "
                 "cat of one value per layer (a gradient bucket)");
}

}  // namespace
}  // namespace autosp
