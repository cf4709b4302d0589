#include "plan/remat.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "util/maxflow.h"

namespace autosp {
namespace {

constexpr int32_t kFarFromBackward = 1000000000;  // PyTorch's int(1e9)
// Sequence-aware capacities are bytes * kTieBreakScale + min(dist_from_bw, kTieBreakScale - 1):
// the cut minimises bytes first; among equal-byte cuts it prefers values close to the
// backward, which leaves less to recompute.
constexpr int64_t kTieBreakScale = 256;

std::string quote(const std::string& s) { return "'" + s + "'"; }

void validate(const RematGraph& graph, const RematOptions& options) {
  const auto n = static_cast<int32_t>(graph.nodes.size());
  for (int32_t i = 0; i < n; ++i) {
    const RematNode& node = graph.nodes[i];
    if (node.fusible_user.size() != node.users.size()) {
      throw std::invalid_argument("[remat] node " + quote(node.name) + " has " +
                                  std::to_string(node.users.size()) + " users but " +
                                  std::to_string(node.fusible_user.size()) + " fusible_user flags");
    }
    if (node.bytes < 0) {
      throw std::invalid_argument("[remat] node " + quote(node.name) + " has negative bytes " +
                                  std::to_string(node.bytes));
    }
    for (int32_t u : node.users) {
      if (u <= i || u >= n) {
        throw std::invalid_argument("[remat] node " + quote(node.name) + " (index " +
                                    std::to_string(i) + ") lists user index " + std::to_string(u) +
                                    "; expected an index in (" + std::to_string(i) + ", " +
                                    std::to_string(n) + "): nodes must be in topological order");
      }
    }
    for (int32_t a : node.args) {
      if (a < 0 || a >= i) {
        throw std::invalid_argument("[remat] node " + quote(node.name) + " (index " +
                                    std::to_string(i) + ") lists argument index " +
                                    std::to_string(a) + "; expected an index in [0, " +
                                    std::to_string(i) + ")");
      }
    }
  }
  if (options.budget_bytes && options.budget_fraction) {
    throw std::invalid_argument("[remat] give a memory budget in bytes or as a fraction, not both");
  }
  const bool has_budget = options.budget_bytes || options.budget_fraction;
  if (has_budget && options.policy != RematPolicy::kSequenceAware) {
    throw std::invalid_argument(std::string("[remat] a memory budget needs policy "
                                            "'sequence-aware', got '") +
                                to_string(options.policy) + "'");
  }
  if (options.budget_bytes && *options.budget_bytes < 0) {
    throw std::invalid_argument("[remat] memory budget must be >= 0 bytes, got " +
                                std::to_string(*options.budget_bytes));
  }
  if (options.budget_fraction &&
      !(*options.budget_fraction >= 0.0 && *options.budget_fraction <= 1.0)) {
    throw std::invalid_argument("[remat] memory budget fraction must be in [0, 1], got " +
                                std::to_string(*options.budget_fraction));
  }
  if (!(options.recompute_flops_ratio >= 0.0) || std::isinf(options.recompute_flops_ratio)) {
    throw std::invalid_argument("[remat] recompute_flops_ratio must be finite and >= 0, got " +
                                std::to_string(options.recompute_flops_ratio));
  }
}

bool fusible_edge(const RematNode& node, size_t user_slot) {
  return node.fusible_user[user_slot] != 0;
}

// Everything solve_once needs that does not change between the solves of a budget search.
struct Prepared {
  const RematGraph* graph;
  std::vector<int32_t> dist_from_bw;
  std::vector<std::vector<int32_t>> preds;
  std::vector<int32_t> fw_order;  // -1 when not a forward node
};

Prepared prepare(const RematGraph& graph) {
  const auto n = static_cast<int32_t>(graph.nodes.size());
  Prepared p;
  p.graph = &graph;
  p.dist_from_bw.assign(n, kFarFromBackward);
  for (int32_t i = n - 1; i >= 0; --i) {
    const RematNode& node = graph.nodes[i];
    if (!node.required_fw) {
      p.dist_from_bw[i] = 0;
      continue;
    }
    for (int32_t u : node.users) {
      p.dist_from_bw[i] = std::min(p.dist_from_bw[i], p.dist_from_bw[u] + 1);
    }
  }
  p.preds.assign(n, {});
  for (int32_t i = 0; i < n; ++i) {
    for (int32_t u : graph.nodes[i].users) p.preds[u].push_back(i);
  }
  p.fw_order.assign(n, -1);
  int32_t order = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (graph.nodes[i].required_fw) p.fw_order[i] = order++;
  }
  return p;
}

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

// PyTorch's is_materialized_backwards: some (view-transitive) user outside the forward cannot
// fuse with this node.
bool materialized_backward(const Prepared& p, int32_t start) {
  const auto& nodes = p.graph->nodes;
  if (nodes[start].kind == RematOpKind::kView) return false;
  std::vector<int32_t> stack{start};
  std::vector<bool> seen(nodes.size(), false);
  seen[start] = true;
  while (!stack.empty()) {
    const int32_t cur = stack.back();
    stack.pop_back();
    const RematNode& node = nodes[cur];
    for (size_t k = 0; k < node.users.size(); ++k) {
      const int32_t user = node.users[k];
      if (!nodes[user].required_fw && !fusible_edge(node, k)) return true;
      if (nodes[user].kind == RematOpKind::kView && !seen[user]) {
        seen[user] = true;
        stack.push_back(user);
      }
    }
  }
  return false;
}

bool reduces_4x(const RematGraph& graph, int32_t i) {
  int64_t inputs = 0;
  for (int32_t a : graph.nodes[i].args) inputs += graph.nodes[a].bytes;
  return graph.nodes[i].bytes * 4 < inputs;
}

// PyTorch's find_first_unfusible: the forward order of the first non-fusible use reachable from
// `starts` through fusible edges, or max_range.
int32_t first_unfusible(const Prepared& p, const std::vector<int32_t>& starts, int32_t max_range) {
  const auto& nodes = p.graph->nodes;
  // (order, fusible flag, node); the unfusible entry of a node pops before its fusible one.
  using Entry = std::tuple<int32_t, bool, int32_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  std::vector<uint8_t> pushed(nodes.size(), 0);  // bit 0: pushed fusible, bit 1: unfusible
  for (int32_t s : starts) {
    if (!(pushed[s] & 1)) {
      pushed[s] |= 1;
      heap.emplace(p.fw_order[s], true, s);
    }
  }
  while (!heap.empty()) {
    auto [order, is_fusible, cur] = heap.top();
    heap.pop();
    if (!is_fusible) return order;
    const RematNode& node = nodes[cur];
    for (size_t k = 0; k < node.users.size(); ++k) {
      const int32_t user = node.users[k];
      if (!nodes[user].required_fw || p.fw_order[user] > max_range) continue;
      const bool f = fusible_edge(node, k);
      const uint8_t bit = f ? 1 : 2;
      if (!(pushed[user] & bit)) {
        pushed[user] |= bit;
        heap.emplace(p.fw_order[user], f, user);
      }
    }
  }
  return max_range;
}

void default_bans(const Prepared& p, const RematOptions& options, Bans& bans) {
  const auto& nodes = p.graph->nodes;
  const auto n = static_cast<int32_t>(nodes.size());
  for (int32_t i = 0; i < n; ++i) {
    const RematNode& node = nodes[i];
    if (node.required_bw && node.tangents_closure) continue;
    if (node.must_recompute) continue;
    if (node.primal_input) bans.ban(i, "primal input");
    if (!node.required_fw || node.kind == RematOpKind::kInput || node.getitem) continue;
    if (node.must_save) {
      bans.ban(i, "marked MUST_SAVE");
      continue;
    }
    if (node.kind != RematOpKind::kCheap && node.kind != RematOpKind::kView) {
      bans.ban(i, std::string("not in recomputable allowlist (") + to_string(node.kind) + ")");
      continue;
    }
    if (materialized_backward(p, i)) {
      bans.ban(i, "materialized in backward");
      continue;
    }
    if (p.dist_from_bw[i] < 1000 && p.dist_from_bw[i] > options.max_dist_from_bw) {
      bans.ban(i, "too far from backward");
      continue;
    }
    if (reduces_4x(*p.graph, i)) bans.ban(i, "reduction op");
  }

  // ban_if_used_far_apart
  for (int32_t used = 0; used < n; ++used) {
    if (!nodes[used].required_fw) continue;
    const RematNode& node = nodes[used];
    std::vector<int32_t> fw_users;
    int32_t max_order = -1;
    for (int32_t u : node.users) {
      if (nodes[u].required_fw) {
        fw_users.push_back(u);
        max_order = std::max(max_order, p.fw_order[u]);
      }
    }
    if (fw_users.empty()) continue;
    const int32_t first = first_unfusible(p, fw_users, max_order);
    for (size_t k = 0; k < node.users.size(); ++k) {
      const int32_t u = node.users[k];
      if (nodes[u].required_fw && p.fw_order[u] > first && fusible_edge(node, k)) {
        if (bans.banned(u)) continue;
        bans.ban(u, "used far apart from a fusible producer");
      }
    }
  }

  // ban_if_long_fusible_chains
  std::vector<bool> visited(n, false);
  for (int32_t start = 0; start < n; ++start) {
    if (!nodes[start].required_fw) continue;
    using Entry = std::pair<int32_t, int32_t>;  // (fw order, node)
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    heap.emplace(p.fw_order[start], start);
    const int32_t start_order = p.fw_order[start];
    while (!heap.empty()) {
      const int32_t cur = heap.top().second;
      heap.pop();
      if (visited[cur]) continue;
      visited[cur] = true;
      if (p.fw_order[cur] > start_order + 100 && heap.empty()) {
        bans.ban(cur, "long fusible chain");
        break;
      }
      const RematNode& node = nodes[cur];
      for (size_t k = 0; k < node.users.size(); ++k) {
        const int32_t u = node.users[k];
        if (nodes[u].required_fw && fusible_edge(node, k) && !bans.banned(u)) {
          heap.emplace(p.fw_order[u], u);
        }
      }
    }
  }
}

// Matmuls the sequence-aware policy may recompute, most bytes saved per FLOP first.
std::vector<int32_t> matmul_candidates(const RematGraph& graph) {
  std::vector<int32_t> candidates;
  for (int32_t i = 0; i < static_cast<int32_t>(graph.nodes.size()); ++i) {
    const RematNode& node = graph.nodes[i];
    if (node.required_fw && node.kind == RematOpKind::kMatmul && !node.must_save &&
        node.flops > 0) {
      candidates.push_back(i);
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(), [&](int32_t a, int32_t b) {
    const RematNode& x = graph.nodes[a];
    const RematNode& y = graph.nodes[b];
    // x.bytes / x.flops > y.bytes / y.flops, without dividing.
    return static_cast<double>(x.bytes) * y.flops > static_cast<double>(y.bytes) * x.flops;
  });
  return candidates;
}

void sequence_aware_bans(const Prepared& p, const std::vector<bool>& admitted, Bans& bans) {
  const auto& nodes = p.graph->nodes;
  for (int32_t i = 0; i < static_cast<int32_t>(nodes.size()); ++i) {
    const RematNode& node = nodes[i];
    if (node.required_bw && node.tangents_closure) continue;
    if (node.must_recompute) continue;
    if (node.primal_input) bans.ban(i, "primal input");
    if (!node.required_fw || node.kind == RematOpKind::kInput || node.getitem) continue;
    if (node.must_save) {
      bans.ban(i, "marked MUST_SAVE");
      continue;
    }
    switch (node.kind) {
      case RematOpKind::kCollective:
        bans.ban(i, "collective");
        break;
      case RematOpKind::kRandom:
        bans.ban(i, "random op");
        break;
      case RematOpKind::kAttention:
        bans.ban(i, "attention");
        break;
      case RematOpKind::kOther:
        bans.ban(i, "op without a recompute rule");
        break;
      case RematOpKind::kMatmul:
        if (!admitted[i]) {
          bans.ban(i, node.flops > 0 ? "matmul over the recompute FLOP allowance"
                                     : "matmul with unknown FLOPs");
        }
        break;
      case RematOpKind::kCheap:
        if (reduces_4x(*p.graph, i)) bans.ban(i, "reduction op");
        break;
      case RematOpKind::kView:
      case RematOpKind::kInput:
        break;
    }
  }
}

void none_bans(const Prepared& p, Bans& bans) {
  const auto& nodes = p.graph->nodes;
  for (int32_t i = 0; i < static_cast<int32_t>(nodes.size()); ++i) {
    const RematNode& node = nodes[i];
    if (node.required_bw && node.tangents_closure) continue;
    if (node.must_recompute) continue;
    if (node.primal_input) bans.ban(i, "primal input");
    if (node.required_fw && node.kind != RematOpKind::kInput) bans.ban(i, "policy 'none'");
  }
}

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
  return node.bytes * kTieBreakScale + std::min<int64_t>(dist, kTieBreakScale - 1);
}

struct CutResult {
  std::vector<int32_t> saved;
  std::vector<int32_t> recomputed;
  int64_t saved_bytes = 0;
  int64_t cut_value = 0;
  int32_t flow_vertices = 0;
  int32_t flow_edges = 0;
};

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
    if (saved[i]) {
      result.saved.push_back(i);
      if (!graph.nodes[i].static_lifetime) result.saved_bytes += graph.nodes[i].bytes;
    }
    if (recomputed[i]) result.recomputed.push_back(i);
  }
  return result;
}

}  // namespace

RematSolution solve_remat(const RematGraph& graph, const RematOptions& options) {
  validate(graph, options);
  const Prepared p = prepare(graph);
  const auto n = static_cast<int32_t>(graph.nodes.size());

  RematSolution solution;
  for (const RematNode& node : graph.nodes) {
    if (node.kind == RematOpKind::kAttention) solution.attention_flops += node.flops;
  }

  // What policy 'none' saves: the budget's reference and the report's baseline. A graph whose
  // backward reads an unsaveable value has no 'none' partition; the baseline is then -1.
  Bans none(graph);
  none_bans(p, none);
  std::optional<CutResult> none_cut;
  std::string none_error;
  try {
    none_cut = solve_once(p, none, RematPolicy::kNone);
    solution.none_saved_bytes = none_cut->saved_bytes;
  } catch (const std::runtime_error& e) {
    solution.none_saved_bytes = -1;
    none_error = e.what();
  }
  solution.solves = 1;

  CutResult chosen;
  Bans chosen_bans(graph);
  switch (options.policy) {
    case RematPolicy::kNone:
      if (!none_cut) throw std::runtime_error(none_error);
      chosen = *none_cut;
      chosen_bans = none;
      break;
    case RematPolicy::kDefault: {
      default_bans(p, options, chosen_bans);
      chosen = solve_once(p, chosen_bans, RematPolicy::kDefault);
      ++solution.solves;
      break;
    }
    case RematPolicy::kSequenceAware: {
      const std::vector<int32_t> candidates = matmul_candidates(graph);
      auto admit_first = [&](size_t k) {
        std::vector<bool> admitted(n, false);
        for (size_t j = 0; j < k; ++j) admitted[candidates[j]] = true;
        return admitted;
      };
      auto solve_with = [&](const std::vector<bool>& admitted, Bans& bans) {
        sequence_aware_bans(p, admitted, bans);
        ++solution.solves;
        return solve_once(p, bans, RematPolicy::kSequenceAware);
      };
      std::vector<bool> admitted(n, false);
      const bool has_budget = options.budget_bytes || options.budget_fraction;
      if (!has_budget) {
        const double allowance = options.recompute_flops_ratio * solution.attention_flops;
        double used = 0;
        for (int32_t c : candidates) {
          if (used + graph.nodes[c].flops <= allowance) {
            admitted[c] = true;
            used += graph.nodes[c].flops;
          }
        }
        chosen = solve_with(admitted, chosen_bans);
      } else {
        if (options.budget_fraction && !none_cut) {
          throw std::runtime_error(
              "[remat] a memory budget given as a fraction needs what policy 'none' saves, but " +
              none_error.substr(std::string("[remat] ").size()));
        }
        const int64_t budget =
            options.budget_bytes
                ? *options.budget_bytes
                : static_cast<int64_t>(std::floor(*options.budget_fraction *
                                                  static_cast<double>(none_cut->saved_bytes)));
        solution.budget_bytes = budget;
        // Saved bytes fall (up to tie-breaks) as more matmuls are admitted; find the fewest
        // admissions, in cost-model order, that fit.
        Bans all_bans(graph);
        admitted = admit_first(candidates.size());
        const CutResult all = solve_with(admitted, all_bans);
        if (all.saved_bytes > budget) {
          std::ostringstream msg;
          msg << "[remat] memory budget of " << budget
              << " bytes cannot be met: recomputing everything the sequence-aware policy allows"
              << " (all " << candidates.size()
              << " matmuls; attention, collectives and random ops are never recomputed)"
              << " still saves " << all.saved_bytes << " bytes for backward (policy 'none' saves "
              << solution.none_saved_bytes << ")";
          throw std::runtime_error(msg.str());
        }
        size_t lo = 0;
        size_t hi = candidates.size();  // fits
        while (lo < hi) {
          const size_t mid = (lo + hi) / 2;
          Bans bans(graph);
          if (solve_with(admit_first(mid), bans).saved_bytes <= budget) {
            hi = mid;
          } else {
            lo = mid + 1;
          }
        }
        // Tie-breaks can make saved bytes dip and rise by a few bytes; step up until it fits.
        for (size_t k = hi;; ++k) {
          admitted = admit_first(k);
          chosen_bans = Bans(graph);
          chosen = solve_with(admitted, chosen_bans);
          if (chosen.saved_bytes <= budget) break;
        }
      }
      for (int32_t c : candidates) {
        if (admitted[c]) {
          ++solution.admitted_matmuls;
          solution.admitted_matmul_flops += graph.nodes[c].flops;
        }
      }
      break;
    }
  }

  solution.saved = chosen.saved;
  solution.recomputed = chosen.recomputed;
  solution.saved_bytes = chosen.saved_bytes;
  solution.cut_value = chosen.cut_value;
  solution.flow_vertices = chosen.flow_vertices;
  solution.flow_edges = chosen.flow_edges;
  solution.ban_reason = chosen_bans.reasons();
  solution.fate.assign(n, RematFate::kBackwardOnly);
  for (int32_t i = 0; i < n; ++i) {
    if (graph.nodes[i].required_fw) solution.fate[i] = RematFate::kForwardOnly;
  }
  for (int32_t i : chosen.saved) solution.fate[i] = RematFate::kSaved;
  for (int32_t i : chosen.recomputed) {
    solution.fate[i] = RematFate::kRecomputed;
    solution.recompute_flops += graph.nodes[i].flops;
  }

  std::unordered_map<std::string, size_t> layer_index;
  auto layer_of = [&](int32_t i) -> RematLayerSummary& {
    const std::string& name = graph.nodes[i].layer;
    auto [it, inserted] = layer_index.try_emplace(name, solution.layers.size());
    if (inserted) solution.layers.push_back(RematLayerSummary{.layer = name});
    return solution.layers[it->second];
  };
  for (int32_t i = 0; i < n; ++i) {
    const RematNode& node = graph.nodes[i];
    if (solution.fate[i] == RematFate::kSaved && !node.static_lifetime) {
      RematLayerSummary& s = layer_of(i);
      s.saved_bytes += node.bytes;
      ++s.saved_count;
    } else if (solution.fate[i] == RematFate::kRecomputed) {
      RematLayerSummary& s = layer_of(i);
      ++s.recomputed_count;
      s.recomputed_bytes += node.bytes;
      s.recompute_flops += node.flops;
    }
  }
  return solution;
}

const char* to_string(RematPolicy policy) {
  switch (policy) {
    case RematPolicy::kNone:
      return "none";
    case RematPolicy::kDefault:
      return "default";
    case RematPolicy::kSequenceAware:
      return "sequence-aware";
  }
  return "?";
}

const char* to_string(RematOpKind kind) {
  switch (kind) {
    case RematOpKind::kInput:
      return "input";
    case RematOpKind::kView:
      return "view";
    case RematOpKind::kCheap:
      return "cheap";
    case RematOpKind::kMatmul:
      return "matmul";
    case RematOpKind::kAttention:
      return "attention";
    case RematOpKind::kCollective:
      return "collective";
    case RematOpKind::kRandom:
      return "random";
    case RematOpKind::kOther:
      return "other";
  }
  return "?";
}

const char* to_string(RematFate fate) {
  switch (fate) {
    case RematFate::kBackwardOnly:
      return "backward-only";
    case RematFate::kSaved:
      return "saved";
    case RematFate::kRecomputed:
      return "recomputed";
    case RematFate::kForwardOnly:
      return "forward-only";
  }
  return "?";
}

}  // namespace autosp
