// Memory model: predicts the peak memory of one training step per rank, and the longest
// sequence length S whose peak fits a budget.
//
// Input: the joint forward+backward graph of one step for one rank (what AOTAutograd traces
// and the remat solver partitions), traced once with S symbolic. Every value's size is then a
// closed form in S (SeqBytes below), so the model is evaluated at any S without re-tracing:
//
//   1. evaluate each node's bytes and FLOPs at S;
//   2. decide the saved set with the remat solver (plan/remat.h) under the strategy's policy,
//      or, for full checkpointing, save only each layer's inputs;
//   3. walk the schedule -- the forward in graph order, then the backward in the order
//      PyTorch's partitioner gives it (reordering_to_mimic_autograd_engine: each backward op
//      is preceded by the recomputations it needs, in graph order), then the optimizer step --
//      allocating each value's storage when its producer runs and freeing it after the last
//      use of any alias of it, with saved values held from the forward until their last
//      backward use and gradients held until the optimizer step has run;
//   4. report the peak and what was live at it.
//
// Example (one layer x -> mm -> relu -> loss, S = 1024, fp32, 4 MiB per activation):
//   policy kNone saves relu (4 MiB): the peak is reached in the backward, where the saved
//   relu, the gradient of mm's weight and the backward's own temporaries are live together.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/remat.h"

namespace autosp {

// One term coef * S^power / shard of a size in bytes. `shard` is the SP degree's share of
// the sequence factor (P for a Shard value, P^2 for one sharded in two S factors, 1 for a
// replicated value); the division is exact when S is a multiple of the SP degree.
//   SeqTerm{.coef = 2 * 4096 * 2, .power = 1, .shard = 8}.at(65536) == 2 * 4096 * 2 * 8192
//
// `cap` > 0 bounds the term: min(coef * S^power / shard, cap) (a buffer of one chunk of the
// rows, such as the tiled loss's: it grows with S up to a chunk, then stays).
struct SeqTerm {
  int64_t coef = 0;
  int power = 0;
  int64_t shard = 1;
  int64_t cap = 0;

  bool operator==(const SeqTerm&) const = default;
};

// Bytes as a function of S: a sum of terms (a multi-output op may mix powers).
//   SeqBytes{{{64, 1, 2}, {16, 0, 1}}}.at(8) == 64 * 8 / 2 + 16 == 272
//   SeqBytes{{{64, 1, 2}, {16, 0, 1}}}.str() == "64*S/2 + 16"
struct SeqBytes {
  std::vector<SeqTerm> terms;

  static SeqBytes constant(int64_t bytes);
  static SeqBytes term(int64_t coef, int power, int64_t shard = 1);
  // Throws std::invalid_argument ("[memory] ...") when a term is not an integer at `seq`
  // (S not a multiple of the shard) and std::overflow_error when the result exceeds int64.
  int64_t at(int64_t seq) const;
  bool is_zero() const;
  std::string str() const;
  bool operator==(const SeqBytes&) const = default;
};

// FLOPs as a function of S: coef * S^power (matmuls are linear in S, attention quadratic).
struct SeqFlops {
  double coef = 0;
  int power = 0;

  double at(int64_t seq) const;
  bool operator==(const SeqFlops&) const = default;
};

enum class MemoryRole : uint8_t {
  kParameter,  // a parameter placeholder: persistent, counted as "parameters"
  kInput,      // another primal placeholder (token ids, labels, RNG seeds): persistent
  kTangent,    // a tangent placeholder: an input of the backward
  kCompute,    // an op of the forward or backward
};

// One node of the joint graph (graph order). `facts` are the remat solver's facts; their
// `bytes` and `flops` are overwritten at each S from `save_bytes` and `flops`.
struct MemoryNode {
  RematNode facts;
  MemoryRole role = MemoryRole::kCompute;
  SeqBytes save_bytes;  // what saving this node costs (PyTorch's _size_of): remat capacities
  SeqFlops flops;       // FLOPs to compute it once
  // FLOPs the op itself spends again, beyond `flops` (the tiled loss's backward recomputes
  // each chunk's logits): counted as recomputation, like the nodes remat recomputes.
  SeqFlops inner_recompute_flops;
  SeqBytes alloc_bytes;    // the storage its output allocates (empty for an alias)
  SeqBytes scratch_bytes;  // allocated while it runs, freed right after (unused tuple outputs)
  // A tiled loss's chunk working set (tiled_loss_workspace): what it would hold were all its
  // rows one chunk; while it runs it holds ceil(chunked_bytes / chunks) on top of
  // scratch_bytes, with MemoryOptions::loss_chunks in place of `chunks` when that is set.
  SeqBytes chunked_bytes;
  int64_t chunks = 0;
  int32_t alias_of = -1;        // index of the node whose storage its output shares (views, waits)
  bool collective = false;      // its storage is a communication buffer (a collective's output)
  bool gradient = false;        // returned by the backward as a parameter's gradient
  bool forward_output = false;  // returned by the forward to the caller (the loss)
  // The decoder layer it belongs to (0, 1, ...), kNoLayer (-2) outside layers, or
  // kLayerUnknown (-1): see plan/layers.h. Only layer replication reads it.
  int32_t layer = -1;

  bool operator==(const MemoryNode&) const = default;
};

struct MemoryGraph {
  std::vector<MemoryNode> nodes;
  bool operator==(const MemoryGraph&) const = default;
};

// Throws std::invalid_argument ("[memory] ...") unless every user and alias index points the
// right way (users later, aliases earlier) and lies inside the graph.
void validate_memory_graph(const MemoryGraph& graph);

// The input nodes of every node (the inverse of RematNode::users), in increasing order.
std::vector<std::vector<int32_t>> node_inputs(const MemoryGraph& graph);

// A compute node of the forward (what a step runs before the backward).
inline bool is_forward_op(const MemoryNode& node) {
  return node.role == MemoryRole::kCompute && node.facts.required_fw;
}

enum class RematStrategy : uint8_t { kNone, kDefault, kSequenceAware, kFullCheckpoint };

enum class DtypePolicy : uint8_t {
  kFp32,       // fp32 parameters and gradients; AdamW exp_avg + exp_avg_sq in fp32 (8 B/param)
  kBf16Mixed,  // bf16 parameters and gradients in the graph; fp32 master weights, fp32
               // gradient accumulator and AdamW state in the optimizer (16 B/param)
};

// The training step around the graph.
struct TrainingConfig {
  int64_t num_params = 0;  // parameters of the model (each rank holds them all)
  DtypePolicy dtype = DtypePolicy::kFp32;
  int64_t optimizer_shards = 1;  // ZeRO-1: optimizer state sharded over this many ranks
  // ZeRO-3 (autosp.fully_shard): parameters, gradients and optimizer state sharded over this
  // many ranks (then optimizer_shards is ignored). The graph's parameter placeholders stand
  // for the gathered copies: each is all-gathered at its first use in the forward and freed
  // after its last, gathered again in the backward likewise; the persistent shards are fp32
  // (the master weights under kBf16Mixed), gradients leave the graph in its dtype and are
  // kept as fp32 shards once the last gradient in their storage is produced; AdamW's moments
  // are sharded too (8 B/param/shards: the master weights and gradients are the shards).
  int64_t param_shards = 1;
  // torch.optim.AdamW(foreach=True) allocates one fp32 temporary per parameter of its shard
  // (exp_avg_sq.sqrt()) during step(); a fused kernel allocates none.
  bool optimizer_foreach = true;
  // ZeRO-Offload (autosp.OffloadOptimizer): the optimizer's state (the master weights, the
  // gradient accumulator and AdamW's moments) lives in host memory and step() runs on the
  // host. The device holds the parameters and their gradients in the graph's dtype, nothing
  // of the optimizer's and no step() temporaries; each step copies the gradients to the host
  // and the updated parameters back (host_optimizer_bytes is what the host holds).
  bool optimizer_offload = false;

  bool operator==(const TrainingConfig&) const = default;
};

struct MemoryOptions {
  RematStrategy strategy = RematStrategy::kSequenceAware;
  double recompute_flops_ratio = 0.1;  // RematOptions::recompute_flops_ratio
  int max_dist_from_bw = 1000;         // RematOptions::max_dist_from_bw
  // Activation offload (RematOptions::offload_layer_outputs; solver strategies only): the saved
  // values that layers hand to each other leave the device after their last forward use and
  // come back for the backward, each reloaded when the previous reload is first read (one
  // layer ahead).
  bool offload_layer_outputs = false;
  bool offload_layer_saved = false;  // RematOptions::offload_layer_saved
  // Chunks per tiled loss (SpConfig::loss_chunks) in place of those each node was traced with
  // (MemoryNode::chunks); 0 keeps them.
  int64_t loss_chunks = 0;
  TrainingConfig training;

  bool operator==(const MemoryOptions&) const = default;
};

// Bytes per rank, live at one moment, by category. `peak` is their sum.
struct MemoryBreakdown {
  int64_t seq_len = 0;
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;    // AdamW state (+ fp32 master weights), and step() temporaries
  int64_t saved_activations = 0;  // storages held for the backward (saved set), still live
  int64_t transient = 0;          // other activations and temporaries live at the peak
  int64_t communication = 0;      // collective outputs live at the peak (not saved, not grads)
  int64_t inputs = 0;             // token ids, labels
  int64_t peak = 0;
  std::string phase;      // "forward", "backward" or "optimizer"
  std::string peak_node;  // the op during which the peak is reached
  // The whole saved set (not only what is live at the peak): distinct storages the forward
  // keeps for the backward, parameters excluded.
  int64_t saved_bytes = 0;
  int32_t saved_count = 0;
  int32_t recomputed_count = 0;
  // FLOPs per rank of one step: the forward and backward ops once each (`step_flops`), and
  // what is computed again on top (`recompute_flops`: remat's recomputed nodes and the ops'
  // inner recomputation). Their ratio is the step-time cost of the strategy's recomputation
  // where compute bounds the step.
  double step_flops = 0;
  double recompute_flops = 0;
  // With offload: the saved bytes kept in host memory between forward and backward (each step
  // copies them to the host and back once).
  int64_t offloaded_bytes = 0;
  // Host memory the step holds per rank: offloaded_bytes and, with
  // TrainingConfig::optimizer_offload, the optimizer (host_optimizer_bytes).
  int64_t host_bytes = 0;

  bool operator==(const MemoryBreakdown&) const = default;
};

// Bytes of the optimizer's persistent state per rank (fp32 master weights, gradient
// accumulator and AdamW moments, sharded over `optimizer_shards`), and of its step()
// temporaries.
//   fp32, 1000 params, 1 shard:  state 8000, workspace 4000 (foreach)
//   bf16, 1000 params, 4 shards: state 4000, workspace 1000
//   bf16, 1000 params, 4 param_shards (ZeRO-3): state 2000, workspace 1000
// With optimizer_offload both are 0 (on the device); host_optimizer_bytes is what the host
// holds then, unsharded: fp32 master weights, their gradients and AdamW's moments (0 without).
//   bf16 or fp32, 1000 params, optimizer_offload: state 0, workspace 0, host 16000
int64_t optimizer_state_bytes(const TrainingConfig& cfg);
int64_t optimizer_workspace_bytes(const TrainingConfig& cfg);
int64_t host_optimizer_bytes(const TrainingConfig& cfg);

// Chunks of a tiled loss's rows (SpConfig::loss_chunks): `chunks` when positive, else
// ceil(classes / hidden), so that one chunk's [rows / chunks, classes] logits are the size of
// the [rows, hidden] hidden states they come from (32 chunks for Llama-3-8B's 128,256 x 4096
// lm_head, 63 for Llama-3.2-1B's x 2048). Each chunk holds ceil(rows / chunks) rows.
//   tiled_loss_chunks(128256, 4096, 0) == 32; tiled_loss_chunks(1000, 10, 4) == 4
int64_t tiled_loss_chunks(int64_t classes, int64_t hidden, int64_t chunks);

// What a tiled loss op (python/autosp/tiled_loss.py) allocates and frees while it runs, for
// its MemoryNode: `per_row` bytes per row of h in one chunk, and `constant` always. With
// `fixed_rows` > 0 (AUTOSP_LOSS_TILE_ROWS: that many rows per chunk) the scratch is
// min(per_row * rows, cap) + constant (`chunks` 0); otherwise the node's chunked_bytes are
// per_row * rows, split over `chunks` (tiled_loss_chunks), and the constant covers the
// rounding up of one chunk's rows. Per element of one chunk's [rows, classes] logits, measured
// on CPU for lm_head, .float() and the loss (tests/test_tiled_loss.py checks the prediction):
// the forward holds 8 bytes (the chunk's logits and their log-softmax), the backward 12
// (recomputed logits, log-softmax and their gradients) plus the weight's gradient twice (the
// fp32 accumulator and one chunk's, `weight_itemsize` bytes per element). The forward that
// also computes the gradients (kForwardWithGrads, the loss of a scalar reduction) holds the
// backward's 12 bytes and one chunk's weight gradient; its fp32 accumulator is one of the
// op's outputs (saved for the backward), so not scratch.
//   forward, classes 1000, hidden 10, chunks 0: {8000, 0, 8000, 100}
//   backward, classes 1000, hidden 10, itemsize 4, 16 rows: {12000, 192000, 80000, 0}
//   forward with grads, classes 1000, hidden 10, itemsize 2, chunks 4: {12000, 0, 32000, 4}
enum class TiledLossPass { kForward, kBackward, kForwardWithGrads };
struct TiledLossWorkspace {
  int64_t per_row = 0;
  int64_t cap = 0;
  int64_t constant = 0;
  int64_t chunks = 0;
  bool operator==(const TiledLossWorkspace&) const = default;
};
TiledLossWorkspace tiled_loss_workspace(TiledLossPass pass, int64_t classes, int64_t hidden,
                                        int64_t weight_itemsize, int64_t fixed_rows,
                                        int64_t chunks);

// The fewest chunks per tiled loss (MemoryOptions::loss_chunks, from 1 to `max_chunks`) whose
// predicted peak at `seq` fits `budget_bytes`: each chunk reads the whole [classes, hidden]
// weight, so fewer chunks are faster, and more hold less. 0 when even `max_chunks` does not
// fit, or the graph has no tiled loss. The peak does not grow with the chunk count (nothing
// else depends on it), so the search is a bisection.
int64_t fewest_loss_chunks(const MemoryGraph& graph, int64_t seq, const MemoryOptions& options,
                           int64_t budget_bytes, int64_t max_chunks);

// Rows per chunk of a tiled row-wise block (SpConfig::tile_mlp, python/autosp/tiled_rows.py)
// over `rows` rows, whose row operands hold `in_bytes` per row and whose intermediates
// `inner_bytes`: `fixed_rows` when positive; else chunks whose intermediates are as large as
// the operands (ceil(rows * in_bytes / inner_bytes) rows), but not under kMinTiledRows rows
// (below that a matmul no longer runs at full speed on a GPU), and not over `rows`.
//   rows 16384, in 8192, inner 114688 (Llama-3-8B's SwiGLU, bf16): 1171 rows (14 chunks)
//   rows 2048, same block: 1024 rows
inline constexpr int64_t kMinTiledRows = 1024;
int64_t tiled_rows_chunk(int64_t rows, int64_t in_bytes, int64_t inner_bytes, int64_t fixed_rows);

// What a tiled row-wise block's op allocates and frees while it runs, for its node's
// scratch_bytes: per_row * tokens + min(capped_per_row * tokens, cap) + constant, where tokens
// are the rows of its operands (batch x rows along the chunk dim; `batch` the dims before it).
// Per token of one chunk: the forward holds the chunk's intermediates (`inner_bytes`, the
// replay keeps them to the end of the chunk) and its result (`out_bytes`); the backward holds
// the recomputed intermediates and the gradients of part of them (3/2 x inner_bytes, fitted to
// CPU measurements), and the operands read
// whole (`whole_bytes`, `whole_elements`) get an fp32 accumulator and one chunk's gradient.
// With chunks of tiled_rows_chunk rows: the even split's bytes grow with the tokens
// (k * in_bytes each), kMinTiledRows rows' bytes bound the rest, and the rounding adds one
// row along the chunk dim.
struct TiledRowsWorkspace {
  int64_t per_row = 0;
  int64_t capped_per_row = 0;
  int64_t cap = 0;
  int64_t constant = 0;
  bool operator==(const TiledRowsWorkspace&) const = default;
};
TiledRowsWorkspace tiled_rows_workspace(bool backward, int64_t in_bytes, int64_t inner_bytes,
                                        int64_t out_bytes, int64_t whole_bytes,
                                        int64_t whole_elements, int64_t batch, int64_t fixed_rows);

// The saved set at `seq`: fate per node (RematFate), as the remat solver decides it for the
// strategy, or, for kFullCheckpoint, saving only values that cross a layer boundary (a layer
// is a RematNode::layer ending in a numbered component, "layers.3") or live outside layers.
std::vector<RematFate> decide_fates(const MemoryGraph& graph, int64_t seq,
                                    const MemoryOptions& options);

// decide_fates with, under MemoryOptions::offload_layer_outputs, the saved nodes the solver
// offloads (RematSolution::offloaded).
struct RematDecision {
  std::vector<RematFate> fate;
  std::vector<int32_t> offloaded;
};
RematDecision decide_remat(const MemoryGraph& graph, int64_t seq, const MemoryOptions& options);

// The peak memory of one training step per rank at sequence length `seq`, with what was live
// at the peak. Throws std::invalid_argument ("[memory] ...") for a malformed graph or a `seq`
// that is not positive or not a multiple of a shard factor.
MemoryBreakdown simulate_peak_memory(const MemoryGraph& graph, int64_t seq,
                                     const MemoryOptions& options);

struct TrainabilityQuery {
  int64_t budget_bytes = 0;   // per rank
  int64_t seq_multiple = 1;   // S is searched over multiples of this (a multiple of P)
  int64_t max_seq = 1 << 24;  // search no further than this
  // Host memory per rank (MemoryBreakdown::host_bytes) a step may take; 0: no limit.
  int64_t host_budget_bytes = 0;

  bool operator==(const TrainabilityQuery&) const = default;
};

struct Trainability {
  int64_t longest_seq = 0;     // 0: not even seq_multiple fits
  MemoryBreakdown at_longest;  // the prediction at longest_seq (seq_len 0 if none)
  MemoryBreakdown first_oom;   // at the next multiple (seq_len 0 if max_seq was reached)
  bool capped = false;         // longest_seq == the largest multiple <= max_seq
  int32_t evaluations = 0;

  bool operator==(const Trainability&) const = default;
};

// The longest multiple of `seq_multiple` whose predicted peak fits the budget, by doubling
// then bisection (the peak grows with S for a fixed strategy).
// Throws std::invalid_argument ("[memory] ...") when the budget is below the parameters' own
// bytes (nothing could train), or for seq_multiple / max_seq < 1.
Trainability longest_trainable_seq(const MemoryGraph& graph, const MemoryOptions& options,
                                   const TrainabilityQuery& query);

const char* to_string(RematStrategy strategy);
const char* to_string(DtypePolicy dtype);

}  // namespace autosp
