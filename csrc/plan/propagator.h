// Placement propagation's walk (internal to plan/, see propagate.h): the decisions for inputs,
// outputs and the generic rule-driven ops and the gather fallback in propagate.cpp; attention
// and cross-entropy in propagate_ops.cpp; token-local regions in token_local.cpp.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "plan/propagate.h"

namespace autosp::plan_detail {

inline constexpr const char* kPass = "ulysses";

// An operand as a decision sees it: its input value, and its placement after the steps so far.
struct Operand {
  int id = -1;  // input-graph value id; -1 for an absent operand
  Placement p;
  bool gathered = false;  // a replicated stand-in computed on the gathered sequence
  std::vector<Step> steps;
  bool present() const { return id >= 0; }
};

class Propagator {
 public:
  Propagator(const Graph& in, const SpConfig& cfg);
  Propagation run();

 private:
  const Graph& in_;
  SpConfig cfg_;
  Propagation out_;
  bool grad_enabled_ = true;

  Value val(const Operand& o) const { return out_.with_same_counts(in_.value(o.id)); }
  // The node's operands as earlier decisions placed them.
  std::vector<Operand> operands(const Node& n) const;

  // Applies a step to the operand (its placement after it) and records it.
  static void step(Operand& o, Step s);
  void to_sequence(Operand& o) const;  // a value split by heads back to the sequence layout
  static void reduce(Operand& o);      // a partial value summed
  void slice(Operand& o, int dim, int64_t inner) const;
  void grad_sync(Operand& o) const;  // a replicated value feeding distributed results

  // Records the decision: the operands' steps and placements, each result's placement as later
  // nodes read it, which are gathered stand-ins, and token-local counts.
  void finish(const Node& n, const std::vector<Operand>& ops, NodePlacement d);

  void decide_input(const Node& n);
  void decide_output(const Node& n);
  void decide_generic(const Node& n, const OpRule* rule);
  void decide_attention(const Node& n);
  void decide_loss(const Node& n);

  // The rule result for `n` on `ops`: token-local, the op's rule, or for an op without one,
  // replicated when every operand is. Throws PlanError where the op has no sequence-parallel
  // form for its operands.
  RuleResult decide(const Node& n, const OpRule* rule, const std::vector<Operand>& ops);

  // decide(); where it throws, operands split by heads go back to the sequence layout, and
  // failing that (with SpConfig::gather_unsupported) sharded operands are gathered and the op
  // decided again on full-length values, its refusal recorded in Propagation::gathered.
  RuleResult decide_or_gather(const Node& n, const OpRule* rule, std::vector<Operand>& ops);

  // Partial operands: kept when the op is linear in them, otherwise reduced first.
  bool partial_passes(const OpRule& rule, const Node& n, const std::vector<Operand>& ops) const;

  // Whether every non-replicated operand of `n` can be gathered whole: sharded along an even
  // split of the sequence (S or k*S, no positions dropped) and not the destination of an
  // in-place write or setitem (the write would land in the gathered copy, not in the tensor).
  bool gatherable(const Node& n, const std::vector<Operand>& ops) const;

  // The gather fallback's step for an op `n` that `refused` stops at: each sharded operand
  // gathered, or `refused` thrown where the fallback is off or cannot apply. Where n's inputs
  // or result are written in place later through an alias (a gathered view is a copy: the
  // write would not reach the other), the error names that write. The caller records the
  // refusal once the op is placed.
  void gather_all(const Node& n, std::vector<Operand>& ops, const PlanError& refused) const;

  // Why attention `n` (the query first) cannot be split by heads, if it cannot: then it runs
  // on the all-gathered sequence, or is refused.
  std::optional<PlanError> heads_refusal(const Node& n, const std::vector<Operand>& ops) const;

  // Rules see the node with its operands' values and the input graph's output values.
  RuleResult call_rule(RuleFn fn, const Node& n, const std::vector<Operand>& ops);
  Graph scratch_;
  Graph& scratch_graph(const Node& n, const std::vector<Operand>& ops);

  // Token-local values (Placement::Local, see analysis/rules_local.cpp): the sizes of their
  // selection dims (the data-dependent counts torch.where found on this rank: the unbacked
  // symbols of their opaque sizes, "u0").
  std::set<std::string> local_counts_;
  // Selections from the same mask (input value and placement read) share the first symbol.
  std::map<std::pair<int, std::string>, std::string> count_of_mask_;
  void note_local_count(const Node& n, const std::vector<Operand>& ops, const Dim& count);

  // Whether `n` reads this rank's count of a selection (attribute "unbacked"); the dim of a
  // zeros/ones/empty output that many rows long, or -1; and the refusal of any other read.
  bool reads_local_count(const Node& n) const;
  int local_count_dim(const Node& n) const;
  void refuse_count_as_number(const Node& n, const std::vector<Operand>& ops) const;

  // The rule result for a node that reads a token-local value or this rank's count of one;
  // nullopt when the node touches neither. Throws where the op would differ from one device.
  std::optional<RuleResult> token_local(const Node& n, const std::vector<Operand>& ops);

  // Whether `value` (an input-graph value) is a new zeros/ones/empty/full tensor that only
  // `n` reads: an in-place write into its local slice then loses nothing (HF MoE's
  // torch.zeros((B * S, C)).index_add_(0, positions, rows)).
  bool fresh_fill(const Node& n, int value) const;

  // Attention and the outputs take whole sequences, never a local selection.
  void refuse_local_operands(const Node& n) const;
};

}  // namespace autosp::plan_detail
