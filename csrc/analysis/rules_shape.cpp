// Placement rules: shape ops (reshape, expand, repeat, permute, cat, split, pad, tril), sizes and
// factories.
#include <algorithm>
#include <optional>

#include "analysis/rule_kit.h"

namespace autosp::rule_kit {

namespace {

// x.view_as(y) / x.expand_as(y) (input 1: y, whose local shape the op reads at run time).
// The result is shaped like y on this rank, so it lies as y does. A replicated x meeting a
// sharded y is cut to the part that this rank's chunk of y takes: along the dim that becomes
// y's sharded dim (a mask [B, S, 1] expanded to [B, S, D], positions [B*S*D] viewed as
// [B, S, D]); one that does not reach it (a bias [1, 1, D]) is expanded as it is. A sharded x
// given the shape of a replicated y has no local form: refused (the gather fallback then
// runs the op on the whole sequence).
std::optional<RuleResult> shaped_like_operand(const RuleInput& r, bool expand) {
  if (r.in.size() < 2 || r.in[0].is_shard() == r.in[1].is_shard()) return std::nullopt;
  const Value& x = input_value(r, 0);
  const Value& out = output_value(r, 0);
  const Placement py = r.in[1];
  if (py.is_shard() && r.in[0].is_replicate()) {
    RuleResult res = keep_all(r, {py});
    if (expand) {
      const int k = py.dim - (out.rank() - x.rank());
      if (k < 0 || x.shape[static_cast<size_t>(k)].is_one()) return res;
      if (x.shape[static_cast<size_t>(k)] == out.shape[static_cast<size_t>(py.dim)]) {
        res.operands[0] = OperandChange::slice(k, py.inner);
        return res;
      }
    } else if (auto px = reshape_shard(out.shape, x.shape, py)) {
      res.operands[0] = OperandChange::slice(px->dim, px->inner);
      return res;
    }
  }
  conflict(r,
           describe_input(r, 0) + " given the shape of " + describe_input(r, 1) +
               ", which this rank holds " + (py.is_shard() ? "a chunk of" : "whole"),
           "a tensor whose chunk takes the shape of the sharded tensor's chunk");
}

}  // namespace

RuleResult rule_reshape(const RuleInput& r) {
  if (auto res = shaped_like_operand(r, false)) return *res;
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  const Value& out = output_value(r, 0);
  auto p = reshape_shard(x.shape, out.shape, r.in[0]);
  if (!p)
    conflict(r,
             describe_input(r, 0) + " reshaped to " + shape_str(out.shape) +
                 ", which splits or reorders the sharded sequence factor",
             "a reshape that keeps the sequence factor whole (merging it with other dims is fine)");
  RuleResult res = keep_all(r, {*p});
  if (out.shape[p->dim].has_seq()) res.attr_updates["local_dims"] = std::vector<int64_t>{p->dim};
  return res;
}

RuleResult rule_expand(const RuleInput& r) {
  if (auto res = shaped_like_operand(r, true)) return *res;
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  const Value& out = output_value(r, 0);
  const int d = r.in[0].dim + (out.rank() - x.rank());
  RuleResult res = keep_all(r, {Placement::shard(d, r.in[0].inner)});
  res.attr_updates["local_dims"] = std::vector<int64_t>{d};
  return res;
}

// repeat_interleave(x, k, dim): out[.., i*k + j, ..] = x[.., i, ..]. Along another dim the
// shard passes through. Along the sharded dim each rank repeats its own chunk: the chunks of
// the output are the repeats of the input's chunks, and the sequence factor gets k more
// elements to its right (inner * k).
RuleResult rule_repeat_interleave(const RuleInput& r) {
  for (size_t i = 1; i < r.in.size(); ++i)
    if (!r.in[i].is_replicate())
      conflict(r, describe_input(r, i) + " used as the repeat counts", "replicated repeat counts");
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Placement p = r.in[0];
  if (!r.node.has_attr("dim"))
    conflict(r, describe_input(r, 0) + " flattened by repeat_interleave without a dim",
             "repeat_interleave(..., dim=d) on a sequence-sharded tensor");
  const int d = norm_dim(r.node.int_attr("dim", 0), input_value(r, 0).rank());
  if (d != p.dim) return keep_all(r, {p});
  if (!r.node.has_attr("repeats"))
    conflict(r, describe_input(r, 0) + " repeated along its sharded sequence dim by a tensor",
             "an int repeat count along the sequence dim");
  return keep_all(r, {Placement::shard(d, p.inner * r.node.int_attr("repeats", 1))});
}

// repeat(x, *sizes) tiles x: each rank tiles its own chunk, and a sharded dim keeps its
// placement (the tiles become outer factors of the dim), shifted by the leading dims repeat
// adds.
RuleResult rule_repeat(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const int offset = output_value(r, 0).rank() - input_value(r, 0).rank();
  return keep_all(r, {Placement::shard(r.in[0].dim + offset, r.in[0].inner)});
}

// view_as_complex drops the trailing dim of 2 (real, imaginary); view_as_real adds it. A
// shard in any other dim stays where it is.
RuleResult rule_complex_view(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  if (r.node.op == "view_as_complex" && r.in[0].dim >= input_value(r, 0).rank() - 1)
    conflict(r, describe_input(r, 0) + ", sharded in its (real, imaginary) dim",
             "the sequence in a leading dim");
  return keep_all(r, {r.in[0]});
}

// one_hot(idx, n) appends a class dim: a shard stays where it is.
RuleResult rule_one_hot(const RuleInput& r) { return rule_complex_view(r); }

RuleResult rule_permute(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const auto perm = r.node.ints_attr("perm");
  for (size_t i = 0; i < perm.size(); ++i)
    if (perm[i] == r.in[0].dim)
      return keep_all(r, {Placement::shard(static_cast<int>(i), r.in[0].inner)});
  conflict(r, "a permutation " + attr_str(perm) + " that drops dim " + std::to_string(r.in[0].dim),
           "a permutation of all dims");
}

RuleResult rule_identity(const RuleInput& r) {
  if (r.in.empty()) return keep_all(r, all_replicate(r));
  return keep_all(r, std::vector<Placement>(r.node.outputs.size(), r.in[0]));
}

RuleResult rule_cat(const RuleInput& r) {
  if (all_replicate_inputs(r)) return keep_all(r, all_replicate(r));
  const Value& out = output_value(r, 0);
  const int cat_dim = norm_dim(r.node.int_attr("dim", 0), out.rank());
  const bool stack = r.node.op == "stack";
  const int s = first_shard(r);
  if (s < 0) conflict(r, "partial operands", "replicate or sharded operands");
  const Placement p = r.in[s];
  if (!stack && p.dim == cat_dim)
    conflict(r, describe_input(r, s) + ", concatenated along its sharded sequence dim",
             "concatenation along another dim");
  RuleResult res;
  res.operands.assign(r.in.size(), OperandChange::keep());
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (r.in[i].is_shard() && !(r.in[i] == p))
      conflict(r, describe_input(r, s) + " and " + describe_input(r, i), "operands sharded alike");
    if (r.in[i].is_replicate()) res.operands[i] = OperandChange::slice(p.dim, p.inner);
  }
  const int d = stack && p.dim >= cat_dim ? p.dim + 1 : p.dim;
  res.out = {Placement::shard(d, p.inner)};
  return res;
}

RuleResult rule_split(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  const int d = norm_dim(r.node.int_attr("dim", 0), x.rank());
  const Placement p = r.in[0];
  if (p.dim == d)
    conflict(r, describe_input(r, 0) + ", split along its sharded sequence dim",
             "a split along another dim");
  Placement outp = p;
  if (r.node.op == "unbind" && p.dim > d) outp.dim -= 1;
  return keep_all(r, std::vector<Placement>(r.node.outputs.size(), outp));
}

RuleResult rule_pad(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  const auto pad = r.node.ints_attr("pad");
  for (size_t i = 0; 2 * i + 1 < pad.size(); ++i) {
    const int d = x.rank() - 1 - static_cast<int>(i);
    if (d == r.in[0].dim && (pad[2 * i] != 0 || pad[2 * i + 1] != 0))
      conflict(r, describe_input(r, 0) + ", padded along its sharded sequence dim",
               "padding along other dims only",
               "Pad sequences before they are sharded (for labels: pad the full-length labels).");
  }
  return keep_all(r, {r.in[0]});
}

RuleResult rule_tril(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const int rank = input_value(r, 0).rank();
  if (r.in[0].dim >= rank - 2)
    conflict(r, describe_input(r, 0) + ", whose last two dims hold the sharded sequence",
             "a replicated matrix");
  return keep_all(r, {r.in[0]});
}

RuleResult rule_sym_size(const RuleInput& r) {
  RuleResult res = keep_all(r, all_replicate(r));
  if (r.in.empty() || !r.in[0].is_shard()) return res;
  // At run time the local tensor reports its local sizes; the graph expects the global ones:
  // x.size(d) of the sharded dim and x.numel() scale by P, and x.size() (attribute
  // whole="size") scales its entry scale_dim.
  const std::string whole = r.node.str_attr("whole", "");
  // A dim of unit * (S + offset) elements (a slice dropped positions of the sequence) is
  // split unevenly: its global size is computed from the rank's part (collectives.global_extent).
  const Dim& size = input_value(r, 0).shape.at(static_cast<size_t>(r.in[0].dim));
  if (size.offset != 0) {
    if (whole == "numel" || size.power != 1)
      conflict(r, describe_input(r, 0) + ", whose element count is asked",
               "sizes of a tensor over the whole sequence, or its size() along the sliced one");
    res.attr_updates["scale_unit"] = size.coef;
    res.attr_updates["scale_offset"] = size.offset;
  }
  if (whole == "numel") {
    res.attr_updates["scale_by_sp"] = true;
  } else if (whole == "size") {
    res.attr_updates["scale_by_sp"] = true;
    res.attr_updates["scale_dim"] = int64_t{r.in[0].dim};
  } else {
    const int d = norm_dim(r.node.int_attr("dim", 0), input_value(r, 0).rank());
    if (d == r.in[0].dim) res.attr_updates["scale_by_sp"] = true;
  }
  return res;
}

RuleResult rule_factory(const RuleInput& r) { return keep_all(r, all_replicate(r)); }

// x.new_empty(size) (new_zeros, new_ones, new_full) from a sharded x, with the sequence where
// x has it: the values do not depend on the position, so each rank allocates its chunk
// (local_dims), and in-place writes of sharded values into it (MLA's key buffer:
// k.new_empty(...)[..., :n].copy_(k_nope)) stay on the rank. Otherwise replicated.
RuleResult rule_new_factory(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Placement p = r.in[0];
  const Value& x = input_value(r, 0);
  const Value& out = output_value(r, 0);
  if (out.rank() != x.rank() ||
      !(out.shape[static_cast<size_t>(p.dim)] == x.shape[static_cast<size_t>(p.dim)]))
    return keep_all(r, all_replicate(r));
  RuleResult res = keep_all(r, {p});
  res.attr_updates["local_dims"] = std::vector<int64_t>{p.dim};
  return res;
}

}  // namespace autosp::rule_kit
