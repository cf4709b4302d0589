// Placement rules: elementwise ops, random ops, reductions, and ops along one dim.
#include <algorithm>
#include <set>

#include "analysis/rule_kit.h"

namespace autosp::rule_kit {

RuleResult rule_elementwise(const RuleInput& r) {
  if (all_replicate_inputs(r)) return keep_all(r, all_replicate(r));
  const Value& out = output_value(r, 0);
  const int ro = out.rank();
  // The output placement, from the sharded operands (aligned from the right).
  std::optional<Placement> shard;
  int from = -1;
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (!r.in[i].is_shard()) continue;
    const int offset = ro - input_value(r, i).rank();
    Placement p = Placement::shard(r.in[i].dim + offset, r.in[i].inner);
    if (shard && !(*shard == p))
      conflict(r,
               describe_input(r, from) + " and " + describe_input(r, i) +
                   ", sharded on different output dims (" + shard->str() + " vs " + p.str() + ")",
               "operands sharded on the same sequence dim",
               "Both operands carry the sequence; their layouts differ. Check that the two "
               "tensors index the sequence the same way.");
    shard = p;
    from = static_cast<int>(i);
  }
  if (!shard) conflict(r, "partial operands", "replicate or sharded operands");
  RuleResult res;
  res.out.assign(r.node.outputs.size(), *shard);
  res.operands.assign(r.in.size(), OperandChange::keep());
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (r.node.inputs[i] < 0 || !r.in[i].is_replicate()) continue;
    const Value& v = input_value(r, i);
    if (!v.is_tensor()) continue;
    const int k = shard->dim - (ro - v.rank());
    if (k < 0) continue;  // broadcast along a dim the operand lacks
    if (v.shape[k].is_one()) continue;
    if (!(v.shape[k] == out.shape[shard->dim]))
      conflict(r,
               describe_input(r, i) + " whose dim " + std::to_string(k) + " is " + v.shape[k].str(),
               "size " + out.shape[shard->dim].str() + " or 1 along the sharded dim");
    res.operands[i] = OperandChange::slice(k, shard->inner);
  }
  return res;
}

// Random elementwise ops (dropout, rand_like, randn_like) on a sharded value. The ranks share
// the random seed, so drawing for the local chunk would give every rank the same numbers
// for its own chunk: position j and j + S/P would share a dropout mask. Instead each rank
// draws at full length and keeps its chunk (attributes random_dim, random_inner and
// random_outer tell the bridge where the chunk lies): the draw is the single-device one, and
// every rank consumes the same random numbers, so replicated draws stay identical on all ranks.
// A value split by heads keeps its heads of the full draw the same way.
RuleResult rule_random(const RuleInput& r) {
  RuleResult res = rule_elementwise(r);
  if (res.out.empty() || !res.out[0].is_shard()) return res;
  const Placement p = res.out[0];
  const Dim& size = output_value(r, 0).shape[static_cast<size_t>(p.dim)];
  if (size.is_static() && p.inner == 1) {  // split by heads (hand-written attention's scores)
    res.attr_updates["random_dim"] = int64_t{p.dim};
    res.attr_updates["random_inner"] = int64_t{1};
    res.attr_updates["random_outer"] = int64_t{1};
    return res;
  }
  if (!size.has_seq() || size.power != 1 || size.offset != 0 || size.coef % p.inner != 0)
    conflict(r, describe_input(r, 0) + ", a random draw over a sharded dim of size " + size.str(),
             "a dim that is a multiple of S");
  res.attr_updates["random_dim"] = int64_t{p.dim};
  res.attr_updates["random_inner"] = p.inner;
  res.attr_updates["random_outer"] = size.coef / p.inner;
  return res;
}

std::vector<int> reduced_dims(const RuleInput& r, int rank) {
  std::vector<int> dims;
  for (int64_t d : r.node.ints_attr("dims")) dims.push_back(norm_dim(d, rank));
  if (dims.empty())
    for (int d = 0; d < rank; ++d) dims.push_back(d);
  return dims;
}

RuleResult rule_reduction(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  const auto dims = reduced_dims(r, x.rank());
  const bool keepdim = r.node.bool_attr("keepdim", false);
  const Placement& p = r.in[0];
  if (std::find(dims.begin(), dims.end(), p.dim) == dims.end()) {
    int d = p.dim;
    if (!keepdim)
      d -= static_cast<int>(
          std::count_if(dims.begin(), dims.end(), [&](int k) { return k < p.dim; }));
    return keep_all(r, std::vector<Placement>(r.node.outputs.size(), Placement::shard(d, p.inner)));
  }
  if (r.node.op == "sum") return keep_all(r, {Placement::partial()});
  if (r.node.op == "mean") {
    RuleResult res = keep_all(r, {Placement::partial()});
    res.expansion = Expansion::MeanPartial;
    return res;
  }
  // Reductions that combine across ranks by the same reduction: reduce the local chunk, then
  // gather every rank's result and reduce those (sp.combine). One output only: max/min with
  // a dim also return indices, which would need each chunk's offset.
  static const std::set<std::string> combinable = {"amax", "amin", "logsumexp",
                                                   "prod", "max",  "min"};
  if (combinable.count(r.node.op) && r.node.outputs.size() == 1) {
    RuleResult res = keep_all(r, {Placement::replicate()});
    res.expansion = Expansion::Combine;
    return res;
  }
  conflict(
      r, describe_input(r, 0) + ", reduced along the sharded sequence dim " + std::to_string(p.dim),
      "a reduction that combines exactly across ranks (sum, mean, amax, amin, logsumexp, prod, "
      "max/min without indices), or a reduction over other dims",
      "'" + r.node.op + "' over the whole sequence is not supported under sequence parallelism.");
}

RuleResult rule_along_dim(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  if (!r.node.has_attr("dim"))  // never guess the dim an op works along
    conflict(r, describe_input(r, 0) + " and no dim attribute", "the dim the op works along");
  const int d = norm_dim(r.node.int_attr("dim", -1), x.rank());
  // Scans along the sequence: each rank scans its chunk, then combines the totals of the
  // ranks before it (sp.scan). Exact when the dim is the sequence alone (size S, or S + offset
  // split unevenly after a shift; no other factor merged in).
  static const std::set<std::string> scans = {"cumsum", "cumprod", "logcumsumexp"};
  if (d == r.in[0].dim && scans.count(r.node.op) && r.in[0].inner == 1 &&
      x.shape[static_cast<size_t>(d)].has_seq() && x.shape[static_cast<size_t>(d)].coef == 1 &&
      x.shape[static_cast<size_t>(d)].power == 1) {
    RuleResult res = keep_all(r, {r.in[0]});
    res.expansion = Expansion::Scan;
    return res;
  }
  if (d == r.in[0].dim) {
    const std::string sliced = sliced_sequence_hint(x.shape[static_cast<size_t>(d)]);
    conflict(r, describe_input(r, 0) + ", and the op works along dim " + std::to_string(d),
             "an op along a dim other than the sharded sequence dim",
             !sliced.empty() ? sliced
                             : "Each rank holds only its chunk of the sequence, so '" + r.node.op +
                                   "' along it would be wrong; compute it before the sequence is "
                                   "sharded or inside attention.");
  }
  return keep_all(r, std::vector<Placement>(r.node.outputs.size(), r.in[0]));
}

}  // namespace autosp::rule_kit
