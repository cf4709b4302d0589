#include "plan/choose.h"

#include <cstddef>
#include <tuple>

namespace autosp {

double offload_seconds(const MemoryBreakdown& b, const CostModel& cost) {
  return 2.0 * static_cast<double>(b.offloaded_bytes) / cost.host_bandwidth;
}

double step_overhead(const MemoryBreakdown& b, const CostModel& cost) {
  if (b.step_flops <= 0) return 0.0;
  const double compute = b.step_flops / cost.device_flops;
  return b.recompute_flops / b.step_flops + offload_seconds(b, cost) / compute;
}

int64_t cheapest_fit(const std::vector<MemoryBreakdown>& candidates, int64_t budget_bytes,
                     int64_t host_budget_bytes, const CostModel& cost) {
  int64_t best = -1;
  std::tuple<double, int64_t> best_key;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const MemoryBreakdown& c = candidates[i];
    if (c.peak > budget_bytes) continue;
    if (host_budget_bytes > 0 && c.host_bytes > host_budget_bytes) continue;
    const std::tuple<double, int64_t> key{step_overhead(c, cost), c.peak};
    if (best < 0 || key < best_key) {
      best = static_cast<int64_t>(i);
      best_key = key;
    }
  }
  return best;
}

}  // namespace autosp
