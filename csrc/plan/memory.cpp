#include "plan/memory.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace autosp {

// ---------------------------------------------------------------------------------------------
// Sizes

SeqBytes SeqBytes::constant(int64_t bytes) { return SeqBytes{{SeqTerm{bytes, 0, 1}}}; }

SeqBytes SeqBytes::term(int64_t coef, int power, int64_t shard) {
  return SeqBytes{{SeqTerm{coef, power, shard}}};
}

int64_t SeqBytes::at(int64_t seq) const {
  __int128 total = 0;
  const __int128 limit = std::numeric_limits<int64_t>::max();
  for (const SeqTerm& t : terms) {
    if (t.shard < 1 || t.power < 0) {
      throw std::invalid_argument("[memory] malformed size term " + str() +
                                  ": expected shard >= 1 and power >= 0");
    }
    __int128 v = t.coef;
    for (int p = 0; p < t.power; ++p) {
      v *= seq;
      if (v > limit || v < -limit)
        throw std::overflow_error("[memory] size " + str() + " at S=" + std::to_string(seq) +
                                  " exceeds int64");
    }
    if (v % t.shard != 0) {
      throw std::invalid_argument("[memory] size " + str() +
                                  " is not whole at S=" + std::to_string(seq) +
                                  "; expected S a multiple of " + std::to_string(t.shard));
    }
    total += t.cap > 0 ? std::min<__int128>(v / t.shard, t.cap) : v / t.shard;
  }
  if (total > limit) {
    throw std::overflow_error("[memory] size " + str() + " at S=" + std::to_string(seq) +
                              " exceeds int64");
  }
  return static_cast<int64_t>(total);
}

bool SeqBytes::is_zero() const {
  return std::all_of(terms.begin(), terms.end(), [](const SeqTerm& t) { return t.coef == 0; });
}

std::string SeqBytes::str() const {
  if (terms.empty()) return "0";
  std::ostringstream out;
  for (size_t i = 0; i < terms.size(); ++i) {
    const SeqTerm& t = terms[i];
    if (i > 0) out << " + ";
    if (t.cap > 0) out << "min(";
    out << t.coef;
    if (t.power == 1) out << "*S";
    if (t.power > 1) out << "*S^" << t.power;
    if (t.shard != 1) out << "/" << t.shard;
    if (t.cap > 0) out << ", " << t.cap << ")";
  }
  return out.str();
}

double SeqFlops::at(int64_t seq) const { return coef * std::pow(static_cast<double>(seq), power); }

namespace {
int64_t optimizer_shards_of(const TrainingConfig& cfg) {
  return std::max<int64_t>(cfg.param_shards > 1 ? cfg.param_shards : cfg.optimizer_shards, 1);
}

int64_t state_bytes(const TrainingConfig& cfg) {
  // ZeRO-3: the fp32 parameter and gradient shards are the master weights and accumulators.
  const int64_t per_param = cfg.dtype == DtypePolicy::kFp32 || cfg.param_shards > 1 ? 8 : 16;
  const int64_t shards = optimizer_shards_of(cfg);
  return (cfg.num_params * per_param + shards - 1) / shards;
}
}  // namespace

int64_t optimizer_state_bytes(const TrainingConfig& cfg) {
  return cfg.optimizer_offload ? 0 : state_bytes(cfg);
}

int64_t host_optimizer_bytes(const TrainingConfig& cfg) {
  // fp32 master weights, their gradients and AdamW's two moments, whatever the parameters'
  // dtype (for fp32 parameters the master is a host copy of them).
  return cfg.optimizer_offload ? cfg.num_params * 16 : 0;
}

int64_t optimizer_workspace_bytes(const TrainingConfig& cfg) {
  if (!cfg.optimizer_foreach || cfg.optimizer_offload) return 0;
  const int64_t shards = optimizer_shards_of(cfg);
  return (cfg.num_params * 4 + shards - 1) / shards;
}

int64_t tiled_loss_chunks(int64_t classes, int64_t hidden, int64_t chunks) {
  if (chunks > 0) return chunks;
  return std::max<int64_t>(
      1, (classes + std::max<int64_t>(hidden, 1) - 1) / std::max<int64_t>(hidden, 1));
}

TiledLossWorkspace tiled_loss_workspace(TiledLossPass pass, int64_t classes, int64_t hidden,
                                        int64_t weight_itemsize, int64_t fixed_rows,
                                        int64_t chunks) {
  const bool grads = pass != TiledLossPass::kForward;
  const int64_t k = grads ? 12 : 8;
  // One chunk's gradient of the weight, and (in the backward) its fp32 accumulator.
  int64_t accumulator = grads ? classes * hidden * weight_itemsize : 0;
  if (pass == TiledLossPass::kBackward) accumulator += classes * hidden * 4;
  if (fixed_rows > 0) return {k * classes, k * classes * fixed_rows, accumulator, 0};
  return {k * classes, 0, k * classes + accumulator, tiled_loss_chunks(classes, hidden, chunks)};
}

int64_t tiled_rows_chunk(int64_t rows, int64_t in_bytes, int64_t inner_bytes, int64_t fixed_rows) {
  if (rows <= 0) return 1;
  if (fixed_rows > 0) return std::min(rows, fixed_rows);
  if (inner_bytes <= 0) return rows;
  const int64_t even = (rows * in_bytes + inner_bytes - 1) / inner_bytes;
  return std::min(rows, std::max<int64_t>({even, kMinTiledRows, 1}));
}

TiledRowsWorkspace tiled_rows_workspace(bool backward, int64_t in_bytes, int64_t inner_bytes,
                                        int64_t out_bytes, int64_t whole_bytes,
                                        int64_t whole_elements, int64_t batch, int64_t fixed_rows) {
  // Bytes per token of one chunk, and the ratio that sets the even split's chunk size.
  // Backward: the recomputed intermediates (autograd keeps nearly all of them) and the
  // gradients of part of them at a time; 3/2 x inner fits the CPU measurements of
  // tests/test_tiled_mlp.py (1.4x between chunks of 512 and 2048 tokens).
  const int64_t live = backward ? inner_bytes + inner_bytes / 2 : inner_bytes + out_bytes;
  const int64_t constant = backward ? whole_elements * 4 + whole_bytes : 0;
  batch = std::max<int64_t>(batch, 1);
  if (fixed_rows > 0) return {0, live, live * batch * fixed_rows, constant};
  if (inner_bytes <= 0) return {live, 0, 0, constant};
  // ceil(rows * in / inner) rows per chunk hold rows * in / inner * live bytes per batch row.
  const int64_t per_row = (live * in_bytes + inner_bytes - 1) / inner_bytes;
  return {per_row, live, live * batch * kMinTiledRows, constant + live * batch};
}

const char* to_string(RematStrategy strategy) {
  switch (strategy) {
    case RematStrategy::kNone:
      return "none";
    case RematStrategy::kDefault:
      return "default";
    case RematStrategy::kSequenceAware:
      return "sequence-aware";
    case RematStrategy::kFullCheckpoint:
      return "full";
  }
  return "?";
}

const char* to_string(DtypePolicy dtype) { return dtype == DtypePolicy::kFp32 ? "fp32" : "bf16"; }

void validate_memory_graph(const MemoryGraph& graph) {
  const int32_t n = static_cast<int32_t>(graph.nodes.size());
  for (int32_t i = 0; i < n; ++i) {
    const MemoryNode& node = graph.nodes[i];
    if (node.alias_of >= i || node.alias_of < -1) {
      throw std::invalid_argument("[memory] node " + std::to_string(i) + " (" + node.facts.name +
                                  ") aliases node " + std::to_string(node.alias_of) +
                                  "; expected an earlier node or -1");
    }
    for (int32_t u : node.facts.users) {
      if (u <= i || u >= n) {
        throw std::invalid_argument("[memory] node " + std::to_string(i) + " (" + node.facts.name +
                                    ") has user " + std::to_string(u) +
                                    "; expected a later node index < " + std::to_string(n));
      }
    }
  }
}

std::vector<std::vector<int32_t>> node_inputs(const MemoryGraph& graph) {
  std::vector<std::vector<int32_t>> inputs(graph.nodes.size());
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    for (int32_t u : graph.nodes[i].facts.users) inputs[u].push_back(static_cast<int32_t>(i));
  }
  return inputs;
}

namespace {

// Full activation checkpointing of every layer, as torch.utils.checkpoint around each decoder
// layer does: a value computed inside a layer is saved only if it leaves the layer (it is then
// the next layer's input); everything else inside the layer that the backward needs is
// recomputed. Values computed outside layers are saved as the backward needs them.
std::vector<RematFate> full_checkpoint_fates(const MemoryGraph& graph) {
  const auto& nodes = graph.nodes;
  const int32_t n = static_cast<int32_t>(nodes.size());
  const auto inputs = node_inputs(graph);
  std::vector<RematFate> fate(n, RematFate::kBackwardOnly);
  for (int32_t i = 0; i < n; ++i) {
    if (nodes[i].facts.required_fw) fate[i] = RematFate::kForwardOnly;
  }
  auto leaves_layer = [&](int32_t i) {
    const std::string& layer = nodes[i].facts.layer;
    if (!is_numbered_layer(layer)) return true;  // full checkpointing wraps numbered layers
    for (int32_t u : nodes[i].facts.users) {
      if (is_forward_op(nodes[u]) && nodes[u].facts.layer != layer) return true;
    }
    return false;
  };
  std::vector<int32_t> stack;
  for (int32_t i = 0; i < n; ++i) {
    if (nodes[i].role != MemoryRole::kCompute || nodes[i].facts.required_fw) continue;
    for (int32_t w : inputs[i]) stack.push_back(w);
  }
  while (!stack.empty()) {
    const int32_t v = stack.back();
    stack.pop_back();
    if (!is_forward_op(nodes[v]) || fate[v] != RematFate::kForwardOnly) continue;
    if (leaves_layer(v)) {
      fate[v] = RematFate::kSaved;
      continue;
    }
    fate[v] = RematFate::kRecomputed;
    for (int32_t w : inputs[v]) stack.push_back(w);
  }
  // Placeholders the backward reads are "saved" in the remat solver's sense.
  for (int32_t i = 0; i < n; ++i) {
    if (nodes[i].role == MemoryRole::kCompute || !nodes[i].facts.required_fw) continue;
    for (int32_t u : nodes[i].facts.users) {
      if (!nodes[u].facts.required_fw || fate[u] == RematFate::kRecomputed) {
        fate[i] = RematFate::kSaved;
        break;
      }
    }
  }
  return fate;
}

}  // namespace

std::vector<RematFate> decide_fates(const MemoryGraph& graph, int64_t seq,
                                    const MemoryOptions& options) {
  return decide_remat(graph, seq, options).fate;
}

RematDecision decide_remat(const MemoryGraph& graph, int64_t seq, const MemoryOptions& options) {
  validate_memory_graph(graph);
  if (options.strategy == RematStrategy::kFullCheckpoint) return {full_checkpoint_fates(graph), {}};
  RematGraph remat;
  remat.nodes.reserve(graph.nodes.size());
  for (const MemoryNode& node : graph.nodes) {
    RematNode facts = node.facts;
    facts.bytes = node.save_bytes.at(seq);
    facts.flops = node.flops.at(seq);
    remat.nodes.push_back(std::move(facts));
  }
  RematOptions ro;
  ro.policy = options.strategy == RematStrategy::kNone      ? RematPolicy::kNone
              : options.strategy == RematStrategy::kDefault ? RematPolicy::kDefault
                                                            : RematPolicy::kSequenceAware;
  ro.recompute_flops_ratio = options.recompute_flops_ratio;
  ro.max_dist_from_bw = options.max_dist_from_bw;
  ro.offload_layer_outputs = options.offload_layer_outputs;
  ro.offload_layer_saved = options.offload_layer_saved;
  RematSolution solution = solve_remat(remat, ro);
  return {std::move(solution.fate), std::move(solution.offloaded)};
}

Trainability longest_trainable_seq(const MemoryGraph& graph, const MemoryOptions& options,
                                   const TrainabilityQuery& query) {
  if (query.seq_multiple < 1 || query.max_seq < query.seq_multiple) {
    throw std::invalid_argument(
        "[memory] search over multiples of " + std::to_string(query.seq_multiple) + " up to " +
        std::to_string(query.max_seq) + "; expected 1 <= seq_multiple <= max_seq");
  }
  int64_t parameters = 0;
  for (const MemoryNode& node : graph.nodes) {
    if (node.role == MemoryRole::kParameter && node.alias_of < 0) {
      parameters += node.alloc_bytes.at(query.seq_multiple);
    }
  }
  if (query.budget_bytes < parameters) {
    std::ostringstream msg;
    msg << std::fixed << std::setprecision(2) << "[memory] budget of " << query.budget_bytes
        << " bytes (" << static_cast<double>(query.budget_bytes) / (1 << 20)
        << " MiB) per rank is below the parameters' own " << parameters << " bytes ("
        << static_cast<double>(parameters) / (1 << 20)
        << " MiB); expected a budget above the parameters' size";
    throw std::invalid_argument(msg.str());
  }
  Trainability result;
  const int64_t m = query.seq_multiple;
  const int64_t kmax = query.max_seq / m;
  auto eval = [&](int64_t k) {
    ++result.evaluations;
    return simulate_peak_memory(graph, k * m, options);
  };
  auto fits = [&](const MemoryBreakdown& b) {
    return b.peak <= query.budget_bytes &&
           (query.host_budget_bytes <= 0 || b.host_bytes <= query.host_budget_bytes);
  };
  MemoryBreakdown b = eval(1);
  if (!fits(b)) {
    result.first_oom = b;
    return result;
  }
  int64_t lo = 1, hi = 0;
  MemoryBreakdown at_lo = b, at_hi;
  while (true) {
    if (lo == kmax) {
      result.capped = true;
      break;
    }
    const int64_t k = std::min(lo * 2, kmax);
    MemoryBreakdown bk = eval(k);
    if (fits(bk)) {
      lo = k;
      at_lo = bk;
    } else {
      hi = k;
      at_hi = bk;
      break;
    }
  }
  while (hi > lo + 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    MemoryBreakdown bm = eval(mid);
    if (fits(bm)) {
      lo = mid;
      at_lo = bm;
    } else {
      hi = mid;
      at_hi = bm;
    }
  }
  result.longest_seq = lo * m;
  result.at_longest = at_lo;
  result.first_oom = at_hi;
  return result;
}

int64_t fewest_loss_chunks(const MemoryGraph& graph, int64_t seq, const MemoryOptions& options,
                           int64_t budget_bytes, int64_t max_chunks) {
  const bool tiled = std::any_of(graph.nodes.begin(), graph.nodes.end(),
                                 [](const MemoryNode& n) { return !n.chunked_bytes.is_zero(); });
  if (!tiled || max_chunks < 1) return 0;
  MemoryOptions o = options;
  auto fits = [&](int64_t chunks) {
    o.loss_chunks = chunks;
    return simulate_peak_memory(graph, seq, o).peak <= budget_bytes;
  };
  if (!fits(max_chunks)) return 0;
  int64_t lo = 0, hi = max_chunks;  // lo does not fit (0: none tried), hi fits
  while (hi > lo + 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? hi : lo) = mid;
  }
  return hi;
}

}  // namespace autosp
