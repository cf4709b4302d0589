// Deciding an op's placements (its rule, or replicated for an op without one), and the gather
// fallback (SpConfig::gather_unsupported): an op with no sequence-parallel form for its sharded
// operands runs on the whole sequence instead of stopping the plan.
//
// Its sharded operands are all-gathered (sp.all_gather: forward the full value on every rank,
// backward this rank's chunk of the gradient), so the op and everything computed from its
// result alone run on full-length replicated values, exactly as on one device. Where such a
// value meets sharded values again it is sliced, behind the usual gradient sync of replicated
// values: the gradient a replicated region receives is then the sum over ranks, and the
// gather's backward keeps this rank's part of it.
#include <string>
#include <vector>

#include "plan/propagator.h"

namespace autosp::plan_detail {

RuleResult Propagator::decide(const Node& n, const OpRule* rule, const std::vector<Operand>& ops) {
  if (auto local = token_local(n, ops)) return std::move(*local);
  if (rule && rule->fn) return call_rule(rule->fn, n, ops);
  for (size_t i = 0; i < ops.size(); ++i)
    if (ops[i].present() && !ops[i].p.is_replicate())
      throw PlanError(kPass, n,
                      "input " + std::to_string(i) + " placed " + ops[i].p.str() + " (" +
                          shape_str(val(ops[i]).shape) + ")",
                      "an op with a sequence-parallel rule",
                      "autosp has no rule for '" + n.op +
                          "' on a sequence-sharded tensor; rather than guess, it stops here.");
  RuleResult res;
  res.out.assign(n.outputs.size(), Placement::replicate());
  res.operands.assign(ops.size(), OperandChange::keep());
  return res;
}

bool Propagator::gatherable(const Node& n, const std::vector<Operand>& ops) const {
  bool any = false;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].present() || ops[i].p.is_replicate()) continue;
    if (!ops[i].p.is_shard()) return false;  // a token-local selection has no full length
    if (i == 0 && writes_into_first_operand(n)) return false;
    const Dim size = val(ops[i]).shape.at(static_cast<size_t>(ops[i].p.dim));
    // Only a split of the sequence itself: every rank holds S/P positions of each factor.
    if (!size.has_seq() || size.power != 1 || size.offset != 0 || size.coef % ops[i].p.inner != 0)
      return false;
    any = true;
  }
  return any;
}

void Propagator::gather_all(const Node& n, std::vector<Operand>& ops,
                            const PlanError& refused) const {
  if (!cfg_.gather_unsupported || !gatherable(n, ops)) throw refused;
  // A gathered value is a copy on each rank: a later in-place write through a view of the op's
  // inputs or result, or into a tensor they view, would reach one and not the other.
  if (const Node* w = later_write_to_aliases(in_, n))
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
  for (Operand& o : ops)
    if (o.present() && o.p.is_shard()) step(o, {Step::Kind::Gather});
}

RuleResult Propagator::decide_or_gather(const Node& n, const OpRule* rule,
                                        std::vector<Operand>& ops) {
  try {
    return decide(n, rule, ops);
  } catch (const PlanError& refused) {
    const PlanError original = refused;
    // Values split by heads (hand-written attention's scores) go back to the sequence layout
    // for an op that cannot take them (heads.cpp), and the op is decided again. The exchange
    // makes a copy: not for the destination of an in-place write, nor where a later in-place
    // write reaches the op's inputs or result through a view (it would miss the copy).
    std::vector<Operand> seq = ops;
    bool moved = false;
    const bool copy_safe = later_write_to_aliases(in_, n) == nullptr;
    for (size_t i = 0; i < seq.size() && copy_safe; ++i) {
      if (!seq[i].present() || (i == 0 && writes_into_first_operand(n))) continue;
      const size_t before = seq[i].steps.size();
      to_sequence(seq[i]);
      moved = moved || seq[i].steps.size() != before;
    }
    if (moved) {
      try {
        RuleResult res = decide(n, rule, seq);
        ops = std::move(seq);
        return res;
      } catch (const PlanError&) {
        ops = seq;  // gathered below from the sequence layout
      }
    }
    std::vector<Operand> full = ops;
    gather_all(n, full, original);
    RuleResult res;
    try {
      res = decide(n, rule, full);
    } catch (const PlanError&) {
      throw original;  // the op needs more than full-length inputs; report what it was first
    }
    ops = std::move(full);
    out_.gathered.push_back(original.what());
    return res;
  }
}

}  // namespace autosp::plan_detail
