// The Ulysses plan's emission (internal to plan/): walks the input graph in order and carries
// out the decisions of placement propagation (propagate.h): each operand's SP steps, then the
// node itself or its expansion (see ulysses.h). Its general machinery is defined in
// ulysses.cpp; the op-specific emitters (attention, scans, shifts, halos) in ulysses_ops.cpp;
// cross-entropy in loss.cpp; exchanges by heads in heads.cpp; slice hoisting in hoist.cpp.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "analysis/rules.h"
#include "plan/propagator.h"
#include "plan/ulysses.h"

namespace autosp::plan_detail {

class PlanBuilder {
 public:
  PlanBuilder(const Graph& in, const SpConfig& cfg, const Propagation& prop)
      : in_(in), cfg_(cfg), prop_(prop), vmap_(in.values.size(), -1) {
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

  // Tiled MLP (SpConfig::tile_mlp, tiled_rows.cpp): each row-wise block that ends in a linear
  // and holds at least two becomes one tiled_rows node; reasons in mlp_tiling_.
  void tile_rows();

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
  const Propagation& prop_;
  Graph out_;
  std::vector<Placement> place_;
  std::vector<int> vmap_;  // input value id -> output value id
  std::map<std::tuple<int, int, int64_t>, int> slice_cache_;
  std::map<int, int> grad_sync_cache_;
  std::map<int, int> reduce_cache_;
  std::map<int, int> gather_cache_;
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
  // inside them (needs_grad_sync).
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

  std::vector<int> mapped_inputs(const Node& n) const {
    std::vector<int> ins;
    for (int old : n.inputs) ins.push_back(mapped(old));
    return ins;
  }

  // A node the table gives the generic emitter: its operands' steps, then the node with the
  // decided placements, or its expansion.
  void emit_generic(const Node& n);

  // Carries out the steps propagation decided for input `i` of `n` on its plan value `v`
  // (the exchanges for attention excepted when `skip_exchange`).
  int apply_steps(const Node& n, size_t i, int v, bool skip_exchange = false);

  // sp.all_gather of a sharded value to full length (replicated), once per value.
  int gather(int v, const SourceLoc& loc);

  // Cross-entropy over this rank's tokens (`args`: logits and targets, local): per token
  // (`per_token`) for reduction none, partial for sum, for mean the local sum over the number
  // of valid targets in the group (sp.count_valid).
  void emit_loss_over_tokens(const Node& n, const std::vector<int>& args,
                             const Placement& per_token, const std::optional<HeadTile>& tile);

  // A scan along the sequence (sp.scan: the local scan, combined with the totals of the ranks
  // before this one) or a reduction over it (sp.combine: the local reduction, combined over
  // all ranks by the same reduction).
  void emit_cross_rank(const Node& n, std::vector<int> ins, const NodePlacement& d);

  // A slice that drops positions at the ends of the sharded sequence: sp.shift takes this
  // rank's part of the sliced sequence (see collectives.shift), and the node itself then
  // indexes the other dims only (attribute unslice_dim: the bridge takes that dim whole).
  void emit_shift(const Node& n, std::vector<int> ins, const NodePlacement& d);

  // A conv along the sharded sequence: sp.halo extends each rank's chunk by the positions its
  // outputs read from its neighbours (see collectives.halo), and the conv itself runs without
  // padding (attribute zero_padding).
  void emit_halo(const Node& n, std::vector<int> ins, const NodePlacement& d);

  // mean over the sharded dim -> local sum / global count (a partial value).
  void emit_mean_partial(const Node& n, std::vector<int> ins);

  void emit_cross_entropy(const Node& n);

  // The tile for cross-entropy `n`, or nullopt with the reason recorded in loss_tiling_.
  std::optional<HeadTile> head_tile(const Node& n);
  // Copies cross-entropy `n` onto `args` (logits, targets), tiled when `tile` is set.
  int copy_loss(const Node& n, std::vector<int> args, const Placement& out, Attrs attrs,
                const std::optional<HeadTile>& tile);
  std::vector<std::string> loss_tiling_;
  std::vector<std::string> mlp_tiling_;
  std::vector<int> uses_;          // input value id -> number of reads (node inputs and outputs)
  std::vector<bool> in_autocast_;  // input node id -> inside a torch.autocast region

  void emit_sdpa(const Node& n);

  // Values split by attention heads outside SDPA (heads.cpp). to_heads: sp.all_to_all from
  // a sequence shard in `seq_dim` to a heads shard in `heads_dim` (the whole sequence).
  // to_sequence: back from a shard along a static dim to a shard along the value's sequence
  // dim (S itself); `v` unchanged when it is not so split. exchange: one fused sp.all_to_all
  // of several values from the sequence in `seq_dim` to heads in `heads_dim`.
  int to_heads(int v, int heads_dim, int seq_dim, const SourceLoc& loc);
  int to_sequence(int v, const SourceLoc& loc);
  std::vector<int> exchange(const std::vector<int>& vs, int heads_dim, int seq_dim,
                            const SourceLoc& loc);
  // Expansion::ToSequence: the node, its result split by heads, and that result exchanged
  // back to the sequence layout for every later reader.
  void emit_to_sequence(const Node& n, std::vector<int> ins, const NodePlacement& d);

  // Internal check: the plan value each output of `n` maps to has the placement propagation
  // decided (a mismatch is an autosp bug: std::logic_error).
  void check_outputs(const Node& n) const;
};

}  // namespace autosp::plan_detail
