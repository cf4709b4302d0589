// Placement propagation (see propagate.h): the walk, the steps of an operand, and the
// decisions for inputs, outputs and the ops the table gives the generic rule-driven emitter
// (deciding a rule's result and the gather fallback: propagate_decide.cpp).
#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/propagator.h"

namespace autosp {

const char* step_op(Step::Kind kind) {
  switch (kind) {
    case Step::Kind::ToSequence:
    case Step::Kind::Exchange:
      return "sp.all_to_all";
    case Step::Kind::ReducePartial:
      return "sp.reduce_partial";
    case Step::Kind::Gather:
      return "sp.all_gather";
    case Step::Kind::CheckIndex:
      return "sp.check_index";
    case Step::Kind::Slice:
      return "sp.slice";
    case Step::Kind::RepeatHeads:
      return "sp.repeat_heads";
    case Step::Kind::GradSync:
      return "sp.grad_sync";
  }
  return "";
}

Value Propagation::with_same_counts(Value v) const {
  for (Dim& d : v.shape) {
    auto it = d.is_opaque() ? same_count.find(d.opaque) : same_count.end();
    if (it != same_count.end()) d = Dim::expr(it->second);
  }
  return v;
}

Propagation propagate_placements(const Graph& g, const SpConfig& cfg) {
  if (cfg.sp_size < 1)
    throw std::invalid_argument("[plan_ulysses] sp_size must be >= 1, got " +
                                std::to_string(cfg.sp_size));
  return plan_detail::Propagator(g, cfg).run();
}

namespace plan_detail {

int sequence_layout_dim(const Value& v, const Placement& p) {
  if (!p.is_shard() || !v.shape.at(static_cast<size_t>(p.dim)).is_static()) return -1;
  for (int d = 0; d < v.rank(); ++d) {
    const Dim& s = v.shape[static_cast<size_t>(d)];
    if (s.has_seq() && s.power == 1 && s.coef == 1 && s.offset == 0) return d;
  }
  return -1;
}

const Node* later_write_to_aliases(const Graph& g, const Node& n) {
  static const std::set<std::string> views = {"reshape", "permute",         "expand",
                                              "index",   "alias",           "split",
                                              "unbind",  "view_as_complex", "view_as_real"};
  std::set<int> alias(n.inputs.begin(), n.inputs.begin() + (n.inputs.empty() ? 0 : 1));
  alias.insert(n.outputs.begin(), n.outputs.end());
  for (bool grew = true; grew;) {
    grew = false;
    for (const Node& m : g.nodes) {
      if (m.inputs.empty() || m.inputs[0] < 0) continue;
      if (!views.count(m.op) && !writes_into_first_operand(m)) continue;
      const bool in = alias.count(m.inputs[0]) > 0;
      const bool out = std::any_of(m.outputs.begin(), m.outputs.end(),
                                   [&](int o) { return alias.count(o) > 0; });
      if (in == out) continue;  // both or neither: nothing new
      const size_t before = alias.size();
      alias.insert(m.inputs[0]);
      alias.insert(m.outputs.begin(), m.outputs.end());
      grew = grew || alias.size() != before;
    }
  }
  bool after = false;
  for (const Node& m : g.nodes) {
    if (m.id == n.id)
      after = true;
    else if (after && writes_into_first_operand(m) && !m.inputs.empty() && alias.count(m.inputs[0]))
      return &m;
  }
  return nullptr;
}

Propagator::Propagator(const Graph& in, const SpConfig& cfg) : in_(in), cfg_(cfg) {
  out_.nodes.resize(in.nodes.size());
  out_.values.assign(in.values.size(), Placement::replicate());
  out_.gathered_value.assign(in.values.size(), false);
}

Propagation Propagator::run() {
  for (const Node& n : in_.nodes) {
    if (n.has_attr("grad_enabled")) grad_enabled_ = n.bool_attr("grad_enabled", true);
    const OpRule* rule = rule_for(n);
    const NodeRole role = n.op == "input"                          ? NodeRole::Input
                          : n.op == "output"                       ? NodeRole::Output
                          : !rule                                  ? NodeRole::Rule
                          : rule->emitter == Emitter::Attention    ? NodeRole::Attention
                          : rule->emitter == Emitter::CrossEntropy ? NodeRole::Loss
                                                                   : NodeRole::Rule;
    switch (role) {
      case NodeRole::Input:
        decide_input(n);
        break;
      case NodeRole::Output:
        refuse_local_operands(n);
        decide_output(n);
        break;
      case NodeRole::Attention:
        refuse_local_operands(n);
        decide_attention(n);
        break;
      case NodeRole::Loss:
        decide_loss(n);
        break;
      case NodeRole::Rule:
        decide_generic(n, rule);
        break;
    }
    out_.nodes[static_cast<size_t>(n.id)].role = role;
  }
  return std::move(out_);
}

std::vector<Operand> Propagator::operands(const Node& n) const {
  std::vector<Operand> ops;
  for (int v : n.inputs) {
    Operand o;
    o.id = v;
    if (v >= 0) {
      o.p = out_.values[static_cast<size_t>(v)];
      o.gathered = out_.gathered_value[static_cast<size_t>(v)];
    }
    ops.push_back(std::move(o));
  }
  return ops;
}

void Propagator::step(Operand& o, Step s) {
  switch (s.kind) {
    case Step::Kind::ToSequence:
      o.p = Placement::shard(s.dim);
      break;
    case Step::Kind::Exchange:
      o.p = Placement::shard(s.dim);
      break;
    case Step::Kind::ReducePartial:
      o.p = Placement::replicate();
      break;
    case Step::Kind::Gather:
      o.p = Placement::replicate();
      o.gathered = true;
      break;
    case Step::Kind::Slice:
      o.p = Placement::shard(s.dim, s.inner);
      break;
    case Step::Kind::CheckIndex:
    case Step::Kind::RepeatHeads:
    case Step::Kind::GradSync:
      break;
  }
  if (!o.p.is_replicate()) o.gathered = false;
  o.steps.push_back(s);
}

void Propagator::to_sequence(Operand& o) const {
  if (!o.present()) return;
  const int d = sequence_layout_dim(val(o), o.p);
  if (d >= 0) step(o, {Step::Kind::ToSequence, d});
}

void Propagator::reduce(Operand& o) {
  if (o.present() && o.p.is_partial()) step(o, {Step::Kind::ReducePartial});
}

void Propagator::slice(Operand& o, int dim, int64_t inner) const {
  step(o, {Step::Kind::Slice, dim, inner});
}

void Propagator::grad_sync(Operand& o) const {
  if (o.present() && o.p.is_replicate() && needs_grad_sync(val(o), grad_enabled_))
    step(o, {Step::Kind::GradSync});
}

void Propagator::finish(const Node& n, const std::vector<Operand>& ops, NodePlacement d) {
  const bool from_gathered =
      std::any_of(ops.begin(), ops.end(), [](const Operand& o) { return o.gathered; });
  d.steps.clear();
  d.operands.clear();
  for (const Operand& o : ops) {
    d.steps.push_back(o.steps);
    d.operands.push_back(o.p);
  }
  d.via.resize(n.outputs.size());
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    const size_t o = static_cast<size_t>(n.outputs[i]);
    const Placement& r = d.results.at(i);
    if (r.is_local()) note_local_count(n, ops, in_.value(n.outputs[i]).shape.at(r.dim));
    out_.values[o] = d.outputs.at(i);
    out_.gathered_value[o] = from_gathered && r.is_replicate() && d.outputs[i].is_replicate();
  }
  out_.nodes[static_cast<size_t>(n.id)] = std::move(d);
}

void Propagator::decide_input(const Node& n) {
  NodePlacement d;
  d.results.assign(n.outputs.size(), Placement::replicate());
  d.outputs = d.results;
  d.via.assign(n.outputs.size(), "");
  // A floating-point activation fed in at full length ([B, S, D] embeddings) is sharded
  // where it enters; token ids are sharded by the embedding that reads them.
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    const Value& value = in_.value(n.outputs[i]);
    const int dim = sequence_dim(value);
    // A value with the sequence in two dims is a mask or bias over (query, key), not an
    // activation: it stays replicated and is sliced where it meets sharded values.
    const auto seq_dims = std::count_if(value.shape.begin(), value.shape.end(),
                                        [](const Dim& s) { return s.has_seq(); });
    if (n.str_attr("role", "") == "data" && value.is_tensor() && is_float(value.dtype) &&
        value.rank() >= 3 && dim >= 0 && seq_dims == 1) {
      d.outputs[i] = Placement::shard(dim);
      d.via[i] = "sp.slice";
    }
  }
  finish(n, {}, std::move(d));
}

void Propagator::decide_output(const Node& n) {
  std::vector<Operand> ops = operands(n);
  for (Operand& o : ops) {
    if (!o.present()) continue;
    to_sequence(o);
    reduce(o);
    const Value v = val(o);
    if (o.p.is_shard() && cfg_.gather_outputs) {
      if (v.shape.at(static_cast<size_t>(o.p.dim)).offset != 0)
        throw PlanError(kPass, n,
                        "an output " + shape_str(v.shape) +
                            " sharded unevenly (a slice dropped positions of the sequence)",
                        "outputs over the whole sequence when outputs are gathered",
                        "Return the value before slicing it, or reduce it inside the model.");
      step(o, {Step::Kind::Gather});
      o.gathered = false;  // the output itself, gathered: not a stand-in
    }
    // Local outputs: a value computed on the gathered sequence is returned as this rank's
    // chunk too, like the sharded values it stands in for.
    if (!cfg_.gather_outputs && o.gathered && v.is_tensor())
      if (const int dim = sequence_dim(v); dim >= 0) slice(o, dim, 1);
  }
  finish(n, ops, {});
}

bool Propagator::partial_passes(const OpRule& rule, const Node& n,
                                const std::vector<Operand>& ops) const {
  int partial = 0, tensors = 0, first_partial = -1;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].present() || !val(ops[i]).is_tensor()) continue;
    ++tensors;
    if (ops[i].p.is_partial()) {
      if (first_partial < 0) first_partial = static_cast<int>(i);
      ++partial;
    } else if (!ops[i].p.is_replicate()) {
      return false;
    }
  }
  if (partial == 0) return false;
  switch (rule.partial) {
    case PartialBehaviour::Additive:
      // P + 1 would add the 1 on every rank: a scalar operand needs the sum first.
      return partial == tensors && !n.bool_attr("scalar_operand", false);
    case PartialBehaviour::Scale:
      return partial == 1 && (n.op != "div" || first_partial == 0);
    case PartialBehaviour::Unary:
      return tensors == 1;
    case PartialBehaviour::Cast: {
      auto bits = [](const std::string& dt) {
        return dt == "f64" ? 64 : dt == "f32" ? 32 : (dt == "f16" || dt == "bf16") ? 16 : 0;
      };
      return tensors == 1 && n.outputs.size() == 1 &&
             bits(in_.value(n.outputs[0]).dtype) >=
                 std::max(1, bits(val(ops[static_cast<size_t>(first_partial)]).dtype));
    }
    case PartialBehaviour::Reduce:
      return false;
  }
  return false;
}

void Propagator::decide_generic(const Node& n, const OpRule* rule) {
  std::vector<Operand> ops = operands(n);
  refuse_count_as_number(n, ops);
  NodePlacement d;
  if (rule && partial_passes(*rule, n, ops)) {
    d.results.assign(n.outputs.size(), Placement::partial());
    d.outputs = d.results;
    for (Operand& o : ops) grad_sync(o);
    return finish(n, ops, std::move(d));
  }
  for (Operand& o : ops) reduce(o);
  RuleResult res = decide_or_gather(n, rule, ops);
  // An in-place op writes into its first operand: it must not be a sliced copy of a
  // replicated tensor (the write would miss the tensor, and any view of it, read later).
  if (n.bool_attr("inplace", false) && !res.operands.empty() &&
      res.operands[0].kind != OperandChange::Kind::Keep && !fresh_fill(n, n.inputs[0]))
    throw PlanError(kPass, n,
                    "an in-place '" + n.op + "' into a replicated " + shape_str(val(ops[0]).shape) +
                        " from sequence-sharded values",
                    "a destination sharded like the values written into it",
                    "Allocate the destination from a sharded tensor (x.new_empty(...), "
                    "torch.zeros_like(x)) or compute the result out of place (a new "
                    "torch.zeros(...) is made local only when nothing but this write reads it).");
  const bool distributed_out = std::any_of(res.out.begin(), res.out.end(),
                                           [](const Placement& p) { return !p.is_replicate(); });
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].present()) continue;
    const OperandChange& c = res.operands.at(i);
    switch (c.kind) {
      case OperandChange::Kind::Slice:
        if (c.check_below > 0) step(ops[i], {Step::Kind::CheckIndex, -1, 1, c.check_below});
        slice(ops[i], c.dim, c.inner);
        break;
      case OperandChange::Kind::ReducePartial:
        reduce(ops[i]);
        break;
      case OperandChange::Kind::Exchange:
        step(ops[i], {Step::Kind::Exchange, c.dim, 1, c.gather_dim});
        break;
      case OperandChange::Kind::Keep:
        if (distributed_out) grad_sync(ops[i]);
        break;
    }
  }
  d.results = res.out;
  d.outputs = res.out;
  d.via.assign(n.outputs.size(), "");
  switch (res.expansion) {
    case Expansion::MeanPartial:  // local sum / global count
      d.results = d.outputs = {Placement::partial()};
      break;
    case Expansion::Scan:  // the local scan, combined with the totals of earlier ranks
      d.results = d.outputs = {ops.at(0).p};
      d.via = {"sp.scan"};
      break;
    case Expansion::Combine:  // the local reduction, combined over the ranks
      d.results = {Placement::partial()};
      d.outputs = {Placement::replicate()};
      d.via = {"sp.combine"};
      break;
    case Expansion::ToSequence:
      if (const int dim = sequence_layout_dim(in_.value(n.outputs.at(0)), res.out.at(0));
          dim >= 0) {
        d.outputs[0] = Placement::shard(dim);
        d.via[0] = "sp.all_to_all";
      }
      break;
    case Expansion::None:
    case Expansion::Halo:
    case Expansion::Shift:
      break;
  }
  d.expansion = res.expansion;
  d.attr_updates = std::move(res.attr_updates);
  finish(n, ops, std::move(d));
}

Graph& Propagator::scratch_graph(const Node& n, const std::vector<Operand>& ops) {
  scratch_.values.clear();
  scratch_.nodes.clear();
  Node c = n;
  c.inputs.clear();
  c.outputs.clear();
  for (const Operand& o : ops) c.inputs.push_back(o.present() ? scratch_.add_value(val(o)) : -1);
  for (int o : n.outputs)
    c.outputs.push_back(scratch_.add_value(out_.with_same_counts(in_.value(o))));
  scratch_.add_node(std::move(c));
  return scratch_;
}

RuleResult Propagator::call_rule(RuleFn fn, const Node& n, const std::vector<Operand>& ops) {
  Graph& g = scratch_graph(n, ops);
  std::vector<Placement> in;
  for (const Operand& o : ops) in.push_back(o.present() ? o.p : Placement::replicate());
  RuleInput r{g, g.nodes.back(), std::move(in), cfg_.sp_size};
  return fn(r);
}

}  // namespace plan_detail

}  // namespace autosp
