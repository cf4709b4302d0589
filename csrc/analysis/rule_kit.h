// What the rule files share: small helpers for writing a rule, and the rules themselves
// (declared here, defined in rules_*.cpp by family, registered in rules.cpp). Internal to
// the analysis library; the public interface is rules.h.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "analysis/rules.h"

namespace autosp::rule_kit {

inline constexpr const char* kPass = "placement";

inline const Value& input_value(const RuleInput& r, size_t i) {
  return r.graph.value(r.node.inputs[i]);
}
inline const Value& output_value(const RuleInput& r, size_t i) {
  return r.graph.value(r.node.outputs[i]);
}

inline RuleResult keep_all(const RuleInput& r, std::vector<Placement> out) {
  RuleResult res;
  res.out = std::move(out);
  res.operands.assign(r.node.inputs.size(), OperandChange::keep());
  return res;
}

inline std::vector<Placement> all_replicate(const RuleInput& r) {
  return std::vector<Placement>(r.node.outputs.size(), Placement::replicate());
}

inline bool all_replicate_inputs(const RuleInput& r) {
  return std::all_of(r.in.begin(), r.in.end(), [](const Placement& p) { return p.is_replicate(); });
}

inline std::string describe_input(const RuleInput& r, size_t i) {
  const Value& v = input_value(r, i);
  return "input " + std::to_string(i) + " " + v.dtype + shape_str(v.shape) + " placed " +
         r.in[i].str();
}

[[noreturn]] inline void conflict(const RuleInput& r, const std::string& found,
                                  const std::string& expected, const std::string& hint = "") {
  throw PlanError(kPass, r.node, found, expected, hint);
}

// A hint for an op refused on a sequence sliced after it was sharded (S-1 positions), or "".
inline std::string sliced_sequence_hint(const Dim& size) {
  if (!size.has_seq() || size.offset == 0) return "";
  return "Its input holds " + size.str() +
         " positions, a slice of the sharded sequence: apply the op to the whole sequence and "
         "slice its result instead.";
}

// Index of the (first) sharded input, or -1.
inline int first_shard(const RuleInput& r) {
  for (size_t i = 0; i < r.in.size(); ++i)
    if (r.in[i].is_shard()) return static_cast<int>(i);
  return -1;
}

inline int norm_dim(int64_t d, int rank) {
  if (d < 0) d += rank;
  return static_cast<int>(d);
}

// The dims a reduction node reduces (attrs dims, keepdim), normalised; all when none given.
std::vector<int> reduced_dims(const RuleInput& r, int rank);

RuleResult rule_elementwise(const RuleInput& r);
RuleResult rule_random(const RuleInput& r);
RuleResult rule_reduction(const RuleInput& r);
RuleResult rule_along_dim(const RuleInput& r);
RuleResult rule_reshape(const RuleInput& r);
RuleResult rule_expand(const RuleInput& r);
RuleResult rule_repeat_interleave(const RuleInput& r);
RuleResult rule_repeat(const RuleInput& r);
RuleResult rule_complex_view(const RuleInput& r);
RuleResult rule_one_hot(const RuleInput& r);
RuleResult rule_scatter_gather(const RuleInput& r);
RuleResult rule_einsum(const RuleInput& r);
RuleResult rule_permute(const RuleInput& r);
RuleResult rule_identity(const RuleInput& r);
RuleResult rule_index(const RuleInput& r);
RuleResult rule_cat(const RuleInput& r);
RuleResult rule_split(const RuleInput& r);
RuleResult rule_pad(const RuleInput& r);
RuleResult rule_conv1d(const RuleInput& r);
RuleResult rule_tril(const RuleInput& r);
RuleResult rule_linear(const RuleInput& r);
RuleResult rule_matmul(const RuleInput& r);
RuleResult rule_embedding(const RuleInput& r);
RuleResult rule_sym_size(const RuleInput& r);
RuleResult rule_layer_norm(const RuleInput& r);
RuleResult rule_factory(const RuleInput& r);
RuleResult rule_new_factory(const RuleInput& r);
RuleResult rule_nonzero(const RuleInput& r);
RuleResult rule_mask_index(const RuleInput& r);
RuleResult rule_local(const RuleInput& r);

}  // namespace autosp::rule_kit
