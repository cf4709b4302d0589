// The Ulysses sequence-parallel plan.
//
// Input: the single-device graph (full-length inputs, the sequence length as symbol S).
// Output: the same computation rewritten for one rank of an SP group of size P, as a new
// graph whose inserted nodes are the SP ops below, plus a placement for every value.
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

namespace autosp {

struct SpConfig {
  int64_t sp_size = 1;
  bool fuse_qkv = true;  // one all-to-all for q, k and v
  // Parameters' grad syncs bucketed: one sp.grad_sync (one all-reduce of the flattened
  // gradients) per layer instead of one per parameter. A parameter's layer is the prefix of
  // its input's "path" attribute up to the first numbered component ("layers.3.mlp.up.weight"
  // -> "layers.3"); parameters without one ("embed.weight", "norm.weight") share one bucket.
  // Each bucket sits where its first parameter is first used, so in the backward it
  // all-reduces as soon as that layer's gradients are complete, and only one layer's
  // flattened gradients are in flight at a time.
  bool bucket_grad_sync = true;
  // Graph outputs sharded along the sequence (logits, hidden states, KV caches) are
  // all-gathered so that each rank returns what the single-device model returns. With false
  // they stay this rank's chunk (the loss and other replicated outputs are unchanged), which
  // saves the gather and the full-length copy when only the loss is used.
  bool gather_outputs = true;
  // An op that has no sequence-parallel form for its sequence-sharded inputs (no rule, or a
  // rule that refuses them: F.pad of the sharded dim, a sort along it, a slice inside it)
  // gets them all-gathered to full length (sp.all_gather) and runs on the whole sequence on
  // every rank, as on one device; what it produces stays replicated until it meets sharded
  // values again, where it is sliced. Exact, but those activations are not split. Each such op
  // is listed in SpPlan::gathered. With false the plan stops at the op (PlanError).
  bool gather_unsupported = false;
  // Cross-entropy over a projection to the classes (lm_head, then casts, pointwise ops and
  // reshapes that keep the class dim, then the loss) runs as one tiled op over chunks of this
  // rank's tokens (the cross_entropy node with attribute head_chain):
  // the [tokens, classes] logits never exist whole, and the backward recomputes each chunk's
  // logits (logits also read elsewhere are still made for that reader). A loss the chunks
  // could not reproduce is left as written, with the reason in SpPlan::loss_tiling.
  bool tile_loss = false;
};

struct SpPlan {
  Graph graph;
  std::vector<Placement> placements;  // indexed by value id of `graph`
  // The ops whose sharded inputs were gathered (SpConfig::gather_unsupported), in program
  // order: for each, the error the plan would have stopped with (op, source line, reason).
  std::vector<std::string> gathered;
  // With SpConfig::tile_loss: for each cross-entropy, in program order, "tiled: ..." or
  // "not tiled: <why>" with its source line.
  std::vector<std::string> loss_tiling;
  // For each value of the input graph, the plan value later nodes read in its place (-1 for
  // none).
  std::vector<int> value_of_input;

  // Number of nodes per SP op ("sp.all_to_all" -> 2L for an L-layer model, ...).
  std::map<std::string, int> collective_counts() const;
  // The graph with each value's placement printed after its type.
  std::string str() const;
};

// The placements the plan gave the input graph, one line per node: the operands the node ran
// on (each input value with the placement it had there, and the SP op that made it so where
// the plan inserted one) and its results as later nodes read them.
//   %12 = linear(%9:S(1), %3:R[sp.grad_sync]) -> %12:S(1)  # model.py:40
//   %20 = sdpa(%17:S(1)[sp.all_to_all], ...) -> %20:S(2)[sp.all_to_all]  # model.py:46
// A replicated chain the plan moved onto the local chunk prints its clone's results and
// "{hoisted}"; a node the plan dropped (nothing read its result) prints "dropped".
std::string print_placements(const Graph& in, const SpPlan& plan);

// Throws PlanError for a model the plan cannot make exact, std::invalid_argument for a
// bad configuration.
SpPlan plan_ulysses(const Graph& g, const SpConfig& cfg);

}  // namespace autosp
