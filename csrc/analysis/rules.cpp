// The op table (one row per op, see rules.h) and the public queries on it. The rules live in
// rules_*.cpp, one file per family.
#include "analysis/rules.h"

#include <map>

#include "analysis/rule_kit.h"

namespace autosp {

namespace {

using namespace rule_kit;

const std::map<std::string, OpRule>& registry() {
  using P = PartialBehaviour;
  using L = Locality;
  static const std::map<std::string, OpRule> rules = [] {
    std::map<std::string, OpRule> m;
    for (const char* op : {"add", "sub", "rsub"})
      m[op] = {rule_elementwise, P::Additive, L::Elementwise};
    for (const char* op : {"mul", "div"}) m[op] = {rule_elementwise, P::Scale, L::Elementwise};
    for (const char* op : {"neg", "contiguous", "clone"})
      m[op] = {rule_elementwise, P::Unary, L::Elementwise};
    m["to"] = {rule_elementwise, P::Cast, L::Elementwise};
    // Elementwise ops PyTorch does not tag pointwise on every overload (every tagged one
    // arrives with the node attribute "pointwise" and takes the pointwise row, see rule_for).
    // copy_(dst, src): dst takes src's values elementwise.
    for (const char* op : {"fill_like", "detach", "copy", "where", "masked_fill"})
      m[op] = {rule_elementwise, P::Reduce, L::Elementwise};
    m["alias"] = {rule_identity, P::Unary, L::Elementwise};
    for (const char* op : {"dropout", "rand_like", "randn_like"}) m[op] = {rule_random};
    m["sum"] = {rule_reduction, P::Unary};
    m["mean"] = {rule_reduction, P::Unary};
    for (const char* op : {"amax", "amin", "max", "min", "prod", "var", "std", "logsumexp", "norm",
                           "all", "any", "argmax", "argmin"})
      m[op] = {rule_reduction};
    for (const char* op :
         {"softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "topk", "sort", "argsort"})
      m[op] = {rule_along_dim};
    m["reshape"] = {rule_reshape, P::Unary, L::Reshape};
    m["expand"] = {rule_expand, P::Reduce, L::Expand};
    m["permute"] = {rule_permute, P::Unary, L::Permute};
    m["repeat_interleave"] = {rule_repeat_interleave, P::Unary};
    m["repeat"] = {rule_repeat, P::Unary};
    for (const char* op : {"view_as_complex", "view_as_real"})
      m[op] = {rule_complex_view, P::Unary};
    m["one_hot"] = {rule_one_hot};
    for (const char* op : {"scatter", "scatter_add", "scatter_reduce", "gather", "index_select",
                           "index_add", "index_copy", "index_fill"})
      m[op] = {rule_scatter_gather};
    m["einsum"] = {rule_einsum};
    m["index"] = {rule_index, P::Reduce, L::Index};
    m["cat"] = {rule_cat, P::Reduce, L::Cat};
    m["stack"] = {rule_cat};
    for (const char* op : {"split", "chunk", "unbind"}) m[op] = {rule_split};
    m["pad"] = {rule_pad};
    for (const char* op : {"tril", "triu"}) m[op] = {rule_tril, P::Reduce, L::Triangle};
    m["conv1d"] = {rule_conv1d};
    m["layer_norm"] = {rule_layer_norm};
    m["linear"] = {rule_linear};
    m["matmul"] = {rule_matmul};
    m["embedding"] = {rule_embedding};
    m["sym_size"] = {rule_sym_size};
    for (const char* op : {"arange", "rand", "randn", "randint", "nontensor", "sym_arith"})
      m[op] = {rule_factory};
    for (const char* op : {"full", "zeros", "ones", "empty"})
      m[op] = {rule_factory, P::Reduce, L::Factory};
    m["eye"] = {nullptr, P::Reduce, L::Eye};
    m["new_full"] = {rule_new_factory};
    m["nonzero"] = {rule_nonzero};
    // Ops the plan builder emits itself (their placements depend on all operands together).
    for (const char* op : {"sdpa", "flex_attention"})
      m[op] = {nullptr, P::Reduce, L::None, Emitter::Attention};
    m["cross_entropy"] = {nullptr, P::Reduce, L::None, Emitter::CrossEntropy};
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
  static const OpRule pointwise{rule_elementwise, PartialBehaviour::Reduce, Locality::Elementwise};
  if (const OpRule* rule = find_rule(n.op)) return rule;
  return n.bool_attr("pointwise", false) ? &pointwise : nullptr;
}

const char* expansion_name(Expansion e) {
  switch (e) {
    case Expansion::MeanPartial:
      return "mean_partial";
    case Expansion::Halo:
      return "halo";
    case Expansion::Shift:
      return "shift";
    case Expansion::Scan:
      return "scan";
    case Expansion::Combine:
      return "combine";
    case Expansion::ToSequence:
      return "to_sequence";
    case Expansion::None:
      break;
  }
  return "";
}

Locality locality_of(const Node& n) {
  const OpRule* rule = rule_for(n);
  return rule ? rule->locality : Locality::None;
}

bool is_elementwise(const Node& n) { return locality_of(n) == Locality::Elementwise; }

RuleResult local_rule(const RuleInput& r) { return rule_local(r); }

std::vector<std::string> registered_ops() {
  std::vector<std::string> ops;
  for (const auto& [k, row] : registry())
    if (row.fn != nullptr || row.emitter != Emitter::Rule) ops.push_back(k);
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
