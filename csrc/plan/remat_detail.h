// Internal to the remat solver (plan/remat.cpp, remat_bans.cpp, remat_cut.cpp): the graph facts
// every solve of a budget search shares, and the ban set each policy builds (which nodes the cut
// may not recompute, with why).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/remat.h"

namespace autosp::remat_detail {

constexpr int32_t kFarFromBackward = 1000000000;  // PyTorch's int(1e9)

inline std::string quote(const std::string& s) { return "'" + s + "'"; }

inline bool fusible_edge(const RematNode& node, size_t user_slot) {
  return node.fusible_user[user_slot] != 0;
}

// Everything solve_once needs that does not change between the solves of a budget search.
struct Prepared {
  const RematGraph* graph;
  std::vector<int32_t> dist_from_bw;
  std::vector<std::vector<int32_t>> preds;
  std::vector<int32_t> fw_order;  // -1 when not a forward node
};

// The ban set: node index -> reason. Mirrors ban_recomputation_if_allowed: views, nodes the
// user marked must-recompute and SymFloats are never banned.
class Bans {
 public:
  explicit Bans(const RematGraph& graph) : graph_(&graph), reason_(graph.nodes.size()) {}

  bool ban(int32_t i, const std::string& reason) {
    const RematNode& node = graph_->nodes[i];
    if (node.kind == RematOpKind::kView || node.must_recompute ||
        node.save_cost == RematSaveCost::kSymFloat) {
      return false;
    }
    if (reason_[i].empty()) reason_[i] = reason;
    return true;
  }
  bool banned(int32_t i) const { return !reason_[i].empty(); }
  const std::vector<std::string>& reasons() const { return reason_; }

 private:
  const RematGraph* graph_;
  std::vector<std::string> reason_;
};

// A forward value computed inside a numbered layer and read by a forward op of another layer
// (or outside layers): the hidden state one decoder layer hands to the next (remat_bans.cpp).
bool leaves_layer(const RematGraph& graph, int32_t i);

// The node that owns the storage `i`'s value lives in: RematNode::aliases followed to a node
// that aliases nothing (`i` itself when it aliases nothing).
int32_t storage_base(const RematGraph& graph, int32_t i);

// The bytes each saved node adds to what the saved set holds, in the order of `saved` (graph
// order): a storage counts once, at its owner's size (storage_base; the node's own size where
// the owner's is unknown), for the first saved node that holds it. A view and its base, or two
// views of one value, hold one storage; a storage of a static-lifetime input (a parameter)
// costs nothing. The report's and the budget's saved bytes are this sum.
std::vector<int64_t> saved_storage_bytes(const RematGraph& graph,
                                         const std::vector<int32_t>& saved);

// Each policy's bans (remat_bans.cpp).
// PyTorch's default partitioner bans (its allowlist, heavy ops, ops far from the backward...).
void default_bans(const Prepared& p, const RematOptions& options, Bans& bans);
// The positions of matmuls with these forward `flops` and output `bytes` in sequence-aware's
// cost-model order: most bytes saved per FLOP first; ties, the most FLOPs first, then in the
// given order. (Measured on the reference Llama, hidden 64, S 256-512, 4 and 16 layers: with
// ties in graph order, q/k/v/o projections fill the allowance before the MLP's gate and up, and
// the cut then saves 12-22% more bytes; bench/remat_regions_bytes.py.)
std::vector<size_t> admission_order(const std::vector<double>& flops,
                                    const std::vector<int64_t>& bytes);
// The matmuls sequence-aware may admit, in graph order, with their forward FLOPs and bytes.
struct CandidateCosts {
  std::vector<int32_t> nodes;
  std::vector<double> flops;
  std::vector<int64_t> bytes;
  std::vector<std::string> layers;  // RematNode::layer
};
CandidateCosts candidate_costs(const RematGraph& graph);
// The matmuls the sequence-aware policy may recompute, in cost-model order.
std::vector<int32_t> matmul_candidates(const RematGraph& graph);
// Sequence-aware: attention, collectives and random ops banned; matmuls unless `admitted`.
void sequence_aware_bans(const Prepared& p, const std::vector<bool>& admitted, Bans& bans);
// None: every forward node the backward reads is saved.
void none_bans(const Prepared& p, Bans& bans);

// One min-cut solve for a ban set (remat_cut.cpp).
struct CutResult {
  std::vector<int32_t> saved;
  std::vector<int32_t> recomputed;
  int64_t saved_bytes = 0;
  int64_t cut_value = 0;
  int32_t flow_vertices = 0;
  int32_t flow_edges = 0;
};
CutResult solve_once(const Prepared& p, const Bans& bans, RematPolicy policy);

}  // namespace autosp::remat_detail
