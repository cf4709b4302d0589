#include "plan/ulysses.h"

#include <algorithm>
#include <cctype>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <tuple>

#include "analysis/rules.h"

namespace autosp {

namespace {

constexpr const char* kPass = "ulysses";

bool is_float(const std::string& dtype) {
  return dtype == "f32" || dtype == "f16" || dtype == "bf16" || dtype == "f64";
}

class PlanBuilder {
 public:
  PlanBuilder(const Graph& in, const SpConfig& cfg)
      : in_(in), cfg_(cfg), vmap_(in.values.size(), -1) {
    // Hoisting re-runs replicated work later in program order; with in-place ops in the
    // graph that work could read a tensor mutated in between, so it is not done.
    for (const Node& n : in.nodes) hoist_ = hoist_ && !n.bool_attr("inplace", false);
  }

  SpPlan run() {
    for (const Node& n : in_.nodes) {
      if (n.has_attr("grad_enabled")) set_grad_mode(n.bool_attr("grad_enabled", true));
      if (n.op == "input")
        emit_input(n);
      else if (n.op == "output")
        emit_output(n);
      else if (n.op == "sdpa" || n.op == "flex_attention")
        emit_sdpa(n);
      else if (n.op == "cross_entropy")
        emit_cross_entropy(n);
      else
        emit_generic(n);
    }
    eliminate_dead_nodes();
    if (cfg_.bucket_grad_sync) bucket_grad_syncs();
    return SpPlan{std::move(out_), std::move(place_)};
  }

  // "layers.3.mlp.up.weight" -> "layers.3"; "" when no component is a number.
  static std::string bucket_of(const std::string& path) {
    size_t begin = 0;
    while (begin <= path.size()) {
      const size_t dot = std::min(path.find('.', begin), path.size());
      const std::string part = path.substr(begin, dot - begin);
      if (!part.empty() && std::all_of(part.begin(), part.end(),
                                       [](unsigned char c) { return std::isdigit(c) != 0; }))
        return path.substr(0, dot);
      begin = dot + 1;
    }
    return "";
  }

  // Merges the grad syncs of graph inputs (parameters) into one node per layer (see
  // SpConfig::bucket_grad_sync), each where the first of its syncs was.
  void bucket_grad_syncs() {
    std::map<int, std::string> bucket_of_value;  // input-valued value -> bucket
    for (const Node& n : out_.nodes) {
      if (n.op != "input") continue;
      for (int o : n.outputs) bucket_of_value[o] = bucket_of(n.str_attr("path", ""));
    }
    std::map<std::string, size_t> merged_at;  // bucket -> index in `kept`
    std::vector<Node> kept;
    for (Node& n : out_.nodes) {
      auto bucket = n.op == "sp.grad_sync" && n.inputs.size() == 1
                        ? bucket_of_value.find(n.inputs[0])
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

  // Drops nodes whose results nothing uses (full-length originals whose slices were
  // hoisted); inputs, the output and side-effecting nodes stay.
  void eliminate_dead_nodes() {
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

 private:
  const Graph& in_;
  SpConfig cfg_;
  Graph out_;
  std::vector<Placement> place_;
  std::vector<int> vmap_;  // input value id -> output value id
  std::map<std::tuple<int, int, int64_t>, int> slice_cache_;
  std::map<int, int> grad_sync_cache_;
  std::map<int, int> reduce_cache_;
  bool hoist_ = true;
  bool grad_enabled_ = true;

  int mapped(int old_id) const { return old_id < 0 ? -1 : vmap_.at(static_cast<size_t>(old_id)); }
  const Value& val(int id) const { return out_.value(id); }
  Placement placement(int id) const {
    return id < 0 ? Placement::replicate() : place_.at(static_cast<size_t>(id));
  }

  int new_value(Value v, Placement p) {
    int id = out_.add_value(std::move(v));
    place_.push_back(p);
    return id;
  }

  // Emits an inserted SP node with one output per entry of `outs`.
  std::vector<int> emit(const std::string& op, std::vector<int> inputs, Attrs attrs,
                        std::vector<std::pair<Value, Placement>> outs, const SourceLoc& loc) {
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

  // Copies an input node, mapping its inputs; its outputs get the given placements.
  int copy_node(const Node& n, std::vector<int> inputs, const std::vector<Placement>& outs,
                const Attrs& updates) {
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
      int id = new_value(in_.value(n.outputs[i]), outs.at(i));
      vmap_[static_cast<size_t>(n.outputs[i])] = id;
      c.outputs.push_back(id);
    }
    return out_.add_node(std::move(c));
  }

  // torch.no_grad() regions: values made there carry no gradient, so a value cached in one
  // grad mode is not reused in the other (a parameter's gradient sync emitted in a no_grad
  // region and reused after it would cut the parameter's gradient), and no sync is needed
  // inside them.
  void set_grad_mode(bool enabled) {
    if (enabled == grad_enabled_) return;
    grad_enabled_ = enabled;
    slice_cache_.clear();
    grad_sync_cache_.clear();
    reduce_cache_.clear();
  }

  int grad_sync(int v, const SourceLoc& loc) {
    if (!val(v).requires_grad || !grad_enabled_) return v;
    auto it = grad_sync_cache_.find(v);
    if (it != grad_sync_cache_.end()) return it->second;
    int id = emit("sp.grad_sync", {v}, {}, {{val(v), Placement::replicate()}}, loc)[0];
    grad_sync_cache_[v] = id;
    return id;
  }

  int slice(int v, int dim, int64_t inner, const SourceLoc& loc) {
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

  // Slices a replicated, non-differentiable value by slicing the operands of its producer
  // instead, when the producer is local along the sequence (elementwise, casts, reshapes,
  // permutes, basic indexing, cat along another dim). Replicated work that only feeds
  // sharded values (RoPE tables from full-length positions, say) then runs on the local
  // chunk, and no per-rank tensor stays O(S) wide. Returns -1 when it does not apply.
  int hoist_slice(int v, int dim, int64_t inner, const SourceLoc& loc) {
    if (!hoist_ || val(v).requires_grad || !placement(v).is_replicate()) return -1;
    const int pi = out_.producer(v);
    if (pi < 0) return -1;
    const Node p = out_.nodes[static_cast<size_t>(pi)];
    if (p.origin < 0 || p.outputs.size() != 1) return -1;
    const Value out = val(v);
    const int ro = out.rank();
    std::vector<std::optional<std::pair<int, int64_t>>> req(p.inputs.size());
    auto aligned = [&](size_t i) -> bool {
      const Value& in = val(p.inputs[i]);
      const int k = dim - (ro - in.rank());
      if (k < 0 || in.shape[static_cast<size_t>(k)].is_one()) return true;
      if (!(in.shape[static_cast<size_t>(k)] == out.shape[static_cast<size_t>(dim)])) return false;
      req[i] = std::make_pair(k, inner);
      return true;
    };
    const OpRule* rule = rule_for(p);
    const bool elementwise =
        rule != nullptr && p.op != "dropout" && p.op != "layer_norm" &&
        (p.op == "to" || p.op == "where" || p.op == "masked_fill" || p.op == "contiguous" ||
         p.op == "clone" || p.op == "alias" || rule->partial != PartialBehaviour::Reduce ||
         p.bool_attr("pointwise", false));
    for (size_t i = 0; i < p.inputs.size(); ++i) {
      if (p.inputs[i] < 0) continue;
      if (!placement(p.inputs[i]).is_replicate() || val(p.inputs[i]).requires_grad) return -1;
    }
    if (p.op == "reshape") {
      if (p.inputs.empty()) return -1;
      auto q = reshape_shard(out.shape, val(p.inputs[0]).shape, Placement::shard(dim, inner));
      if (!q) return -1;
      req[0] = std::make_pair(q->dim, q->inner);
    } else if (p.op == "expand") {
      if (p.inputs.empty() || !aligned(0)) return -1;
    } else if (p.op == "permute") {
      const auto perm = p.ints_attr("perm");
      if (dim >= static_cast<int>(perm.size())) return -1;
      req[0] = std::make_pair(static_cast<int>(perm[static_cast<size_t>(dim)]), inner);
    } else if (p.op == "index") {
      if (p.inputs.size() != 1) return -1;
      const auto dim_map = p.ints_attr("dim_map");
      const auto sliced = p.ints_attr("sliced_dims");
      int k = -1;
      for (size_t j = 0; j < dim_map.size(); ++j)
        if (dim_map[j] == dim) k = static_cast<int>(j);
      if (k < 0 || std::find(sliced.begin(), sliced.end(), k) != sliced.end()) return -1;
      req[0] = std::make_pair(k, inner);
    } else if (p.op == "cat") {
      int64_t cat_dim = p.int_attr("dim", 0);
      if (cat_dim < 0) cat_dim += ro;
      if (cat_dim == dim) return -1;
      for (size_t i = 0; i < p.inputs.size(); ++i) req[i] = std::make_pair(dim, inner);
    } else if (elementwise) {
      for (size_t i = 0; i < p.inputs.size(); ++i)
        if (p.inputs[i] >= 0 && val(p.inputs[i]).is_tensor() && !aligned(i)) return -1;
    } else {
      return -1;
    }
    Node c = p;
    c.outputs.clear();
    for (size_t i = 0; i < p.inputs.size(); ++i)
      if (req[i]) c.inputs[i] = slice(p.inputs[i], req[i]->first, req[i]->second, loc);
    c.attrs["clone"] = true;
    if (out.shape[static_cast<size_t>(dim)].has_seq())
      c.attrs["local_dims"] = std::vector<int64_t>{dim};
    c.outputs.push_back(new_value(out, Placement::shard(dim, inner)));
    const int id = c.outputs[0];
    out_.add_node(std::move(c));
    return id;
  }

  int reduce_partial(int v, const SourceLoc& loc) {
    auto it = reduce_cache_.find(v);
    if (it != reduce_cache_.end()) return it->second;
    int id = emit("sp.reduce_partial", {v}, {}, {{val(v), Placement::replicate()}}, loc)[0];
    reduce_cache_[v] = id;
    return id;
  }

  void emit_input(const Node& n) {
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

  void emit_output(const Node& n) {
    std::vector<int> ins;
    for (int old : n.inputs) {
      int v = mapped(old);
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
      ins.push_back(v);
    }
    copy_node(n, ins, {}, {});
  }

  // Applies a rule's operand changes and the gradient rule for replicated operands:
  // a replicated value that requires grad and feeds a sharded or partial result gets
  // only a partial gradient on each rank, so it passes through sp.grad_sync.
  std::vector<int> apply_operands(const Node& n, std::vector<int> ins,
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
        case OperandChange::Kind::Keep:
          if (distributed_out && placement(ins[i]).is_replicate() && val(ins[i]).is_tensor())
            ins[i] = grad_sync(ins[i], n.loc);
          break;
      }
    }
    return ins;
  }

  std::vector<int> mapped_inputs(const Node& n) const {
    std::vector<int> ins;
    for (int old : n.inputs) ins.push_back(mapped(old));
    return ins;
  }

  std::vector<Placement> placements_of(const std::vector<int>& ins) const {
    std::vector<Placement> ps;
    for (int v : ins) ps.push_back(placement(v));
    return ps;
  }

  // Partial operands: kept when the op is linear in them, otherwise reduced first.
  bool partial_passes(const OpRule& rule, const Node& n, const std::vector<int>& ins) const {
    int partial = 0, tensors = 0, first_partial = -1;
    for (size_t i = 0; i < ins.size(); ++i) {
      if (ins[i] < 0 || !val(ins[i]).is_tensor()) continue;
      ++tensors;
      if (placement(ins[i]).is_partial()) {
        if (first_partial < 0) first_partial = static_cast<int>(i);
        ++partial;
      } else if (placement(ins[i]).is_shard()) {
        return false;
      }
    }
    if (partial == 0) return false;
    switch (rule.partial) {
      case PartialBehaviour::Additive:
        return partial == tensors;
      case PartialBehaviour::Scale:
        return partial == 1 && (n.op != "div" || first_partial == 0);
      case PartialBehaviour::Unary:
        return tensors == 1;
      case PartialBehaviour::Reduce:
        return false;
    }
    return false;
  }

  void emit_generic(const Node& n) {
    std::vector<int> ins = mapped_inputs(n);
    const OpRule* rule = rule_for(n);
    if (rule && partial_passes(*rule, n, ins)) {
      std::vector<Placement> outs(n.outputs.size(), Placement::partial());
      std::vector<OperandChange> keep(ins.size(), OperandChange::keep());
      copy_node(n, apply_operands(n, ins, keep, outs), outs, {});
      return;
    }
    for (int& v : ins)
      if (v >= 0 && placement(v).is_partial()) v = reduce_partial(v, n.loc);
    const std::vector<Placement> in_places = placements_of(ins);
    RuleResult res;
    if (!rule) {
      for (size_t i = 0; i < ins.size(); ++i)
        if (!in_places[i].is_replicate())
          throw PlanError(kPass, n,
                          "input " + std::to_string(i) + " placed " + in_places[i].str() + " (" +
                              shape_str(val(ins[i]).shape) + ")",
                          "an op with a sequence-parallel rule",
                          "autosp has no rule for '" + n.op +
                              "' on a sequence-sharded tensor; rather than guess, it stops here.");
      res.out.assign(n.outputs.size(), Placement::replicate());
      res.operands.assign(ins.size(), OperandChange::keep());
    } else {
      res = call_rule(*rule, n, ins);
    }
    // An in-place op writes into its first operand: it must not be a sliced copy of a
    // replicated tensor (the write would miss the tensor, and any view of it, read later).
    if (n.bool_attr("inplace", false) && !res.operands.empty() &&
        res.operands[0].kind != OperandChange::Kind::Keep)
      throw PlanError(kPass, n,
                      "an in-place '" + n.op + "' into a replicated " +
                          shape_str(val(ins[0]).shape) + " from sequence-sharded values",
                      "a destination sharded like the values written into it",
                      "Allocate the destination from a sharded tensor (x.new_empty(...), "
                      "torch.zeros_like(x)) or compute the result out of place.");
    if (res.expansion == "mean_partial") {
      emit_mean_partial(n, apply_operands(n, ins, res.operands, res.out));
      return;
    }
    if (res.expansion == "halo") {
      emit_halo(n, apply_operands(n, ins, res.operands, res.out), res);
      return;
    }
    if (res.expansion == "shift") {
      emit_shift(n, apply_operands(n, ins, res.operands, res.out), res);
      return;
    }
    if (res.expansion == "scan" || res.expansion == "combine") {
      emit_cross_rank(n, apply_operands(n, ins, res.operands, res.out), res.expansion);
      return;
    }
    copy_node(n, apply_operands(n, ins, res.operands, res.out), res.out, res.attr_updates);
  }

  // Rules see the node with mapped inputs and the *input graph's* output values (same
  // shapes), so shapes of both sides are available.
  RuleResult call_rule(const OpRule& rule, const Node& n, const std::vector<int>& ins) {
    Graph& g = scratch_graph(n, ins);
    RuleInput r{g, g.nodes.back(), placements_of(ins), cfg_.sp_size};
    return rule.fn(r);
  }

  Graph scratch_;
  Graph& scratch_graph(const Node& n, const std::vector<int>& ins) {
    scratch_.values.clear();
    scratch_.nodes.clear();
    Node c = n;
    c.inputs.clear();
    c.outputs.clear();
    for (int v : ins) c.inputs.push_back(v < 0 ? -1 : scratch_.add_value(val(v)));
    for (int o : n.outputs) c.outputs.push_back(scratch_.add_value(in_.value(o)));
    scratch_.add_node(std::move(c));
    return scratch_;
  }

  // A scan along the sequence (sp.scan: the local scan, combined with the totals of the ranks
  // before this one) or a reduction over it (sp.combine: the local reduction, combined over
  // all ranks by the same reduction).
  void emit_cross_rank(const Node& n, std::vector<int> ins, const std::string& kind) {
    const bool scan = kind == "scan";
    // The local reduction is one per-rank term of the combined result, which sp.combine
    // reduces with the op itself (not a sum); the plan prints it as P.
    const Placement local = scan ? placement(ins[0]) : Placement::partial();
    // A chunk whose elements are all -inf has a local logsumexp of -inf, whose backward is NaN
    // (one device never forms it): the local step is a guarded logsumexp.
    Attrs local_attrs;
    if (!scan && n.op == "logsumexp") local_attrs["guarded_logsumexp"] = true;
    const int idx = copy_node(n, ins, {local}, local_attrs);
    const int y = out_.nodes[static_cast<size_t>(idx)].outputs[0];
    Attrs attrs{{"op", n.op}};
    if (scan) attrs["dim"] = int64_t{local.dim};
    const int out = emit(scan ? "sp.scan" : "sp.combine", {y}, attrs,
                         {{val(y), scan ? local : Placement::replicate()}}, n.loc)[0];
    vmap_[static_cast<size_t>(n.outputs[0])] = out;
  }

  // A slice that drops positions at the ends of the sharded sequence: sp.shift takes this
  // rank's part of the sliced sequence (see collectives.shift), and the node itself then
  // indexes the other dims only (attribute unslice_dim: the bridge takes that dim whole).
  void emit_shift(const Node& n, std::vector<int> ins, const RuleResult& res) {
    const int64_t d = std::get<int64_t>(res.attr_updates.at("shift_dim"));
    const int64_t start = std::get<int64_t>(res.attr_updates.at("shift_start"));
    // Starting after position 0, each rank's part is a copy (it takes the next rank's first
    // positions), not a view: a later in-place write through it, or into the tensor it was
    // sliced from, would not reach the other.
    if (start > 0) {
      if (const Node* w = later_write_to_aliases(n))
        throw PlanError(
            kPass, *w,
            "an in-place '" + w->op + "' that writes, after it, into the sequence slice " + "at " +
                n.loc.file + ":" + std::to_string(n.loc.line) +
                " (which starts after position 0) or into the tensor it was sliced from",
            "no in-place writes through a slice that starts after position 0 of the "
            "sharded sequence",
            "Under sequence parallelism that slice is a copy on each rank; write out of "
            "place (y = torch.cat([...]) or x * mask) instead.");
    }
    const int64_t offset = std::get<int64_t>(res.attr_updates.at("shift_offset"));
    const int64_t in_offset = std::get<int64_t>(res.attr_updates.at("shift_in_offset"));
    Value v = val(ins[0]);
    v.shape.at(static_cast<size_t>(d)) = Dim::seq(1, 1, offset);
    ins[0] = emit("sp.shift", {ins[0]},
                  {{"dim", d}, {"start", start}, {"offset", offset}, {"in_offset", in_offset}},
                  {{v, placement(ins[0])}}, n.loc)[0];
    copy_node(n, ins, res.out, {{"unslice_dim", d}});
  }

  // The first in-place node after `n` in program order that writes into a value aliasing n's
  // input or output (through view-like ops, or in-place ops, which return their operand), or
  // nullptr.
  const Node* later_write_to_aliases(const Node& n) const {
    static const std::set<std::string> views = {"reshape", "permute",         "expand",
                                                "index",   "alias",           "split",
                                                "unbind",  "view_as_complex", "view_as_real"};
    std::set<int> alias(n.inputs.begin(), n.inputs.begin() + 1);
    alias.insert(n.outputs.begin(), n.outputs.end());
    for (bool grew = true; grew;) {
      grew = false;
      for (const Node& m : in_.nodes) {
        if (m.inputs.empty() || m.inputs[0] < 0) continue;
        if (!views.count(m.op) && !m.bool_attr("inplace", false)) continue;
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
    for (const Node& m : in_.nodes) {
      if (m.id == n.id)
        after = true;
      else if (after && m.bool_attr("inplace", false) && !m.inputs.empty() &&
               alias.count(m.inputs[0]))
        return &m;
    }
    return nullptr;
  }

  // A conv along the sharded sequence: sp.halo extends each rank's chunk by the positions its
  // outputs read from its neighbours (see collectives.halo), and the conv itself runs without
  // padding (attribute zero_padding).
  void emit_halo(const Node& n, std::vector<int> ins, const RuleResult& res) {
    const Placement p = placement(ins[0]);
    Value v = val(ins[0]);
    v.shape.at(static_cast<size_t>(p.dim)) = Dim::expr("S/P + halo");
    Attrs attrs{{"dim", int64_t{p.dim}}};
    for (const char* k : {"halo_left", "halo_right", "halo_last_pad"})
      attrs[std::string(k).substr(5)] = res.attr_updates.at(k);
    ins[0] = emit("sp.halo", {ins[0]}, attrs, {{v, p}}, n.loc)[0];
    copy_node(n, ins, res.out, {{"zero_padding", true}});
  }

  // mean over the sharded dim -> local sum / global count (a partial value).
  void emit_mean_partial(const Node& n, std::vector<int> ins) {
    const Value& x = val(ins[0]);
    std::vector<int> dims;
    for (int64_t d : n.ints_attr("dims"))
      dims.push_back(static_cast<int>(d < 0 ? d + x.rank() : d));
    if (dims.empty())
      for (int d = 0; d < x.rank(); ++d) dims.push_back(d);
    Dim count = Dim::constant(1);
    for (int d : dims) count = count * x.shape[static_cast<size_t>(d)];
    if (count.is_opaque())
      throw PlanError(kPass, n, "a mean over dims of size " + count.str(),
                      "sizes that are multiples of S");
    Node s = n;
    s.op = "sum";
    const int idx =
        copy_node(s, ins, {Placement::partial()}, {{"rewrite_target", std::string("sum")}});
    const int sum_out = out_.nodes[static_cast<size_t>(idx)].outputs[0];
    Attrs divisor{{"divisor_coef", count.coef}, {"divisor_power", int64_t{count.power}}};
    if (count.offset != 0) divisor["divisor_offset"] = count.offset;  // coef * (S + offset)^power
    const int q = emit("div", {sum_out}, divisor, {{val(sum_out), Placement::partial()}}, n.loc)[0];
    vmap_[static_cast<size_t>(n.outputs[0])] = q;
  }

  void emit_cross_entropy(const Node& n) {
    std::vector<int> ins = mapped_inputs(n);
    for (int& v : ins)
      if (v >= 0 && placement(v).is_partial()) v = reduce_partial(v, n.loc);
    const Placement px = placement(ins[0]);
    const Placement pt = placement(ins[1]);
    if (px.is_replicate() && pt.is_replicate()) {
      copy_node(n, ins, {Placement::replicate()}, {});
      return;
    }
    if (ins.size() > 2 && ins[2] >= 0)
      throw PlanError(kPass, n, "a class-weight tensor", "cross-entropy without class weights",
                      "Weighted cross-entropy is not supported under sequence parallelism yet.");
    const Value& x = val(ins[0]);
    if (!px.is_shard() || px.dim == 1 || (x.rank() > 1 && px.dim == 0 && x.rank() != 2) ||
        (x.rank() == 2 && px.dim != 0))
      throw PlanError(kPass, n, "logits " + shape_str(x.shape) + " placed " + px.str(),
                      "logits sharded along the token dim ([N, C] sharded on N)");
    const int tdim = px.dim == 0 ? 0 : px.dim - 1;
    if (pt.is_shard() && !(pt == Placement::shard(tdim, px.inner)))
      throw PlanError(kPass, n, "targets placed " + pt.str() + " and logits placed " + px.str(),
                      "targets sharded like the logits' token dim");
    std::vector<int> args = ins;
    if (pt.is_replicate()) args[1] = slice(ins[1], tdim, px.inner, n.loc);
    const std::string reduction = n.str_attr("reduction", "mean");
    if (reduction == "none") {
      copy_node(n, args, {Placement::shard(tdim, px.inner)}, {});
      return;
    }
    if (reduction == "sum") {
      copy_node(n, args, {Placement::partial()}, {});
      return;
    }
    // mean: local sum over this rank's tokens / the number of valid tokens in the group.
    const int idx = copy_node(n, args, {Placement::partial()}, {{"reduction", std::string("sum")}});
    const int ce = out_.nodes[static_cast<size_t>(idx)].outputs[0];
    Value count_v;
    count_v.kind = ValueKind::Tensor;
    count_v.dtype = "i64";
    const int count =
        emit("sp.count_valid", {args[1]}, {{"ignore_index", n.int_attr("ignore_index", -100)}},
             {{count_v, Placement::replicate()}}, n.loc)[0];
    const int q = emit("div", {ce, count}, {}, {{val(ce), Placement::partial()}}, n.loc)[0];
    vmap_[static_cast<size_t>(n.outputs[0])] = q;
  }

  void emit_sdpa(const Node& n) {
    std::vector<int> ins = mapped_inputs(n);
    for (int& v : ins)
      if (v >= 0 && placement(v).is_partial()) v = reduce_partial(v, n.loc);
    const int P = static_cast<int>(cfg_.sp_size);
    bool any_shard = false;
    for (int v : ins) any_shard = any_shard || placement(v).is_shard();
    if (!any_shard) {
      copy_node(n, ins, {Placement::replicate()}, {});
      return;
    }
    if (n.op == "sdpa" && n.has_attr("dropout_p"))
      throw PlanError(kPass, n, "attention dropout (dropout_p > 0)", "dropout_p=0 under Ulysses",
                      "Each rank runs H/P heads and would draw its attention-dropout mask from the "
                      "same random state as every other rank; apply dropout outside attention.");
    // A copy: emit() below appends to the value table, which would leave a reference dangling.
    const Value q = val(ins[0]);
    if (q.rank() != 4)
      throw PlanError(kPass, n,
                      "query of rank " + std::to_string(q.rank()) + " " + shape_str(q.shape),
                      "[batch, heads, seq, head_dim] query, key and value");
    for (int i = 0; i < 3; ++i) {
      Placement p = placement(ins[i]);
      const Dim& len = val(ins[i]).shape.at(2);
      if (p.is_shard() && len.offset != 0)
        throw PlanError(kPass, n,
                        "attention over " + len.str() + " positions, sharded unevenly " +
                            "(a slice dropped positions of the sequence)",
                        "attention over the whole sequence",
                        "Slice the sequence after attention (the logits or the loss inputs), not "
                        "before it.");
      if (!(p.is_replicate() || p == Placement::shard(2)))
        throw PlanError(kPass, n,
                        std::string(i == 0   ? "query"
                                    : i == 1 ? "key"
                                             : "value") +
                            " " + shape_str(val(ins[i]).shape) + " placed " + p.str(),
                        "the sequence in dim 2 (S(2)) or a replicated tensor");
    }
    if (!placement(ins[0]).is_shard())
      throw PlanError(kPass, n, "a replicated query with sharded key/value",
                      "a query sharded along the sequence");
    const Dim& hq = q.shape[1];
    if (!hq.is_static() || hq.coef % P != 0)
      throw PlanError(
          kPass, n,
          std::to_string(hq.coef) + " query heads for an SP degree of " + std::to_string(P),
          "a number of query heads divisible by the SP degree (" + std::to_string(hq.coef) + " % " +
              std::to_string(P) + " = " + std::to_string(hq.coef % P) + ")",
          "Ulysses splits attention heads across the SP group; choose an SP degree that "
          "divides the number of heads.");
    const int64_t Hq = hq.coef;
    std::vector<int> args = ins;
    std::vector<int> exchange;  // positions in args that go through the all-to-all
    for (int i = 0; i < 3; ++i) {
      int v = args[i];
      const Dim& h = val(v).shape[1];
      if (!h.is_static())
        throw PlanError(kPass, n, "a heads dim of size " + h.str(), "a static number of heads");
      int64_t H = h.coef;
      if (i > 0 && H != Hq) {
        // One key/value head broadcasts against every query head (multi-query attention,
        // as SDPA broadcasts it without enable_gqa): handled as GQA.
        if ((!n.bool_attr("enable_gqa", false) && H != 1) || Hq % H != 0)
          throw PlanError(
              kPass, n,
              std::to_string(H) + " key/value heads for " + std::to_string(Hq) + " query heads",
              "equal heads, or enable_gqa=True with query heads a multiple of key/value heads");
        if (H % P != 0) {
          // Fewer KV heads than ranks: repeat each KV head so that every rank receives the
          // KV head its query heads attend to.
          const int64_t f = P / std::gcd(H, static_cast<int64_t>(P));
          if (Hq % (H * f) != 0)
            throw PlanError(
                kPass, n,
                std::to_string(H) + " key/value heads, " + std::to_string(Hq) +
                    " query heads, SP degree " + std::to_string(P),
                "key/value heads that can be repeated to a multiple of the SP degree dividing the "
                "query heads");
          Value rv = val(v);
          rv.shape[1] = Dim::constant(H * f);
          v = emit("sp.repeat_heads", {v}, {{"dim", int64_t{1}}, {"repeats", f}},
                   {{rv, placement(v)}}, n.loc)[0];
        }
      }
      if (placement(v).is_shard())
        exchange.push_back(i);
      else
        v = slice(v, 1, 1, n.loc);  // replicated full-length k/v: keep the local heads
      args[i] = v;
    }
    // Masks (sdpa's attn_mask; flex_attention's block mask tensors, then its mods' buffers)
    // apply to the whole sequence, which every rank sees after the exchange: they stay
    // replicated, and a per-head mask keeps this rank's heads.
    const bool flex = n.op == "flex_attention";
    if (flex && n.bool_attr("reads_head_index", false))
      throw PlanError(kPass, n, "a score_mod or mask_mod that reads the head index h",
                      "mods that do not depend on h",
                      "Ulysses gives each rank H/P heads, and flex_attention passes the rank's "
                      "local head index to the mods; pass per-head values through q/k/v instead.");
    const size_t per_head_end =
        flex ? 3 + static_cast<size_t>(n.int_attr("block_mask_inputs", 0)) : args.size();
    for (size_t i = 3; i < args.size(); ++i) {
      if (args[i] < 0) continue;
      const Placement pm = placement(args[i]);
      if (!pm.is_replicate())
        throw PlanError(kPass, n, "an attention mask placed " + pm.str(),
                        "a replicated (full-length) mask",
                        "Build the mask from full-length positions (as single-device code does).");
      const Value& m = val(args[i]);
      // The heads dim: dim 1 of flex's block mask tensors ([B, H, blocks...]); for an SDPA mask,
      // which broadcasts against [B, H, S, S] from the right, the third dim from the end.
      const int hd = flex ? 1 : m.rank() - 3;
      if (i < per_head_end && hd >= 0 && hd < m.rank() &&
          m.shape[static_cast<size_t>(hd)].is_static() &&
          m.shape[static_cast<size_t>(hd)].coef == Hq && Hq > 1)
        args[i] = slice(args[i], hd, 1, n.loc);
    }
    const Dim seq = q.shape[2];
    auto exchange_group = [&](std::vector<int> positions) {
      std::vector<int> xs;
      std::vector<std::pair<Value, Placement>> outs;
      for (int i : positions) {
        xs.push_back(args[i]);
        outs.push_back({val(args[i]), Placement::shard(1)});
      }
      auto ys = emit("sp.all_to_all", xs,
                     {{"scatter_dim", int64_t{1}},
                      {"gather_dim", int64_t{2}},
                      {"gather_coef", seq.coef},
                      {"gather_power", int64_t{seq.power}}},
                     outs, n.loc);
      for (size_t j = 0; j < positions.size(); ++j) args[positions[j]] = ys[j];
    };
    if (cfg_.fuse_qkv) {
      exchange_group(exchange);
    } else {
      for (int i : exchange) exchange_group({i});
    }
    for (size_t i = 0; i < 3; ++i) args[i] = grad_sync_if_replicated(args[i], n.loc);
    // Every output ([B, H, S, D] attention, [B, H, S] logsumexp) goes back to the sequence
    // layout; exchanges of outputs nobody reads are dropped as dead code.
    const int idx =
        copy_node(n, args, std::vector<Placement>(n.outputs.size(), Placement::shard(1)), {});
    const std::vector<int> outs = out_.nodes[static_cast<size_t>(idx)].outputs;
    for (size_t j = 0; j < outs.size(); ++j) {
      if (val(outs[j]).rank() < 3) continue;
      const int back = emit("sp.all_to_all", {outs[j]},
                            {{"scatter_dim", int64_t{2}},
                             {"gather_dim", int64_t{1}},
                             {"gather_coef", Hq},
                             {"gather_power", int64_t{0}}},
                            {{val(outs[j]), Placement::shard(2)}}, n.loc)[0];
      vmap_[static_cast<size_t>(n.outputs[j])] = back;
    }
  }

  int grad_sync_if_replicated(int v, const SourceLoc& loc) {
    return placement(v).is_replicate() ? grad_sync(v, loc) : v;
  }
};

}  // namespace

std::map<std::string, int> SpPlan::collective_counts() const {
  static const std::set<std::string> collectives = {
      "sp.all_to_all", "sp.reduce_partial", "sp.grad_sync", "sp.all_gather", "sp.count_valid",
      "sp.scan",       "sp.shift",          "sp.halo",      "sp.combine"};
  std::map<std::string, int> counts;
  for (const Node& n : graph.nodes)
    if (collectives.count(n.op)) counts[n.op] += 1;
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
