// simulate_peak_memory (see memory.h): one training step's schedule walked with every value's
// liveness, the peak and its breakdown.
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/memory.h"

namespace autosp {

namespace {

// What each byte at the peak is (MemoryBreakdown's fields).
enum Category : int {
  kParamsCat,
  kGradsCat,
  kOptimCat,
  kSavedCat,
  kTransientCat,
  kCommCat,
  kInputsCat,
  kNumCategories
};

}  // namespace

MemoryBreakdown simulate_peak_memory(const MemoryGraph& graph, int64_t seq,
                                     const MemoryOptions& options) {
  if (seq < 1) {
    throw std::invalid_argument("[memory] sequence length " + std::to_string(seq) +
                                "; expected a positive length");
  }
  const RematDecision decision = decide_remat(graph, seq, options);
  const std::vector<RematFate>& fate = decision.fate;
  const auto& nodes = graph.nodes;
  const int32_t n = static_cast<int32_t>(nodes.size());
  const auto inputs = node_inputs(graph);

  std::vector<int64_t> alloc(n), scratch(n);
  for (int32_t i = 0; i < n; ++i) {
    alloc[i] = nodes[i].alias_of >= 0 ? 0 : nodes[i].alloc_bytes.at(seq);
    scratch[i] = nodes[i].scratch_bytes.at(seq);
    if (!nodes[i].chunked_bytes.is_zero()) {  // a tiled loss: one chunk of its rows at a time
      const int64_t chunks = options.loss_chunks > 0 ? options.loss_chunks : nodes[i].chunks;
      const int64_t whole = nodes[i].chunked_bytes.at(seq);
      scratch[i] += chunks > 1 ? (whole + chunks - 1) / chunks : whole;
    }
  }
  auto root = [&](int32_t i) {
    while (nodes[i].alias_of >= 0) i = nodes[i].alias_of;
    return i;
  };
  auto saved = [&](int32_t i) {
    return fate[i] == RematFate::kSaved && nodes[i].role != MemoryRole::kParameter;
  };

  // ZeRO-3 (TrainingConfig::param_shards): fp32 shards persist; the graph's parameters are
  // gathered copies, allocated at their first use in each program and freed after the last.
  const int64_t shards = std::max<int64_t>(options.training.param_shards, 1);
  const bool zero3 = shards > 1;
  const int64_t master_scale = options.training.dtype == DtypePolicy::kBf16Mixed ? 2 : 1;
  auto shard_of = [&](int64_t bytes) { return (bytes * master_scale + shards - 1) / shards; };
  auto gathered = [&](int32_t s) {
    return zero3 && s < n && nodes[s].role == MemoryRole::kParameter;
  };

  MemoryBreakdown out;
  out.seq_len = seq;
  std::array<int64_t, kNumCategories> persistent{};
  for (int32_t i = 0; i < n; ++i) {
    if (nodes[i].role == MemoryRole::kParameter) {
      persistent[kParamsCat] += zero3 ? shard_of(alloc[i]) : alloc[i];
    }
    if (nodes[i].role == MemoryRole::kInput) persistent[kInputsCat] += alloc[i];
  }
  persistent[kOptimCat] = optimizer_state_bytes(options.training);

  // Storage instances: [0, n) the forward's (or a placeholder's), [n, 2n) the backward's own
  // (recomputed or backward ops), both indexed by the node that allocated them.
  std::vector<uint8_t> held(2 * n, 0);  // not freed at its last use in its program
  std::vector<int> category(2 * n, kTransientCat);
  std::vector<uint8_t> is_saved_storage(n, 0);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t r = root(i);
    if (saved(i)) is_saved_storage[r] = 1;
    if (nodes[i].forward_output) held[r] = 1;
    if (nodes[r].collective) category[r] = category[n + r] = kCommCat;
  }
  for (int32_t r = 0; r < n; ++r) {
    // A saved view of a gathered parameter is gathered again in the backward, not held.
    if (gathered(r)) is_saved_storage[r] = 0;
    if (gathered(r)) category[r] = category[n + r] = kCommCat;
    if (is_saved_storage[r]) {
      held[r] = 1;
      category[r] = kSavedCat;
    }
  }
  // Offloaded storages leave the device after their last forward use (the host copy is made
  // when they are computed) and are reloaded for the backward.
  // A storage saved through several nodes (a view and its base, two views) leaves the device
  // only when every one of them is offloaded.
  std::vector<uint8_t> offloaded(n, 0), kept(n, 0), chosen(n, 0);
  for (int32_t i : decision.offloaded) chosen[i] = 1;
  for (int32_t i = 0; i < n; ++i) {
    if (saved(i) && !chosen[i]) kept[root(i)] = 1;
  }
  for (int32_t i : decision.offloaded) {
    const int32_t r = root(i);
    if (!is_saved_storage[r] || nodes[r].forward_output || offloaded[r] || kept[r]) continue;
    offloaded[r] = 1;
    held[r] = 0;
    out.offloaded_bytes += alloc[r];
  }
  for (int32_t i = 0; i < n; ++i) {
    if (is_saved_storage[i] && nodes[i].role == MemoryRole::kCompute) {
      out.saved_bytes += alloc[i];
    } else if (is_saved_storage[i] && nodes[i].role == MemoryRole::kInput) {
      out.saved_bytes += alloc[i];
    }
    if (saved(i) && nodes[i].role != MemoryRole::kTangent) ++out.saved_count;
    if (fate[i] == RematFate::kRecomputed) ++out.recomputed_count;
    if (nodes[i].role != MemoryRole::kCompute) continue;
    out.step_flops += nodes[i].flops.at(seq);
    out.recompute_flops += nodes[i].inner_recompute_flops.at(seq);
    if (fate[i] == RematFate::kRecomputed) out.recompute_flops += nodes[i].flops.at(seq);
  }

  std::array<int64_t, kNumCategories> live{};
  auto total = [&](const std::array<int64_t, kNumCategories>& extra) {
    int64_t t = 0;
    for (int c = 0; c < kNumCategories; ++c) t += persistent[c] + live[c] + extra[c];
    return t;
  };
  auto record = [&](const std::array<int64_t, kNumCategories>& extra, const char* phase,
                    const std::string& at) {
    const int64_t t = total(extra);
    if (t <= out.peak) return;
    out.peak = t;
    out.phase = phase;
    out.peak_node = at;
    out.parameters = persistent[kParamsCat] + live[kParamsCat] + extra[kParamsCat];
    out.gradients = persistent[kGradsCat] + live[kGradsCat] + extra[kGradsCat];
    out.optimizer_state = persistent[kOptimCat] + live[kOptimCat] + extra[kOptimCat];
    out.saved_activations = persistent[kSavedCat] + live[kSavedCat] + extra[kSavedCat];
    out.transient = persistent[kTransientCat] + live[kTransientCat] + extra[kTransientCat];
    out.communication = persistent[kCommCat] + live[kCommCat] + extra[kCommCat];
    out.inputs = persistent[kInputsCat] + live[kInputsCat] + extra[kInputsCat];
  };
  std::vector<int64_t> instance_bytes(2 * n, 0);
  auto free_instance = [&](int32_t s) {
    live[category[s]] -= instance_bytes[s];
    instance_bytes[s] = 0;
  };
  // Runs one program (forward or backward): `order` lists node indices, `storage(i)` maps a
  // node to the instance holding its output, `owns(i)` says whether running i allocates it;
  // with `reload`, offloaded storages are allocated again before their first use, each when
  // the previous one is first read (prefetched one ahead).
  auto run = [&](const std::vector<int32_t>& order, auto&& storage, auto&& owns, const char* phase,
                 bool reload) {
    std::vector<int32_t> first_use(2 * n, -1), last_use(2 * n, -1);
    for (int32_t p = 0; p < static_cast<int32_t>(order.size()); ++p) {
      const int32_t i = order[p];
      last_use[storage(i)] = std::max(last_use[storage(i)], p);
      for (int32_t w : inputs[i]) {
        last_use[storage(w)] = std::max(last_use[storage(w)], p);
        if (first_use[storage(w)] < 0) first_use[storage(w)] = p;
      }
    }
    std::vector<std::vector<int32_t>> frees(order.size()), gathers(order.size()),
        reduced(order.size());
    std::vector<std::pair<int32_t, int32_t>> reloads;  // (first use, storage)
    for (int32_t s = 0; s < 2 * n; ++s) {
      if (last_use[s] >= 0 && !held[s]) frees[last_use[s]].push_back(s);
      if (gathered(s) && first_use[s] >= 0) gathers[first_use[s]].push_back(s);
      if (reload && s < n && offloaded[s] && first_use[s] >= 0)
        reloads.push_back({first_use[s], s});
      if (zero3 && held[s] && category[s] == kGradsCat && last_use[s] >= 0) {
        reduced[last_use[s]].push_back(s);
      }
    }
    std::sort(reloads.begin(), reloads.end());
    for (size_t k = 0; k < reloads.size(); ++k)
      gathers[k == 0 ? reloads[k].first : reloads[k - 1].first].push_back(reloads[k].second);
    for (int32_t p = 0; p < static_cast<int32_t>(order.size()); ++p) {
      const int32_t i = order[p];
      for (int32_t s : gathers[p]) {  // the all-gather of a parameter before its first use
        instance_bytes[s] += alloc[s];
        live[category[s]] += alloc[s];
      }
      if (owns(i)) {
        const int32_t s = storage(i);
        instance_bytes[s] += alloc[i];
        live[category[s]] += alloc[i];
      }
      std::array<int64_t, kNumCategories> extra{};
      extra[kTransientCat] = scratch[i];
      record(extra, phase, nodes[i].facts.name);
      for (int32_t s : frees[p]) free_instance(s);
      for (int32_t s : reduced[p]) {  // reduce-scattered: this rank keeps its fp32 shard
        const int64_t kept = shard_of(instance_bytes[s]);
        live[kGradsCat] += kept - instance_bytes[s];
        instance_bytes[s] = kept;
      }
    }
  };

  // Forward: every op the forward graph computes, in graph order: the ops the forward's
  // outputs need, the saved values (a getitem of a forward op that only the backward reads is
  // saved without being "required" by the forward) and whatever those need.
  std::vector<uint8_t> in_forward(n, 0);
  for (int32_t i = n - 1; i >= 0; --i) {
    if (nodes[i].role != MemoryRole::kCompute) continue;
    if (is_forward_op(nodes[i]) || fate[i] == RematFate::kSaved) in_forward[i] = 1;
    if (!in_forward[i]) continue;
    for (int32_t w : inputs[i]) in_forward[w] = 1;
  }
  std::vector<int32_t> fw_order;
  for (int32_t i = 0; i < n; ++i) {
    if (in_forward[i] && nodes[i].role == MemoryRole::kCompute) fw_order.push_back(i);
  }
  run(
      fw_order, [&](int32_t i) { return root(i); },
      [&](int32_t i) { return nodes[i].alias_of < 0; }, "forward", false);

  // Backward: each backward op preceded by the recomputations it needs, in graph order
  // (PyTorch's reordering_to_mimic_autograd_engine): the walk starts at the first user of a
  // tangent; what comes before it (recomputations, views of parameters) runs only when an op
  // from there on needs it.
  std::vector<uint8_t> emitted(n, 0);
  std::vector<int32_t> bw_order;
  int32_t first_bw = n;
  for (int32_t i = 0; i < n; ++i) {
    if (nodes[i].role != MemoryRole::kTangent) continue;
    for (int32_t u : nodes[i].facts.users) first_bw = std::min(first_bw, u);
  }
  if (first_bw == n) first_bw = 0;  // no tangent is read: every backward op is a start
  for (int32_t i = first_bw; i < n; ++i) {
    if (nodes[i].role != MemoryRole::kCompute || in_forward[i] || emitted[i]) continue;
    std::vector<int32_t> pending, stack{i};
    while (!stack.empty()) {
      const int32_t v = stack.back();
      stack.pop_back();
      if (emitted[v]) continue;
      emitted[v] = 1;
      pending.push_back(v);
      for (int32_t w : inputs[v]) {
        if (nodes[w].role != MemoryRole::kCompute || emitted[w] || saved(w)) continue;
        if (fate[w] == RematFate::kForwardOnly) {
          throw std::invalid_argument("[memory] backward op " + nodes[v].facts.name + " reads " +
                                      nodes[w].facts.name +
                                      ", which is neither saved nor recomputed");
        }
        stack.push_back(w);
      }
    }
    std::sort(pending.begin(), pending.end());
    bw_order.insert(bw_order.end(), pending.begin(), pending.end());
  }
  // A node's output in the backward: the backward's own allocation, unless the alias chain
  // reaches a saved value or a placeholder first (then the forward's instance, still held).
  auto bw_storage = [&](int32_t i) {
    int32_t j = i;
    while (true) {
      if (nodes[j].role != MemoryRole::kCompute || saved(j) || !emitted[j]) return root(j);
      if (nodes[j].alias_of < 0) return n + j;
      j = nodes[j].alias_of;
    }
  };
  for (int32_t i = 0; i < n; ++i) {
    if (nodes[i].role == MemoryRole::kTangent) {
      instance_bytes[i] = alloc[i];
      live[kTransientCat] += alloc[i];
    }
  }
  for (int32_t i : bw_order) {
    if (nodes[i].gradient) {
      const int32_t s = bw_storage(i);
      held[s] = 1;
      category[s] = kGradsCat;
    }
  }
  // Saved storages are released by the backward at their last use there: un-hold them.
  for (int32_t r = 0; r < n; ++r) {
    if (is_saved_storage[r] && !nodes[r].forward_output) held[r] = 0;
  }
  for (int32_t i = 0; i < n; ++i) {
    if (nodes[i].forward_output) held[root(i)] = 1;
  }
  // A saved storage the backward never reads is released when the backward starts.
  std::vector<uint8_t> read_in_bw(2 * n, 0);
  for (int32_t i : bw_order) {
    read_in_bw[bw_storage(i)] = 1;
    for (int32_t w : inputs[i]) read_in_bw[bw_storage(w)] = 1;
  }
  for (int32_t r = 0; r < n; ++r) {
    if (is_saved_storage[r] && !read_in_bw[r] && !held[r]) free_instance(r);
  }
  run(
      bw_order, bw_storage,
      [&](int32_t i) { return nodes[i].alias_of < 0 && bw_storage(i) == n + i; }, "backward", true);

  // Optimizer step: parameters, gradients, state and the step's temporaries.
  std::array<int64_t, kNumCategories> extra{};
  extra[kOptimCat] = optimizer_workspace_bytes(options.training);
  // Activations still live here would be a leak in the graph; only gradients and held
  // forward outputs (the loss) remain.
  record(extra, "optimizer", "optimizer.step");
  out.host_bytes = out.offloaded_bytes + host_optimizer_bytes(options.training);
  return out;
}

}  // namespace autosp
