// Placement propagation's driver for token-local regions (see analysis/rules_local.cpp):
// which nodes read a local selection or this rank's count of one, the counts that selections
// from one mask share, fresh destinations written in place, and the ops that take whole
// sequences only.
#include <algorithm>
#include <set>

#include "plan/propagator.h"

namespace autosp::plan_detail {

namespace {

// Ops whose symbolic arguments are sizes only (full / new_full also take a fill value, and
// repeat's counts multiply rows: both could read the count as a number).
const std::set<std::string>& size_ops() {
  static const std::set<std::string> ops = {"reshape", "expand"};
  return ops;
}
const std::set<std::string>& fill_ops() {
  static const std::set<std::string> ops = {"zeros", "ones", "empty"};
  return ops;
}

}  // namespace

void Propagator::note_local_count(const Node& n, const std::vector<Operand>& ops,
                                  const Dim& count) {
  if (!count.is_opaque()) return;
  local_counts_.insert(count.opaque);
  // torch.where(mask) and x[mask] select mask.sum() rows.
  const bool by_mask =
      (n.op == "nonzero" || (n.op == "index" && n.bool_attr("index_bool", false))) &&
      ops.size() == (n.op == "nonzero" ? 1u : 2u);
  if (!by_mask) return;
  const std::pair<int, std::string> mask{ops.back().id, ops.back().p.str()};
  auto [it, fresh] = count_of_mask_.emplace(mask, count.opaque);
  if (!fresh && it->second != count.opaque) out_.same_count[count.opaque] = it->second;
}

bool Propagator::fresh_fill(const Node& n, int value) const {
  const int p = in_.producer(value);
  if (p < 0) return false;
  const std::string& op = in_.nodes[static_cast<size_t>(p)].op;
  if (!fill_ops().count(op) && op != "full" && op != "new_full") return false;
  int readers = 0;
  for (const Node& m : in_.nodes)
    readers += static_cast<int>(std::count(m.inputs.begin(), m.inputs.end(), value));
  return readers == 1 && std::count(n.inputs.begin(), n.inputs.end(), value) == 1;
}

void Propagator::refuse_local_operands(const Node& n) const {
  for (size_t i = 0; i < n.inputs.size(); ++i) {
    const int v = n.inputs[i];
    if (v < 0 || !out_.values[static_cast<size_t>(v)].is_local()) continue;
    throw PlanError(
        kPass, n,
        "input " + std::to_string(i) + " " + shape_str(in_.value(v).shape) + " placed " +
            out_.values[static_cast<size_t>(v)].str() +
            ", a token-local value (a data-dependent selection of this rank's tokens)",
        n.op == "output" ? "outputs over the whole sequence" : "operands over the whole sequence",
        "Write the routed rows back into the token dim (index_add_) first.");
  }
}

bool Propagator::reads_local_count(const Node& n) const {
  const std::string symbols = n.str_attr("unbacked", "");
  for (size_t b = 0, e; b < symbols.size(); b = e + 1) {
    e = std::min(symbols.find(',', b), symbols.size());
    if (local_counts_.count(symbols.substr(b, e - b))) return true;
  }
  return false;
}

int Propagator::local_count_dim(const Node& n) const {
  if (!fill_ops().count(n.op) || n.outputs.size() != 1) return -1;
  const Value& out = in_.value(n.outputs[0]);
  for (int d = 0; d < out.rank(); ++d) {
    const Dim& size = out.shape[static_cast<size_t>(d)];
    if (size.is_opaque() && local_counts_.count(size.opaque)) return d;
  }
  return -1;
}

void Propagator::refuse_count_as_number(const Node& n, const std::vector<Operand>& ops) const {
  // This rank's count of selected tokens, read as a number: one device reads the count of the
  // whole batch. Sizes of new tensors (views, zeros of that many rows) are fine: they list
  // the same selection. Checked before anything else (a partial sum divided by the count
  // must not pass as a partial).
  if (!reads_local_count(n)) return;
  static const std::set<std::string> symbolic = {"nontensor", "sym_arith", "sym_size"};
  const bool local_in =
      std::any_of(ops.begin(), ops.end(), [](const Operand& o) { return o.p.is_local(); });
  if (symbolic.count(n.op) || (local_in && size_ops().count(n.op)) ||
      (!local_in && local_count_dim(n) >= 0))
    return;
  throw PlanError(kPass, n,
                  "an argument that depends on the number of tokens torch.where selected (" +
                      n.str_attr("unbacked", "") +
                      "), which on this rank counts its own tokens only",
                  "that count used only as the size of the selection",
                  "One device counts the tokens of the whole batch: a mean over the selected "
                  "tokens must be a sum over them divided by a count from the full mask "
                  "(mask.sum()).");
}

std::optional<RuleResult> Propagator::token_local(const Node& n, const std::vector<Operand>& ops) {
  const bool local_in =
      std::any_of(ops.begin(), ops.end(), [](const Operand& o) { return o.p.is_local(); });
  if (!local_in) {
    // zeros / ones / empty with this rank's count of rows: a local value of that selection.
    const int d = reads_local_count(n) ? local_count_dim(n) : -1;
    if (d < 0) return std::nullopt;
    RuleResult res;
    res.out = {Placement::local(d)};
    res.operands.assign(ops.size(), OperandChange::keep());
    return res;
  }
  return call_rule(&local_rule, n, ops);
}

}  // namespace autosp::plan_detail
