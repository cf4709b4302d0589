// The Ulysses sequence-parallel plan.
//
// Input: the single-device graph (full-length inputs, the sequence length as symbol S).
// Output: the same computation rewritten for one rank of an SP group of size P, as a new
// graph whose inserted nodes are the SP ops below, plus a placement for every value.
//
// Two stages: placement propagation (propagate.h) decides every node's placements and the SP
// steps its operands take; emission inserts those steps as SP ops, hoists slices of
// replicated work onto the local chunk, tiles masks and losses, drops dead nodes and buckets
// gradient syncs.
//
//   sp.slice(x) {dim, inner, outer}      keep this rank's 1/P chunk of the sequence factor
//                                        of `dim` (or of a static dim such as heads)
//   sp.grad_sync(x...)                   identity forward; all-reduce(sum) of the gradient
//                                        (several operands: one bucketed all-reduce, one
//                                        per layer; see SpConfig::bucket_grad_sync)
//   sp.reduce_partial(x)                 all-reduce(sum) forward; identity backward
//   sp.all_gather(x) {dim, inner}        gather the sequence (backward: keep the local chunk)
//   sp.all_to_all(x...) {scatter_dim, gather_dim, gather_coef, gather_power}
//                                        one fused exchange for all operands
//   sp.repeat_heads(x) {dim, repeats}    repeat_interleave KV heads (GQA, KV heads < P)
//   sp.count_valid(t) {ignore_index}     global number of targets != ignore_index
//
// A cross_entropy node with attribute head_chain (SpConfig::tile_loss) has inputs
// (-1, targets, h, weight, bias): the loss of linear(h, weight, bias) followed by the input
// graph nodes listed in head_chain (their origins: the linear, then the row-wise ops to the
// logits; head_regroup marks with 1 the reshapes among them, which a chunk of rows skips),
// computed a chunk of rows at a time.
//
// A tiled_rows node (SpConfig::tile_mlp, tiled_rows.cpp) stands for a row-wise block (an
// MLP): inputs are its row operands (attribute row_inputs of them, cut into chunks along
// row_dim) then the operands it reads whole; row_nodes lists the block's input-graph nodes in
// order, and row_args, per node, its number of inputs then each input: k >= 0 the tiled
// node's input k, -1 absent, -2 - j the result of the block's node j. row_in_bytes and
// row_inner_bytes: bytes per index of row_dim of its row operands and of its intermediates.
//
// Original nodes keep their ids in `origin` and may carry attribute updates the bridge
// applies: local_dims (output dims whose size arguments become S/P), scale_by_sp,
// reduction, rewrite_target.
//
// Example (one attention, P = 2):
//   %q: f32[2, 4, S, 16] S(2)
//   %qa, %ka, %va = sp.all_to_all(%q, %k, %v) {gather_dim=2, scatter_dim=1, ...}   S(1) each
//   %o: f32[2, 4, S, 16] S(1) = sdpa(%qa, %ka, %va) {is_causal=true}
//   %ob: f32[2, 4, S, 16] S(2) = sp.all_to_all(%o) {gather_dim=1, scatter_dim=2, ...}
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "analysis/placement.h"
#include "ir/graph.h"
#include "plan/propagate.h"
#include "plan/sp_config.h"

namespace autosp {

struct SpPlan {
  Graph graph;
  std::vector<Placement> placements;  // indexed by value id of `graph`
  // The ops whose sharded inputs were gathered (SpConfig::gather_unsupported), in program
  // order: for each, the error the plan would have stopped with (op, source line, reason).
  std::vector<std::string> gathered;
  // With SpConfig::tile_loss: for each cross-entropy, in program order, "tiled: ..." or
  // "not tiled: <why>" with its source line.
  std::vector<std::string> loss_tiling;
  // With SpConfig::tile_mlp: for each row-wise block found, in program order, "tiled: ..." or
  // "not tiled: <why>" with its source line.
  std::vector<std::string> mlp_tiling;
  // The first stage's decisions (propagate.h), which the graph carries out.
  Propagation propagation;

  // Number of nodes per SP op ("sp.all_to_all" -> 2L for an L-layer model, ...).
  std::map<std::string, int> collective_counts() const;
  // The graph with each value's placement printed after its type.
  std::string str() const;
};

// The placements the plan gave the input graph (print_placements of its propagation).
std::string print_placements(const Graph& in, const SpPlan& plan);

// Throws PlanError for a model the plan cannot make exact, std::invalid_argument for a
// bad configuration.
SpPlan plan_ulysses(const Graph& g, const SpConfig& cfg);

}  // namespace autosp
