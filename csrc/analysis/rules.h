// The op-rule registry: one entry per canonical op, saying how placements flow through
// it. A rule either propagates (outputs get placements), asks for a cheap local slice of
// a replicated operand, asks for a partial operand to be reduced, or throws a PlanError
// naming the conflict. An op without a rule is fine while every operand is replicated
// (each rank computes what the single device computes) and an error otherwise.
//
// Example: `mul` with operands [Shard(1) f32[2, S, 64], Replicate f32[1, S, 64]] returns
// outputs [Shard(1)] and operand changes [Keep, Slice(dim=1)].
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "analysis/placement.h"
#include "ir/graph.h"

namespace autosp {

struct OperandChange {
  enum class Kind { Keep, Slice, ReducePartial };
  Kind kind = Kind::Keep;
  int dim = -1;             // Slice: the operand's dim to slice
  int64_t inner = 1;        // Slice: factor right of S inside that dim
  int64_t check_below = 0;  // Slice: when > 0, first check every element is in [0, check_below)

  static OperandChange keep() { return {}; }
  static OperandChange slice(int dim, int64_t inner = 1) { return {Kind::Slice, dim, inner}; }
  // Slices indices after checking them on the full-length value, which every rank holds: a
  // bad index then fails on every rank alike, instead of in the one rank whose chunk holds
  // it while the others wait in a collective.
  static OperandChange checked_slice(int dim, int64_t below) {
    return {Kind::Slice, dim, 1, below};
  }
  static OperandChange reduce() { return {Kind::ReducePartial, -1, 1}; }
  bool operator==(const OperandChange&) const = default;
};

struct RuleInput {
  const Graph& graph;
  const Node& node;
  std::vector<Placement> in;  // one per node input; Replicate for absent (-1) inputs
  int64_t sp_size = 1;
};

struct RuleResult {
  std::vector<Placement> out;
  std::vector<OperandChange> operands;  // one per node input
  Attrs attr_updates;
  // Set when the driver must expand the node into several ("mean_partial",
  // "cross_entropy_partial"); empty for a plain propagation.
  std::string expansion;
};

using RuleFn = RuleResult (*)(const RuleInput&);

// How an op treats Partial(sum) operands.
enum class PartialBehaviour {
  Reduce,    // reduce every partial operand first (the conservative default)
  Additive,  // add/sub: all tensor operands partial -> partial
  Scale,     // mul/div: one partial operand (the numerator for div), the rest replicate
  Unary,     // linear in its only tensor operand: neg, sum, mean, views
  Cast,      // a cast: linear while it does not narrow (float to an equal or wider float);
             // to an integer or narrower float it would truncate/round each rank's summand
};

struct OpRule {
  RuleFn fn = nullptr;
  PartialBehaviour partial = PartialBehaviour::Reduce;
};

// The rule registered for a canonical op, or nullptr when none is.
const OpRule* find_rule(const std::string& op);

// The rule for a node: its op's registered rule, else the elementwise rule when the node is
// marked pointwise (attribute "pointwise", set by the bridge from torch.Tag.pointwise: the
// pointwise set is PyTorch's, not a list kept here), else nullptr.
//   {op="expm1", attrs={pointwise=true}} -> the elementwise rule; {op="expm1"} -> nullptr.
const OpRule* rule_for(const Node& n);

// Whether each element of the node's result is computed from the elements at the same
// position of its (broadcast) operands alone: ops with the elementwise rule (registered, or
// pointwise by torch's tag), where, masked_fill and aliases. Reductions, repeats and views
// that move elements are not, whatever their partial behaviour.
bool is_elementwise(const Node& n);

// The rule for a node with a token-local operand (Placement::Local: a data-dependent
// selection of this rank's tokens, see rules_local.cpp), from the family of its op's rule:
// row-by-row ops keep the selection, index_add_ at its positions writes it back into the
// sharded tokens, a sum over it is partial. Throws PlanError for ops that would mix its rows.
RuleResult local_rule(const RuleInput& r);

// The ops with a registered rule, sorted (for documentation and tests).
std::vector<std::string> registered_ops();

// Where a Shard(dim, inner) of a tensor of shape `in` lands after a reshape to `out`;
// nullopt when the reshape splits the sequence factor or the sizes are opaque.
//   [2, S, 64] S(1) -> [2*S, 64]: S(0)
//   [S, 2, 64] S(0) -> [2*S, 64]: S(0, inner=2)
//   [2, S, 64] S(1) -> [2, S, 4, 16]: S(1)
std::optional<Placement> reshape_shard(const std::vector<Dim>& in, const std::vector<Dim>& out,
                                       const Placement& p);

// The first dim of `v` whose size is exactly a multiple of S (power 1), or -1.
int sequence_dim(const Value& v);

}  // namespace autosp
