// Shared by the rule tests (test_rules*.cpp): a RuleResult as a comparable value, and
// running one node's rule (or the token-local rule) with given operand placements.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "analysis/placement.h"
#include "analysis/rules.h"
#include "graph_builder.h"
#include "plan_error.h"

namespace autosp::rule_test {

using testutil::C;
using testutil::contains;
using testutil::GraphBuilder;
using testutil::S;

inline const Placement R = Placement::replicate();
inline const Placement P = Placement::partial();
inline Placement Sh(int dim, int64_t inner = 1) { return Placement::shard(dim, inner); }
inline const OperandChange Keep = OperandChange::keep();
inline OperandChange Slice(int dim, int64_t inner = 1) { return OperandChange::slice(dim, inner); }
inline OperandChange Exchange(int dim, int seq_dim) {
  return OperandChange::exchange(dim, seq_dim);
}

// A RuleResult as a comparable value.
struct Outcome {
  std::vector<Placement> out;
  std::vector<OperandChange> operands;
  Attrs attr_updates = {};
  std::string expansion = {};
  bool operator==(const Outcome&) const = default;
};

inline void PrintTo(const Outcome& o, std::ostream* os) {
  *os << "{out=[";
  for (size_t i = 0; i < o.out.size(); ++i) *os << (i ? ", " : "") << o.out[i].str();
  *os << "], operands=[";
  for (size_t i = 0; i < o.operands.size(); ++i) {
    const OperandChange& c = o.operands[i];
    *os << (i ? ", " : "");
    switch (c.kind) {
      case OperandChange::Kind::Keep:
        *os << "Keep";
        break;
      case OperandChange::Kind::Slice:
        *os << "Slice(" << c.dim << ", inner=" << c.inner << ")";
        break;
      case OperandChange::Kind::ReducePartial:
        *os << "ReducePartial";
        break;
      case OperandChange::Kind::Exchange:
        *os << "Exchange(" << c.dim << ", seq " << c.gather_dim << ")";
        break;
    }
  }
  *os << "], attr_updates={";
  for (const auto& [k, a] : o.attr_updates) *os << k << "=" << attr_str(a) << " ";
  *os << "}, expansion=\"" << o.expansion << "\"}";
}

// Runs the rule of the node producing `out` (rule_for), with the given operand placements.
inline Outcome run_rule(const GraphBuilder& b, int out, std::vector<Placement> in, int64_t sp = 2) {
  const Node& n = b.graph.nodes.at(static_cast<size_t>(b.graph.producer(out)));
  const OpRule* rule = rule_for(n);
  if (!rule) throw std::logic_error("no rule for " + n.op);
  RuleResult r = rule->fn(RuleInput{b.graph, n, std::move(in), sp});
  return {r.out, r.operands, r.attr_updates, expansion_name(r.expansion)};
}

inline std::string rule_error(const GraphBuilder& b, int out, std::vector<Placement> in) {
  return plan_error([&] { run_rule(b, out, std::move(in)); });
}

inline Outcome run_local(const GraphBuilder& b, int out, std::vector<Placement> in) {
  const Node& n = b.graph.nodes.at(static_cast<size_t>(b.graph.producer(out)));
  RuleResult r = local_rule(RuleInput{b.graph, n, std::move(in), 2});
  return {r.out, r.operands, r.attr_updates, expansion_name(r.expansion)};
}

inline std::string local_error(const GraphBuilder& b, int out, std::vector<Placement> in) {
  return plan_error([&] { run_local(b, out, std::move(in)); });
}

}  // namespace autosp::rule_test
