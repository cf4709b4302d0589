// The planner's step-time cost model and its choice among strategies: what `autosp plan`
// reports as a strategy's overhead, what `remat="auto"` (autosp.compile, autosp train) picks.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/memory.h"

namespace autosp {

// What a step's extra work costs in time. Offload's copies are weighed against recomputation
// as seconds on the host link over the step's compute seconds.
struct CostModel {
  // Host <-> device bytes per second each way: PCIe 4.0 x16, about 25 GB/s in practice.
  double host_bandwidth = 25e9;
  // Effective device FLOPs per second: an H100's bf16 at about 40% MFU.
  double device_flops = 400e12;

  bool operator==(const CostModel&) const = default;
};

// Seconds per step the offloaded bytes spend on the host link (to the host and back), as if
// the copies did not overlap compute.
//   offloaded 25e9 bytes, default model: 2.0
double offload_seconds(const MemoryBreakdown& b, const CostModel& cost = {});

// The predicted step-time overhead of a strategy: its recomputed FLOPs over the step's, plus
// offload_seconds over the step's compute seconds (step_flops / device_flops).
//   step 400e12, recompute 100e12, offloaded 25e9 bytes: 0.25 + 2.0 / 1.0 = 2.25
//   step_flops 0: 0
double step_overhead(const MemoryBreakdown& b, const CostModel& cost = {});

// The cheapest strategy that fits: among `candidates` whose peak is at most `budget_bytes` and
// whose host_bytes are at most `host_budget_bytes` (0: any), the index of the least
// step_overhead, then the lowest peak, then the first; -1 when none fits.
int64_t cheapest_fit(const std::vector<MemoryBreakdown>& candidates, int64_t budget_bytes,
                     int64_t host_budget_bytes, const CostModel& cost = {});

// The share of a budget that the fewest loss chunks (fewest_loss_chunks) are chosen to fit.
// The predicted peaks are within 10% of measured ones (tests/test_tiled_loss.py), and the
// fewest chunks fill the budget to its edge, so their prediction keeps that much headroom
// (measured on CPU: 6 chunks predicted 1.91 GiB and measured 2.04 for a 2 GiB budget without
// it).
inline constexpr double kLossChunksHeadroom = 0.9;

}  // namespace autosp
