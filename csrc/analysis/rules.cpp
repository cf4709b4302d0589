// The op-rule registry (one row per op) and the public queries on it. The rules live in
// rules_*.cpp, one file per family.
#include "analysis/rules.h"

#include <map>

#include "analysis/rule_kit.h"

namespace autosp {

namespace {

using namespace rule_kit;

const std::map<std::string, OpRule>& registry() {
  static const std::map<std::string, OpRule> rules = [] {
    std::map<std::string, OpRule> m;
    for (const char* op : {"add", "sub", "rsub"})
      m[op] = {rule_elementwise, PartialBehaviour::Additive};
    for (const char* op : {"mul", "div"}) m[op] = {rule_elementwise, PartialBehaviour::Scale};
    for (const char* op : {"neg", "contiguous", "clone"})
      m[op] = {rule_elementwise, PartialBehaviour::Unary};
    m["to"] = {rule_elementwise, PartialBehaviour::Cast};
    // Elementwise ops PyTorch does not tag pointwise (every tagged one arrives with the
    // node attribute "pointwise" and takes the pointwise rule, see rule_for).
    for (const char* op : {"fill_like", "detach"})
      m[op] = {rule_elementwise, PartialBehaviour::Reduce};
    for (const char* op : {"dropout", "rand_like", "randn_like"})
      m[op] = {rule_random, PartialBehaviour::Reduce};
    m["sum"] = {rule_reduction, PartialBehaviour::Unary};
    m["mean"] = {rule_reduction, PartialBehaviour::Unary};
    for (const char* op : {"amax", "amin", "max", "min", "prod", "var", "std", "logsumexp", "norm",
                           "all", "any", "argmax", "argmin"})
      m[op] = {rule_reduction, PartialBehaviour::Reduce};
    for (const char* op :
         {"softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "topk", "sort", "argsort"})
      m[op] = {rule_along_dim, PartialBehaviour::Reduce};
    m["reshape"] = {rule_reshape, PartialBehaviour::Unary};
    m["expand"] = {rule_expand, PartialBehaviour::Reduce};
    m["permute"] = {rule_permute, PartialBehaviour::Unary};
    m["repeat_interleave"] = {rule_repeat_interleave, PartialBehaviour::Unary};
    m["repeat"] = {rule_repeat, PartialBehaviour::Unary};
    for (const char* op : {"view_as_complex", "view_as_real"})
      m[op] = {rule_complex_view, PartialBehaviour::Unary};
    m["one_hot"] = {rule_one_hot, PartialBehaviour::Reduce};
    for (const char* op : {"scatter", "scatter_add", "scatter_reduce", "gather", "index_select",
                           "index_add", "index_copy", "index_fill"})
      m[op] = {rule_scatter_gather, PartialBehaviour::Reduce};
    m["einsum"] = {rule_einsum, PartialBehaviour::Reduce};
    m["alias"] = {rule_identity, PartialBehaviour::Unary};
    m["index"] = {rule_index, PartialBehaviour::Reduce};
    m["cat"] = {rule_cat, PartialBehaviour::Reduce};
    m["stack"] = {rule_cat, PartialBehaviour::Reduce};
    for (const char* op : {"split", "chunk", "unbind"})
      m[op] = {rule_split, PartialBehaviour::Reduce};
    m["pad"] = {rule_pad, PartialBehaviour::Reduce};
    m["tril"] = {rule_tril, PartialBehaviour::Reduce};
    m["conv1d"] = {rule_conv1d, PartialBehaviour::Reduce};
    m["triu"] = {rule_tril, PartialBehaviour::Reduce};
    m["layer_norm"] = {rule_layer_norm, PartialBehaviour::Reduce};
    m["linear"] = {rule_linear, PartialBehaviour::Reduce};
    m["matmul"] = {rule_matmul, PartialBehaviour::Reduce};
    m["embedding"] = {rule_embedding, PartialBehaviour::Reduce};
    m["sym_size"] = {rule_sym_size, PartialBehaviour::Reduce};
    for (const char* op : {"arange", "full", "zeros", "ones", "empty", "rand", "randn", "randint",
                           "nontensor", "sym_arith"})
      m[op] = {rule_factory, PartialBehaviour::Reduce};
    m["new_full"] = {rule_new_factory, PartialBehaviour::Reduce};
    m["nonzero"] = {rule_nonzero, PartialBehaviour::Reduce};
    // copy_(dst, src): dst takes src's values elementwise (aten.copy carries no pointwise tag).
    m["copy"] = {rule_elementwise, PartialBehaviour::Reduce};
    return m;
  }();
  return rules;
}

}  // namespace

const OpRule* find_rule(const std::string& op) {
  const auto& m = registry();
  auto it = m.find(op);
  return it == m.end() ? nullptr : &it->second;
}

const OpRule* rule_for(const Node& n) {
  static const OpRule pointwise{rule_elementwise, PartialBehaviour::Reduce};
  if (const OpRule* rule = find_rule(n.op)) return rule;
  return n.bool_attr("pointwise", false) ? &pointwise : nullptr;
}

bool is_elementwise(const Node& n) {
  if (n.op == "where" || n.op == "masked_fill") return true;
  const OpRule* rule = rule_for(n);
  return rule != nullptr && (rule->fn == rule_elementwise || rule->fn == rule_identity);
}

RuleResult local_rule(const RuleInput& r) { return rule_local(r); }

std::vector<std::string> registered_ops() {
  std::vector<std::string> ops;
  for (const auto& [k, _] : registry()) ops.push_back(k);
  return ops;
}

int sequence_dim(const Value& v) {
  for (int i = 0; i < v.rank(); ++i)
    if (v.shape[i].has_seq() && v.shape[i].power == 1) return i;
  return -1;
}

std::optional<Placement> reshape_shard(const std::vector<Dim>& in, const std::vector<Dim>& out,
                                       const Placement& p) {
  if (!p.is_shard()) return p;
  // Elements to the right of the sequence factor, in row-major order.
  const Dim stride =
      Dim::constant(p.inner) * product(in, static_cast<size_t>(p.dim) + 1, in.size());
  if (stride.is_opaque()) return std::nullopt;
  for (int j = static_cast<int>(out.size()) - 1; j >= 0; --j) {
    const Dim tail = product(out, static_cast<size_t>(j) + 1, out.size());
    auto inner = stride.divide(tail);
    if (!inner || !inner->is_static()) continue;
    // The sequence factor keeps its offset (S - 1 positions stay S - 1 when merged).
    auto rest = out[j].divide(Dim::seq(inner->coef, 1, in.at(static_cast<size_t>(p.dim)).offset));
    if (rest && rest->is_static()) return Placement::shard(j, inner->coef);
  }
  return std::nullopt;
}

}  // namespace autosp
