#include "plan/ulysses.h"

#include <algorithm>
#include <cctype>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <tuple>

#include "analysis/rules.h"
#include "plan/plan_builder.h"

namespace autosp {

namespace plan_detail {

SpPlan PlanBuilder::run() {
  for (const Node& n : in_.nodes) {
    if (n.has_attr("grad_enabled")) set_grad_mode(n.bool_attr("grad_enabled", true));
    if (n.op == "input") {
      emit_input(n);
    } else if (n.op == "output") {
      refuse_local_operands(n);
      emit_output(n);
    } else {
      const OpRule* rule = rule_for(n);
      switch (rule ? rule->emitter : Emitter::Rule) {
        case Emitter::Attention:
          refuse_local_operands(n);
          emit_sdpa(n);
          break;
        case Emitter::CrossEntropy:
          emit_cross_entropy(n);
          break;
        case Emitter::Rule:
          emit_generic(n, rule);
          break;
      }
    }
  }
  eliminate_dead_nodes();
  if (cfg_.bucket_grad_sync) bucket_grad_syncs();
  return SpPlan{std::move(out_), std::move(place_), std::move(gathered_ops_),
                std::move(loss_tiling_), std::move(vmap_)};
}

std::string PlanBuilder::bucket_of(const std::string& path) {
  size_t begin = 0;
  while (begin <= path.size()) {
    const size_t dot = std::min(path.find('.', begin), path.size());
    const std::string part = path.substr(begin, dot - begin);
    if (!part.empty() &&
        std::all_of(part.begin(), part.end(), [](unsigned char c) { return std::isdigit(c) != 0; }))
      return path.substr(0, dot);
    begin = dot + 1;
  }
  return "";
}

void PlanBuilder::bucket_grad_syncs() {
  std::map<int, std::string> bucket_of_value;  // input-valued value -> bucket
  for (const Node& n : out_.nodes) {
    if (n.op != "input") continue;
    for (int o : n.outputs) bucket_of_value[o] = bucket_of(n.str_attr("path", ""));
  }
  std::map<std::string, size_t> merged_at;  // bucket -> index in `kept`
  std::vector<Node> kept;
  for (Node& n : out_.nodes) {
    auto bucket = n.op == "sp.grad_sync" && n.inputs.size() == 1 ? bucket_of_value.find(n.inputs[0])
                                                                 : bucket_of_value.end();
    if (bucket == bucket_of_value.end()) {
      kept.push_back(std::move(n));
      continue;
    }
    auto [at, fresh] = merged_at.try_emplace(bucket->second, kept.size());
    if (fresh) {
      Node merged;
      merged.op = "sp.grad_sync";
      merged.target = "sp.grad_sync";
      kept.push_back(std::move(merged));
    }
    kept[at->second].inputs.push_back(n.inputs[0]);
    kept[at->second].outputs.push_back(n.outputs[0]);
  }
  for (size_t i = 0; i < kept.size(); ++i) kept[i].id = static_cast<int>(i);
  out_.nodes = std::move(kept);
}

void PlanBuilder::eliminate_dead_nodes() {
  std::vector<int> uses(out_.values.size(), 0);
  for (const Node& n : out_.nodes) {
    for (int v : n.inputs)
      if (v >= 0) uses[static_cast<size_t>(v)] += 1;
    for (int64_t v : n.ints_attr("refs")) uses[static_cast<size_t>(v)] += 1;
  }
  std::vector<bool> dead(out_.nodes.size(), false);
  for (size_t i = out_.nodes.size(); i-- > 0;) {
    const Node& n = out_.nodes[i];
    // In-place ops write into a tensor that may be read through another name (a view's
    // base): never dead.
    if (n.op == "input" || n.op == "output" || n.op == "nontensor" || n.outputs.empty() ||
        n.bool_attr("inplace", false))
      continue;
    bool all_tensors = true;
    for (int o : n.outputs) all_tensors = all_tensors && out_.value(o).is_tensor();
    if (!all_tensors) continue;  // symbols feed size arguments the core does not see
    bool used = false;
    for (int o : n.outputs) used = used || uses[static_cast<size_t>(o)] > 0;
    if (used) continue;
    dead[i] = true;
    for (int v : n.inputs)
      if (v >= 0) uses[static_cast<size_t>(v)] -= 1;
  }
  std::vector<Node> kept;
  for (size_t i = 0; i < out_.nodes.size(); ++i)
    if (!dead[i]) kept.push_back(std::move(out_.nodes[i]));
  for (size_t i = 0; i < kept.size(); ++i) kept[i].id = static_cast<int>(i);
  out_.nodes = std::move(kept);
}

std::vector<int> PlanBuilder::emit(const std::string& op, std::vector<int> inputs, Attrs attrs,
                                   std::vector<std::pair<Value, Placement>> outs,
                                   const SourceLoc& loc) {
  Node n;
  n.op = op;
  n.target = op;
  n.inputs = std::move(inputs);
  n.attrs = std::move(attrs);
  n.loc = loc;
  const bool from_gathered = std::any_of(n.inputs.begin(), n.inputs.end(),
                                         [&](int v) { return gathered_values_.count(v) > 0; });
  for (auto& [v, p] : outs) {
    n.outputs.push_back(new_value(v, p));
    if (from_gathered && p.is_replicate()) gathered_values_.insert(n.outputs.back());
  }
  std::vector<int> ids = n.outputs;
  out_.add_node(std::move(n));
  return ids;
}

int PlanBuilder::copy_node(const Node& n, std::vector<int> inputs,
                           const std::vector<Placement>& outs, const Attrs& updates) {
  Node c = n;
  c.origin = n.id;
  c.inputs = std::move(inputs);
  c.outputs.clear();
  for (const auto& [k, a] : updates) c.attrs[k] = a;
  if (c.has_attr("refs")) {
    // Tensors the op reads only for metadata (type_as, view_as): keep them alive.
    std::vector<int64_t> refs;
    for (int64_t r : c.ints_attr("refs")) refs.push_back(mapped(static_cast<int>(r)));
    c.attrs["refs"] = refs;
  }
  const bool from_gathered = std::any_of(c.inputs.begin(), c.inputs.end(),
                                         [&](int v) { return gathered_values_.count(v) > 0; });
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    const Placement& p = outs.at(i);
    if (p.is_local()) note_local_count(n, c.inputs, in_.value(n.outputs[i]).shape.at(p.dim));
    int id = new_value(same_counts(in_.value(n.outputs[i])), p);
    vmap_[static_cast<size_t>(n.outputs[i])] = id;
    c.outputs.push_back(id);
    if (from_gathered && p.is_replicate()) gathered_values_.insert(id);
  }
  return out_.add_node(std::move(c));
}

void PlanBuilder::set_grad_mode(bool enabled) {
  if (enabled == grad_enabled_) return;
  grad_enabled_ = enabled;
  slice_cache_.clear();
  grad_sync_cache_.clear();
  reduce_cache_.clear();
  gather_cache_.clear();
}

int PlanBuilder::grad_sync(int v, const SourceLoc& loc) {
  if (!val(v).requires_grad || !grad_enabled_) return v;
  auto it = grad_sync_cache_.find(v);
  if (it != grad_sync_cache_.end()) return it->second;
  int id = emit("sp.grad_sync", {v}, {}, {{val(v), Placement::replicate()}}, loc)[0];
  grad_sync_cache_[v] = id;
  return id;
}

int PlanBuilder::slice(int v, int dim, int64_t inner, const SourceLoc& loc) {
  auto key = std::make_tuple(v, dim, inner);
  auto it = slice_cache_.find(key);
  if (it != slice_cache_.end()) return it->second;
  if (int hoisted = hoist_slice(v, dim, inner, loc); hoisted >= 0) {
    slice_cache_[key] = hoisted;
    return hoisted;
  }
  const Dim& size = val(v).shape.at(static_cast<size_t>(dim));
  int64_t outer = 1;
  if (size.has_seq()) {
    if (size.power != 1 || size.coef % inner != 0)
      throw std::invalid_argument("[plan_ulysses] cannot slice dim " + std::to_string(dim) +
                                  " of size " + size.str() + " with inner " +
                                  std::to_string(inner));
    outer = size.coef / inner;
  } else if (size.is_static() && size.coef % cfg_.sp_size != 0) {
    throw std::invalid_argument("[plan_ulysses] static dim of size " + size.str() +
                                " is not divisible by the SP degree " +
                                std::to_string(cfg_.sp_size));
  }
  const int src = grad_sync(v, loc);
  Attrs attrs{{"dim", int64_t{dim}}, {"inner", inner}, {"outer", outer}};
  // S + offset positions: every rank takes S/P of them, the last one S/P + offset.
  if (size.offset != 0) attrs["offset"] = size.offset;
  int id = emit("sp.slice", {src}, attrs, {{val(v), Placement::shard(dim, inner)}}, loc)[0];
  slice_cache_[key] = id;
  return id;
}

int PlanBuilder::reduce_partial(int v, const SourceLoc& loc) {
  auto it = reduce_cache_.find(v);
  if (it != reduce_cache_.end()) return it->second;
  int id = emit("sp.reduce_partial", {v}, {}, {{val(v), Placement::replicate()}}, loc)[0];
  reduce_cache_[v] = id;
  return id;
}

void PlanBuilder::emit_input(const Node& n) {
  copy_node(n, {}, std::vector<Placement>(n.outputs.size(), Placement::replicate()), {});
  // A floating-point activation fed in at full length ([B, S, D] embeddings) is sharded
  // where it enters; token ids are sharded by the embedding that reads them.
  for (int old : n.outputs) {
    int v = mapped(old);
    const Value& value = val(v);
    const int d = sequence_dim(value);
    // A value with the sequence in two dims is a mask or bias over (query, key), not an
    // activation: it stays replicated and is sliced where it meets sharded values.
    const auto seq_dims = std::count_if(value.shape.begin(), value.shape.end(),
                                        [](const Dim& s) { return s.has_seq(); });
    if (n.str_attr("role", "") == "data" && value.is_tensor() && is_float(value.dtype) &&
        value.rank() >= 3 && d >= 0 && seq_dims == 1)
      vmap_[static_cast<size_t>(old)] = slice(v, d, 1, n.loc);
  }
}

void PlanBuilder::emit_output(const Node& n) {
  std::vector<int> ins;
  for (int old : n.inputs) {
    int v = to_sequence(mapped(old), n.loc);
    Placement p = placement(v);
    if (p.is_partial()) v = reduce_partial(v, n.loc);
    if (p.is_shard() && cfg_.gather_outputs && val(v).shape.at(p.dim).offset != 0)
      throw PlanError(kPass, n,
                      "an output " + shape_str(val(v).shape) +
                          " sharded unevenly (a slice dropped positions of the sequence)",
                      "outputs over the whole sequence when outputs are gathered",
                      "Return the value before slicing it, or reduce it inside the model.");
    if (p.is_shard() && cfg_.gather_outputs)
      v = emit("sp.all_gather", {v}, {{"dim", int64_t{p.dim}}, {"inner", p.inner}},
               {{val(v), Placement::replicate()}}, n.loc)[0];
    // Local outputs: a value computed on the gathered sequence is returned as this rank's
    // chunk too, like the sharded values it stands in for.
    if (!cfg_.gather_outputs && gathered_values_.count(v) && val(v).is_tensor())
      if (const int d = sequence_dim(val(v)); d >= 0) v = slice(v, d, 1, n.loc);
    ins.push_back(v);
  }
  copy_node(n, ins, {}, {});
}

std::vector<int> PlanBuilder::apply_operands(const Node& n, std::vector<int> ins,
                                             const std::vector<OperandChange>& changes,
                                             const std::vector<Placement>& outs) {
  const bool distributed_out =
      std::any_of(outs.begin(), outs.end(), [](const Placement& p) { return !p.is_replicate(); });
  for (size_t i = 0; i < ins.size(); ++i) {
    if (ins[i] < 0) continue;
    const OperandChange& c = changes.at(i);
    switch (c.kind) {
      case OperandChange::Kind::Slice:
        if (c.check_below > 0)
          ins[i] = emit("sp.check_index", {ins[i]}, {{"below", c.check_below}},
                        {{val(ins[i]), placement(ins[i])}}, n.loc)[0];
        ins[i] = slice(ins[i], c.dim, c.inner, n.loc);
        break;
      case OperandChange::Kind::ReducePartial:
        ins[i] = reduce_partial(ins[i], n.loc);
        break;
      case OperandChange::Kind::Exchange:
        ins[i] = to_heads(ins[i], c.dim, c.gather_dim, n.loc);
        break;
      case OperandChange::Kind::Keep:
        if (distributed_out && placement(ins[i]).is_replicate() && val(ins[i]).is_tensor())
          ins[i] = grad_sync(ins[i], n.loc);
        break;
    }
  }
  return ins;
}

bool PlanBuilder::partial_passes(const OpRule& rule, const Node& n,
                                 const std::vector<int>& ins) const {
  int partial = 0, tensors = 0, first_partial = -1;
  for (size_t i = 0; i < ins.size(); ++i) {
    if (ins[i] < 0 || !val(ins[i]).is_tensor()) continue;
    ++tensors;
    if (placement(ins[i]).is_partial()) {
      if (first_partial < 0) first_partial = static_cast<int>(i);
      ++partial;
    } else if (!placement(ins[i]).is_replicate()) {
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
    case PartialBehaviour::Cast:
      return tensors == 1 && n.outputs.size() == 1 &&
             float_bits(in_.value(n.outputs[0]).dtype) >=
                 std::max(1, float_bits(val(ins[static_cast<size_t>(first_partial)]).dtype));
    case PartialBehaviour::Reduce:
      return false;
  }
  return false;
}

void PlanBuilder::emit_generic(const Node& n, const OpRule* rule) {
  std::vector<int> ins = mapped_inputs(n);
  refuse_count_as_number(n, ins);
  if (rule && partial_passes(*rule, n, ins)) {
    std::vector<Placement> outs(n.outputs.size(), Placement::partial());
    std::vector<OperandChange> keep(ins.size(), OperandChange::keep());
    copy_node(n, apply_operands(n, ins, keep, outs), outs, {});
    return;
  }
  for (int& v : ins)
    if (v >= 0 && placement(v).is_partial()) v = reduce_partial(v, n.loc);
  RuleResult res = decide_or_gather(n, rule, ins);
  // An in-place op writes into its first operand: it must not be a sliced copy of a
  // replicated tensor (the write would miss the tensor, and any view of it, read later).
  if (n.bool_attr("inplace", false) && !res.operands.empty() &&
      res.operands[0].kind != OperandChange::Kind::Keep && !fresh_fill(n, n.inputs[0]))
    throw PlanError(kPass, n,
                    "an in-place '" + n.op + "' into a replicated " + shape_str(val(ins[0]).shape) +
                        " from sequence-sharded values",
                    "a destination sharded like the values written into it",
                    "Allocate the destination from a sharded tensor (x.new_empty(...), "
                    "torch.zeros_like(x)) or compute the result out of place (a new "
                    "torch.zeros(...) is made local only when nothing but this write reads it).");
  std::vector<int> args = apply_operands(n, ins, res.operands, res.out);
  switch (res.expansion) {
    case Expansion::MeanPartial:
      return emit_mean_partial(n, std::move(args));
    case Expansion::Halo:
      return emit_halo(n, std::move(args), res);
    case Expansion::Shift:
      return emit_shift(n, std::move(args), res);
    case Expansion::ToSequence:
      return emit_to_sequence(n, std::move(args), res);
    case Expansion::Scan:
    case Expansion::Combine:
      return emit_cross_rank(n, std::move(args), res.expansion == Expansion::Scan);
    case Expansion::None:
      copy_node(n, std::move(args), res.out, res.attr_updates);
      return;
  }
}

Graph& PlanBuilder::scratch_graph(const Node& n, const std::vector<int>& ins) {
  scratch_.values.clear();
  scratch_.nodes.clear();
  Node c = n;
  c.inputs.clear();
  c.outputs.clear();
  for (int v : ins) c.inputs.push_back(v < 0 ? -1 : scratch_.add_value(val(v)));
  for (int o : n.outputs) c.outputs.push_back(scratch_.add_value(same_counts(in_.value(o))));
  scratch_.add_node(std::move(c));
  return scratch_;
}

}  // namespace plan_detail

using plan_detail::PlanBuilder;

std::map<std::string, int> SpPlan::collective_counts() const {
  static const std::set<std::string> collectives = {
      "sp.all_to_all", "sp.reduce_partial", "sp.grad_sync", "sp.all_gather", "sp.count_valid",
      "sp.scan",       "sp.shift",          "sp.halo",      "sp.combine"};
  std::map<std::string, int> counts;
  for (const Node& n : graph.nodes)
    // A shift starting at position 0 exchanges nothing: each rank only trims its part.
    if (collectives.count(n.op) && !(n.op == "sp.shift" && n.int_attr("start", 0) == 0))
      counts[n.op] += 1;
  return counts;
}

std::string SpPlan::str() const {
  std::vector<std::string> notes;
  for (const Placement& p : placements) notes.push_back(p.str());
  return print_graph(graph, notes);
}

SpPlan plan_ulysses(const Graph& g, const SpConfig& cfg) {
  if (cfg.sp_size < 1)
    throw std::invalid_argument("[plan_ulysses] sp_size must be >= 1, got " +
                                std::to_string(cfg.sp_size));
  return PlanBuilder(g, cfg).run();
}

}  // namespace autosp
