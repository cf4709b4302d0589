// Bindings for placement analysis and the Ulysses plan (csrc/analysis, csrc/plan/ulysses).
#include <nanobind/nanobind.h>
#include <nanobind/operators.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "analysis/rules.h"
#include "plan/ulysses.h"

namespace nb = nanobind;
using namespace autosp;

void init_sp(nb::module_& m) {
  nb::exception<PlanError>(m, "PlanError", PyExc_ValueError);

  nb::enum_<PlacementKind>(m, "PlacementKind")
      .value("Replicate", PlacementKind::Replicate)
      .value("Shard", PlacementKind::Shard)
      .value("Partial", PlacementKind::Partial)
      .value("Local", PlacementKind::Local);

  nb::class_<Placement>(m, "Placement")
      .def_ro("kind", &Placement::kind)
      .def_ro("dim", &Placement::dim)
      .def_ro("inner", &Placement::inner)
      .def_ro("positions", &Placement::positions)
      .def_ro("coef", &Placement::coef)
      .def_static("replicate", &Placement::replicate)
      .def_static("shard", &Placement::shard, nb::arg("dim"), nb::arg("inner") = 1)
      .def_static("partial", &Placement::partial)
      .def_static("local", &Placement::local, nb::arg("bag"))
      .def_static("local_positions", &Placement::local_positions, nb::arg("bag"), nb::arg("inner"),
                  nb::arg("coef"))
      .def("is_shard", &Placement::is_shard)
      .def("is_partial", &Placement::is_partial)
      .def("is_replicate", &Placement::is_replicate)
      .def("is_local", &Placement::is_local)
      .def("__str__", &Placement::str)
      .def("__repr__", &Placement::str)
      .def(nb::self == nb::self);

  nb::class_<SpConfig>(m, "SpConfig")
      .def(nb::init<>())
      .def_rw("sp_size", &SpConfig::sp_size)
      .def_rw("fuse_qkv", &SpConfig::fuse_qkv)
      .def_rw("bucket_grad_sync", &SpConfig::bucket_grad_sync)
      .def_rw("gather_outputs", &SpConfig::gather_outputs)
      .def_rw("gather_unsupported", &SpConfig::gather_unsupported)
      .def_rw("tile_loss", &SpConfig::tile_loss)
      .def_rw("loss_chunks", &SpConfig::loss_chunks)
      .def_rw("tile_mlp", &SpConfig::tile_mlp);

  nb::class_<SpPlan>(m, "SpPlan")
      .def_ro("graph", &SpPlan::graph)
      .def_ro("placements", &SpPlan::placements)
      .def_ro("gathered", &SpPlan::gathered)
      .def_ro("loss_tiling", &SpPlan::loss_tiling)
      .def_ro("mlp_tiling", &SpPlan::mlp_tiling)
      .def("collective_counts", &SpPlan::collective_counts)
      .def("__str__", &SpPlan::str);

  m.def(
      "plan_ulysses",
      [](const Graph& g, const SpConfig& cfg) {
        nb::gil_scoped_release release;
        return plan_ulysses(g, cfg);
      },
      nb::arg("graph"), nb::arg("config"),
      "Plan Ulysses sequence parallelism for one rank; raises PlanError for models it cannot make "
      "exact.");
  m.def(
      "print_placements",
      [](const Graph& g, const SpPlan& plan) { return print_placements(g, plan); },
      nb::arg("graph"), nb::arg("plan"),
      "The placements the plan's propagation stage decided for the input graph, one line per "
      "node: the operands it reads (with the SP steps that make each so) and its results.");
  m.def("registered_ops", &registered_ops,
        "Canonical ops with a placement rule or their own emitter (the op table's rows).");
}
