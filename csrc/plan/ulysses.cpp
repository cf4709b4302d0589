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
    switch (prop_.nodes.at(static_cast<size_t>(n.id)).role) {  // decided by propagation
      case NodeRole::Input:
        emit_input(n);
        break;
      case NodeRole::Output:
        emit_output(n);
        break;
      case NodeRole::Attention:
        emit_sdpa(n);
        break;
      case NodeRole::Loss:
        emit_cross_entropy(n);
        break;
      case NodeRole::Rule:
        emit_generic(n);
        break;
    }
    check_outputs(n);
  }
  eliminate_dead_nodes();
  if (cfg_.tile_mlp) tile_rows();
  if (cfg_.bucket_grad_sync) bucket_grad_syncs();
  SpPlan plan;
  plan.graph = std::move(out_);
  plan.placements = std::move(place_);
  plan.gathered = prop_.gathered;
  plan.loss_tiling = std::move(loss_tiling_);
  plan.mlp_tiling = std::move(mlp_tiling_);
  return plan;
}

void PlanBuilder::check_outputs(const Node& n) const {
  for (int o : n.outputs) {
    const int v = mapped(o);
    const Placement& decided = prop_.values.at(static_cast<size_t>(o));
    if (v >= 0 && !(placement(v) == decided))
      throw std::logic_error("[autosp:ulysses] internal error: op '" + n.op + "' (" + n.loc.str() +
                             ") emitted %" + std::to_string(o) + " placed " + placement(v).str() +
                             ", propagation decided " + decided.str());
  }
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
  for (auto& [v, p] : outs) n.outputs.push_back(new_value(v, p));
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
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    int id = new_value(prop_.with_same_counts(in_.value(n.outputs[i])), outs.at(i));
    vmap_[static_cast<size_t>(n.outputs[i])] = id;
    c.outputs.push_back(id);
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
  if (!needs_grad_sync(val(v), grad_enabled_)) return v;
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

int PlanBuilder::gather(int v, const SourceLoc& loc) {
  auto it = gather_cache_.find(v);
  if (it != gather_cache_.end()) return it->second;
  const Placement p = placement(v);
  const int id = emit("sp.all_gather", {v}, {{"dim", int64_t{p.dim}}, {"inner", p.inner}},
                      {{val(v), Placement::replicate()}}, loc)[0];
  gather_cache_[v] = id;
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
  // An activation fed in at full length is sharded where it enters (propagate.cpp).
  for (int old : n.outputs) {
    const Placement& p = prop_.values.at(static_cast<size_t>(old));
    if (p.is_shard()) vmap_[static_cast<size_t>(old)] = slice(mapped(old), p.dim, p.inner, n.loc);
  }
}

void PlanBuilder::emit_output(const Node& n) {
  std::vector<int> ins = mapped_inputs(n);
  for (size_t i = 0; i < ins.size(); ++i)
    if (ins[i] >= 0) ins[i] = apply_steps(n, i, ins[i]);
  copy_node(n, ins, {}, {});
}

int PlanBuilder::apply_steps(const Node& n, size_t i, int v, bool skip_exchange) {
  for (const Step& s : prop_.nodes.at(static_cast<size_t>(n.id)).steps.at(i)) {
    switch (s.kind) {
      case Step::Kind::ToSequence:
        v = to_sequence(v, n.loc);
        break;
      case Step::Kind::ReducePartial:
        v = reduce_partial(v, n.loc);
        break;
      case Step::Kind::Gather:
        v = gather(v, n.loc);
        break;
      case Step::Kind::CheckIndex:
        v = emit("sp.check_index", {v}, {{"below", s.arg}}, {{val(v), placement(v)}}, n.loc)[0];
        break;
      case Step::Kind::Slice:
        v = slice(v, s.dim, s.inner, n.loc);
        break;
      case Step::Kind::RepeatHeads: {
        Value rv = val(v);
        rv.shape.at(static_cast<size_t>(s.dim)) =
            Dim::constant(rv.shape[static_cast<size_t>(s.dim)].coef * s.arg);
        v = emit("sp.repeat_heads", {v}, {{"dim", int64_t{s.dim}}, {"repeats", s.arg}},
                 {{rv, placement(v)}}, n.loc)[0];
        break;
      }
      case Step::Kind::Exchange:
        if (!skip_exchange) v = to_heads(v, s.dim, static_cast<int>(s.arg), n.loc);
        break;
      case Step::Kind::GradSync:
        v = grad_sync(v, n.loc);
        break;
    }
  }
  return v;
}

void PlanBuilder::emit_generic(const Node& n) {
  const NodePlacement& d = prop_.nodes.at(static_cast<size_t>(n.id));
  std::vector<int> args = mapped_inputs(n);
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i] >= 0) args[i] = apply_steps(n, i, args[i]);
  switch (d.expansion) {
    case Expansion::MeanPartial:
      return emit_mean_partial(n, std::move(args));
    case Expansion::Halo:
      return emit_halo(n, std::move(args), d);
    case Expansion::Shift:
      return emit_shift(n, std::move(args), d);
    case Expansion::ToSequence:
      return emit_to_sequence(n, std::move(args), d);
    case Expansion::Scan:
    case Expansion::Combine:
      return emit_cross_rank(n, std::move(args), d);
    case Expansion::None:
      copy_node(n, std::move(args), d.results, d.attr_updates);
      return;
  }
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

std::string print_placements(const Graph& in, const SpPlan& plan) {
  return print_placements(in, plan.propagation);
}

std::string SpPlan::str() const {
  std::vector<std::string> notes;
  for (const Placement& p : placements) notes.push_back(p.str());
  return print_graph(graph, notes);
}

SpPlan plan_ulysses(const Graph& g, const SpConfig& cfg) {
  Propagation prop = propagate_placements(g, cfg);  // validates cfg
  SpPlan plan = PlanBuilder(g, cfg, prop).run();
  plan.propagation = std::move(prop);
  return plan;
}

}  // namespace autosp
