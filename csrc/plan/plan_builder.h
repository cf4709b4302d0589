// The Ulysses plan builder (internal to plan/): walks the input graph in order, applies each
// op's placement rule and emits the plan (see ulysses.h). Its general machinery is defined in
// ulysses.cpp; the op-specific emitters (attention, cross-entropy, scans, shifts, halos) in
// ulysses_ops.cpp; the token-local driver in token_local.cpp; deciding an op's placements and
// the gather fallback in decide.cpp; slice hoisting in hoist.cpp.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "analysis/rules.h"
#include "plan/ulysses.h"

namespace autosp::plan_detail {

inline constexpr const char* kPass = "ulysses";

// x.add_(y), F.relu(x, inplace=True) (attribute "inplace") and x[i] = y (setitem).
inline bool writes_into_first_operand(const Node& n) {
  return n.bool_attr("inplace", false) || n.op == "setitem";
}

inline bool is_float(const std::string& dtype) {
  return dtype == "f32" || dtype == "f16" || dtype == "bf16" || dtype == "f64";
}

// Bits of a float dtype, 0 for any other.
inline int float_bits(const std::string& dtype) {
  return dtype == "f64" ? 64 : dtype == "f32" ? 32 : (dtype == "f16" || dtype == "bf16") ? 16 : 0;
}

class PlanBuilder {
 public:
  PlanBuilder(const Graph& in, const SpConfig& cfg)
      : in_(in), cfg_(cfg), vmap_(in.values.size(), -1) {
    // Hoisting re-runs replicated work later in program order; with in-place ops or setitem
    // in the graph that work could read a tensor mutated in between, so it is not done.
    for (const Node& n : in.nodes) hoist_ = hoist_ && !writes_into_first_operand(n);
  }

  SpPlan run();

  // "layers.3.mlp.up.weight" -> "layers.3"; "" when no component is a number.
  static std::string bucket_of(const std::string& path);

  // Merges the grad syncs of graph inputs (parameters) into one node per layer (see
  // SpConfig::bucket_grad_sync), each where the first of its syncs was.
  void bucket_grad_syncs();

  // Drops nodes whose results nothing uses (full-length originals whose slices were
  // hoisted); inputs, the output and side-effecting nodes stay.
  void eliminate_dead_nodes();

 private:
  // Tiled loss (SpConfig::tile_loss, loss.cpp): a cross-entropy whose logits come from a
  // linear through row-wise ops. `chain`: the
  // input-graph node ids, the linear first; `regroup`: per chain node, 1 for a reshape keeping
  // the class dim (a chunk of rows stays [rows, classes] through it: skipped when replayed);
  // `inputs`: the plan values of the linear's operands (h, weight, bias or -1).
  struct HeadTile {
    std::vector<int64_t> chain;
    std::vector<int64_t> regroup;
    std::vector<int> inputs;
  };

  const Graph& in_;
  SpConfig cfg_;
  Graph out_;
  std::vector<Placement> place_;
  std::vector<int> vmap_;  // input value id -> output value id
  std::map<std::tuple<int, int, int64_t>, int> slice_cache_;
  std::map<int, int> grad_sync_cache_;
  std::map<int, int> reduce_cache_;
  bool hoist_ = true;
  bool grad_enabled_ = true;

  int mapped(int old_id) const { return old_id < 0 ? -1 : vmap_.at(static_cast<size_t>(old_id)); }
  const Value& val(int id) const { return out_.value(id); }
  Placement placement(int id) const {
    return id < 0 ? Placement::replicate() : place_.at(static_cast<size_t>(id));
  }

  int new_value(Value v, Placement p) {
    int id = out_.add_value(std::move(v));
    place_.push_back(p);
    return id;
  }

  // Emits an inserted SP node with one output per entry of `outs`.
  std::vector<int> emit(const std::string& op, std::vector<int> inputs, Attrs attrs,
                        std::vector<std::pair<Value, Placement>> outs, const SourceLoc& loc);

  // Copies an input node, mapping its inputs; its outputs get the given placements.
  int copy_node(const Node& n, std::vector<int> inputs, const std::vector<Placement>& outs,
                const Attrs& updates);

  // torch.no_grad() regions: values made there carry no gradient, so a value cached in one
  // grad mode is not reused in the other (a parameter's gradient sync emitted in a no_grad
  // region and reused after it would cut the parameter's gradient), and no sync is needed
  // inside them.
  void set_grad_mode(bool enabled);

  int grad_sync(int v, const SourceLoc& loc);

  int slice(int v, int dim, int64_t inner, const SourceLoc& loc);

  // Slices a replicated, non-differentiable value by slicing the operands of its producer
  // instead, when the producer is local along the sequence (elementwise, casts, reshapes,
  // permutes, basic indexing, cat along another dim). Replicated work that only feeds
  // sharded values (RoPE tables from full-length positions, say) then runs on the local
  // chunk, and no per-rank tensor stays O(S) wide. Returns -1 when it does not apply.
  int hoist_slice(int v, int dim, int64_t inner, const SourceLoc& loc);

  // Whether the producer `p` of a value computes its part along `dim` from parts of its
  // operands alone (the ops hoist_slice moves a slice through): for each operand, the dim that
  // part lies along (and the chunk granularity `inner`), or nullopt where the operand is read
  // whole (broadcast along `dim`). nullopt when `p` is not local along `dim`.
  std::optional<std::vector<std::optional<std::pair<int, int64_t>>>> local_along(
      const Node& p, int dim, int64_t inner) const;

  // An attention mask as a recipe over query tiles (mask_tiles.cpp): the chain of ops that
  // computes it from O(S) operands, replayed on each tile of query rows by sp's tiled
  // attention, so that no [S, S] mask exists. nullopt when the mask is not such a chain.
  struct MaskTiles {
    std::vector<int> leaves;         // plan values the chain reads (the tiled op's operands)
    std::vector<int64_t> leaf_dims;  // each leaf's query dim, -1 when it is read whole
    std::vector<int64_t> chain;      // per chain node: origin, how, query dim, #in, ins, out
  };
  std::optional<MaskTiles> mask_tiles(int mask, int qdim) const;

  int reduce_partial(int v, const SourceLoc& loc);

  void emit_input(const Node& n);

  void emit_output(const Node& n);

  // Applies a rule's operand changes and the gradient rule for replicated operands:
  // a replicated value that requires grad and feeds a sharded or partial result gets
  // only a partial gradient on each rank, so it passes through sp.grad_sync.
  std::vector<int> apply_operands(const Node& n, std::vector<int> ins,
                                  const std::vector<OperandChange>& changes,
                                  const std::vector<Placement>& outs);

  std::vector<int> mapped_inputs(const Node& n) const {
    std::vector<int> ins;
    for (int old : n.inputs) ins.push_back(mapped(old));
    return ins;
  }

  std::vector<Placement> placements_of(const std::vector<int>& ins) const {
    std::vector<Placement> ps;
    for (int v : ins) ps.push_back(placement(v));
    return ps;
  }

  // Partial operands: kept when the op is linear in them, otherwise reduced first.
  bool partial_passes(const OpRule& rule, const Node& n, const std::vector<int>& ins) const;

  // A node the table gives the generic emitter: its rule's placements (`rule`: its row, or
  // nullptr), partial operands passed or reduced, the gather fallback, the rule's expansion.
  void emit_generic(const Node& n, const OpRule* rule);

  // The rule result for `n` on the inputs `ins`: token-local, the op's rule, or for an op
  // without one, replicated when every input is. Throws PlanError where the op has no
  // sequence-parallel form for its inputs.
  RuleResult decide(const Node& n, const OpRule* rule, const std::vector<int>& ins);

  // decide(); where it throws and SpConfig::gather_unsupported is on, the sharded inputs are
  // all-gathered (replacing them in `ins`), the op is decided again on full-length values,
  // and the error is recorded in gathered_ops_ (decide.cpp).
  RuleResult decide_or_gather(const Node& n, const OpRule* rule, std::vector<int>& ins);
  // Why attention `n` (inputs `ins`, the query first) cannot be split by heads, if it cannot
  // (ulysses_ops.cpp): then it runs on the all-gathered sequence, or is refused.
  std::optional<PlanError> heads_refusal(const Node& n, const std::vector<int>& ins) const;

  // Whether every non-replicated input of `n` can be gathered whole: sharded along an even
  // split of the sequence (S or k*S, no positions dropped) and not the destination of an
  // in-place write or setitem (the write would land in the gathered copy, not in the tensor).
  bool gatherable(const Node& n, const std::vector<int>& ins) const;

  // sp.all_gather of a sharded value to full length (replicated), once per value.
  int gather(int v, const SourceLoc& loc);

  // The gather fallback's step for an op `n` that `refused` stops at: `ins` with each sharded
  // value gathered, or `refused` thrown where the fallback is off or cannot apply
  // (gatherable). Where n's inputs or result are written in place later through an alias (a
  // gathered view is a copy: the write would not reach the other), the error names that
  // write. The caller records the refusal in gathered_ops_ once the op is placed.
  std::vector<int> gathered_inputs(const Node& n, std::vector<int> ins, const PlanError& refused);

  std::map<int, int> gather_cache_;
  std::vector<std::string> gathered_ops_;
  // Replicated values computed from gathered ones (full-length stand-ins for sharded values).
  std::set<int> gathered_values_;

  // Token-local values (Placement::Local, see analysis/rules_local.cpp): the sizes of their
  // selection dims (the data-dependent counts torch.where found on this rank: the unbacked
  // symbols of their opaque sizes, "u0").
  std::set<std::string> local_counts_;
  // Selections made from the same mask have the same count, though Dynamo gives each its own
  // symbol (logits[keep] and labels[keep]): symbol -> the first symbol of that mask, and
  // mask (plan value) -> that symbol. Values are copied with the first symbol.
  std::map<std::string, std::string> same_count_;
  std::map<int, std::string> count_of_mask_;
  void note_local_count(const Node& n, const std::vector<int>& mapped_inputs, const Dim& count);
  Value same_counts(Value v) const {
    for (Dim& d : v.shape) {
      auto it = d.is_opaque() ? same_count_.find(d.opaque) : same_count_.end();
      if (it != same_count_.end()) d = Dim::expr(it->second);
    }
    return v;
  }

  // Whether `n` reads this rank's count of a selection (attribute "unbacked"); the dim of a
  // zeros/ones/empty output that many rows long, or -1; and the refusal of any other read.
  bool reads_local_count(const Node& n) const;
  int local_count_dim(const Node& n) const;
  void refuse_count_as_number(const Node& n, const std::vector<int>& ins) const;

  // The rule result for a node that reads a token-local value or this rank's count of one;
  // nullopt when the node touches neither. Throws where the op would differ from one device.
  std::optional<RuleResult> token_local(const Node& n, const std::vector<int>& ins);

  // Whether `value` (an input-graph value) is a new zeros/ones/empty/full tensor that only
  // `n` reads: an in-place write into its local slice then loses nothing (HF MoE's
  // torch.zeros((B * S, C)).index_add_(0, positions, rows)).
  bool fresh_fill(const Node& n, int value) const;

  // Cross-entropy over this rank's tokens (`args`: logits and targets, local): per token
  // (`per_token`) for reduction none, partial for sum, for mean the local sum over the number
  // of valid targets in the group (sp.count_valid).
  void emit_loss_over_tokens(const Node& n, const std::vector<int>& args,
                             const Placement& per_token, const std::optional<HeadTile>& tile);

  // Attention and the outputs take whole sequences, never a local selection.
  void refuse_local_operands(const Node& n) const;

  // Rules see the node with mapped inputs and the *input graph's* output values (same
  // shapes), so shapes of both sides are available.
  RuleResult call_rule(RuleFn fn, const Node& n, const std::vector<int>& ins) {
    Graph& g = scratch_graph(n, ins);
    RuleInput r{g, g.nodes.back(), placements_of(ins), cfg_.sp_size};
    return fn(r);
  }

  Graph scratch_;
  Graph& scratch_graph(const Node& n, const std::vector<int>& ins);

  // A scan along the sequence (sp.scan: the local scan, combined with the totals of the ranks
  // before this one) or a reduction over it (sp.combine: the local reduction, combined over
  // all ranks by the same reduction).
  void emit_cross_rank(const Node& n, std::vector<int> ins, bool scan);

  // A slice that drops positions at the ends of the sharded sequence: sp.shift takes this
  // rank's part of the sliced sequence (see collectives.shift), and the node itself then
  // indexes the other dims only (attribute unslice_dim: the bridge takes that dim whole).
  void emit_shift(const Node& n, std::vector<int> ins, const RuleResult& res);

  // The first in-place node after `n` in program order that writes into a value aliasing n's
  // input or output (through view-like ops, or in-place ops, which return their operand), or
  // nullptr.
  const Node* later_write_to_aliases(const Node& n) const;

  // A conv along the sharded sequence: sp.halo extends each rank's chunk by the positions its
  // outputs read from its neighbours (see collectives.halo), and the conv itself runs without
  // padding (attribute zero_padding).
  void emit_halo(const Node& n, std::vector<int> ins, const RuleResult& res);

  // mean over the sharded dim -> local sum / global count (a partial value).
  void emit_mean_partial(const Node& n, std::vector<int> ins);

  void emit_cross_entropy(const Node& n);

  // The tile for cross-entropy `n`, or nullopt with the reason recorded in loss_tiling_.
  std::optional<HeadTile> head_tile(const Node& n);
  // Copies cross-entropy `n` onto `args` (logits, targets), tiled when `tile` is set.
  int copy_loss(const Node& n, std::vector<int> args, const Placement& out, Attrs attrs,
                const std::optional<HeadTile>& tile);
  std::vector<std::string> loss_tiling_;
  std::vector<int> uses_;          // input value id -> number of reads (node inputs and outputs)
  std::vector<bool> in_autocast_;  // input node id -> inside a torch.autocast region

  void emit_sdpa(const Node& n);

  // Values split by attention heads outside SDPA (heads.cpp). to_heads: sp.all_to_all from
  // a sequence shard in `seq_dim` to a heads shard in `heads_dim` (the whole sequence).
  // to_sequence: back from a shard along a static dim to a shard along the value's sequence
  // dim (S itself); `v` unchanged when it is not so split. split_by_heads: whether it is.
  int to_heads(int v, int heads_dim, int seq_dim, const SourceLoc& loc);
  int to_sequence(int v, const SourceLoc& loc);
  bool split_by_heads(int v) const;
  // Expansion::ToSequence: the node, its result split by heads, and that result exchanged
  // back to the sequence layout for every later reader.
  void emit_to_sequence(const Node& n, std::vector<int> ins, const RuleResult& res);

  int grad_sync_if_replicated(int v, const SourceLoc& loc) {
    return placement(v).is_replicate() ? grad_sync(v, loc) : v;
  }
};

}  // namespace autosp::plan_detail
