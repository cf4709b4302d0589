#include "util/maxflow.h"

#include <algorithm>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string>

namespace autosp {

FlowNetwork::FlowNetwork(int num_vertices) {
  if (num_vertices < 0) {
    throw std::invalid_argument("[maxflow] num_vertices must be >= 0, got " +
                                std::to_string(num_vertices));
  }
  first_arc_.assign(num_vertices, -1);
}

int FlowNetwork::add_vertex() {
  first_arc_.push_back(-1);
  return num_vertices() - 1;
}

int FlowNetwork::add_edge(int from, int to, int64_t capacity) {
  if (from < 0 || from >= num_vertices() || to < 0 || to >= num_vertices()) {
    throw std::invalid_argument("[maxflow] edge " + std::to_string(from) + " -> " +
                                std::to_string(to) + " names a vertex outside [0, " +
                                std::to_string(num_vertices()) + ")");
  }
  if (capacity < 0) {
    throw std::invalid_argument("[maxflow] edge " + std::to_string(from) + " -> " +
                                std::to_string(to) + " has negative capacity " +
                                std::to_string(capacity));
  }
  const int id = num_edges();
  arcs_.push_back(Arc{to, first_arc_[from], capacity});
  first_arc_[from] = 2 * id;
  arcs_.push_back(Arc{from, first_arc_[to], 0});
  first_arc_[to] = 2 * id + 1;
  return id;
}

std::vector<int> find_infinite_path(const FlowNetwork& network, int source, int sink) {
  const int n = network.num_vertices();
  std::vector<int> via_edge(n, -1);
  std::vector<bool> seen(n, false);
  std::vector<std::vector<int>> out(n);
  for (int e = 0; e < network.num_edges(); ++e) {
    if (network.edge_capacity(e) == kInfiniteCapacity) out[network.edge_from(e)].push_back(e);
  }
  std::queue<int> queue;
  queue.push(source);
  seen[source] = true;
  while (!queue.empty()) {
    const int u = queue.front();
    queue.pop();
    if (u == sink) break;
    for (int e : out[u]) {
      const int v = network.edge_to(e);
      if (!seen[v]) {
        seen[v] = true;
        via_edge[v] = e;
        queue.push(v);
      }
    }
  }
  std::vector<int> path;
  if (!seen[sink]) return path;
  for (int v = sink; v != source; v = network.edge_from(via_edge[v])) path.push_back(via_edge[v]);
  std::reverse(path.begin(), path.end());
  return path;
}

class MaxFlowSolver {
 public:
  MaxFlowSolver(const FlowNetwork& network, int source, int sink)
      : arcs_(network.arcs_),
        first_arc_(network.first_arc_),
        source_(source),
        sink_(sink),
        level_(first_arc_.size()),
        current_(first_arc_.size()) {}

  int64_t run() {
    int64_t total = 0;
    while (build_levels()) {
      current_ = first_arc_;
      total += blocking_flow();
    }
    return total;
  }

  std::vector<bool> source_side() const {
    std::vector<bool> reached(first_arc_.size(), false);
    std::vector<int> stack{source_};
    reached[source_] = true;
    while (!stack.empty()) {
      const int u = stack.back();
      stack.pop_back();
      for (int a = first_arc_[u]; a != -1; a = arcs_[a].next) {
        if (arcs_[a].capacity > 0 && !reached[arcs_[a].to]) {
          reached[arcs_[a].to] = true;
          stack.push_back(arcs_[a].to);
        }
      }
    }
    return reached;
  }

  // Residual capacity of the reverse arc of edge e is the flow on e.
  int64_t flow_on(int edge) const { return arcs_[2 * edge + 1].capacity; }

 private:
  bool build_levels() {
    std::fill(level_.begin(), level_.end(), -1);
    std::queue<int> queue;
    level_[source_] = 0;
    queue.push(source_);
    while (!queue.empty()) {
      const int u = queue.front();
      queue.pop();
      for (int a = first_arc_[u]; a != -1; a = arcs_[a].next) {
        const int v = arcs_[a].to;
        if (arcs_[a].capacity > 0 && level_[v] < 0) {
          level_[v] = level_[u] + 1;
          queue.push(v);
        }
      }
    }
    return level_[sink_] >= 0;
  }

  // Saturates every shortest augmenting path. The path is kept as a stack of arcs; after an
  // augmentation it is cut back to the tail of the first saturated arc, and a vertex with no
  // admissible arc left is taken out of the level graph, so each arc is advanced past at most
  // once per phase.
  int64_t blocking_flow() {
    int64_t pushed = 0;
    std::vector<int> path;
    int u = source_;
    while (true) {
      if (u == sink_) {
        int64_t bottleneck = kInfiniteCapacity;
        for (int a : path) bottleneck = std::min(bottleneck, arcs_[a].capacity);
        size_t first_saturated = path.size();
        for (size_t i = 0; i < path.size(); ++i) {
          FlowNetwork::Arc& arc = arcs_[path[i]];
          FlowNetwork::Arc& reverse = arcs_[path[i] ^ 1];
          if (arc.capacity != kInfiniteCapacity) arc.capacity -= bottleneck;
          if (reverse.capacity != kInfiniteCapacity) reverse.capacity += bottleneck;
          if (arc.capacity == 0 && first_saturated == path.size()) first_saturated = i;
        }
        pushed += bottleneck;
        path.resize(first_saturated);
        u = path.empty() ? source_ : arcs_[path.back()].to;
        continue;
      }
      int& a = current_[u];
      while (a != -1 && !(arcs_[a].capacity > 0 && level_[arcs_[a].to] == level_[u] + 1)) {
        a = arcs_[a].next;
      }
      if (a != -1) {
        path.push_back(a);
        u = arcs_[a].to;
        continue;
      }
      if (u == source_) return pushed;
      level_[u] = -1;
      path.pop_back();
      u = path.empty() ? source_ : arcs_[path.back()].to;
      current_[u] = arcs_[current_[u]].next;
    }
  }

  std::vector<FlowNetwork::Arc> arcs_;
  std::vector<int> first_arc_;
  int source_;
  int sink_;
  std::vector<int> level_;
  std::vector<int> current_;
};

MinCut solve_min_cut(const FlowNetwork& network, int source, int sink) {
  const int n = network.num_vertices();
  if (source < 0 || source >= n || sink < 0 || sink >= n || source == sink) {
    throw std::invalid_argument("[maxflow] need distinct source and sink in [0, " +
                                std::to_string(n) + "), got source " + std::to_string(source) +
                                " and sink " + std::to_string(sink));
  }
  int64_t finite_total = 0;
  for (int e = 0; e < network.num_edges(); ++e) {
    const int64_t c = network.edge_capacity(e);
    if (c == kInfiniteCapacity) continue;
    if (finite_total > kInfiniteCapacity - 1 - c) {
      throw std::overflow_error("[maxflow] finite capacities sum past int64");
    }
    finite_total += c;
  }
  const std::vector<int> infinite_path = find_infinite_path(network, source, sink);
  if (!infinite_path.empty()) {
    std::ostringstream msg;
    msg << "[maxflow] no finite cut: a path of infinite edges joins source to sink: " << source;
    for (int e : infinite_path) msg << " -> " << network.edge_to(e);
    throw std::overflow_error(msg.str());
  }

  MaxFlowSolver solver(network, source, sink);
  MinCut cut;
  cut.value = solver.run();
  cut.source_side = solver.source_side();
  cut.flow.resize(network.num_edges());
  for (int e = 0; e < network.num_edges(); ++e) {
    cut.flow[e] = solver.flow_on(e);
    if (cut.source_side[network.edge_from(e)] && !cut.source_side[network.edge_to(e)]) {
      cut.cut_edges.push_back(e);
    }
  }
  return cut;
}

}  // namespace autosp
