// One min-cut solve of the remat flow network (see remat.h): node capacities per policy, the
// network PyTorch's partitioner builds, and the cut read back as the saved set.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "plan/remat_detail.h"
#include "util/maxflow.h"

namespace autosp::remat_detail {

namespace {

// Sequence-aware capacities are bytes * kTieBreakScale + min(dist_from_bw, kTieBreakScale - 1):
// the cut minimises bytes first; among equal-byte cuts it prefers a forward output (held by
// the caller anyway: tie-break 0), then values close to the backward, which leaves less to
// recompute.
constexpr int64_t kTieBreakScale = 256;

int64_t capacity_of(const Prepared& p, int32_t i, RematPolicy policy) {
  const RematNode& node = p.graph->nodes[i];
  switch (node.save_cost) {
    case RematSaveCost::kUnsaveable:
      return kInfiniteCapacity;
    case RematSaveCost::kFree:
      return 0;
    case RematSaveCost::kSymInt:
      return policy == RematPolicy::kDefault ? 1 : kTieBreakScale;
    case RematSaveCost::kSymFloat:
      return policy == RematPolicy::kDefault ? 4 : 4 * kTieBreakScale;
    case RematSaveCost::kTensor:
      break;
  }
  if (node.static_lifetime) return 0;  // treat_parameters_as_free_to_save
  const int32_t dist = p.dist_from_bw[i];
  if (policy == RematPolicy::kDefault) {
    // PyTorch's get_node_weight: bias towards values close to the backward, and double the
    // price of materialising a value that would otherwise fuse into all its users.
    int64_t weight = static_cast<int64_t>(static_cast<double>(node.bytes) *
                                          std::pow(1.1, std::max(std::min(dist, 100), 1)));
    bool materialized = node.kind == RematOpKind::kInput;
    for (size_t k = 0; k < node.users.size() && !materialized; ++k) {
      materialized = !fusible_edge(node, k);
    }
    return materialized ? weight : weight * 2;
  }
  const int64_t tie = node.forward_output ? 0 : std::min<int64_t>(dist, kTieBreakScale - 1);
  return node.bytes * kTieBreakScale + tie;
}

std::string describe_path(const RematGraph& graph, const FlowNetwork& net,
                          const std::vector<int>& path, const std::vector<std::string>& why) {
  // Vertex 2i is node i's "in", 2i+1 its "out"; the last two are source and sink.
  const int source = net.num_vertices() - 2;
  const int sink = net.num_vertices() - 1;
  auto vertex_name = [&](int v) -> std::string {
    if (v == source) return "source";
    if (v == sink) return "sink";
    return graph.nodes[v / 2].name + (v % 2 == 0 ? "_in" : "_out");
  };
  std::ostringstream msg;
  for (int e : path) {
    msg << "\n  " << vertex_name(net.edge_from(e)) << " -> " << vertex_name(net.edge_to(e)) << " ("
        << why[e] << ")";
  }
  return msg.str();
}

}  // namespace

CutResult solve_once(const Prepared& p, const Bans& bans, RematPolicy policy) {
  const RematGraph& graph = *p.graph;
  const auto n = static_cast<int32_t>(graph.nodes.size());
  FlowNetwork net(2 * n + 2);
  const int source = 2 * n;
  const int sink = 2 * n + 1;
  std::vector<std::string> why;  // per edge, for the no-finite-cut error
  std::vector<int32_t> value_edge(n, -1);
  auto add = [&](int from, int to, int64_t cap, std::string reason) {
    net.add_edge(from, to, cap);
    why.push_back(std::move(reason));
    return net.num_edges() - 1;
  };
  for (int32_t i = 0; i < n; ++i) {
    const RematNode& node = graph.nodes[i];
    const int in = 2 * i;
    const int out = 2 * i + 1;
    if (node.required_bw) {
      if (!node.tangents_closure) {
        add(out, sink, kInfiniteCapacity, "backward reads " + quote(node.name));
      } else {
        add(in, sink, kInfiniteCapacity, "backward computes " + quote(node.name));
        continue;
      }
    }
    if (node.must_recompute) {
      add(in, sink, kInfiniteCapacity, "marked must-recompute");
      continue;
    }
    if (bans.banned(i)) {
      add(source, in, kInfiniteCapacity, "cannot recompute: " + bans.reasons()[i]);
    }
    const int64_t cap = capacity_of(p, i, policy);
    value_edge[i] =
        add(in, out, cap, cap == kInfiniteCapacity ? "cannot save: non-tensor value" : "save");
    for (int32_t u : node.users) add(out, 2 * u, kInfiniteCapacity, "data dependency");
  }

  const std::vector<int> infinite = find_infinite_path(net, source, sink);
  if (!infinite.empty()) {
    throw std::runtime_error(
        "[remat] no valid partition: a value the backward needs can be neither saved nor "
        "recomputed. Path of infinite edges:" +
        describe_path(graph, net, infinite, why));
  }
  const MinCut cut = solve_min_cut(net, source, sink);

  CutResult result;
  result.cut_value = cut.value;
  result.flow_vertices = net.num_vertices();
  result.flow_edges = net.num_edges();
  std::vector<bool> candidate(n, false);
  for (int e : cut.cut_edges) {
    const int from = net.edge_from(e);
    const int to = net.edge_to(e);
    if (from >= 2 * n || to != from + 1 || from % 2 != 0) {
      throw std::logic_error("[remat] internal: the min cut crossed a non-value edge");
    }
    candidate[from / 2] = true;
  }

  // What the backward graph will contain: walk back from the backward nodes, stopping at
  // saved values. Cut values the walk never reaches (free parameters on the cut) are not
  // saved, as in PyTorch's _extract_fwd_bwd_modules.
  std::vector<bool> seen(n, false);
  std::vector<bool> saved(n, false);
  std::vector<bool> recomputed(n, false);
  std::vector<int32_t> stack;
  for (int32_t i = 0; i < n; ++i) {
    if (!graph.nodes[i].required_bw) continue;
    seen[i] = true;
    // A backward node that does not depend on a tangent may be computed by the forward and
    // saved, like any other value.
    if (candidate[i] && !graph.nodes[i].tangents_closure) {
      saved[i] = true;
    } else {
      stack.push_back(i);
    }
  }
  while (!stack.empty()) {
    const int32_t cur = stack.back();
    stack.pop_back();
    for (int32_t pred : p.preds[cur]) {
      if (seen[pred]) continue;
      seen[pred] = true;
      const RematNode& node = graph.nodes[pred];
      if (candidate[pred]) {
        saved[pred] = true;
        continue;
      }
      if (node.required_fw) {
        if (node.kind == RematOpKind::kInput) {
          throw std::logic_error("[remat] internal: the backward reads forward input " +
                                 quote(node.name) + " without saving it");
        }
        recomputed[pred] = true;
      }
      stack.push_back(pred);
    }
  }
  for (int32_t i = 0; i < n; ++i) {
    if (saved[i]) result.saved.push_back(i);
    if (recomputed[i]) result.recomputed.push_back(i);
  }
  for (int64_t bytes : saved_storage_bytes(graph, result.saved)) result.saved_bytes += bytes;
  return result;
}

}  // namespace autosp::remat_detail
