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

#include "plan/remat_detail.h"
#include "util/maxflow.h"

namespace autosp {
namespace {

using namespace remat_detail;

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
  if (options.admitted && (options.policy != RematPolicy::kSequenceAware || options.budget_bytes ||
                           options.budget_fraction)) {
    throw std::invalid_argument(
        "[remat] admitted matmuls are given only to policy sequence-aware without a budget");
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

// ZeRO-3 (see solve_remat in remat.h). Overrides PyTorch's rule that collectives are saved
// (must_save), which is meant for collectives on activations.
RematGraph recompute_parameter_gathers(const RematGraph& graph) {
  RematGraph out = graph;
  const size_t n = graph.nodes.size();
  std::vector<uint8_t> gathered(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const RematNode& node = graph.nodes[i];
    bool is_gathered = node.parameter_collective;
    if (!is_gathered && node.required_fw && !node.tangents_closure && !node.args.empty()) {
      is_gathered = std::all_of(node.args.begin(), node.args.end(),
                                [&](int32_t a) { return gathered[a] != 0; });
    }
    if (!is_gathered) continue;
    gathered[i] = 1;
    out.nodes[i].must_recompute = true;
    out.nodes[i].must_save = false;
  }
  return out;
}

}  // namespace

RematSolution solve_remat(const RematGraph& input, const RematOptions& options) {
  validate(input, options);
  const RematGraph graph = recompute_parameter_gathers(input);
  const Prepared p = prepare(graph);
  const auto n = static_cast<int32_t>(graph.nodes.size());

  RematSolution solution;
  solution.attention_flops = attention_flops(graph);

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
        if (options.admitted) {  // decided over a larger graph than this one
          for (int32_t c : *options.admitted) {
            if (std::find(candidates.begin(), candidates.end(), c) == candidates.end()) {
              throw std::invalid_argument("[remat] an admitted matmul (node " + std::to_string(c) +
                                          ") is not one sequence-aware may recompute");
            }
            admitted[c] = true;
          }
        } else {
          const CandidateCosts costs = candidate_costs(graph);
          const std::vector<bool> chosen_ones =
              admit_matmuls(costs.flops, costs.bytes,
                            options.recompute_flops_ratio * solution.attention_flops, costs.layers);
          for (size_t i = 0; i < costs.nodes.size(); ++i) admitted[costs.nodes[i]] = chosen_ones[i];
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
          solution.admitted.push_back(c);
          ++solution.admitted_matmuls;
          solution.admitted_matmul_flops += graph.nodes[c].flops;
        }
      }
      std::sort(solution.admitted.begin(), solution.admitted.end());
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
  std::vector<int64_t> held(n, 0);  // a storage's bytes go to the layer of its first saved node
  const std::vector<int64_t> added = remat_detail::saved_storage_bytes(graph, solution.saved);
  for (size_t k = 0; k < solution.saved.size(); ++k) held[solution.saved[k]] = added[k];
  for (int32_t i = 0; i < n; ++i) {
    const RematNode& node = graph.nodes[i];
    if (solution.fate[i] == RematFate::kSaved && !node.static_lifetime) {
      RematLayerSummary& s = layer_of(i);
      s.saved_bytes += held[i];
      ++s.saved_count;
    } else if (solution.fate[i] == RematFate::kRecomputed) {
      RematLayerSummary& s = layer_of(i);
      ++s.recomputed_count;
      s.recomputed_bytes += node.bytes;
      s.recompute_flops += node.flops;
    }
  }
  if (options.offload_layer_outputs || options.offload_layer_saved) {
    // Saved nodes per storage (a view counts for what it views): a view is copied only when it
    // is the one saved node of its storage, and holds all of it; otherwise the copy would add
    // host traffic and leave the storage on the device.
    std::vector<int32_t> saved_per_base(n, 0);
    for (int32_t i : solution.saved) ++saved_per_base[remat_detail::storage_base(graph, i)];
    for (int32_t i : solution.saved) {
      const RematNode& node = graph.nodes[i];
      const bool chosen = options.offload_layer_saved ? is_numbered_layer(node.layer)
                                                      : remat_detail::leaves_layer(graph, i);
      // PyTorch's offloading pass copies contiguous tensors only, and neither the ops it
      // lists as views (view, t, alias) nor getitems: the partitioner hands it a copy of those
      // (python/autosp/remat_partition.py); other aliases (a detach, an _unsafe_view) it
      // copies to the host itself. Either way the storage is freed. A storage saved through two
      // nodes stays on the device (a copy would add host traffic and free nothing), and so
      // does an alias of a parameter or an input (they stay there anyway) or of a larger
      // storage.
      if (node.save_cost != RematSaveCost::kTensor || !node.contiguous || node.static_lifetime ||
          node.primal_input || !chosen)
        continue;
      const int32_t base = remat_detail::storage_base(graph, i);
      const RematNode& b = graph.nodes[base];
      if (saved_per_base[base] != 1) continue;
      if (base != i && (b.kind == RematOpKind::kInput || b.static_lifetime || b.primal_input ||
                        b.bytes != node.bytes))
        continue;
      solution.offloaded.push_back(i);
      solution.offloaded_bytes += node.bytes;
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
