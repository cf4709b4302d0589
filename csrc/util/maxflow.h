// Maximum flow / minimum s-t cut on a directed network with int64 capacities.
//
// The remat solver (plan/remat.h) builds one of these per joint graph; it is also usable on
// its own. Capacities are non-negative; kInfiniteCapacity marks an edge that no finite cut may
// contain (a data dependency, a ban). The solver is Dinic's algorithm (BFS level graph plus
// blocking flow with current-arc pointers, iterative, so deep graphs do not recurse).
//
// Example:
//   FlowNetwork net(4);              // vertices 0..3, source 0, sink 3
//   net.add_edge(0, 1, 3);
//   net.add_edge(0, 2, 2);
//   net.add_edge(1, 3, 2);
//   net.add_edge(2, 3, kInfiniteCapacity);
//   MinCut cut = solve_min_cut(net, 0, 3);
//   // cut.value == 4, cut.source_side == {1, 1, 0, 0}, cut.cut_edges == {1, 2}
//   // (edge ids in insertion order: 0->1 is 0, 0->2 is 1, 1->3 is 2, 2->3 is 3)
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace autosp {

inline constexpr int64_t kInfiniteCapacity = std::numeric_limits<int64_t>::max();

class FlowNetwork {
 public:
  explicit FlowNetwork(int num_vertices = 0);

  // Adds a vertex and returns its id.
  int add_vertex();
  // Adds a directed edge from -> to and returns its id (0, 1, 2, ... in insertion order).
  // Throws std::invalid_argument for an unknown vertex or a negative capacity.
  int add_edge(int from, int to, int64_t capacity);

  int num_vertices() const { return static_cast<int>(first_arc_.size()); }
  int num_edges() const { return static_cast<int>(arcs_.size() / 2); }
  int edge_from(int edge) const { return arcs_[2 * edge + 1].to; }
  int edge_to(int edge) const { return arcs_[2 * edge].to; }
  int64_t edge_capacity(int edge) const { return arcs_[2 * edge].capacity; }

 private:
  friend class MaxFlowSolver;
  // Each edge is stored as two arcs: 2*e (forward, residual = capacity - flow) and 2*e+1
  // (reverse, residual = flow). Arcs of one vertex form a singly linked list.
  struct Arc {
    int to;
    int next;
    int64_t capacity;
  };
  std::vector<int> first_arc_;
  std::vector<Arc> arcs_;
};

struct MinCut {
  // Sum of the capacities of cut_edges; the value of the maximum flow.
  int64_t value = 0;
  // True for vertices reachable from the source in the final residual network.
  std::vector<bool> source_side;
  // Edges from the source side to the sink side, ascending ids. All finite.
  std::vector<int> cut_edges;
  // Flow on every edge, by edge id.
  std::vector<int64_t> flow;

  bool operator==(const MinCut&) const = default;
};

// Computes a maximum flow and the minimum cut whose source side is as small as possible (the
// vertices reachable from `source` in the residual network).
//
// Throws std::invalid_argument if source == sink or either is out of range, and
// std::overflow_error if the finite capacities sum past int64 or a path of infinite edges
// joins source to sink (no finite cut exists); the message of the latter lists that path.
MinCut solve_min_cut(const FlowNetwork& network, int source, int sink);

// Returns a path of infinite-capacity edges from source to sink as a list of edge ids, or an
// empty list if there is none.
std::vector<int> find_infinite_path(const FlowNetwork& network, int source, int sink);

}  // namespace autosp
