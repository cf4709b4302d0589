#include <gtest/gtest.h>

#include <vector>

#include "plan/choose.h"

namespace autosp {
namespace {

MemoryBreakdown candidate(int64_t peak, double recompute_flops, int64_t offloaded = 0,
                          int64_t host = 0) {
  MemoryBreakdown b;
  b.peak = peak;
  b.step_flops = 400e12;  // one second at the default model's device FLOPs
  b.recompute_flops = recompute_flops;
  b.offloaded_bytes = offloaded;
  b.host_bytes = host;
  return b;
}

TEST(Choose, OverheadAddsRecomputationAndLinkTime) {
  // 0.25 recomputed, and 25e9 bytes there and back at 25 GB/s: 2 s over a 1 s step.
  const MemoryBreakdown b = candidate(0, 100e12, 25'000'000'000);
  EXPECT_DOUBLE_EQ(offload_seconds(b), 2.0);
  EXPECT_DOUBLE_EQ(step_overhead(b), 2.25);
  // A link twice as fast halves the link's share.
  EXPECT_DOUBLE_EQ(step_overhead(b, CostModel{.host_bandwidth = 50e9}), 1.25);
  EXPECT_DOUBLE_EQ(step_overhead(MemoryBreakdown{}), 0.0);  // no FLOPs: nothing to weigh
}

TEST(Choose, CheapestFitIsTheLeastOverheadUnderBothBudgets) {
  const std::vector<MemoryBreakdown> c = {
      candidate(100, 0),                        // 0: no overhead, too big for 90
      candidate(80, 40e12),                     // 1: 0.1
      candidate(60, 20e12, 2'500'000'000, 50),  // 2: 0.05 + 0.2 = 0.25
      candidate(70, 40e12),                     // 3: 0.1, lower peak than 1
  };
  EXPECT_EQ(cheapest_fit(c, 100, 0), 0);
  EXPECT_EQ(cheapest_fit(c, 90, 0), 3);  // ties on overhead go to the lower peak
  EXPECT_EQ(cheapest_fit(c, 65, 0), 2);
  EXPECT_EQ(cheapest_fit(c, 65, 40), -1);  // 2's host bytes exceed the host budget
  EXPECT_EQ(cheapest_fit(c, 65, 50), 2);
  EXPECT_EQ(cheapest_fit(c, 59, 0), -1);
  EXPECT_EQ(cheapest_fit({}, 100, 0), -1);
  // Equal overhead and peak: the first.
  EXPECT_EQ(cheapest_fit({candidate(5, 0), candidate(5, 0)}, 10, 0), 0);
}

}  // namespace
}  // namespace autosp
