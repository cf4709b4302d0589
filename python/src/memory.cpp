// Bindings for the memory model (plan/memory.h): sizes as functions of S, the per-rank
// simulator and the trainability search.
#include "plan/memory.h"

#include <nanobind/nanobind.h>
#include <nanobind/operators.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "plan/choose.h"
#include "plan/layers.h"

namespace nb = nanobind;
using namespace nb::literals;

void init_memory(nb::module_& m) {
  using namespace autosp;

  nb::class_<SeqTerm>(m, "SeqTerm")
      .def(nb::init<>())
      .def(
          "__init__",
          [](SeqTerm* t, int64_t coef, int power, int64_t shard, int64_t cap) {
            new (t) SeqTerm{coef, power, shard, cap};
          },
          "coef"_a, "power"_a = 0, "shard"_a = 1, "cap"_a = 0)
      .def_rw("coef", &SeqTerm::coef)
      .def_rw("power", &SeqTerm::power)
      .def_rw("shard", &SeqTerm::shard)
      .def_rw("cap", &SeqTerm::cap)
      .def(nb::self == nb::self);

  nb::class_<SeqBytes>(m, "SeqBytes")
      .def(nb::init<>())
      .def(
          "__init__",
          [](SeqBytes* b, const std::vector<SeqTerm>& terms) { new (b) SeqBytes{terms}; },
          "terms"_a)
      .def_rw("terms", &SeqBytes::terms)
      .def("at", &SeqBytes::at, "seq"_a, "Bytes at sequence length `seq`.")
      .def("__str__", &SeqBytes::str)
      .def("__repr__", [](const SeqBytes& b) { return "SeqBytes(" + b.str() + ")"; })
      .def(nb::self == nb::self);

  nb::class_<SeqFlops>(m, "SeqFlops")
      .def(nb::init<>())
      .def(
          "__init__",
          [](SeqFlops* f, double coef, int power) {
            new (f) SeqFlops{coef, power};
          },
          "coef"_a, "power"_a)
      .def_rw("coef", &SeqFlops::coef)
      .def_rw("power", &SeqFlops::power)
      .def("at", &SeqFlops::at, "seq"_a);

  nb::enum_<MemoryRole>(m, "MemoryRole")
      .value("PARAMETER", MemoryRole::kParameter)
      .value("INPUT", MemoryRole::kInput)
      .value("TANGENT", MemoryRole::kTangent)
      .value("COMPUTE", MemoryRole::kCompute);

  nb::class_<MemoryNode>(m, "MemoryNode")
      .def(nb::init<>())
      .def_rw("facts", &MemoryNode::facts)
      .def_rw("role", &MemoryNode::role)
      .def_rw("save_bytes", &MemoryNode::save_bytes)
      .def_rw("flops", &MemoryNode::flops)
      .def_rw("inner_recompute_flops", &MemoryNode::inner_recompute_flops)
      .def_rw("alloc_bytes", &MemoryNode::alloc_bytes)
      .def_rw("scratch_bytes", &MemoryNode::scratch_bytes)
      .def_rw("chunked_bytes", &MemoryNode::chunked_bytes)
      .def_rw("chunks", &MemoryNode::chunks)
      .def_rw("alias_of", &MemoryNode::alias_of)
      .def_rw("collective", &MemoryNode::collective)
      .def_rw("gradient", &MemoryNode::gradient)
      .def_rw("forward_output", &MemoryNode::forward_output)
      .def_rw("layer", &MemoryNode::layer);

  nb::class_<MemoryGraph>(m, "MemoryGraph")
      .def(nb::init<>())
      .def(
          "__init__",
          [](MemoryGraph* g, const std::vector<MemoryNode>& nodes) { new (g) MemoryGraph{nodes}; },
          "nodes"_a)
      .def_rw("nodes", &MemoryGraph::nodes)
      .def("__len__", [](const MemoryGraph& g) { return g.nodes.size(); });

  nb::enum_<RematStrategy>(m, "RematStrategy")
      .value("NONE", RematStrategy::kNone)
      .value("DEFAULT", RematStrategy::kDefault)
      .value("SEQUENCE_AWARE", RematStrategy::kSequenceAware)
      .value("FULL_CHECKPOINT", RematStrategy::kFullCheckpoint);

  nb::enum_<DtypePolicy>(m, "DtypePolicy")
      .value("FP32", DtypePolicy::kFp32)
      .value("BF16_MIXED", DtypePolicy::kBf16Mixed);

  nb::class_<TrainingConfig>(m, "TrainingConfig")
      .def(nb::init<>())
      .def_rw("num_params", &TrainingConfig::num_params)
      .def_rw("dtype", &TrainingConfig::dtype)
      .def_rw("optimizer_shards", &TrainingConfig::optimizer_shards)
      .def_rw("param_shards", &TrainingConfig::param_shards)
      .def_rw("optimizer_foreach", &TrainingConfig::optimizer_foreach)
      .def_rw("optimizer_offload", &TrainingConfig::optimizer_offload);

  nb::class_<MemoryOptions>(m, "MemoryOptions")
      .def(nb::init<>())
      .def_rw("strategy", &MemoryOptions::strategy)
      .def_rw("recompute_flops_ratio", &MemoryOptions::recompute_flops_ratio)
      .def_rw("max_dist_from_bw", &MemoryOptions::max_dist_from_bw)
      .def_rw("offload_layer_outputs", &MemoryOptions::offload_layer_outputs)
      .def_rw("offload_layer_saved", &MemoryOptions::offload_layer_saved)
      .def_rw("loss_chunks", &MemoryOptions::loss_chunks)
      .def_rw("training", &MemoryOptions::training);

  nb::class_<MemoryBreakdown>(m, "MemoryBreakdown")
      .def(nb::init<>())
      .def_rw("seq_len", &MemoryBreakdown::seq_len)
      .def_rw("parameters", &MemoryBreakdown::parameters)
      .def_rw("gradients", &MemoryBreakdown::gradients)
      .def_rw("optimizer_state", &MemoryBreakdown::optimizer_state)
      .def_rw("saved_activations", &MemoryBreakdown::saved_activations)
      .def_rw("transient", &MemoryBreakdown::transient)
      .def_rw("communication", &MemoryBreakdown::communication)
      .def_rw("inputs", &MemoryBreakdown::inputs)
      .def_rw("peak", &MemoryBreakdown::peak)
      .def_rw("phase", &MemoryBreakdown::phase)
      .def_rw("peak_node", &MemoryBreakdown::peak_node)
      .def_rw("saved_bytes", &MemoryBreakdown::saved_bytes)
      .def_rw("saved_count", &MemoryBreakdown::saved_count)
      .def_rw("recomputed_count", &MemoryBreakdown::recomputed_count)
      .def_rw("step_flops", &MemoryBreakdown::step_flops)
      .def_rw("recompute_flops", &MemoryBreakdown::recompute_flops)
      .def_rw("offloaded_bytes", &MemoryBreakdown::offloaded_bytes)
      .def_rw("host_bytes", &MemoryBreakdown::host_bytes);

  nb::class_<TrainabilityQuery>(m, "TrainabilityQuery")
      .def(nb::init<>())
      .def_rw("budget_bytes", &TrainabilityQuery::budget_bytes)
      .def_rw("seq_multiple", &TrainabilityQuery::seq_multiple)
      .def_rw("max_seq", &TrainabilityQuery::max_seq)
      .def_rw("host_budget_bytes", &TrainabilityQuery::host_budget_bytes);

  nb::class_<Trainability>(m, "Trainability")
      .def_ro("longest_seq", &Trainability::longest_seq)
      .def_ro("at_longest", &Trainability::at_longest)
      .def_ro("first_oom", &Trainability::first_oom)
      .def_ro("capped", &Trainability::capped)
      .def_ro("evaluations", &Trainability::evaluations);

  m.attr("LAYER_UNKNOWN") = kLayerUnknown;
  m.attr("NO_LAYER") = kNoLayer;
  m.def("label_layers", &label_layers, "graph"_a,
        "The decoder layer of every node (NO_LAYER outside layers): the seeds in "
        "MemoryNode.layer, completed from inputs and users (see csrc/plan/layers.h).");
  m.def(
      "replicate_layers",
      [](const MemoryGraph& g, int32_t num_layers) {
        nb::gil_scoped_release release;
        return replicate_layers(g, num_layers);
      },
      "graph"_a, "num_layers"_a,
      "The memory graph of `num_layers` decoder layers from the trace of 3 or more (copies of "
      "layer 1 inserted after it). Raises ValueError when the trace does not have that "
      "structure.");
  nb::class_<CostModel>(m, "CostModel")
      .def(nb::init<>())
      .def_rw("host_bandwidth", &CostModel::host_bandwidth)
      .def_rw("device_flops", &CostModel::device_flops);
  m.def("offload_seconds", &offload_seconds, "breakdown"_a, "cost"_a = CostModel{},
        "Seconds per step the offloaded bytes spend on the host link, there and back.");
  m.def("step_overhead", &step_overhead, "breakdown"_a, "cost"_a = CostModel{},
        "Predicted step-time overhead: recomputed FLOPs over the step's, plus the offload's "
        "link seconds over the step's compute seconds.");
  m.def("cheapest_fit", &cheapest_fit, "candidates"_a, "budget_bytes"_a, "host_budget_bytes"_a,
        "cost"_a = CostModel{},
        "The index of the candidate with the least step_overhead (then the lowest peak) whose "
        "peak fits budget_bytes and host_bytes fits host_budget_bytes (0: any); -1 if none.");
  m.attr("LOSS_CHUNKS_HEADROOM") = kLossChunksHeadroom;
  m.def("optimizer_state_bytes", &optimizer_state_bytes, "config"_a);
  m.def("host_optimizer_bytes", &host_optimizer_bytes, "config"_a);
  m.def("optimizer_workspace_bytes", &optimizer_workspace_bytes, "config"_a);
  nb::class_<TiledLossWorkspace>(m, "TiledLossWorkspace")
      .def_ro("per_row", &TiledLossWorkspace::per_row)
      .def_ro("cap", &TiledLossWorkspace::cap)
      .def_ro("constant", &TiledLossWorkspace::constant)
      .def_ro("chunks", &TiledLossWorkspace::chunks);
  nb::enum_<TiledLossPass>(m, "TiledLossPass")
      .value("FORWARD", TiledLossPass::kForward)
      .value("BACKWARD", TiledLossPass::kBackward)
      .value("FORWARD_WITH_GRADS", TiledLossPass::kForwardWithGrads);
  m.def("tiled_loss_workspace", &tiled_loss_workspace, "pass_"_a, "classes"_a, "hidden"_a,
        "weight_itemsize"_a, "fixed_rows"_a, "chunks"_a,
        "Scratch bytes of a tiled loss op: per_row bytes per row of one chunk, capped or split "
        "over chunks, + constant (see csrc/plan/memory.h).");
  m.def("tiled_loss_chunks", &tiled_loss_chunks, "classes"_a, "hidden"_a, "chunks"_a,
        "Chunks of a tiled loss's rows: `chunks` when positive, else ceil(classes / hidden).");
  m.def(
      "fewest_loss_chunks",
      [](const MemoryGraph& g, int64_t seq, const MemoryOptions& o, int64_t budget,
         int64_t max_chunks) {
        nb::gil_scoped_release release;
        return fewest_loss_chunks(g, seq, o, budget, max_chunks);
      },
      "graph"_a, "seq"_a, "options"_a, "budget_bytes"_a, "max_chunks"_a,
      "The fewest chunks per tiled loss, up to max_chunks, whose predicted peak at seq fits "
      "budget_bytes; 0 when none does or the graph has no tiled loss.");
  nb::class_<TiledRowsWorkspace>(m, "TiledRowsWorkspace")
      .def_ro("per_row", &TiledRowsWorkspace::per_row)
      .def_ro("capped_per_row", &TiledRowsWorkspace::capped_per_row)
      .def_ro("cap", &TiledRowsWorkspace::cap)
      .def_ro("constant", &TiledRowsWorkspace::constant);
  m.def("tiled_rows_workspace", &tiled_rows_workspace, "backward"_a, "in_bytes"_a, "inner_bytes"_a,
        "out_bytes"_a, "whole_bytes"_a, "whole_elements"_a, "batch"_a, "fixed_rows"_a,
        "Scratch bytes of a tiled row-wise block's op: per_row * tokens + min(capped_per_row * "
        "tokens, cap) + constant (see csrc/plan/memory.h).");
  m.def("tiled_rows_chunk", &tiled_rows_chunk, "rows"_a, "in_bytes"_a, "inner_bytes"_a,
        "fixed_rows"_a, "Rows per chunk of a tiled row-wise block (see csrc/plan/memory.h).");
  m.def(
      "decide_fates",
      [](const MemoryGraph& g, int64_t seq, const MemoryOptions& o) {
        nb::gil_scoped_release release;
        return decide_fates(g, seq, o);
      },
      "graph"_a, "seq"_a, "options"_a,
      "Fate of every node (RematFate) at sequence length `seq` under the options' strategy.");
  m.def(
      "simulate_peak_memory",
      [](const MemoryGraph& g, int64_t seq, const MemoryOptions& o) {
        nb::gil_scoped_release release;
        return simulate_peak_memory(g, seq, o);
      },
      "graph"_a, "seq"_a, "options"_a,
      "Predicted peak memory per rank of one training step at sequence length `seq` (see "
      "csrc/plan/memory.h).");
  m.def(
      "longest_trainable_seq",
      [](const MemoryGraph& g, const MemoryOptions& o, const TrainabilityQuery& q) {
        nb::gil_scoped_release release;
        return longest_trainable_seq(g, o, q);
      },
      "graph"_a, "options"_a, "query"_a,
      "The longest multiple of query.seq_multiple whose predicted peak fits query.budget_bytes.");
}
