// The Ulysses plan's options (see ulysses.h), shared by both of its stages: placement
// propagation (propagate.h) and emission.
#pragma once

#include <cstdint>

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
  // Chunks of this rank's tokens per tiled loss (attribute loss_chunks of its cross_entropy
  // node); 0: ceil(classes / hidden), the chunks whose logits are the size of the hidden states
  // (tiled_loss_chunks, plan/memory.h). Fewer chunks are faster (each reads the whole weight),
  // more hold less: fewest_loss_chunks picks them for a memory budget.
  int64_t loss_chunks = 0;
  // Row-wise blocks (an MLP: linears and elementwise ops whose intermediates nothing else
  // reads, ending in a linear) run as one tiled_rows node over chunks of rows, recomputed in
  // backward (ALST's TiledMLP): one chunk's intermediates exist at a time. Reasons and blocks
  // in SpPlan::mlp_tiling.
  bool tile_mlp = false;
};

}  // namespace autosp
