// Placement propagation: the Ulysses plan's first stage. It walks the input graph in program
// order and decides, for every node, how each operand reaches it (the SP steps: slices,
// exchanges, reductions, gathers) and how its results are placed, from the op table's rules
// (analysis/rules.h). It builds no graph. The second stage, emission (plan_ulysses, see
// ulysses.h), inserts the SP ops these decisions name and checks that every value it emits
// has the placement decided here.
//
//   %22 = linear(%21:S(1), %6:R[sp.grad_sync]) -> %22:S(1)
//   %31 = sdpa(%26:S(1)[sp.all_to_all], %28:S(1)[sp.all_to_all], ...) -> %31:S(2)[sp.all_to_all]
//
// Placement refusals (an op without a sequence-parallel form, attention whose heads cannot be
// split, mismatched loss operands) are thrown from here as PlanError; refusals about how an op
// is emitted (a count the plan cannot write, an in-place write through a copied slice) come
// from emission.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "analysis/rules.h"
#include "ir/graph.h"
#include "plan/sp_config.h"

namespace autosp {

// One step on the way from a value to the op that reads it; each is an SP op of ulysses.h.
struct Step {
  enum class Kind {
    ToSequence,     // sp.all_to_all: from a shard along heads back to the sequence layout
    ReducePartial,  // sp.reduce_partial: Partial -> Replicate
    Gather,         // sp.all_gather: Shard -> Replicate (the op runs on the whole sequence)
    CheckIndex,     // sp.check_index: indices checked below `arg` before they are sliced
    Slice,          // sp.slice (behind sp.grad_sync): Replicate -> Shard(dim, inner)
    RepeatHeads,    // sp.repeat_heads: key/value heads in `dim` repeated `arg` times
    Exchange,       // sp.all_to_all: Shard(seq dim `arg`) -> Shard(heads dim `dim`)
    GradSync,       // sp.grad_sync: a replicated value feeding distributed results
  };
  Kind kind = Kind::GradSync;
  int dim = -1;
  int64_t inner = 1;
  int64_t arg = 0;
  bool operator==(const Step&) const = default;
};

// "sp.slice", "sp.all_to_all", ... for a step.
const char* step_op(Step::Kind kind);

// Which decision a node took, and so which emitter carries it out (the op table's Emitter
// column for ops; graph inputs and the output have their own).
enum class NodeRole { Input, Output, Attention, Loss, Rule };

// The decision for one node of the input graph.
struct NodePlacement {
  NodeRole role = NodeRole::Rule;
  std::vector<std::vector<Step>> steps;  // per input, in order
  std::vector<Placement> operands;       // per input: the placement the op reads (after steps)
  std::vector<Placement> results;        // per output: as the op itself makes it
  std::vector<Placement> outputs;        // per output: as later nodes read it
  std::vector<std::string> via;          // per output: the SP op from result to output, or ""
  Expansion expansion = Expansion::None;
  Attrs attr_updates;    // the rule's attribute updates (shift and halo parameters, ...)
  bool decided = false;  // false for nodes the plan skips (nontensor, symbols)
};

struct Propagation {
  std::vector<NodePlacement> nodes;  // indexed by input node id
  std::vector<Placement> values;     // per input value: its placement as later nodes read it
  // Per input value: a replicated value computed on the gathered sequence, standing in for a
  // sharded one (with gather_outputs off it is returned as this rank's chunk).
  std::vector<bool> gathered_value;
  // The refusals of the ops run on the gathered sequence, in program order (SpPlan::gathered).
  std::vector<std::string> gathered;
  // Token-local selections from the same mask have the same count though Dynamo gives each
  // its own unbacked symbol: symbol -> the first symbol of that mask.
  std::map<std::string, std::string> same_count;

  // `v` with each selection count renamed to the first of its mask.
  Value with_same_counts(Value v) const;
};

// Throws PlanError for a model whose placements cannot be made exact (see above).
Propagation propagate_placements(const Graph& g, const SpConfig& cfg);

// The propagation printed, one line per node: each operand with the placement the node reads
// and the SP ops of its steps, and each result as later nodes read it.
//   %12 = linear(%9:S(1), %3:R[sp.grad_sync]) -> %12:S(1)  # model.py:40
std::string print_placements(const Graph& in, const Propagation& p);

// Shared by both stages.
namespace plan_detail {

// x.add_(y), F.relu(x, inplace=True) (attribute "inplace") and x[i] = y (setitem).
inline bool writes_into_first_operand(const Node& n) {
  return n.bool_attr("inplace", false) || n.op == "setitem";
}

inline bool is_float(const std::string& dtype) {
  return dtype == "f32" || dtype == "f16" || dtype == "bf16" || dtype == "f64";
}

// A value split by attention heads (a shard along a static dim, with the whole sequence in
// another): the dim its sequence layout shards (the first dim of size S), else -1.
int sequence_layout_dim(const Value& v, const Placement& p);

// Whether a replicated value feeding distributed results needs sp.grad_sync.
inline bool needs_grad_sync(const Value& v, bool grad_enabled) {
  return v.is_tensor() && v.requires_grad && grad_enabled;
}

// The first in-place node after `n` in program order that writes into a value aliasing n's
// first input or its outputs (through view-like ops, or in-place ops, which return their
// operand), or nullptr.
const Node* later_write_to_aliases(const Graph& g, const Node& n);

}  // namespace plan_detail

}  // namespace autosp
