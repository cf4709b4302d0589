// print_placements (see ulysses.h): the input graph with the placement each value took in the
// plan, for golden tests of placement propagation and for reading a plan.
#include <map>
#include <sstream>
#include <string>

#include "plan/ulysses.h"

namespace autosp {

namespace {

// "%7:S(1)", with "[sp.slice]" when an inserted SP op produced the plan value.
std::string operand(const SpPlan& plan, int input_id, int plan_id) {
  std::string s = "%" + std::to_string(input_id) + ":";
  if (plan_id < 0) return s + "-";
  s += plan.placements.at(static_cast<size_t>(plan_id)).str();
  const int p = plan.graph.producer(plan_id);
  if (p >= 0) {
    const Node& n = plan.graph.nodes[static_cast<size_t>(p)];
    if (n.origin < 0 && n.op.rfind("sp.", 0) == 0) s += "[" + n.op + "]";
  }
  return s;
}

}  // namespace

std::string print_placements(const Graph& in, const SpPlan& plan) {
  std::map<int, const Node*> copy_of;  // input node id -> the plan node that runs it
  for (const Node& n : plan.graph.nodes)
    if (n.origin >= 0) copy_of.try_emplace(n.origin, &n);
  auto bound = [&](int v) {
    return v < 0 || static_cast<size_t>(v) >= plan.value_of_input.size()
               ? -1
               : plan.value_of_input[static_cast<size_t>(v)];
  };
  std::ostringstream os;
  for (const Node& n : in.nodes) {
    if (n.op == "nontensor" || n.op == "sym_size" || n.op == "sym_arith") continue;
    os << (n.op == "output"
               ? "output"
               : "%" + std::to_string(n.outputs.empty() ? -1 : n.outputs[0]) + " = " + n.op)
       << '(';
    auto it = copy_of.find(n.id);
    const Node* c = it == copy_of.end() ? nullptr : it->second;
    for (size_t i = 0, shown = 0; i < n.inputs.size(); ++i) {
      if (n.inputs[i] < 0 || !in.value(n.inputs[i]).is_tensor()) continue;
      const int used = c && i < c->inputs.size() ? c->inputs[i] : bound(n.inputs[i]);
      os << (shown++ ? ", " : "") << operand(plan, n.inputs[i], used);
    }
    os << ')';
    if (!c && n.op != "input" && n.op != "output") {
      os << " dropped";
    } else if (!n.outputs.empty()) {
      // A replicated chain hoisted onto the local chunk (PlanBuilder::hoist_slice) runs as a
      // clone on sliced operands: its results are the clone's.
      const bool hoisted =
          c && c->bool_attr("clone", false) && c->outputs.size() == n.outputs.size();
      os << " ->";
      for (size_t i = 0; i < n.outputs.size(); ++i)
        os << (i ? ", " : " ")
           << operand(plan, n.outputs[i], hoisted ? c->outputs[i] : bound(n.outputs[i]));
      if (hoisted) os << " {hoisted}";
    }
    if (!n.loc.empty()) os << "  # " << n.loc.file << ':' << n.loc.line;
    os << '\n';
  }
  return os.str();
}

}  // namespace autosp
