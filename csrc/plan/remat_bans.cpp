// The remat policies' ban sets (see remat_detail.h): PyTorch's default partitioner heuristics,
// sequence-aware's bans and matmul candidates, and none.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include "plan/remat_detail.h"

namespace autosp::remat_detail {

namespace {

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

// The bans both heuristic policies start with (PyTorch's ban_recomputation_if_allowed
// prologue): primal inputs and MUST_SAVE nodes. False when the policy's own rules do not apply
// (a backward node, a must-recompute node, a node outside the forward, a getitem, MUST_SAVE).
bool shared_bans(const RematNode& node, int32_t i, Bans& bans) {
  if (node.required_bw && node.tangents_closure) return false;
  if (node.must_recompute) return false;
  if (node.primal_input) bans.ban(i, "primal input");
  if (!node.required_fw || node.kind == RematOpKind::kInput || node.getitem) return false;
  if (node.must_save) {
    bans.ban(i, "marked MUST_SAVE");
    return false;
  }
  return true;
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

}  // namespace

void default_bans(const Prepared& p, const RematOptions& options, Bans& bans) {
  const auto& nodes = p.graph->nodes;
  const auto n = static_cast<int32_t>(nodes.size());
  for (int32_t i = 0; i < n; ++i) {
    const RematNode& node = nodes[i];
    if (!shared_bans(node, i, bans)) continue;
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

std::vector<size_t> admission_order(const std::vector<double>& flops,
                                    const std::vector<int64_t>& bytes) {
  std::vector<size_t> order(flops.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    // bytes[a] / flops[a] against bytes[b] / flops[b], without dividing.
    const double lhs = static_cast<double>(bytes[a]) * flops[b];
    const double rhs = static_cast<double>(bytes[b]) * flops[a];
    if (lhs != rhs) return lhs > rhs;
    return flops[a] > flops[b];  // ties: the larger first
  });
  return order;
}

CandidateCosts candidate_costs(const RematGraph& graph) {
  CandidateCosts costs;
  costs.nodes = matmul_candidates_in_graph_order(graph);
  for (int32_t c : costs.nodes) {
    costs.flops.push_back(graph.nodes[c].flops);
    costs.bytes.push_back(graph.nodes[c].bytes);
    costs.layers.push_back(graph.nodes[c].layer);
  }
  return costs;
}

// Matmuls the sequence-aware policy may recompute, most bytes saved per FLOP first.
std::vector<int32_t> matmul_candidates(const RematGraph& graph) {
  const CandidateCosts costs = candidate_costs(graph);
  std::vector<int32_t> candidates;
  for (size_t i : admission_order(costs.flops, costs.bytes)) candidates.push_back(costs.nodes[i]);
  return candidates;
}

bool leaves_layer(const RematGraph& graph, int32_t i) {
  const RematNode& node = graph.nodes[i];
  if (!is_numbered_layer(node.layer)) return false;
  for (int32_t u : node.users) {
    const RematNode& user = graph.nodes[u];
    if (user.required_fw && !(user.required_bw && user.tangents_closure) &&
        user.layer != node.layer)
      return true;
  }
  return false;
}

namespace {
template <class AliasOf>
int32_t follow_aliases(int32_t i, int32_t n, AliasOf alias_of) {
  for (int32_t steps = 0; steps < n; ++steps) {  // a chain of aliases, never a cycle
    const int32_t a = alias_of(i);
    if (a < 0 || a >= n) return i;
    i = a;
  }
  return i;
}
}  // namespace

int32_t storage_base(const RematGraph& graph, int32_t i) {
  return follow_aliases(i, static_cast<int32_t>(graph.nodes.size()),
                        [&](int32_t k) { return graph.nodes[k].aliases; });
}

std::vector<int64_t> saved_storage_bytes(const RematGraph& graph,
                                         const std::vector<int32_t>& saved) {
  std::vector<int64_t> added(saved.size(), 0);
  std::unordered_set<int32_t> held;
  for (size_t k = 0; k < saved.size(); ++k) {
    const RematNode& node = graph.nodes[saved[k]];
    const int32_t base = storage_base(graph, saved[k]);
    const RematNode& owner = graph.nodes[base];
    if (node.static_lifetime || owner.static_lifetime || !held.insert(base).second) continue;
    added[k] = owner.bytes > 0 ? owner.bytes : node.bytes;
  }
  return added;
}

void sequence_aware_bans(const Prepared& p, const std::vector<bool>& admitted, Bans& bans) {
  const auto& nodes = p.graph->nodes;
  for (int32_t i = 0; i < static_cast<int32_t>(nodes.size()); ++i) {
    const RematNode& node = nodes[i];
    if (!shared_bans(node, i, bans)) continue;
    if (leaves_layer(*p.graph, i)) bans.ban(i, "a layer's output to the next layer");
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

}  // namespace autosp::remat_detail

namespace autosp {

int32_t storage_owner(const std::vector<int32_t>& aliases, int32_t i) {
  return remat_detail::follow_aliases(i, static_cast<int32_t>(aliases.size()),
                                      [&](int32_t k) { return aliases[k]; });
}

std::vector<int32_t> storage_owners(const std::vector<int32_t>& aliases) {
  std::vector<int32_t> owners(aliases.size());
  for (size_t i = 0; i < aliases.size(); ++i)
    owners[i] = storage_owner(aliases, static_cast<int32_t>(i));
  return owners;
}

double attention_flops(const RematGraph& graph) {
  double flops = 0;
  for (const RematNode& node : graph.nodes) {
    if (node.kind == RematOpKind::kAttention) flops += node.flops;
  }
  return flops;
}

namespace {

// A node the forward does not compute: it runs in the backward (with or without a tangent).
bool in_backward(const RematNode& node) { return !node.required_fw; }

// Whether recomputing matmul `c` can spare the forward a saved value: the backward reads its
// output, or the output of a forward op computed from it by cheap ops and views alone (which
// the cut may recompute with it), not crossing a layer's output to the next layer (never
// recomputed). A matmul whose output the backward never reads (an attention output projection
// feeding the residual add; the head, whose loss saves its own values) frees nothing when
// recomputed, and admitting it would only spend the FLOP allowance.
bool recompute_can_spare(const RematGraph& graph, int32_t c) {
  std::vector<int32_t> stack{c};
  std::vector<bool> seen(graph.nodes.size(), false);
  seen[c] = true;
  while (!stack.empty()) {
    const int32_t i = stack.back();
    stack.pop_back();
    for (int32_t u : graph.nodes[i].users) {
      const RematNode& user = graph.nodes[u];
      if (in_backward(user)) return true;
      const bool cheap = user.kind == RematOpKind::kCheap || user.kind == RematOpKind::kView;
      if (cheap && user.required_fw && !seen[u] && !remat_detail::leaves_layer(graph, u)) {
        seen[u] = true;
        stack.push_back(u);
      }
    }
  }
  return false;
}

}  // namespace

std::vector<int32_t> matmul_candidates_in_graph_order(const RematGraph& graph) {
  std::vector<int32_t> candidates;
  for (int32_t i = 0; i < static_cast<int32_t>(graph.nodes.size()); ++i) {
    const RematNode& node = graph.nodes[i];
    if (node.required_fw && node.kind == RematOpKind::kMatmul && !node.must_save &&
        node.flops > 0 && !remat_detail::leaves_layer(graph, i) && recompute_can_spare(graph, i)) {
      candidates.push_back(i);
    }
  }
  return candidates;
}

namespace {

// admit_matmuls' classes: for each matmul, a class number (numbered in order of first member).
std::vector<int32_t> alike_matmul_classes(const std::vector<double>& flops,
                                          const std::vector<int64_t>& bytes,
                                          const std::vector<std::string>& layers) {
  if (flops.size() != bytes.size() || (!layers.empty() && layers.size() != flops.size())) {
    throw std::invalid_argument("[remat] admit_matmuls: flops, bytes and layers differ in length");
  }
  // (the layer's path without its number, place among the layer's candidates, FLOPs, bytes)
  using Key = std::tuple<std::string, int32_t, double, int64_t>;
  std::map<Key, int32_t> class_of;
  std::map<std::string, int32_t> seen_in_layer;
  std::vector<int32_t> classes(flops.size());
  int32_t next = 0;
  for (size_t i = 0; i < flops.size(); ++i) {
    if (layers.empty() || !is_numbered_layer(layers[i])) {
      classes[i] = next++;
      continue;
    }
    const std::string& layer = layers[i];
    const std::string stem = layer.substr(0, layer.find_last_not_of("0123456789") + 1);
    const Key key{stem, seen_in_layer[layer]++, flops[i], bytes[i]};
    auto [it, inserted] = class_of.try_emplace(key, next);
    if (inserted) ++next;
    classes[i] = it->second;
  }
  return classes;
}

}  // namespace

std::vector<bool> admit_matmuls(const std::vector<double>& flops, const std::vector<int64_t>& bytes,
                                double allowance, const std::vector<std::string>& layers) {
  const std::vector<int32_t> classes = alike_matmul_classes(flops, bytes, layers);
  // One unit per class, in the order of its first member; its members share FLOPs and bytes,
  // so the unit's bytes per FLOP are each member's.
  const int32_t n = classes.empty() ? 0 : *std::max_element(classes.begin(), classes.end()) + 1;
  std::vector<double> unit_flops(n, 0);
  std::vector<int64_t> unit_bytes(n, 0);
  for (size_t i = 0; i < classes.size(); ++i) {
    unit_flops[classes[i]] += flops[i];
    unit_bytes[classes[i]] += bytes[i];
  }
  std::vector<bool> unit_admitted(n, false);
  double used = 0;
  for (size_t u : remat_detail::admission_order(unit_flops, unit_bytes)) {
    if (used + unit_flops[u] <= allowance) {
      unit_admitted[u] = true;
      used += unit_flops[u];
    }
  }
  std::vector<bool> admitted(flops.size(), false);
  for (size_t i = 0; i < classes.size(); ++i) admitted[i] = unit_admitted[classes[i]];
  return admitted;
}

}  // namespace autosp
