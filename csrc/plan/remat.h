// Rematerialisation (activation checkpointing) solver: given the joint forward+backward graph of
// one training step, decide which forward values the forward saves for the backward and which
// the backward recomputes.
//
// The formulation is PyTorch's min-cut partitioner's (torch/_functorch/partitioners.py,
// solve_min_cut), so results compare: every graph value v becomes two flow vertices v_in ->
// v_out whose edge capacity is the cost of saving v; data edges u_out -> v_in are infinite;
// values the backward needs are tied to the sink; values that must not be recomputed ("bans")
// are tied to the source. The saved set is the set of v_in -> v_out edges in a minimum cut.
//
// What differs is where the bans come from (RematPolicy):
//   kNone           every forward op is banned (views excepted): the forward saves exactly what
//                   the backward reads, and nothing is recomputed.
//   kDefault        PyTorch's own heuristics with its default config: only ops on its
//                   recomputable allowlist may be recomputed (so never a matmul), plus its
//                   materialised-in-backward, reduction, far-apart-use and long-fusible-chain
//                   bans and its distance-to-backward weighting. The baseline.
//   kSequenceAware  bans from a cost model evaluated at the actual sequence length. Attention,
//                   collectives, random ops and ops the caller marked must_save are never
//                   recomputed, nor is a value a numbered layer hands to another (the hidden
//                   state between decoder layers): each layer then recomputes from its own
//                   input, just before its backward, instead of every layer's recomputation
//                   running at the start of the backward and staying live until its layer's
//                   turn (measured: 4 layers, 17.7 MiB saved but a 65 MiB transient peak). Cheap
//                   ops (PyTorch's allowlist) are recomputable. Matmuls are recomputable while
//                   their summed forward FLOPs stay within recompute_flops_ratio x the step's
//                   attention FLOPs (forward + backward attention nodes of this graph); candidates
//                   are admitted in order of bytes saved per FLOP, most first. Capacities are bytes
//                   (plus a distance tie-break that prefers saving values close to the backward).
// With a MemoryBudget the solver instead finds the fewest matmul recomputations (same
// admission order, FLOP cap lifted) whose saved bytes fit the budget, or throws.
//
// Example (a 2-op chain x -> mm -> relu, backward reads relu):
//   nodes: x (kInput, primal), mm (kMatmul, 4 KiB, 1 MFLOP), relu (kCheap, 4 KiB) -> bwd
//   kDefault:        mm banned (not on the allowlist); saves relu or mm (both 4 KiB).
//   kSequenceAware with attention FLOPs 100 MFLOP and ratio 0.1: mm admitted; saves x.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace autosp {

enum class RematOpKind : uint8_t {
  kInput,       // a placeholder: primal, tangent, RNG seed/offset
  kView,        // aliasing view (view, expand, permute, slice, ...): free to recompute
  kCheap,       // on PyTorch's recomputable allowlist (pointwise, cheap reductions, ...)
  kMatmul,      // mm / bmm / addmm / convolution / ...: compute intensive
  kAttention,   // scaled-dot-product attention, forward or backward
  kCollective,  // _c10d_functional collectives and wait_tensor
  kRandom,      // ops that consume RNG state
  kOther,       // anything else: never recomputed
};

enum class RematSaveCost : uint8_t {
  kTensor,      // capacity from bytes
  kSymInt,      // a SymInt/SymBool scalar: capacity 1
  kSymFloat,    // a SymFloat scalar: capacity 4, and never banned (PyTorch's rule)
  kFree,        // opaque objects / backward state: capacity 0
  kUnsaveable,  // a non-tensor value that cannot be saved: infinite capacity
};

enum class RematPolicy : uint8_t { kNone, kDefault, kSequenceAware };

// One node of the joint FX graph, in graph (topological) order. Filled by the Python partition
// function from fake-tensor metadata evaluated at the real sizes.
struct RematNode {
  std::string name;    // the FX node name, unique
  std::string target;  // op name for reports, e.g. "aten.mm.default"
  std::string layer;   // module path for reports, e.g. "layers.3" ("" if unknown)
  RematOpKind kind = RematOpKind::kOther;
  RematSaveCost save_cost = RematSaveCost::kTensor;
  int64_t bytes = 0;              // size of the value(s) this node produces
  double flops = 0;               // FLOPs to compute this node once
  bool required_fw = false;       // computed by the forward (NodeInfo.required_fw_nodes)
  bool required_bw = false;       // computed by the backward (NodeInfo.required_bw_nodes)
  bool tangents_closure = false;  // depends on a tangent (NodeInfo.tangents_closure)
  bool primal_input = false;      // a primal or forward RNG seed placeholder: never recomputed
  bool static_lifetime = false;   // a parameter/buffer input: free to save
  // Handed on by the forward (one of the joint graph's forward outputs): its caller holds it
  // anyway, so sequence-aware prefers it among cuts of equal bytes (a region's output that
  // its backward reads, rather than a value computed from it).
  bool forward_output = false;
  bool must_save = false;       // tagged MUST_SAVE (collectives, effectful ops, ...)
  bool must_recompute = false;  // tagged MUST/PREFER_RECOMPUTE by the user
  // A collective over the group parameters are sharded on (autosp.fully_shard): its value is a
  // gathered parameter (see solve_remat).
  bool parameter_collective = false;
  bool fusible = false;  // on PyTorch's fusible list (allowlist + random ops)
  bool getitem = false;  // operator.getitem: never banned by op-type rules
  // A tensor known to be contiguous (PyTorch's activation-offloading pass copies only those;
  // false where unknown).
  bool contiguous = false;
  std::vector<int32_t> users;  // indices of user nodes (deduplicated)
  // fusible_user[i]: PyTorch's is_fusible(this, users[i]) (both fusible, or users[i] is cat).
  std::vector<uint8_t> fusible_user;
  std::vector<int32_t> args;  // indices of the top-level Node arguments (for the reduction ban)
  // The node whose storage this one's output shares (a view, a detach, a wait on a
  // collective: autosp.remat_facts.aliased_arg), or -1.
  int32_t aliases = -1;

  bool operator==(const RematNode&) const = default;
};

// Whether a RematNode::layer names a numbered layer, a decoder layer of the model ("layers.3",
// "model.h.0"; not "lm_head", "norm" or ""): the unit full checkpointing wraps, and whose
// outputs sequence-aware remat keeps.
inline bool is_numbered_layer(const std::string& layer) {
  return !layer.empty() && layer.back() >= '0' && layer.back() <= '9';
}

struct RematGraph {
  std::vector<RematNode> nodes;
  bool operator==(const RematGraph&) const = default;
};

struct RematOptions {
  RematPolicy policy = RematPolicy::kSequenceAware;
  // Sequence-aware: matmuls may be recomputed while their total forward FLOPs stay within this
  // fraction of the step's attention FLOPs. 0 disables matmul recomputation.
  double recompute_flops_ratio = 0.1;
  // At most one of these: a cap on saved-for-backward bytes (parameters excluded), absolute or
  // as a fraction of what kNone saves. Only with kSequenceAware.
  std::optional<int64_t> budget_bytes;
  std::optional<double> budget_fraction;
  // PyTorch's torch._functorch.config.max_dist_from_bw, used by kDefault.
  int max_dist_from_bw = 1000;
  // Activation offload: the saved values a numbered layer hands to the next (the hidden state
  // between decoder layers, from which each layer's backward recomputes) are kept in host
  // memory between the forward and the backward (RematSolution::offloaded).
  bool offload_layer_outputs = false;
  // Offload more: every saved tensor computed inside a numbered layer, not only what it hands to
  // the next (ALST offloads each layer's checkpoint likewise). Implies offload_layer_outputs.
  bool offload_layer_saved = false;
  // Sequence-aware without a budget: the matmuls admitted (node indices, each one of
  // matmul_candidates_in_graph_order), given instead of chosen within this graph's allowance.
  // Set where the choice was made over more than this graph: a region of layers that one
  // subgraph serves is decided over every call of it (python/autosp/remat_regions.py).
  std::optional<std::vector<int32_t>> admitted;

  bool operator==(const RematOptions&) const = default;
};

enum class RematFate : uint8_t {
  kBackwardOnly,  // not a forward node
  kSaved,         // saved by the forward for the backward
  kRecomputed,    // computed in the forward and again in the backward
  kForwardOnly,   // computed in the forward only (the backward neither reads nor recomputes it)
};

struct RematLayerSummary {
  std::string layer;
  int64_t saved_bytes = 0;
  int32_t saved_count = 0;
  int32_t recomputed_count = 0;
  int64_t recomputed_bytes = 0;
  double recompute_flops = 0;

  bool operator==(const RematLayerSummary&) const = default;
};

struct RematSolution {
  std::vector<int32_t> saved;           // node indices, ascending
  std::vector<int32_t> recomputed;      // forward node indices the backward recomputes, ascending
  std::vector<RematFate> fate;          // per node
  std::vector<std::string> ban_reason;  // per node, "" when not banned
  int64_t saved_bytes = 0;              // storages the saved set holds, each once; parameters free
  int64_t none_saved_bytes = 0;         // what kNone would save (the budget's reference)
  int64_t budget_bytes = -1;            // the resolved budget, -1 if none
  double recompute_flops = 0;           // sum of flops over recomputed
  double attention_flops = 0;           // the step's attention FLOPs (sequence-aware reference)
  double admitted_matmul_flops = 0;     // forward FLOPs of the matmuls allowed to recompute
  int32_t admitted_matmuls = 0;
  std::vector<int32_t> admitted;  // their node indices, ascending
  int64_t cut_value = 0;          // the min-cut value in capacity units
  int32_t flow_vertices = 0;
  int32_t flow_edges = 0;
  int32_t solves = 0;                     // max-flow solves (several when searching a budget)
  std::vector<RematLayerSummary> layers;  // in order of first appearance
  // With RematOptions::offload_layer_outputs: the saved tensors (node indices, ascending) a
  // numbered layer hands to another (with offload_layer_saved: every saved tensor computed in
  // a numbered layer), views excluded, which the forward copies to host memory and the
  // backward copies back; and their bytes.
  std::vector<int32_t> offloaded;
  int64_t offloaded_bytes = 0;

  bool operator==(const RematSolution&) const = default;
};

// Decides the saved set for `graph` under `options`.
//
// A gathered parameter (a parameter_collective node, and what is computed from gathered
// parameters alone: the wait, a dtype cast, a view) is always recomputed for the backward, never
// saved (ZeRO-3): saving it would keep every layer's full parameters alive until the backward.
//
// Throws std::invalid_argument ("[remat] ...") for a malformed graph (an index out of range, a
// user before its producer, fusible_user not matching users) or options (both budgets, a
// budget with a policy other than kSequenceAware, a negative ratio), and std::runtime_error
// ("[remat] ...") when no finite cut exists (a value the backward needs can be neither saved
// nor recomputed; the message names the nodes on the offending path) or when no set of
// recomputations meets the memory budget (the message gives the budget and the smallest
// achievable saved bytes).
RematSolution solve_remat(const RematGraph& graph, const RematOptions& options);

// The graph's attention FLOPs (forward and backward): sequence-aware's allowance is a ratio
// of them.
double attention_flops(const RematGraph& graph);

// The matmuls sequence-aware may admit for recomputation (forward, not must-save, with
// FLOPs, not a layer's output to the next, and whose recomputation can spare a saved value: the
// backward reads their output, or what cheap ops and views compute from it within the layer),
// in graph order. (solve_remat asks this of the graph after the ZeRO-3 rule above, which
// changes no matmul.)
std::vector<int32_t> matmul_candidates_in_graph_order(const RematGraph& graph);

// Sequence-aware's choice among matmuls with forward `flops`, output `bytes` and `layers`
// (RematNode::layer; empty: none known), in graph order. Matmuls alike across layers form one
// class: the same place among their layer's candidates, in layers whose paths differ only in
// their number ("layers.3", "layers.7"), with equal FLOPs and bytes. A matmul outside numbered
// layers is a class of its own. Classes are admitted whole, in order of bytes saved per FLOP,
// most first (ties: the class of most FLOPs first, then graph order of first members), each one
// whose FLOPs still fit within
// `allowance` with those admitted before it. So alike layers recompute alike (a subgraph
// compiled once serves them all, and no layer saves what its twin recomputes), and layers that
// differ are decided apart. solve_remat makes its choice with this; autosp's regions make it
// over every call of a region (remat_regions.py).
std::vector<bool> admit_matmuls(const std::vector<double>& flops, const std::vector<int64_t>& bytes,
                                double allowance, const std::vector<std::string>& layers = {});

// For each value, the value whose storage it lives in: `aliases[i]` (the value `i` is a view
// of, or -1: RematNode::aliases) followed to a value that aliases nothing (`i` itself when it
// aliases nothing; an index outside the list ends the chain). The one rule of storage
// ownership: the saved-bytes count (remat_detail::storage_base) and autosp's region outputs
// (remat_facts.region_call_aliases, over a region's own graph) both follow it.
int32_t storage_owner(const std::vector<int32_t>& aliases, int32_t i);
std::vector<int32_t> storage_owners(const std::vector<int32_t>& aliases);

const char* to_string(RematPolicy policy);
const char* to_string(RematOpKind kind);
const char* to_string(RematFate fate);

}  // namespace autosp
