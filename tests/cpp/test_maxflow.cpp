#include <gtest/gtest.h>

#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "util/maxflow.h"

namespace autosp {
namespace {

struct Edge {
  int from;
  int to;
  int64_t capacity;
};

FlowNetwork make_network(int n, const std::vector<Edge>& edges) {
  FlowNetwork net(n);
  for (const Edge& e : edges) net.add_edge(e.from, e.to, e.capacity);
  return net;
}

// Minimum over all vertex sets S with source in S and sink not in S of the capacity leaving S;
// kInfiniteCapacity if every such set is crossed by an infinite edge.
int64_t brute_force_min_cut(int n, const std::vector<Edge>& edges, int source, int sink) {
  int64_t best = kInfiniteCapacity;
  for (uint32_t mask = 0; mask < (1u << n); ++mask) {
    if (!(mask >> source & 1) || (mask >> sink & 1)) continue;
    int64_t value = 0;
    for (const Edge& e : edges) {
      if ((mask >> e.from & 1) && !(mask >> e.to & 1)) {
        if (e.capacity == kInfiniteCapacity) {
          value = kInfiniteCapacity;
          break;
        }
        value += e.capacity;
      }
    }
    best = std::min(best, value);
  }
  return best;
}

// The flow respects capacities and conservation, and the cut is a valid certificate: its value
// equals the flow out of the source and the sum of its (finite) edges.
void expect_valid(const FlowNetwork& net, const MinCut& cut, int source, int sink) {
  const int n = net.num_vertices();
  ASSERT_EQ(static_cast<int>(cut.source_side.size()), n);
  ASSERT_EQ(static_cast<int>(cut.flow.size()), net.num_edges());
  EXPECT_TRUE(cut.source_side[source]);
  EXPECT_FALSE(cut.source_side[sink]);
  std::vector<int64_t> balance(n, 0);
  for (int e = 0; e < net.num_edges(); ++e) {
    EXPECT_GE(cut.flow[e], 0);
    EXPECT_LE(cut.flow[e], net.edge_capacity(e));
    balance[net.edge_from(e)] -= cut.flow[e];
    balance[net.edge_to(e)] += cut.flow[e];
  }
  for (int v = 0; v < n; ++v) {
    if (v != source && v != sink) EXPECT_EQ(balance[v], 0) << "vertex " << v;
  }
  EXPECT_EQ(balance[sink], cut.value);
  int64_t cut_sum = 0;
  for (int e : cut.cut_edges) {
    EXPECT_NE(net.edge_capacity(e), kInfiniteCapacity);
    EXPECT_EQ(cut.flow[e], net.edge_capacity(e)) << "cut edge " << e << " not saturated";
    cut_sum += net.edge_capacity(e);
  }
  EXPECT_EQ(cut_sum, cut.value);
}

TEST(MaxFlow, HeaderExample) {
  const FlowNetwork net =
      make_network(4, {{0, 1, 3}, {0, 2, 2}, {1, 3, 2}, {2, 3, kInfiniteCapacity}});
  const MinCut cut = solve_min_cut(net, 0, 3);
  EXPECT_EQ(cut.value, 4);
  EXPECT_EQ(cut.source_side, (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ(cut.cut_edges, (std::vector<int>{1, 2}));
  expect_valid(net, cut, 0, 3);
}

TEST(MaxFlow, ClassicCLRSNetwork) {
  // CLRS figure 26.6: max flow 23.
  const FlowNetwork net = make_network(6, {{0, 1, 16},
                                           {0, 2, 13},
                                           {2, 1, 4},
                                           {1, 3, 12},
                                           {3, 2, 9},
                                           {2, 4, 14},
                                           {4, 3, 7},
                                           {3, 5, 20},
                                           {4, 5, 4}});
  const MinCut cut = solve_min_cut(net, 0, 5);
  EXPECT_EQ(cut.value, 23);
  EXPECT_EQ(cut.source_side, (std::vector<bool>{true, true, true, false, true, false}));
  EXPECT_EQ(cut.cut_edges, (std::vector<int>{3, 6, 8}));
  expect_valid(net, cut, 0, 5);
}

TEST(MaxFlow, DisconnectedSinkHasZeroCut) {
  const FlowNetwork net = make_network(3, {{0, 1, 5}});
  const MinCut cut = solve_min_cut(net, 0, 2);
  EXPECT_EQ(cut.value, 0);
  EXPECT_TRUE(cut.cut_edges.empty());
}

TEST(MaxFlow, RandomSmallGraphsMatchBruteForce) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 7);  // 2..8 vertices
    const int m = static_cast<int>(rng() % (3 * n));
    std::vector<Edge> edges;
    for (int i = 0; i < m; ++i) {
      const int from = static_cast<int>(rng() % n);
      const int to = static_cast<int>(rng() % n);
      if (from == to) continue;
      const int64_t capacity =
          rng() % 6 == 0 ? kInfiniteCapacity : static_cast<int64_t>(rng() % 20);
      edges.push_back({from, to, capacity});
    }
    const int source = 0;
    const int sink = n - 1;
    const FlowNetwork net = make_network(n, edges);
    const int64_t expected = brute_force_min_cut(n, edges, source, sink);
    SCOPED_TRACE("trial " + std::to_string(trial));
    if (expected == kInfiniteCapacity) {
      EXPECT_THROW(solve_min_cut(net, source, sink), std::overflow_error);
      EXPECT_FALSE(find_infinite_path(net, source, sink).empty());
      continue;
    }
    const MinCut cut = solve_min_cut(net, source, sink);
    EXPECT_EQ(cut.value, expected);
    expect_valid(net, cut, source, sink);
  }
}

TEST(MaxFlow, RandomLargeGraphsAreValidCertificates) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 300;
    FlowNetwork net(n);
    for (int i = 0; i < 3000; ++i) {
      const int from = static_cast<int>(rng() % n);
      const int to = static_cast<int>(rng() % n);
      if (from == to) continue;
      net.add_edge(from, to, static_cast<int64_t>(rng() % 1000000));
    }
    const MinCut cut = solve_min_cut(net, 0, n - 1);
    expect_valid(net, cut, 0, n - 1);
  }
}

TEST(MaxFlow, DeepChainDoesNotRecurse) {
  const int n = 200000;
  FlowNetwork net(n);
  for (int i = 0; i + 1 < n; ++i) net.add_edge(i, i + 1, i == n / 2 ? 7 : kInfiniteCapacity);
  const MinCut cut = solve_min_cut(net, 0, n - 1);
  EXPECT_EQ(cut.value, 7);
  EXPECT_EQ(cut.cut_edges, (std::vector<int>{n / 2}));
}

TEST(MaxFlow, InfinitePathIsReported) {
  const FlowNetwork net =
      make_network(3, {{0, 1, kInfiniteCapacity}, {1, 2, kInfiniteCapacity}, {0, 2, 4}});
  EXPECT_EQ(find_infinite_path(net, 0, 2), (std::vector<int>{0, 1}));
  try {
    solve_min_cut(net, 0, 2);
    FAIL() << "expected std::overflow_error";
  } catch (const std::overflow_error& e) {
    EXPECT_EQ(
        std::string(e.what()),
        "[maxflow] no finite cut: a path of infinite edges joins source to sink: 0 -> 1 -> 2");
  }
}

TEST(MaxFlow, BadArgumentsThrow) {
  FlowNetwork net(2);
  EXPECT_THROW(net.add_edge(0, 2, 1), std::invalid_argument);
  EXPECT_THROW(net.add_edge(0, 1, -1), std::invalid_argument);
  EXPECT_THROW(solve_min_cut(net, 0, 0), std::invalid_argument);
  EXPECT_THROW(solve_min_cut(net, 0, 5), std::invalid_argument);
  try {
    net.add_edge(0, 1, -3);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "[maxflow] edge 0 -> 1 has negative capacity -3");
  }
}

}  // namespace
}  // namespace autosp
