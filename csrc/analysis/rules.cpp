#include "analysis/rules.h"

#include <algorithm>
#include <map>
#include <set>

namespace autosp {

namespace {

constexpr const char* kPass = "placement";

const Value& input_value(const RuleInput& r, size_t i) { return r.graph.value(r.node.inputs[i]); }
const Value& output_value(const RuleInput& r, size_t i) { return r.graph.value(r.node.outputs[i]); }

RuleResult keep_all(const RuleInput& r, std::vector<Placement> out) {
  RuleResult res;
  res.out = std::move(out);
  res.operands.assign(r.node.inputs.size(), OperandChange::keep());
  return res;
}

std::vector<Placement> all_replicate(const RuleInput& r) {
  return std::vector<Placement>(r.node.outputs.size(), Placement::replicate());
}

bool all_replicate_inputs(const RuleInput& r) {
  return std::all_of(r.in.begin(), r.in.end(), [](const Placement& p) { return p.is_replicate(); });
}

std::string describe_input(const RuleInput& r, size_t i) {
  const Value& v = input_value(r, i);
  return "input " + std::to_string(i) + " " + v.dtype + shape_str(v.shape) + " placed " +
         r.in[i].str();
}

[[noreturn]] void conflict(const RuleInput& r, const std::string& found,
                           const std::string& expected, const std::string& hint = "") {
  throw PlanError(kPass, r.node, found, expected, hint);
}

// Index of the (first) sharded input, or -1.
int first_shard(const RuleInput& r) {
  for (size_t i = 0; i < r.in.size(); ++i)
    if (r.in[i].is_shard()) return static_cast<int>(i);
  return -1;
}

int norm_dim(int64_t d, int rank) {
  if (d < 0) d += rank;
  return static_cast<int>(d);
}

// ---- elementwise with broadcasting -------------------------------------------------------

RuleResult rule_elementwise(const RuleInput& r) {
  if (all_replicate_inputs(r)) return keep_all(r, all_replicate(r));
  const Value& out = output_value(r, 0);
  const int ro = out.rank();
  // The output placement, from the sharded operands (aligned from the right).
  std::optional<Placement> shard;
  int from = -1;
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (!r.in[i].is_shard()) continue;
    const int offset = ro - input_value(r, i).rank();
    Placement p = Placement::shard(r.in[i].dim + offset, r.in[i].inner);
    if (shard && !(*shard == p))
      conflict(r,
               describe_input(r, from) + " and " + describe_input(r, i) +
                   ", sharded on different output dims (" + shard->str() + " vs " + p.str() + ")",
               "operands sharded on the same sequence dim",
               "Both operands carry the sequence; their layouts differ. Check that the two "
               "tensors index the sequence the same way.");
    shard = p;
    from = static_cast<int>(i);
  }
  if (!shard) conflict(r, "partial operands", "replicate or sharded operands");
  RuleResult res;
  res.out.assign(r.node.outputs.size(), *shard);
  res.operands.assign(r.in.size(), OperandChange::keep());
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (r.node.inputs[i] < 0 || !r.in[i].is_replicate()) continue;
    const Value& v = input_value(r, i);
    if (!v.is_tensor()) continue;
    const int k = shard->dim - (ro - v.rank());
    if (k < 0) continue;  // broadcast along a dim the operand lacks
    if (v.shape[k].is_one()) continue;
    if (!(v.shape[k] == out.shape[shard->dim]))
      conflict(r,
               describe_input(r, i) + " whose dim " + std::to_string(k) + " is " + v.shape[k].str(),
               "size " + out.shape[shard->dim].str() + " or 1 along the sharded dim");
    res.operands[i] = OperandChange::slice(k, shard->inner);
  }
  return res;
}

// Random elementwise ops (dropout, rand_like, randn_like) on a sharded value. The ranks share
// the random seed, so drawing for the local chunk would give every rank the same numbers
// for its own chunk: position j and j + S/P would share a dropout mask. Instead each rank
// draws at full length and keeps its chunk (attributes random_dim, random_inner and
// random_outer tell the bridge where the chunk lies): the draw is the single-device one, and
// every rank consumes the same random numbers, so replicated draws stay identical on all ranks.
RuleResult rule_random(const RuleInput& r) {
  RuleResult res = rule_elementwise(r);
  if (res.out.empty() || !res.out[0].is_shard()) return res;
  const Placement p = res.out[0];
  const Dim& size = output_value(r, 0).shape[static_cast<size_t>(p.dim)];
  if (!size.has_seq() || size.power != 1 || size.offset != 0 || size.coef % p.inner != 0)
    conflict(r, describe_input(r, 0) + ", a random draw over a sharded dim of size " + size.str(),
             "a dim that is a multiple of S");
  res.attr_updates["random_dim"] = int64_t{p.dim};
  res.attr_updates["random_inner"] = p.inner;
  res.attr_updates["random_outer"] = size.coef / p.inner;
  return res;
}

// ---- reductions ------------------------------------------------------------------------

std::vector<int> reduced_dims(const RuleInput& r, int rank) {
  std::vector<int> dims;
  for (int64_t d : r.node.ints_attr("dims")) dims.push_back(norm_dim(d, rank));
  if (dims.empty())
    for (int d = 0; d < rank; ++d) dims.push_back(d);
  return dims;
}

RuleResult rule_reduction(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  const auto dims = reduced_dims(r, x.rank());
  const bool keepdim = r.node.bool_attr("keepdim", false);
  const Placement& p = r.in[0];
  if (std::find(dims.begin(), dims.end(), p.dim) == dims.end()) {
    int d = p.dim;
    if (!keepdim)
      d -= static_cast<int>(
          std::count_if(dims.begin(), dims.end(), [&](int k) { return k < p.dim; }));
    return keep_all(r, std::vector<Placement>(r.node.outputs.size(), Placement::shard(d, p.inner)));
  }
  if (r.node.op == "sum") return keep_all(r, {Placement::partial()});
  if (r.node.op == "mean") {
    RuleResult res = keep_all(r, {Placement::partial()});
    res.expansion = "mean_partial";
    return res;
  }
  // Reductions that combine across ranks by the same reduction: reduce the local chunk, then
  // gather every rank's result and reduce those (sp.combine). One output only: max/min with
  // a dim also return indices, which would need each chunk's offset.
  static const std::set<std::string> combinable = {"amax", "amin", "logsumexp",
                                                   "prod", "max",  "min"};
  if (combinable.count(r.node.op) && r.node.outputs.size() == 1) {
    RuleResult res = keep_all(r, {Placement::replicate()});
    res.expansion = "combine";
    return res;
  }
  conflict(
      r, describe_input(r, 0) + ", reduced along the sharded sequence dim " + std::to_string(p.dim),
      "a reduction that combines exactly across ranks (sum, mean, amax, amin, logsumexp, prod, "
      "max/min without indices), or a reduction over other dims",
      "'" + r.node.op + "' over the whole sequence is not supported under sequence parallelism.");
}

// ---- ops along one dim that must not be the sharded one (softmax, cumsum, ...) ---------

RuleResult rule_along_dim(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const Value& x = input_value(r, 0);
  if (!r.node.has_attr("dim"))  // never guess the dim an op works along
    conflict(r, describe_input(r, 0) + " and no dim attribute", "the dim the op works along");
  const int d = norm_dim(r.node.int_attr("dim", -1), x.rank());
  // Scans along the sequence: each rank scans its chunk, then combines the totals of the
  // ranks before it (sp.scan). Exact when the dim is the sequence alone (size S, no other
  // factor merged in).
  static const std::set<std::string> scans = {"cumsum", "cumprod", "logcumsumexp"};
  if (d == r.in[0].dim && scans.count(r.node.op) && r.in[0].inner == 1 &&
      x.shape[static_cast<size_t>(d)] == Dim::seq(1)) {
    RuleResult res = keep_all(r, {r.in[0]});
    res.expansion = "scan";
    return res;
  }
  if (d == r.in[0].dim)
    conflict(r, describe_input(r, 0) + ", and the op works along dim " + std::to_string(d),
             "an op along a dim other than the sharded sequence dim",
             "Each rank holds only its chunk of the sequence, so '" + r.node.op +
                 "' along it would be wrong; compute it before the sequence is sharded or "
                 "inside attention.");
  return keep_all(r, std::vector<Placement>(r.node.outputs.size(), r.in[0]));
}

// ---- shape ops -------------------------------------------------------------------------

RuleResult rule_reshape(const RuleInput& r) {
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

// einsum: the sequence letter is the one a sharded operand has at its sharded dim. Kept in
// the output, the output is sharded there; contracted, the output is a partial sum. Replicated
// operands that carry the letter are sliced to the local chunk.
//   "bsd,de->bse" with S(1), R -> S(1);   "bsd,bse->de" with S(1), S(1) -> P
RuleResult rule_einsum(const RuleInput& r) {
  if (all_replicate_inputs(r)) return keep_all(r, all_replicate(r));
  const std::string eq = r.node.str_attr("equation", "");
  const size_t arrow = eq.find("->");
  if (arrow == std::string::npos || eq.find('.') != std::string::npos)
    conflict(r, "equation \"" + eq + "\" on a sequence-sharded operand",
             "an explicit output (\"->\") and no ellipsis");
  std::vector<std::string> terms;
  for (size_t b = 0, e;; b = e + 1) {
    e = eq.find(',', b);
    terms.push_back(eq.substr(b, std::min(e, arrow) - b));
    if (e == std::string::npos || e > arrow) break;
  }
  const std::string out_term = eq.substr(arrow + 2);
  if (terms.size() != r.in.size())
    conflict(
        r, std::to_string(terms.size()) + " terms for " + std::to_string(r.in.size()) + " operands",
        "one term per operand");
  char letter = 0;
  for (size_t i = 0; i < r.in.size(); ++i) {
    if (!r.in[i].is_shard()) continue;
    if (r.in[i].inner != 1 || r.in[i].dim >= static_cast<int>(terms[i].size()))
      conflict(r, describe_input(r, i), "the sequence as a dim of its own");
    const char c = terms[i][static_cast<size_t>(r.in[i].dim)];
    if (letter != 0 && c != letter)
      conflict(r,
               "operands sharded along different letters ('" + std::string(1, letter) + "' and '" +
                   std::string(1, c) + "') of \"" + eq + "\"",
               "one sequence letter",
               "This looks like attention written by hand; use "
               "torch.nn.functional.scaled_dot_product_attention, which autosp parallelises.");
    letter = c;
  }
  RuleResult res;
  res.operands.assign(r.in.size(), OperandChange::keep());
  for (size_t i = 0; i < r.in.size(); ++i) {
    const size_t k = terms[i].find(letter);
    if (std::count(terms[i].begin(), terms[i].end(), letter) > 1)
      conflict(r, "the sequence letter repeated in \"" + terms[i] + "\"", "a letter once per term");
    if (r.in[i].is_replicate() && k != std::string::npos)
      res.operands[i] = OperandChange::slice(static_cast<int>(k));
    if (r.in[i].is_shard() && k != static_cast<size_t>(r.in[i].dim))
      conflict(r, describe_input(r, i), "operands sharded along the same letter");
  }
  const size_t o = out_term.find(letter);
  res.out = {o == std::string::npos ? Placement::partial() : Placement::shard(static_cast<int>(o))};
  return res;
}

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

// Basic indexing and slicing: attrs dim_map (input dim -> output dim or -1) and
// sliced_dims (input dims not taken whole).
RuleResult rule_index(const RuleInput& r) {
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
      res.expansion = "shift";
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
             "no wider than dilation*(kernel-1) on the left");
  RuleResult res = keep_all(r, {p});
  res.expansion = "halo";
  res.attr_updates["halo_left"] = left;
  res.attr_updates["halo_right"] = span - left;
  res.attr_updates["halo_last_pad"] = right;
  return res;
}

RuleResult rule_tril(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const int rank = input_value(r, 0).rank();
  if (r.in[0].dim >= rank - 2)
    conflict(r, describe_input(r, 0) + ", whose last two dims hold the sharded sequence",
             "a replicated matrix");
  return keep_all(r, {r.in[0]});
}

// ---- linear algebra --------------------------------------------------------------------

RuleResult rule_linear(const RuleInput& r) {
  if (all_replicate_inputs(r)) return keep_all(r, all_replicate(r));
  for (size_t i = 1; i < r.in.size(); ++i)
    if (!r.in[i].is_replicate())
      conflict(r, describe_input(r, i) + " (a weight or bias)", "replicated weights and bias");
  const Value& x = input_value(r, 0);
  if (r.in[0].dim == x.rank() - 1)
    conflict(r, describe_input(r, 0) + ", sharded along its feature (contraction) dim",
             "the sequence in a leading dim");
  return keep_all(r, {r.in[0]});
}

RuleResult rule_matmul(const RuleInput& r) {
  if (all_replicate_inputs(r)) return keep_all(r, all_replicate(r));
  const Value& a = input_value(r, 0);
  const Value& b = input_value(r, 1);
  const Value& out = output_value(r, 0);
  if (a.rank() < 2 || b.rank() < 2)
    conflict(r, "a matrix-vector product with a sharded operand", "operands of rank >= 2");
  const int ro = out.rank();
  const Placement pa = r.in[0], pb = r.in[1];
  RuleResult res;
  res.operands.assign(2, OperandChange::keep());
  // Contraction over the sequence: a[..., M, S] @ b[..., S, N] gives a partial sum.
  const bool a_k = pa.is_shard() && pa.dim == a.rank() - 1;
  const bool b_k = pb.is_shard() && pb.dim == b.rank() - 2;
  if (a_k || b_k) {
    if (a_k && b_k && pa.inner == pb.inner) {
      res.out = {Placement::partial()};
      return res;
    }
    if (a_k && pb.is_replicate()) {
      res.operands[1] = OperandChange::slice(b.rank() - 2, pa.inner);
      res.out = {Placement::partial()};
      return res;
    }
    if (b_k && pa.is_replicate()) {
      res.operands[0] = OperandChange::slice(a.rank() - 1, pb.inner);
      res.out = {Placement::partial()};
      return res;
    }
    conflict(r,
             describe_input(r, 0) + " and " + describe_input(r, 1) +
                 ": one operand is sharded along the contraction dim, the other elsewhere",
             "both operands sharded along the contraction dim, or one of them replicated",
             "This looks like attention written by hand (probs @ v); use "
             "torch.nn.functional.scaled_dot_product_attention, which autosp parallelises.");
  }
  std::optional<Placement> outp;
  auto set = [&](Placement p) {
    if (outp && !(*outp == p))
      conflict(r,
               describe_input(r, 0) + " and " + describe_input(r, 1) +
                   ": both operands are sharded along the sequence in different output dims",
               "at most one sequence-sharded operand in a matmul",
               "This looks like attention written by hand (q @ k.transpose(-2, -1)); use "
               "torch.nn.functional.scaled_dot_product_attention, which autosp parallelises.");
    outp = p;
  };
  if (pa.is_shard())
    set(Placement::shard(pa.dim == a.rank() - 2 ? ro - 2 : pa.dim + (ro - a.rank()), pa.inner));
  if (pb.is_shard()) {
    if (pb.dim == b.rank() - 1)
      set(Placement::shard(ro - 1, pb.inner));
    else
      set(Placement::shard(pb.dim + (ro - b.rank()), pb.inner));
  }
  // A batch-dim shard on one side needs the replicated other side sliced in that dim.
  if (outp && outp->dim < ro - 2) {
    for (int i = 0; i < 2; ++i) {
      const Value& v = i == 0 ? a : b;
      if (!r.in[i].is_replicate()) continue;
      const int k = outp->dim - (ro - v.rank());
      if (k >= 0 && !v.shape[k].is_one()) res.operands[i] = OperandChange::slice(k, outp->inner);
    }
  }
  res.out = {*outp};
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

// layer_norm / rms_norm normalise over the last `norm_dims` dims; the sequence must lie
// outside them. Weight and bias broadcast like elementwise operands.
RuleResult rule_layer_norm(const RuleInput& r) {
  if (r.in.empty() || !r.in[0].is_shard()) return keep_all(r, all_replicate(r));
  const int rank = input_value(r, 0).rank();
  const int first_normed = rank - static_cast<int>(r.node.int_attr("norm_dims", 1));
  if (r.in[0].dim >= first_normed)
    conflict(r, describe_input(r, 0) + ", normalised over dims >= " + std::to_string(first_normed),
             "normalisation over dims that do not hold the sharded sequence");
  return rule_elementwise(r);
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

const std::map<std::string, OpRule>& registry() {
  static const std::map<std::string, OpRule> rules = [] {
    std::map<std::string, OpRule> m;
    for (const char* op : {"add", "sub", "rsub"})
      m[op] = {rule_elementwise, PartialBehaviour::Additive};
    for (const char* op : {"mul", "div"}) m[op] = {rule_elementwise, PartialBehaviour::Scale};
    for (const char* op : {"neg", "to", "contiguous", "clone"})
      m[op] = {rule_elementwise, PartialBehaviour::Unary};
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
