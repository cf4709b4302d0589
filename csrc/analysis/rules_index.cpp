// Placement rules: indexing and slicing (shifts), scatter/gather, embeddings, convolutions along
// the sequence.
#include <algorithm>

#include "analysis/rule_kit.h"

namespace autosp::rule_kit {

// Basic indexing and slicing: attrs dim_map (input dim -> output dim or -1) and
// sliced_dims (input dims not taken whole).
RuleResult rule_index(const RuleInput& r) {
  if (r.node.bool_attr("index_bool", false) && !all_replicate_inputs(r)) return rule_mask_index(r);
  if (r.in.empty() || !r.in[0].is_shard()) {
    // A replicated table gathered by a sequence-sharded index tensor (MoE expert weights
    // picked per token: w[expert_ids]) is sharded like the index, whose dims stand at
    // index_out in the output: each rank gathers the rows of its own tokens.
    int sharded = -1;
    for (size_t i = 1; i < r.in.size(); ++i) {
      if (r.in[i].is_replicate()) continue;
      if (!r.in[i].is_shard() || sharded >= 0 || r.in.size() != 2 ||
          r.node.bool_attr("index_bool", false) || !r.node.has_attr("index_out"))
        conflict(r, describe_input(r, i) + " used as an index",
                 "replicated index tensors, or one integer index tensor sharded along the "
                 "sequence into a replicated tensor");
      sharded = static_cast<int>(i);
    }
    if (sharded < 0) return keep_all(r, all_replicate(r));
    const Placement p = r.in[static_cast<size_t>(sharded)];
    return keep_all(
        r, {Placement::shard(static_cast<int>(r.node.int_attr("index_out", 0)) + p.dim, p.inner)});
  }
  const int d = r.in[0].dim;
  const auto sliced = r.node.ints_attr("sliced_dims");
  const auto dim_map = r.node.ints_attr("dim_map");
  const auto at = std::find(sliced.begin(), sliced.end(), d);
  if (at != sliced.end() && d < static_cast<int>(dim_map.size()) && dim_map[d] >= 0 &&
      r.in.size() == 1) {
    // A slice that drops a few positions at either end of the sequence (logits[:, :-1],
    // h[:, 1:], a padded conv's output cut back to S): the result has S + offset positions,
    // split as every sharded dim of that size is (S/P per rank, the last rank S/P + offset);
    // sp.shift takes each rank's part, with a boundary exchange when the slice starts after
    // position 0.
    const auto starts = r.node.ints_attr("slice_starts");
    const size_t k = static_cast<size_t>(at - sliced.begin());
    const int64_t start = k < starts.size() ? starts[k] : -1;
    const Dim& in_size = input_value(r, 0).shape[static_cast<size_t>(d)];
    const Dim& out_size = output_value(r, 0).shape[static_cast<size_t>(dim_map[d])];
    auto plain = [](const Dim& s) { return s.has_seq() && s.coef == 1 && s.power == 1; };
    if (r.in[0].inner == 1 && plain(in_size) && plain(out_size) && start >= 0 &&
        start <= in_size.offset - out_size.offset) {
      RuleResult res = keep_all(r, {Placement::shard(static_cast<int>(dim_map[d]))});
      res.expansion = Expansion::Shift;
      res.attr_updates["shift_dim"] = int64_t{d};
      res.attr_updates["shift_start"] = start;
      res.attr_updates["shift_offset"] = out_size.offset;
      res.attr_updates["shift_in_offset"] = in_size.offset;
      return res;
    }
  }
  if (at != sliced.end() || d >= static_cast<int>(dim_map.size()) || dim_map[d] < 0)
    conflict(r,
             describe_input(r, 0) + ", indexed or sliced along the sharded sequence dim " +
                 std::to_string(d),
             "the sequence dim taken whole, or a step-1 slice of S positions that drops a few "
             "at its ends (x[:, :-1], x[:, 1:])",
             "Each rank holds only its chunk of the sequence. Index or slice the sequence "
             "before it is sharded (on the full-length inputs), or take it whole.");
  for (size_t i = 1; i < r.in.size(); ++i)
    if (!r.in[i].is_replicate())
      conflict(r, describe_input(r, i) + " used as an index", "replicated index tensors");
  return keep_all(r, {Placement::shard(static_cast<int>(dim_map[d]), r.in[0].inner)});
}

// scatter / gather / index_select / index_add along `dim`: every tensor operand (input,
// index, src) lines up with the output outside `dim`, so a shard in another dim passes
// through, and replicated operands are sliced to the local chunk there. Along the sharded
// dim the op would move values between ranks' chunks: an error.
//   scatter(zeros [2*S, 8] S(0), dim=1, idx [2*S, 2] S(0), w [2*S, 2] S(0)) -> S(0)
RuleResult rule_scatter_gather(const RuleInput& r) {
  if (all_replicate_inputs(r)) return keep_all(r, all_replicate(r));
  const int s = first_shard(r);
  if (s < 0) conflict(r, "partial operands", "replicated or sharded operands");
  const Placement p = r.in[s];
  const int d = norm_dim(r.node.int_attr("dim", 0), output_value(r, 0).rank());
  const bool indexes_dim = r.node.op == "index_select" || r.node.op == "index_add" ||
                           r.node.op == "index_copy" || r.node.op == "index_fill";
  if (p.dim == d)
    conflict(r,
             describe_input(r, s) + ", and the op moves values along the sharded dim " +
                 std::to_string(d),
             "a " + r.node.op + " along a dim other than the sharded sequence dim");
  RuleResult res;
  res.out.assign(r.node.outputs.size(), p);
  res.operands.assign(r.in.size(), OperandChange::keep());
  const Dim& local = output_value(r, 0).shape[static_cast<size_t>(p.dim)];
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (r.node.inputs[i] < 0) continue;
    const Value& v = input_value(r, i);
    // index_select / index_add take a 1-D index over `dim`: it stays replicated.
    if (indexes_dim && i == 1) {
      if (!r.in[i].is_replicate())
        conflict(r, describe_input(r, i) + " used as the index", "a replicated index");
      continue;
    }
    if (r.in[i].is_shard() && !(r.in[i] == p))
      conflict(r, describe_input(r, s) + " and " + describe_input(r, i), "operands sharded alike");
    if (!r.in[i].is_replicate() || !v.is_tensor()) continue;
    if (v.rank() != output_value(r, 0).rank() || !(v.shape[static_cast<size_t>(p.dim)] == local))
      conflict(
          r,
          describe_input(r, i) + " whose dim " + std::to_string(p.dim) + " is not " + local.str(),
          "operands the size of the output along the sharded dim");
    res.operands[i] = OperandChange::slice(p.dim, p.inner);
  }
  return res;
}

RuleResult rule_embedding(const RuleInput& r) {
  if (r.in.size() > 1 && !r.in[1].is_replicate())
    conflict(r, describe_input(r, 1) + " (the embedding table)", "a replicated table");
  if (r.node.bool_attr("max_norm", false))
    conflict(r, "an embedding with max_norm (it renormalises, in the table, the rows the ids hit)",
             "an embedding without max_norm",
             "Each rank would renormalise only the rows its chunk of the sequence uses, and the "
             "ranks' tables would drift apart.");
  if (r.in[0].is_shard()) return keep_all(r, {r.in[0]});
  // The sequence is sharded here: the ids are sliced to the local chunk, so the large
  // activation is never materialised at full length.
  const int d = sequence_dim(input_value(r, 0));
  if (d < 0) return keep_all(r, all_replicate(r));
  RuleResult res = keep_all(r, {Placement::shard(d)});
  const Value& table = input_value(r, 1);
  const bool rows_known = table.rank() == 2 && table.shape[0].is_static();
  res.operands[0] =
      rows_known ? OperandChange::checked_slice(d, table.shape[0].coef) : OperandChange::slice(d);
  return res;
}

// conv1d(x, weight, bias) over x's last dim. With the sequence elsewhere (per-token convs over
// a merged batch) the shard passes through. Along the sequence (a Mamba-style causal conv, a
// local mixer), output t reads x[t - pad_left, t - pad_left + dilation*(kernel-1)]: each rank
// convolves its chunk extended by a halo (sp.halo: pad_left positions of the previous rank's
// chunk, zeros on rank 0; dilation*(kernel-1) - pad_left of the next one's, and the right
// padding's zeros on the last rank) without padding. The output has S + pad_left + pad_right
// - dilation*(kernel-1) positions, split as every sequence of S + offset positions is.
RuleResult rule_conv1d(const RuleInput& r) {
  for (size_t i = 1; i < r.in.size(); ++i)
    if (!r.in[i].is_replicate())
      conflict(r, describe_input(r, i) + " as the conv's weight or bias",
               "replicated weight and bias");
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  const Placement p = r.in[0];
  const int length_dim = x.rank() - 1;
  if (p.dim < length_dim - 1) return keep_all(r, {p});  // the batch dim
  const Dim& size = x.shape[static_cast<size_t>(length_dim)];
  const int64_t stride = r.node.int_attr("stride", -1), dilation = r.node.int_attr("dilation", -1);
  const int64_t left = r.node.int_attr("pad_left", -1), right = r.node.int_attr("pad_right", -1);
  const int64_t span = dilation * (r.node.int_attr("kernel", 0) - 1);
  const Dim& out_size = output_value(r, 0).shape[static_cast<size_t>(length_dim)];
  if (p.dim != length_dim || p.inner != 1 || !(size == Dim::seq()) || stride != 1 || left < 0 ||
      right < 0 || span < left || !out_size.has_seq() || out_size.power != 1 ||
      out_size.coef != 1 || out_size.offset != left + right - span)
    conflict(r,
             describe_input(r, 0) + ", convolved along its sharded dim " + std::to_string(p.dim) +
                 " (stride " + std::to_string(stride) + ", padding " + std::to_string(left) + "/" +
                 std::to_string(right) + ", dilation*(kernel-1) " + std::to_string(span) + ")",
             "a stride-1 conv along the whole sequence (its last dim) with static zero padding "
             "no wider than dilation*(kernel-1) on the left",
             sliced_sequence_hint(size));
  RuleResult res = keep_all(r, {p});
  res.expansion = Expansion::Halo;
  res.attr_updates["halo_left"] = left;
  res.attr_updates["halo_right"] = span - left;
  res.attr_updates["halo_last_pad"] = right;
  return res;
}

}  // namespace autosp::rule_kit
