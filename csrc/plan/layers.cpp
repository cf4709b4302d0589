#include "plan/layers.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace autosp {
namespace {

[[noreturn]] void fail(const std::string& why) {
  throw std::invalid_argument("[memory] cannot replicate layers: " + why);
}

std::string describe(const MemoryGraph& graph, int32_t i) {
  const RematNode& f = graph.nodes[i].facts;
  return f.name + " (" + f.target + ")";
}

// The layers (>= 0) among `ids`' labels.
std::set<int32_t> layers_of(const std::vector<int32_t>& ids, const std::vector<int32_t>& label) {
  std::set<int32_t> out;
  for (int32_t i : ids) {
    if (label[i] >= 0) out.insert(label[i]);
  }
  return out;
}

// "layers.1" with old == 1 -> "layers.<new_index>"; any other string is kept.
std::string renumber(const std::string& layer, int32_t old_index, int32_t new_index) {
  size_t digits = layer.size();
  while (digits > 0 && std::isdigit(static_cast<unsigned char>(layer[digits - 1]))) --digits;
  if (digits == layer.size() || layer.substr(digits) != std::to_string(old_index)) return layer;
  return layer.substr(0, digits) + std::to_string(new_index);
}

SeqBytes plus_times(const SeqBytes& base, const SeqBytes& extra, int64_t times) {
  SeqBytes out = base;
  for (SeqTerm t : extra.terms) {
    t.coef *= times;
    t.cap *= times;
    out.terms.push_back(t);
  }
  return out;
}

SeqBytes sum(const SeqBytes& a, const SeqBytes& b) { return plus_times(a, b, 1); }

uint8_t fusible_edge(const MemoryGraph& graph, int32_t from, int32_t to) {
  const RematNode& f = graph.nodes[from].facts;
  for (size_t k = 0; k < f.users.size(); ++k) {
    if (f.users[k] == to) return k < f.fusible_user.size() ? f.fusible_user[k] : 0;
  }
  return 0;
}

}  // namespace

std::vector<int32_t> label_layers(const MemoryGraph& graph) {
  validate_memory_graph(graph);
  const int32_t n = static_cast<int32_t>(graph.nodes.size());
  const auto inputs = node_inputs(graph);
  std::vector<int32_t> label(n);
  for (int32_t i = 0; i < n; ++i) {
    label[i] = graph.nodes[i].layer;
    if (label[i] < kNoLayer) {
      throw std::invalid_argument("[memory] node " + describe(graph, i) + " has layer " +
                                  std::to_string(label[i]) +
                                  "; expected a layer index >= 0, -1 (unknown) or -2 (none)");
    }
  }
  // A labelled value read by two or more other layers (a size computed in the first layer and
  // reused by all) belongs to no layer.
  auto demote_shared = [&] {
    for (int32_t i = 0; i < n; ++i) {
      if (label[i] < 0) continue;
      std::set<int32_t> others = layers_of(graph.nodes[i].facts.users, label);
      others.erase(label[i]);
      if (others.size() >= 2) label[i] = kNoLayer;
    }
  };
  demote_shared();
  auto infer = [&](int32_t i) {
    if (label[i] != kLayerUnknown) return false;
    const std::set<int32_t> from = layers_of(inputs[i], label);
    const std::set<int32_t> to = layers_of(graph.nodes[i].facts.users, label);
    if (from.size() == 1) {
      label[i] = *from.begin();
    } else if (to.size() == 1 && (from.empty() || from.count(*to.begin()))) {
      // No labelled input (a gradient's getitem), or inputs from this layer and the next
      // (the first op of a layer's backward reads the next layer's gradient).
      label[i] = *to.begin();
    } else {
      return false;
    }
    return true;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (int32_t i = 0; i < n; ++i) changed |= infer(i);
    for (int32_t i = n - 1; i >= 0; --i) changed |= infer(i);
  }
  for (int32_t& l : label) {
    if (l == kLayerUnknown) l = kNoLayer;
  }
  demote_shared();
  return label;
}

MemoryGraph replicate_layers(const MemoryGraph& traced, int32_t num_layers) {
  const std::vector<int32_t> label = label_layers(traced);
  const int32_t n = static_cast<int32_t>(traced.nodes.size());
  const int32_t traced_layers = 1 + *std::max_element(label.begin(), label.end());
  if (traced_layers < 3) {
    fail("the trace has " + std::to_string(traced_layers) +
         " labelled layers; expected 3 or more (a layer with a layer before and after it)");
  }
  if (num_layers < traced_layers) {
    fail("asked for " + std::to_string(num_layers) + " layers from a trace of " +
         std::to_string(traced_layers) + "; expected at least as many as traced");
  }
  MemoryGraph labelled = traced;
  for (int32_t i = 0; i < n; ++i) labelled.nodes[i].layer = label[i];
  const int32_t copies = num_layers - traced_layers;
  if (copies == 0) return labelled;

  constexpr int32_t m = 1;  // the template layer
  const auto inputs = node_inputs(traced);
  // The nodes of layer `from` that layer `to` reads: one each way is a layer's interface.
  auto interface = [&](int32_t from, int32_t to, const char* what) {
    std::vector<int32_t> found;
    for (int32_t i = 0; i < n; ++i) {
      if (label[i] != from) continue;
      const auto& users = traced.nodes[i].facts.users;
      if (std::any_of(users.begin(), users.end(), [&](int32_t u) { return label[u] == to; }))
        found.push_back(i);
    }
    if (found.size() != 1) {
      std::string names;
      for (int32_t i : found) names += (names.empty() ? "" : ", ") + describe(traced, i);
      fail("layer " + std::to_string(to) + " reads " + std::to_string(found.size()) +
           " values of layer " + std::to_string(from) + (names.empty() ? "" : " (" + names + ")") +
           "; expected one, " + what);
    }
    return found[0];
  };
  const int32_t prev_hidden = interface(m - 1, m, "the hidden state");
  const int32_t hidden = interface(m, m + 1, "the hidden state");
  const int32_t next_grad = interface(m + 1, m, "the gradient of its output");
  const int32_t grad = interface(m, m - 1, "the gradient of its input");
  if (!(traced.nodes[prev_hidden].save_bytes == traced.nodes[hidden].save_bytes) ||
      !(traced.nodes[next_grad].save_bytes == traced.nodes[grad].save_bytes)) {
    fail("the hidden states or gradients between layers differ in size (" +
         traced.nodes[prev_hidden].save_bytes.str() + " vs " +
         traced.nodes[hidden].save_bytes.str() + ", " + traced.nodes[next_grad].save_bytes.str() +
         " vs " + traced.nodes[grad].save_bytes.str() + "); expected identical layers");
  }
  for (int32_t i = 0; i < n; ++i) {
    if (label[i] != m) continue;
    for (int32_t a : inputs[i]) {
      if (label[a] == m || label[a] == kNoLayer || a == prev_hidden || a == next_grad) continue;
      fail(describe(traced, i) + " in layer 1 reads " + describe(traced, a) + " of layer " +
           std::to_string(label[a]) +
           "; expected only its own values, values outside layers "
           "and the interface");
    }
    for (int32_t u : traced.nodes[i].facts.users) {
      if (label[u] == m || label[u] == kNoLayer) continue;
      if ((i == hidden && label[u] == m + 1) || (i == grad && label[u] == m - 1)) continue;
      fail(describe(traced, i) + " in layer 1 is read by " + describe(traced, u) + " of layer " +
           std::to_string(label[u]) + "; expected only the interface to be read");
    }
  }

  // Values outside layers that read the template: concatenations of one value per layer (the
  // gradient bucket) and size-preserving ops on them grow by the template's share per copy.
  std::vector<SeqBytes> grow_save(n), grow_alloc(n);
  std::vector<std::vector<int32_t>> gathered(n);  // template inputs of such a value
  std::vector<uint8_t> grows(n, 0);
  for (int32_t i = 0; i < n; ++i) {
    if (label[i] != kNoLayer) continue;
    const MemoryNode& node = traced.nodes[i];
    std::vector<int32_t> grown;
    for (int32_t a : inputs[i]) {
      if (label[a] == m) gathered[i].push_back(a);
      if (grows[a]) grown.push_back(a);
    }
    if (gathered[i].empty() && grown.empty()) continue;
    if (node.facts.target.rfind("aten.cat", 0) == 0) {
      for (int32_t a : gathered[i]) grow_save[i] = sum(grow_save[i], traced.nodes[a].save_bytes);
      for (int32_t a : grown) grow_save[i] = sum(grow_save[i], grow_save[a]);
    } else if (gathered[i].empty() && grown.size() == 1) {
      // The same value (an all-reduce, a wait, a split as a whole) grows with it; a piece of
      // it (one parameter's slice of the bucket) does not.
      if (!(node.save_bytes == traced.nodes[grown[0]].save_bytes)) continue;
      grow_save[i] = grow_save[grown[0]];
    } else {
      const std::string read = gathered[i].empty()
                                   ? std::to_string(grown.size()) + " values that grow with layers"
                                   : describe(traced, gathered[i][0]) + " of layer 1";
      fail(describe(traced, i) + " outside layers reads " + read +
           "; expected only a cat of one value per layer (a gradient bucket) and ops on one "
           "such cat");
    }
    if (!node.alloc_bytes.is_zero()) grow_alloc[i] = grow_save[i];
    grows[i] = 1;
  }

  // The new order: (original node, copy), copy 0 being the original. The template's nodes
  // come in runs (its parameters, its forward, its backward, its gradients' slices of the
  // bucket), each between nodes of other layers. Each run's copies go where a full trace puts
  // them: after the run in increasing layer order when the layer before it precedes the run
  // (parameters, forward, slices of the bucket), before the run in decreasing order when the
  // layer after it precedes the run (the backward).
  int32_t backward_start = n;
  for (int32_t i = 0; i < n; ++i) {
    const MemoryNode& node = traced.nodes[i];
    if (node.role == MemoryRole::kCompute && node.facts.tangents_closure) {
      backward_start = i;
      break;
    }
  }
  std::vector<std::vector<int32_t>> runs_after(n), runs_before(n);  // keyed by anchor node
  for (int32_t i = 0; i < n;) {
    if (label[i] != m) {
      ++i;
      continue;
    }
    std::vector<int32_t> run;
    int32_t end = i;
    for (int32_t k = i; k < n && (label[k] == m || label[k] == kNoLayer); ++k) {
      if (label[k] == m) {
        run.push_back(k);
        end = k;
      }
    }
    // The layers of the nearest nodes of other layers before and after the run.
    int32_t before = kNoLayer, after = kNoLayer;
    for (int32_t k = i - 1; k >= 0 && before == kNoLayer; --k) before = label[k];
    for (int32_t k = end + 1; k < n && after == kNoLayer; ++k) after = label[k];
    const bool up = before == m - 1 || after == m + 1;
    const bool down = before == m + 1 || after == m - 1;
    const bool increasing = up != down ? up : i < backward_start;
    if (increasing) {
      runs_after[end] = std::move(run);
    } else {
      runs_before[i] = std::move(run);
    }
    i = end + 1;
  }
  std::vector<std::pair<int32_t, int32_t>> order;
  order.reserve(n + static_cast<size_t>(copies) * std::count(label.begin(), label.end(), m));
  for (int32_t i = 0; i < n; ++i) {
    for (int32_t c = copies; c >= 1 && !runs_before[i].empty(); --c) {
      for (int32_t j : runs_before[i]) order.emplace_back(j, c);
    }
    order.emplace_back(i, 0);
    for (int32_t c = 1; c <= copies && !runs_after[i].empty(); ++c) {
      for (int32_t j : runs_after[i]) order.emplace_back(j, c);
    }
  }
  std::vector<std::vector<int32_t>> where(copies + 1, std::vector<int32_t>(n, -1));
  for (size_t k = 0; k < order.size(); ++k) where[order[k].second][order[k].first] = k;

  // Where copy c of node j reads node a.
  auto image = [&](int32_t j, int32_t c, int32_t a) {
    if (c == 0) {
      if (label[j] == m + 1 && a == hidden) return where[copies][hidden];
      if (label[j] == m && a == next_grad) return where[1][grad];
      return where[0][a];
    }
    if (label[a] == m) return where[c][a];
    if (a == prev_hidden) return where[c - 1][hidden];
    if (a == next_grad) return c == copies ? where[0][next_grad] : where[c + 1][grad];
    return where[0][a];
  };

  MemoryGraph out;
  out.nodes.reserve(order.size());
  std::vector<std::vector<std::pair<int32_t, uint8_t>>> new_inputs(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const auto [j, c] = order[k];
    MemoryNode node = traced.nodes[j];
    for (int32_t a : inputs[j])
      new_inputs[k].emplace_back(image(j, c, a), fusible_edge(traced, a, j));
    if (c == 0 && grows[j]) {
      for (int32_t cc = 1; cc <= copies; ++cc) {
        for (int32_t a : gathered[j])
          new_inputs[k].emplace_back(where[cc][a], fusible_edge(traced, a, j));
      }
      node.save_bytes = plus_times(node.save_bytes, grow_save[j], copies);
      node.alloc_bytes = plus_times(node.alloc_bytes, grow_alloc[j], copies);
    }
    for (int32_t& a : node.facts.args) a = image(j, c, a);
    if (node.alias_of >= 0) node.alias_of = image(j, c, node.alias_of);
    if (node.facts.aliases >= 0) node.facts.aliases = image(j, c, node.facts.aliases);
    node.layer = label[j];
    if (c > 0) {
      node.layer = m + c;
      node.facts.name += "#" + std::to_string(m + c);
      node.facts.layer = renumber(node.facts.layer, m, m + c);
    } else if (label[j] > m) {
      node.layer = label[j] + copies;
      node.facts.layer = renumber(node.facts.layer, label[j], label[j] + copies);
    }
    node.facts.users.clear();
    node.facts.fusible_user.clear();
    out.nodes.push_back(std::move(node));
  }
  std::vector<std::vector<std::pair<int32_t, uint8_t>>> users(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    for (const auto& [a, fusible] : new_inputs[k])
      users[a].emplace_back(static_cast<int32_t>(k), fusible);
  }
  for (size_t k = 0; k < order.size(); ++k) {
    auto& list = users[k];
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end(),
                           [](const auto& x, const auto& y) { return x.first == y.first; }),
               list.end());
    for (const auto& [u, fusible] : list) {
      out.nodes[k].facts.users.push_back(u);
      out.nodes[k].facts.fusible_user.push_back(fusible);
    }
  }
  try {
    validate_memory_graph(out);
  } catch (const std::invalid_argument& e) {
    fail(std::string("the copies would not be in topological order: ") + e.what());
  }
  return out;
}

}  // namespace autosp
