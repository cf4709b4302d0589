// Bindings for the graph IR (csrc/ir): the bridge builds a Graph value by value.
#include <nanobind/nanobind.h>
#include <nanobind/operators.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "ir/graph.h"

namespace nb = nanobind;
using namespace autosp;

void init_ir(nb::module_& m) {
  nb::class_<Dim>(m, "Dim")
      .def_static("constant", &Dim::constant, nb::arg("n"))
      .def_static("seq", &Dim::seq, nb::arg("coef") = 1, nb::arg("power") = 1,
                  nb::arg("offset") = 0)
      .def_static("expr", &Dim::expr, nb::arg("text"))
      .def_rw("coef", &Dim::coef)
      .def_rw("power", &Dim::power)
      .def_rw("opaque", &Dim::opaque)
      .def_rw("offset", &Dim::offset)
      .def("__str__", &Dim::str)
      .def("__repr__", [](const Dim& d) { return "Dim(" + d.str() + ")"; })
      .def(nb::self == nb::self);

  nb::enum_<ValueKind>(m, "ValueKind")
      .value("Tensor", ValueKind::Tensor)
      .value("Symbol", ValueKind::Symbol)
      .value("Other", ValueKind::Other);

  nb::class_<Value>(m, "Value")
      .def(nb::init<>())
      .def_rw("id", &Value::id)
      .def_rw("kind", &Value::kind)
      .def_rw("shape", &Value::shape)
      .def_rw("dtype", &Value::dtype)
      .def_rw("requires_grad", &Value::requires_grad);

  nb::class_<SourceLoc>(m, "SourceLoc")
      .def(nb::init<>())
      .def_rw("file", &SourceLoc::file)
      .def_rw("line", &SourceLoc::line)
      .def_rw("code", &SourceLoc::code)
      .def("__str__", &SourceLoc::str);

  nb::class_<Node>(m, "Node")
      .def(nb::init<>())
      .def_rw("id", &Node::id)
      .def_rw("op", &Node::op)
      .def_rw("target", &Node::target)
      .def_rw("inputs", &Node::inputs)
      .def_rw("outputs", &Node::outputs)
      .def_rw("attrs", &Node::attrs)
      .def_rw("loc", &Node::loc)
      .def_rw("origin", &Node::origin);

  nb::class_<Graph>(m, "Graph")
      .def(nb::init<>())
      .def("add_value", &Graph::add_value, nb::arg("value"))
      .def("add_node", &Graph::add_node, nb::arg("node"))
      .def("value", &Graph::value, nb::arg("id"), nb::rv_policy::copy)
      .def_ro("values", &Graph::values)
      .def_ro("nodes", &Graph::nodes)
      .def("__str__", [](const Graph& g) { return print_graph(g); });
}
