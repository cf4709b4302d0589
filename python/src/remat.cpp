// Bindings for the remat solver (plan/remat.h) and the max-flow it uses (util/maxflow.h).
#include "plan/remat.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "util/maxflow.h"

namespace nb = nanobind;
using namespace nb::literals;

void init_remat(nb::module_& m) {
  using namespace autosp;

  m.attr("INFINITE_CAPACITY") = kInfiniteCapacity;

  nb::class_<MinCut>(m, "MinCut")
      .def_ro("value", &MinCut::value)
      .def_ro("source_side", &MinCut::source_side)
      .def_ro("cut_edges", &MinCut::cut_edges)
      .def_ro("flow", &MinCut::flow);

  m.def(
      "solve_min_cut",
      [](int num_vertices, const std::vector<std::tuple<int, int, int64_t>>& edges, int source,
         int sink) {
        FlowNetwork net(num_vertices);
        for (const auto& [from, to, capacity] : edges) net.add_edge(from, to, capacity);
        nb::gil_scoped_release release;
        return solve_min_cut(net, source, sink);
      },
      "num_vertices"_a, "edges"_a, "source"_a, "sink"_a,
      "Max-flow/min-cut (Dinic) on a network given as (from, to, capacity) edges; capacity "
      "INFINITE_CAPACITY marks an uncuttable edge. Returns a MinCut whose cut_edges index into "
      "`edges`.");

  nb::enum_<RematOpKind>(m, "RematOpKind")
      .value("INPUT", RematOpKind::kInput)
      .value("VIEW", RematOpKind::kView)
      .value("CHEAP", RematOpKind::kCheap)
      .value("MATMUL", RematOpKind::kMatmul)
      .value("ATTENTION", RematOpKind::kAttention)
      .value("COLLECTIVE", RematOpKind::kCollective)
      .value("RANDOM", RematOpKind::kRandom)
      .value("OTHER", RematOpKind::kOther);

  nb::enum_<RematSaveCost>(m, "RematSaveCost")
      .value("TENSOR", RematSaveCost::kTensor)
      .value("SYM_INT", RematSaveCost::kSymInt)
      .value("SYM_FLOAT", RematSaveCost::kSymFloat)
      .value("FREE", RematSaveCost::kFree)
      .value("UNSAVEABLE", RematSaveCost::kUnsaveable);

  nb::enum_<RematPolicy>(m, "RematPolicy")
      .value("NONE", RematPolicy::kNone)
      .value("DEFAULT", RematPolicy::kDefault)
      .value("SEQUENCE_AWARE", RematPolicy::kSequenceAware);

  nb::enum_<RematFate>(m, "RematFate")
      .value("BACKWARD_ONLY", RematFate::kBackwardOnly)
      .value("SAVED", RematFate::kSaved)
      .value("RECOMPUTED", RematFate::kRecomputed)
      .value("FORWARD_ONLY", RematFate::kForwardOnly);

  nb::class_<RematNode>(m, "RematNode")
      .def(nb::init<>())
      .def_rw("name", &RematNode::name)
      .def_rw("target", &RematNode::target)
      .def_rw("layer", &RematNode::layer)
      .def_rw("kind", &RematNode::kind)
      .def_rw("save_cost", &RematNode::save_cost)
      .def_rw("bytes", &RematNode::bytes)
      .def_rw("flops", &RematNode::flops)
      .def_rw("required_fw", &RematNode::required_fw)
      .def_rw("required_bw", &RematNode::required_bw)
      .def_rw("tangents_closure", &RematNode::tangents_closure)
      .def_rw("primal_input", &RematNode::primal_input)
      .def_rw("static_lifetime", &RematNode::static_lifetime)
      .def_rw("forward_output", &RematNode::forward_output)
      .def_rw("must_save", &RematNode::must_save)
      .def_rw("must_recompute", &RematNode::must_recompute)
      .def_rw("parameter_collective", &RematNode::parameter_collective)
      .def_rw("fusible", &RematNode::fusible)
      .def_rw("getitem", &RematNode::getitem)
      .def_rw("contiguous", &RematNode::contiguous)
      .def_rw("users", &RematNode::users)
      .def_rw("fusible_user", &RematNode::fusible_user)
      .def_rw("args", &RematNode::args)
      .def_rw("aliases", &RematNode::aliases);

  nb::class_<RematOptions>(m, "RematOptions")
      .def(nb::init<>())
      .def_rw("policy", &RematOptions::policy)
      .def_rw("recompute_flops_ratio", &RematOptions::recompute_flops_ratio)
      .def_rw("budget_bytes", &RematOptions::budget_bytes)
      .def_rw("budget_fraction", &RematOptions::budget_fraction)
      .def_rw("max_dist_from_bw", &RematOptions::max_dist_from_bw)
      .def_rw("offload_layer_outputs", &RematOptions::offload_layer_outputs)
      .def_rw("offload_layer_saved", &RematOptions::offload_layer_saved)
      .def_rw("admitted", &RematOptions::admitted);

  nb::class_<RematLayerSummary>(m, "RematLayerSummary")
      .def_ro("layer", &RematLayerSummary::layer)
      .def_ro("saved_bytes", &RematLayerSummary::saved_bytes)
      .def_ro("saved_count", &RematLayerSummary::saved_count)
      .def_ro("recomputed_count", &RematLayerSummary::recomputed_count)
      .def_ro("recomputed_bytes", &RematLayerSummary::recomputed_bytes)
      .def_ro("recompute_flops", &RematLayerSummary::recompute_flops);

  nb::class_<RematSolution>(m, "RematSolution")
      .def_ro("saved", &RematSolution::saved)
      .def_ro("recomputed", &RematSolution::recomputed)
      .def_ro("fate", &RematSolution::fate)
      .def_ro("ban_reason", &RematSolution::ban_reason)
      .def_ro("saved_bytes", &RematSolution::saved_bytes)
      .def_ro("offloaded", &RematSolution::offloaded)
      .def_ro("offloaded_bytes", &RematSolution::offloaded_bytes)
      .def_ro("none_saved_bytes", &RematSolution::none_saved_bytes)
      .def_ro("budget_bytes", &RematSolution::budget_bytes)
      .def_ro("recompute_flops", &RematSolution::recompute_flops)
      .def_ro("attention_flops", &RematSolution::attention_flops)
      .def_ro("admitted_matmul_flops", &RematSolution::admitted_matmul_flops)
      .def_ro("admitted_matmuls", &RematSolution::admitted_matmuls)
      .def_ro("admitted", &RematSolution::admitted)
      .def_ro("cut_value", &RematSolution::cut_value)
      .def_ro("flow_vertices", &RematSolution::flow_vertices)
      .def_ro("flow_edges", &RematSolution::flow_edges)
      .def_ro("solves", &RematSolution::solves)
      .def_ro("layers", &RematSolution::layers);

  m.def(
      "solve_remat",
      [](const std::vector<RematNode>& nodes, const RematOptions& options) {
        RematGraph graph{nodes};
        nb::gil_scoped_release release;
        return solve_remat(graph, options);
      },
      "nodes"_a, "options"_a,
      "Decide which forward values to save for the backward (see csrc/plan/remat.h).");

  m.def(
      "attention_flops",
      [](const std::vector<RematNode>& nodes) { return attention_flops(RematGraph{nodes}); },
      "nodes"_a, "The graph's attention FLOPs (see csrc/plan/remat.h).");
  m.def(
      "matmul_candidates",
      [](const std::vector<RematNode>& nodes) {
        return matmul_candidates_in_graph_order(RematGraph{nodes});
      },
      "nodes"_a, "The matmuls sequence-aware may admit, in graph order (csrc/plan/remat.h).");
  m.def("storage_owners", &storage_owners, "aliases"_a,
        "For each value, the value whose storage it lives in: aliases[i] (the value i is a "
        "view of, or -1) followed to one that aliases nothing (csrc/plan/remat.h).");
  m.def("admit_matmuls", &admit_matmuls, "flops"_a, "bytes"_a, "allowance"_a,
        "layers"_a = std::vector<std::string>{},
        "Sequence-aware's choice among matmuls given in graph order, alike layers alike "
        "(csrc/plan/remat.h).");
}
