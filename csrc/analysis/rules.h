// The op table: one row per canonical op. Its columns: the placement rule (how placements
// flow through the op), how Partial(sum) operands pass through it, where each part of its
// result comes from (its locality, the inverse slice hoisting and mask tiling read), and how
// the plan builder emits it (the generic rule-driven emitter, or attention's all-to-alls and
// cross-entropy's token-wise loss). A rule either propagates (outputs get placements), asks for a
// cheap local slice of a replicated operand, asks for a partial operand to be reduced, or throws a
// PlanError naming the conflict. An op without a rule is fine while every operand is replicated
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
  enum class Kind { Keep, Slice, ReducePartial, Exchange };
  Kind kind = Kind::Keep;
  int dim = -1;             // Slice: the operand's dim to slice; Exchange: the dim to scatter
  int64_t inner = 1;        // Slice: factor right of S inside that dim
  int64_t check_below = 0;  // Slice: when > 0, first check every element is in [0, check_below)
  int gather_dim = -1;      // Exchange: the operand's sharded sequence dim, gathered whole

  static OperandChange keep() { return {}; }
  static OperandChange slice(int dim, int64_t inner = 1) { return {Kind::Slice, dim, inner}; }
  // Slices indices after checking them on the full-length value, which every rank holds: a
  // bad index then fails on every rank alike, instead of in the one rank whose chunk holds
  // it while the others wait in a collective.
  static OperandChange checked_slice(int dim, int64_t below) {
    return {Kind::Slice, dim, 1, below};
  }
  static OperandChange reduce() { return {Kind::ReducePartial, -1, 1}; }
  // An all-to-all (sp.all_to_all): the operand, sharded along the sequence in `seq_dim`,
  // becomes sharded along the static dim `dim` (attention heads) with the whole sequence:
  // how hand-written attention's scores are computed per head group, as Ulysses does.
  static OperandChange exchange(int dim, int seq_dim) {
    return {Kind::Exchange, dim, 1, 0, seq_dim};
  }
  bool operator==(const OperandChange&) const = default;
};

struct RuleInput {
  const Graph& graph;
  const Node& node;
  std::vector<Placement> in;  // one per node input; Replicate for absent (-1) inputs
  int64_t sp_size = 1;
};

// How the plan builder expands a node a rule placed (RuleResult::expansion).
enum class Expansion {
  None,         // the node itself, with the rule's placements
  MeanPartial,  // mean over the sharded dim: local sum / global count (partial)
  Halo,         // a conv along the sharded dim: sp.halo exchanges the neighbours' positions
  Shift,        // a slice dropping positions at the sequence's ends: sp.shift
  Scan,         // cumsum & co. along the sharded dim: local scan + the earlier ranks' totals
  Combine,      // a reduction over the sharded dim: local reduction, combined over ranks
  ToSequence,   // a result sharded along heads goes back to the sequence (sp.all_to_all)
};

// "" for None, else "mean_partial", "halo", "shift", "scan" or "combine".
const char* expansion_name(Expansion e);

struct RuleResult {
  std::vector<Placement> out;
  std::vector<OperandChange> operands;  // one per node input
  Attrs attr_updates;
  Expansion expansion = Expansion::None;
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

// Where each part of an op's result along a dim comes from: the table's column that slice
// hoisting (PlanBuilder::local_along) and mask tiling (PlanBuilder::mask_tiles) read.
enum class Locality {
  None,         // parts read the whole of some operand (matmul, reductions, random ops)
  Elementwise,  // each element from the same position of its (broadcast) operands
  Reshape,      // the same elements, regrouped (reshape_shard maps the dim)
  Expand,       // broadcast: local along the dims it does not broadcast
  Permute,      // the dim moved to perm[dim]
  Index,        // basic indexing: local along dims it takes whole
  Cat,          // cat: local along the dims it does not concatenate
  Triangle,     // tril/triu: rows of the result from rows of the operand, diagonal shifted
  Factory,      // ones/zeros/full/empty: a tile is the factory with the tile's size
  Eye,          // eye(n): a tile of rows is a shifted diagonal
};

// How the plan builder emits the op.
enum class Emitter {
  Rule,          // apply the placement rule (no rule: the op runs only on replicated values)
  Attention,     // sdpa / flex_attention: Ulysses all-to-alls around the kernel
  CrossEntropy,  // the loss over each rank's tokens, reduced over the group
};

struct OpRule {
  RuleFn fn = nullptr;  // nullptr: no placement rule (replicated operands only)
  PartialBehaviour partial = PartialBehaviour::Reduce;
  Locality locality = Locality::None;
  Emitter emitter = Emitter::Rule;
};

// The table's row for a canonical op, or nullptr when it has none.
const OpRule* find_rule(const std::string& op);

// The row for a node: its op's row, else the elementwise row when the node is
// marked pointwise (attribute "pointwise", set by the bridge from torch.Tag.pointwise: the
// pointwise set is PyTorch's, not a list kept here), else nullptr.
//   {op="expm1", attrs={pointwise=true}} -> the elementwise rule; {op="expm1"} -> nullptr.
const OpRule* rule_for(const Node& n);

// The node's locality column (Locality::None for an op without a row).
Locality locality_of(const Node& n);

// Whether each element of the node's result is computed from the elements at the same
// position of its (broadcast) operands alone (locality Elementwise: rows so marked, and ops
// pointwise by torch's tag). Reductions, repeats and views that move elements are not,
// whatever their partial behaviour.
bool is_elementwise(const Node& n);

// The rule for a node with a token-local operand (Placement::Local: a data-dependent
// selection of this rank's tokens, see rules_local.cpp), from the family of its op's rule:
// row-by-row ops keep the selection, index_add_ at its positions writes it back into the
// sharded tokens, a sum over it is partial. Throws PlanError for ops that would mix its rows.
RuleResult local_rule(const RuleInput& r);

// The ops with a placement rule or their own emitter, sorted (for documentation and tests).
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
