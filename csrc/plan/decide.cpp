// Deciding an op's placements (its rule, or replicated for an op without one), and the gather
// fallback (SpConfig::gather_unsupported): an op with no sequence-parallel form for its sharded
// inputs runs on the whole sequence instead of stopping the plan.
//
// Its sharded inputs are all-gathered (sp.all_gather: forward the full value on every rank,
// backward this rank's chunk of the gradient), so the op and everything computed from its
// result alone run on full-length replicated values, exactly as on one device. Where such a
// value meets sharded values again it is sliced (PlanBuilder::slice), behind the usual
// gradient sync of replicated values: the gradient a replicated region receives is then the
// sum over ranks, and the gather's backward keeps this rank's part of it.
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/plan_builder.h"

namespace autosp::plan_detail {

RuleResult PlanBuilder::decide(const Node& n, const OpRule* rule, const std::vector<int>& ins) {
  if (auto local = token_local(n, ins)) return std::move(*local);
  if (rule && rule->fn) return call_rule(rule->fn, n, ins);
  for (size_t i = 0; i < ins.size(); ++i)
    if (!placement(ins[i]).is_replicate())
      throw PlanError(kPass, n,
                      "input " + std::to_string(i) + " placed " + placement(ins[i]).str() + " (" +
                          shape_str(val(ins[i]).shape) + ")",
                      "an op with a sequence-parallel rule",
                      "autosp has no rule for '" + n.op +
                          "' on a sequence-sharded tensor; rather than guess, it stops here.");
  RuleResult res;
  res.out.assign(n.outputs.size(), Placement::replicate());
  res.operands.assign(ins.size(), OperandChange::keep());
  return res;
}

bool PlanBuilder::gatherable(const Node& n, const std::vector<int>& ins) const {
  bool any = false;
  for (size_t i = 0; i < ins.size(); ++i) {
    if (ins[i] < 0) continue;
    const Placement p = placement(ins[i]);
    if (p.is_replicate()) continue;
    if (!p.is_shard()) return false;  // a token-local selection has no full length to gather
    if (i == 0 && writes_into_first_operand(n)) return false;
    const Dim& size = val(ins[i]).shape.at(static_cast<size_t>(p.dim));
    // Only a split of the sequence itself: every rank holds S/P positions of each factor.
    if (!size.has_seq() || size.power != 1 || size.offset != 0 || size.coef % p.inner != 0)
      return false;
    any = true;
  }
  return any;
}

int PlanBuilder::gather(int v, const SourceLoc& loc) {
  auto it = gather_cache_.find(v);
  if (it != gather_cache_.end()) return it->second;
  const Placement p = placement(v);
  const int id = emit("sp.all_gather", {v}, {{"dim", int64_t{p.dim}}, {"inner", p.inner}},
                      {{val(v), Placement::replicate()}}, loc)[0];
  gather_cache_[v] = id;
  gathered_values_.insert(id);
  return id;
}

std::vector<int> PlanBuilder::gathered_inputs(const Node& n, std::vector<int> ins,
                                              const PlanError& refused) {
  if (!cfg_.gather_unsupported || !gatherable(n, ins)) throw refused;
  // A gathered value is a copy on each rank: a later in-place write through a view of the op's
  // inputs or result, or into a tensor they view, would reach one and not the other.
  if (const Node* w = later_write_to_aliases(n))
    throw PlanError(kPass, *w,
                    "an in-place '" + w->op + "' that writes, after op '" + n.op + "' at " +
                        n.loc.file + ":" + std::to_string(n.loc.line) +
                        ", into its inputs or result (or a tensor they view); that op has no "
                        "sequence-parallel form, so it would run on the all-gathered sequence, "
                        "where the write would reach a copy",
                    "no in-place writes into, or through, the values of an op run on the "
                    "gathered sequence",
                    "Write out of place (y = x * mask, torch.where, torch.cat) instead. The op's "
                    "own refusal: " +
                        std::string(refused.what()));
  for (int& v : ins)
    if (v >= 0 && placement(v).is_shard()) v = gather(v, n.loc);
  return ins;
}

RuleResult PlanBuilder::decide_or_gather(const Node& n, const OpRule* rule, std::vector<int>& ins) {
  try {
    return decide(n, rule, ins);
  } catch (const PlanError& refused) {
    const PlanError original = refused;
    // Values split by heads (hand-written attention's scores) go back to the sequence layout
    // for an op that cannot take them (heads.cpp), and the op is decided again. The exchange
    // makes a copy: not for the destination of an in-place write, nor where a later in-place
    // write reaches the op's inputs or result through a view (it would miss the copy).
    std::vector<int> seq = ins;
    bool moved = false;
    const bool copy_safe = later_write_to_aliases(n) == nullptr;
    for (size_t i = 0; i < seq.size() && copy_safe; ++i) {
      if (seq[i] < 0 || !split_by_heads(seq[i]) || (i == 0 && writes_into_first_operand(n)))
        continue;
      seq[i] = to_sequence(seq[i], n.loc);
      moved = true;
    }
    if (moved) {
      try {
        RuleResult res = decide(n, rule, seq);
        ins = std::move(seq);
        return res;
      } catch (const PlanError&) {
        ins = seq;  // gathered below from the sequence layout
      }
    }
    std::vector<int> full = gathered_inputs(n, ins, original);
    RuleResult res;
    try {
      res = decide(n, rule, full);
    } catch (const PlanError&) {
      throw original;  // the op needs more than full-length inputs; report what it was first
    }
    ins = std::move(full);
    gathered_ops_.push_back(original.what());
    return res;
  }
}

}  // namespace autosp::plan_detail
