// Token-local regions: the placement rules for values that hold a data-dependent selection
// of this rank's tokens (MoE routing: torch.where on a sharded expert mask, the tokens it
// selects, the expert MLP on them, index_add back into the token dim).
//
// On one device, torch.where(mask) lists the selected positions of the whole sequence; on a
// rank, of its chunk. Ops that work row by row on such a list give, on each rank, the rows
// of the single-device result that belong to its tokens, so the region runs locally and is
// exact when it ends in one of two ways: written back into the sharded token dim at the
// positions torch.where gave (index_add: Shard again), or summed over the list (Partial, a
// sum over ranks). Anything that mixes rows of the list (sort, cumsum or softmax along it, a
// mean over it) or reads its length as a number would differ from one device, and is
// refused. The behaviour of each op on a local value follows from its family in the op
// table (rule_for): no op is listed twice.
#include <algorithm>
#include <set>

#include "analysis/rule_kit.h"

namespace autosp::rule_kit {

namespace {

const char* kWhat = "a token-local value (a data-dependent selection of this rank's tokens)";

int first_local(const RuleInput& r) {
  for (size_t i = 0; i < r.in.size(); ++i)
    if (r.in[i].is_local()) return static_cast<int>(i);
  return -1;
}

const Dim& bag_size(const RuleInput& r, int i) {
  return input_value(r, static_cast<size_t>(i)).shape.at(static_cast<size_t>(r.in[i].dim));
}

[[noreturn]] void refuse(const RuleInput& r, int i, const std::string& found,
                         const std::string& expected) {
  conflict(r, describe_input(r, static_cast<size_t>(i)) + ", " + kWhat + ", " + found, expected,
           "Each rank selects only its own tokens, so this would differ from one device. Keep "
           "the routed tokens row by row and write them back with index_add_ into the token "
           "dim, or sum over them.");
}

// Row-by-row ops (elementwise, linear on the feature dim, norms): every local operand holds
// the same list in the same output dim; replicated operands broadcast along it.
RuleResult rowwise(const RuleInput& r, int out_rank, bool keep_positions) {
  const int l = first_local(r);
  int bag = -1;
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (r.node.inputs[i] < 0) continue;
    const Value& v = input_value(r, i);
    if (r.in[i].is_shard())
      conflict(r, describe_input(r, l) + " (" + kWhat + ") and " + describe_input(r, i),
               "a token-local value combined with replicated values only",
               "The selection and the sequence chunk list different tokens.");
    if (!r.in[i].is_local()) continue;
    const int b = r.in[i].dim + (out_rank - v.rank());
    if ((bag >= 0 && b != bag) || !(bag_size(r, static_cast<int>(i)) == bag_size(r, l)))
      refuse(r, static_cast<int>(i), "combined with " + describe_input(r, l),
             "operands that list the same selection in the same dim");
    bag = b;
  }
  const Dim& n = bag_size(r, l);
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (r.node.inputs[i] < 0 || !r.in[i].is_replicate() || !input_value(r, i).is_tensor()) continue;
    const Value& v = input_value(r, i);
    const int k = bag - (out_rank - v.rank());
    if (k >= 0 && !v.shape[static_cast<size_t>(k)].is_one())
      refuse(r, static_cast<int>(i), "against " + describe_input(r, l),
             "replicated operands of size 1 along the selection");
  }
  Placement p = Placement::local(bag);
  if (keep_positions && r.in[l].positions) {
    p = r.in[l];
    p.dim = bag;
  }
  (void)n;
  return keep_all(r, std::vector<Placement>(r.node.outputs.size(), p));
}

RuleResult reduction(const RuleInput& r) {
  const Placement& p = r.in[0];
  const int rank = input_value(r, 0).rank();
  const auto dims = reduced_dims(r, rank);
  if (std::find(dims.begin(), dims.end(), p.dim) != dims.end()) {
    if (r.node.op == "sum") return keep_all(r, {Placement::partial()});
    refuse(r, 0, "reduced by '" + r.node.op + "' along its selection dim",
           "a sum over the selection (each rank sums its tokens; the ranks' sums add up)");
  }
  int d = p.dim;
  if (!r.node.bool_attr("keepdim", false))
    d -=
        static_cast<int>(std::count_if(dims.begin(), dims.end(), [&](int k) { return k < p.dim; }));
  return keep_all(r, std::vector<Placement>(r.node.outputs.size(), Placement::local(d)));
}

RuleResult along_dim(const RuleInput& r) {
  const int rank = input_value(r, 0).rank();
  if (!r.node.has_attr("dim") || norm_dim(r.node.int_attr("dim", -1), rank) == r.in[0].dim)
    refuse(r, 0, "and '" + r.node.op + "' works along its selection dim",
           "an op along another dim (row by row)");
  return keep_all(r, std::vector<Placement>(r.node.outputs.size(), Placement::local(r.in[0].dim)));
}

RuleResult reshape(const RuleInput& r) {
  const Value& x = input_value(r, 0);
  const Value& out = output_value(r, 0);
  const int b = r.in[0].dim;
  const Dim before = product(x.shape, 0, static_cast<size_t>(b));
  for (int j = 0; j < out.rank(); ++j)
    if (out.shape[static_cast<size_t>(j)] == x.shape[static_cast<size_t>(b)] &&
        product(out.shape, 0, static_cast<size_t>(j)) == before)
      return keep_all(r, {Placement::local(j)});
  refuse(r, 0, "reshaped to " + shape_str(out.shape), "a reshape that keeps the selection dim");
}

// x[...] with index tensors: gathers rows of a sharded (or replicated) tensor at the positions
// torch.where found (Local positions of the same dim), or picks along other dims by local
// values; or plain slicing of a local value away from its selection dim.
RuleResult index(const RuleInput& r) {
  const Value& x = input_value(r, 0);
  const auto dim_map = r.node.ints_attr("dim_map");
  const auto sliced = r.node.ints_attr("sliced_dims");
  if (r.in[0].is_local()) {
    const int b = r.in[0].dim;
    for (size_t i = 1; i < r.in.size(); ++i)
      if (!r.in[i].is_replicate()) refuse(r, 0, "indexed by another local value", "plain slicing");
    if (std::find(sliced.begin(), sliced.end(), b) != sliced.end() ||
        b >= static_cast<int>(dim_map.size()) || dim_map[static_cast<size_t>(b)] < 0)
      refuse(r, 0, "indexed along its selection dim", "indexing along other dims");
    return keep_all(r, {Placement::local(static_cast<int>(dim_map[static_cast<size_t>(b)]))});
  }
  const auto index_dims = r.node.ints_attr("index_dims");
  if (r.node.bool_attr("index_bool", false) || index_dims.size() + 1 != r.in.size())
    conflict(r, describe_input(r, 0) + " indexed by a boolean mask or an unknown index",
             "integer index tensors from torch.where");
  RuleResult res = keep_all(r, {});
  const int l = first_local(r);
  bool sharded_dim_indexed = !r.in[0].is_shard();
  for (size_t i = 1; i < r.in.size(); ++i) {
    const Placement& q = r.in[i];
    const Value& idx = input_value(r, i);
    if (!q.is_local() || idx.rank() != 1 || !(bag_size(r, static_cast<int>(i)) == bag_size(r, l)))
      conflict(r, describe_input(r, i) + " used as an index next to " + describe_input(r, l),
               "one-dimensional index tensors from the same torch.where");
    const int k = static_cast<int>(index_dims[i - 1]);
    const Dim& size = x.shape.at(static_cast<size_t>(k));
    const bool seq = size.has_seq();
    if (!q.positions) {
      if (seq || (r.in[0].is_shard() && r.in[0].dim == k))
        conflict(r,
                 describe_input(r, i) + " indexing dim " + std::to_string(k) + " of size " +
                     size.str() + " of " + describe_input(r, 0),
                 "positions from torch.where on a mask over this same sequence dim");
      continue;
    }
    if (!seq || size.power != 1 || size.offset != 0 || size.coef != q.coef ||
        (r.in[0].is_shard() && (r.in[0].dim != k || r.in[0].inner != q.inner)))
      conflict(r,
               describe_input(r, i) + " indexing dim " + std::to_string(k) + " (size " +
                   size.str() + ") of " + describe_input(r, 0),
               "the positions index the sequence dim they were found in (same size and layout)");
    if (r.in[0].is_shard()) sharded_dim_indexed = true;
    if (r.in[0].is_replicate()) res.operands[0] = OperandChange::slice(k, q.inner);
  }
  if (!sharded_dim_indexed)
    conflict(r,
             describe_input(r, 0) + " indexed by " + describe_input(r, l) +
                 " along dims other than its sharded one",
             "the sharded dim indexed by the positions torch.where found in it");
  res.out = {Placement::local(static_cast<int>(r.node.int_attr("index_out", 0)))};
  return res;
}

// dst.index_add_(dim, positions, rows): writes the local rows back at the positions
// torch.where found in this rank's chunk; the result is sharded like dst.
RuleResult index_write(const RuleInput& r) {
  if (r.in.size() != 3 || (r.node.op != "index_add" && r.node.op != "index_copy"))
    refuse(r, first_local(r), "in '" + r.node.op + "'", "index_add or index_copy into the tokens");
  const Value& dst = input_value(r, 0);
  const int d = static_cast<int>(r.node.int_attr("dim", 0));
  const Dim& size = dst.shape.at(static_cast<size_t>(d));
  const Placement &pd = r.in[0], &pi = r.in[1], &ps = r.in[2];
  const bool ok = pi.is_local() && pi.positions && ps.is_local() && ps.dim == d &&
                  bag_size(r, 1) == bag_size(r, 2) && size.has_seq() && size.power == 1 &&
                  size.offset == 0 && size.coef == pi.coef &&
                  ((pd.is_shard() && pd.dim == d && pd.inner == pi.inner) || pd.is_replicate());
  if (!ok)
    conflict(r,
             describe_input(r, 0) + ", " + describe_input(r, 1) + ", " + describe_input(r, 2) +
                 ", along dim " + std::to_string(d),
             "rows selected by torch.where written back at its positions into the sequence dim "
             "they were found in");
  RuleResult res = keep_all(r, {Placement::shard(d, pi.inner)});
  if (pd.is_replicate()) res.operands[0] = OperandChange::slice(d, pi.inner);
  return res;
}

}  // namespace

// torch.where(mask) / nonzero(as_tuple=True) on a sharded mask: each rank finds the positions
// in its chunk. The index of the sharded dim holds positions in that chunk; the others hold
// plain values (which expert, which of the top-k).
RuleResult rule_nonzero(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  const Placement& p = r.in[0];
  const Dim& size = x.shape.at(static_cast<size_t>(p.dim));
  if (!r.node.bool_attr("as_tuple", false) || static_cast<int>(r.node.outputs.size()) != x.rank())
    conflict(r, describe_input(r, 0) + ", nonzero as one [n, ndim] tensor",
             "torch.where(mask) or torch.nonzero(mask, as_tuple=True)",
             "The tuple form gives the positions along the sharded dim in their own tensor, "
             "which autosp keeps local to each rank.");
  if (!size.has_seq() || size.power != 1 || size.offset != 0)
    conflict(r, describe_input(r, 0) + ", sharded along a dim of size " + size.str(),
             "a mask sharded along a dim of size a multiple of S");
  std::vector<Placement> out;
  for (int i = 0; i < x.rank(); ++i)
    out.push_back(i == p.dim ? Placement::local_positions(0, p.inner, size.coef)
                             : Placement::local(0));
  return keep_all(r, out);
}

// x[mask] with a boolean mask over dims k.. of x, either of them sharded along the same
// sequence dim: each rank keeps the selected rows of its chunk (logits[labels != -100]).
RuleResult rule_mask_index(const RuleInput& r) {
  const auto index_dims = r.node.ints_attr("index_dims");
  if (r.in.size() != 2 || index_dims.size() != 1)
    conflict(r, describe_input(r, 0) + " indexed by a boolean mask next to other indices",
             "one boolean mask");
  const Value& mask = input_value(r, 1);
  const int k = static_cast<int>(index_dims[0]);
  const Placement &px = r.in[0], &pm = r.in[1];
  // The mask's dim that holds the sequence, in x's dims.
  const int d = px.is_shard() ? px.dim : pm.is_shard() ? k + pm.dim : -1;
  const int64_t inner = px.is_shard() ? px.inner : pm.inner;
  const bool covered = d >= k && d < k + mask.rank() &&
                       input_value(r, 0).shape.at(static_cast<size_t>(d)).has_seq() &&
                       input_value(r, 0).shape.at(static_cast<size_t>(d)) == mask.shape.at(d - k);
  if (d < 0 || !covered ||
      (px.is_shard() && pm.is_shard() && !(pm == Placement::shard(d - k, inner))))
    conflict(r, describe_input(r, 0) + " indexed by the boolean " + describe_input(r, 1),
             "a mask over the sharded sequence dim, sharded like it");
  RuleResult res =
      keep_all(r, {Placement::local(static_cast<int>(r.node.int_attr("index_out", 0)))});
  if (px.is_replicate()) res.operands[0] = OperandChange::slice(d, inner);
  if (pm.is_replicate()) res.operands[1] = OperandChange::slice(d - k, inner);
  return res;
}

bool has_local_input(const RuleInput& r) { return first_local(r) >= 0; }

RuleResult rule_local(const RuleInput& r) {
  const OpRule* rule = rule_for(r.node);
  const RuleFn fn = rule ? rule->fn : nullptr;
  const int l = first_local(r);
  // Positions inside this rank's chunk are not the single device's positions: they may be
  // copied, cast and used as an index, never read as numbers (tok % S, tok < 4, tok * w).
  static const std::set<std::string> copies = {"to", "clone", "contiguous", "detach", "alias"};
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (!r.in[i].is_local() || !r.in[i].positions) continue;
    const bool as_index = (fn == rule_index && i >= 1) || (fn == rule_scatter_gather && i == 1);
    if (!as_index && !copies.count(r.node.op) && fn != rule_sym_size)
      refuse(r, static_cast<int>(i), "holding positions in this rank's chunk, read as numbers",
             "positions only used to index the dim they were found in (or copied, cast)");
  }
  const int out_rank = r.node.outputs.empty() ? 0 : output_value(r, 0).rank();
  if (fn == rule_elementwise || fn == rule_identity)
    return rowwise(r, out_rank, copies.count(r.node.op) != 0);
  if (fn == rule_linear || fn == rule_layer_norm || fn == rule_matmul) {
    const Value& x = input_value(r, 0);
    const bool last =
        fn == rule_layer_norm
            ? r.in[0].dim >= x.rank() - static_cast<int>(r.node.int_attr("norm_dims", 1))
            : r.in[0].dim >= x.rank() - 1;
    if (l != 0 || last || (fn == rule_matmul && input_value(r, 1).rank() != 2))
      refuse(r, l, "in '" + r.node.op + "' over its selection dim",
             "the selection in a leading dim of the first operand");
    if (fn == rule_layer_norm) return rowwise(r, out_rank, false);
    for (size_t i = 1; i < r.in.size(); ++i)
      if (!r.in[i].is_replicate())
        conflict(r, describe_input(r, i) + " (a weight or bias)", "replicated weights and bias");
    return keep_all(r, {Placement::local(r.in[0].dim + out_rank - x.rank())});
  }
  if (l == 0 && fn == rule_reduction) return reduction(r);
  if (l == 0 && fn == rule_along_dim) return along_dim(r);
  if (l == 0 && fn == rule_reshape) return reshape(r);
  if (l == 0 && (fn == rule_expand || fn == rule_repeat))
    return keep_all(r, {Placement::local(r.in[0].dim + out_rank - input_value(r, 0).rank())});
  if (l == 0 && (fn == rule_one_hot || fn == rule_complex_view) &&
      r.in[0].dim < input_value(r, 0).rank() - (r.node.op == "view_as_complex" ? 1 : 0))
    return keep_all(r, {Placement::local(r.in[0].dim)});
  if (l == 0 && fn == rule_permute) {
    const auto perm = r.node.ints_attr("perm");
    for (size_t i = 0; i < perm.size(); ++i)
      if (perm[i] == r.in[0].dim) return keep_all(r, {Placement::local(static_cast<int>(i))});
  }
  if (fn == rule_index) return index(r);
  if (fn == rule_scatter_gather) return index_write(r);
  if (fn == rule_sym_size || fn == rule_factory) return keep_all(r, all_replicate(r));
  refuse(r, l, "in '" + r.node.op + "'",
         "an op that works row by row on the selection, index_add_ back into the tokens, or a "
         "sum over them");
}

}  // namespace autosp::rule_kit
