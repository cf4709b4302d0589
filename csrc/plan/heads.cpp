// Values split by attention heads outside SDPA (PlanBuilder::to_heads / to_sequence, see
// plan_builder.h): attention written by hand, q @ k.transpose(-2, -1) and probs @ v, runs
// like Ulysses runs SDPA. The matmul rule asks for its sequence-sharded operands to be
// exchanged (sp.all_to_all) to hold a group of heads over the whole sequence; the result of
// probs @ v goes back to the sequence layout. Every other op that meets a value split by
// heads and cannot take it gets it back in the sequence layout first (where: placement
// propagation's ToSequence steps, propagate.cpp).
#include <string>
#include <vector>

#include "plan/plan_builder.h"

namespace autosp::plan_detail {

std::vector<int> PlanBuilder::exchange(const std::vector<int>& vs, int heads_dim, int seq_dim,
                                       const SourceLoc& loc) {
  const Dim seq = val(vs.at(0)).shape.at(static_cast<size_t>(seq_dim));
  std::vector<std::pair<Value, Placement>> outs;
  for (int v : vs) outs.push_back({val(v), Placement::shard(heads_dim)});
  return emit("sp.all_to_all", vs,
              {{"scatter_dim", int64_t{heads_dim}},
               {"gather_dim", int64_t{seq_dim}},
               {"gather_coef", seq.coef},
               {"gather_power", int64_t{seq.power}}},
              outs, loc);
}

int PlanBuilder::to_heads(int v, int heads_dim, int seq_dim, const SourceLoc& loc) {
  return exchange({v}, heads_dim, seq_dim, loc)[0];
}

int PlanBuilder::to_sequence(int v, const SourceLoc& loc) {
  const Placement p = placement(v);
  const Value& x = val(v);
  const int d = sequence_layout_dim(x, p);
  if (d < 0) return v;
  const int64_t heads = x.shape.at(static_cast<size_t>(p.dim)).coef;
  return emit("sp.all_to_all", {v},
              {{"scatter_dim", int64_t{d}},
               {"gather_dim", int64_t{p.dim}},
               {"gather_coef", heads},
               {"gather_power", int64_t{0}}},
              {{x, Placement::shard(d)}}, loc)[0];
}

void PlanBuilder::emit_to_sequence(const Node& n, std::vector<int> ins, const NodePlacement& d) {
  const int idx = copy_node(n, std::move(ins), d.results, d.attr_updates);
  const int o = out_.nodes[static_cast<size_t>(idx)].outputs.at(0);
  vmap_[static_cast<size_t>(n.outputs[0])] = to_sequence(o, n.loc);
}

}  // namespace autosp::plan_detail
