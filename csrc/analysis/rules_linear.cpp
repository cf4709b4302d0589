// Placement rules: linear algebra: linear, matmul, einsum, layer norms.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "analysis/rule_kit.h"

namespace autosp::rule_kit {

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

namespace {

// The output batch dim along which both matmul operands split into head groups, for attention
// written by hand: the last batch dim where both have the same static size, a multiple of the
// SP degree (and more than one group). -1 when there is none.
int heads_dim(const RuleInput& r, const Value& a, const Value& b, int ro) {
  for (int d = ro - 3; d >= 0; --d) {
    const int da = d - (ro - a.rank()), db = d - (ro - b.rank());
    if (da < 0 || db < 0) continue;
    const Dim& x = a.shape[static_cast<size_t>(da)];
    if (x.is_static() && x == b.shape[static_cast<size_t>(db)] && r.sp_size > 1 &&
        x.coef % r.sp_size == 0)
      return d;
  }
  return -1;
}

// A sequence dim an all-to-all can gather whole: S itself (no dropped positions), not merged.
bool whole_sequence(const Value& v, const Placement& p) {
  const Dim& d = v.shape.at(static_cast<size_t>(p.dim));
  return p.is_shard() && p.inner == 1 && d.has_seq() && d.power == 1 && d.coef == 1 &&
         d.offset == 0;
}

// A shard along a static dim (attention heads, after an exchange).
bool static_shard(const Value& v, const Placement& p) {
  return p.is_shard() && v.shape.at(static_cast<size_t>(p.dim)).is_static();
}

}  // namespace

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
  // Attention written by hand, the scores q @ k.transpose(-2, -1): both operands sharded along
  // the sequence in their free dims, so the result would need the sequence split twice. As
  // Ulysses does for SDPA, both are exchanged to hold a group of heads over the whole
  // sequence; the scores are then split by heads ([B, H/P, S, S] per rank).
  if (pa.is_shard() && pa.dim == a.rank() - 2 && pb.is_shard() && pb.dim == b.rank() - 1 &&
      whole_sequence(a, pa) && whole_sequence(b, pb)) {
    if (const int h = heads_dim(r, a, b, ro); h >= 0) {
      res.operands[0] = OperandChange::exchange(h - (ro - a.rank()), pa.dim);
      res.operands[1] = OperandChange::exchange(h - (ro - b.rank()), pb.dim);
      res.out = {Placement::shard(h)};
      return res;
    }
  }
  // The scores, split by heads, times v (probs @ v): v is exchanged to the same heads, and
  // the result goes back to the sequence layout.
  if (static_shard(a, pa) && pa.dim < a.rank() - 2 &&
      (pb.is_replicate() || (pb.dim == b.rank() - 2 && whole_sequence(b, pb)))) {
    const int h = pa.dim + (ro - a.rank());
    const int hb = h - (ro - b.rank());
    if (hb >= 0 && b.shape[static_cast<size_t>(hb)] == a.shape[static_cast<size_t>(pa.dim)]) {
      res.operands[1] =
          pb.is_replicate() ? OperandChange::slice(hb) : OperandChange::exchange(hb, pb.dim);
      res.out = {Placement::shard(h)};
      const Dim& rows = out.shape[static_cast<size_t>(ro - 2)];
      if (rows.has_seq() && rows.power == 1 && rows.coef == 1 && rows.offset == 0)
        res.expansion = Expansion::ToSequence;
      return res;
    }
  }
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
             "If this is attention written by hand (probs @ v), autosp splits it by heads when "
             "the scores are split by heads (q @ k.transpose(-2, -1) over a batch dim whose "
             "size is a multiple of the SP degree).");
  }
  std::optional<Placement> outp;
  auto set = [&](Placement p) {
    if (outp && !(*outp == p))
      conflict(r,
               describe_input(r, 0) + " and " + describe_input(r, 1) +
                   ": both operands are sharded along the sequence in different output dims",
               "at most one sequence-sharded operand in a matmul",
               "This looks like attention written by hand (q @ k.transpose(-2, -1)). autosp "
               "splits it by heads when the operands share a batch dim (the heads) whose size is "
               "a multiple of the SP degree (" +
                   std::to_string(r.sp_size) + "); here none is.");
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

namespace {

// Attention written with einsum, split by heads as rule_matmul splits q @ k^T and probs @ v:
//   "bhqd,bhkd->bhqk" with q, k sharded along q and k: both exchanged to heads (S(1) out);
//   "bhqk,bhkd->bhqd" with the scores split by heads, v sharded along k: v exchanged, the
//   result back to the sequence layout. nullopt for any other einsum.
std::optional<RuleResult> einsum_by_heads(const RuleInput& r, const std::vector<std::string>& terms,
                                          const std::string& out_term) {
  if (r.in.size() != 2 || !r.in[0].is_shard() || !r.in[1].is_shard()) return std::nullopt;
  const Value& a = input_value(r, 0);
  const Value& b = input_value(r, 1);
  for (size_t i = 0; i < 2; ++i)
    if (terms[i].size() != static_cast<size_t>(input_value(r, i).rank())) return std::nullopt;
  auto letter_at = [&](size_t i) { return terms[i][static_cast<size_t>(r.in[i].dim)]; };
  auto dim_of = [](const std::string& t, char c) { return static_cast<int>(t.find(c)); };
  // The letter both terms and the output share with one static size, a multiple of P.
  auto heads_letter = [&]() -> char {
    for (auto it = out_term.rbegin(); it != out_term.rend(); ++it) {
      const size_t ka = terms[0].find(*it), kb = terms[1].find(*it);
      if (ka == std::string::npos || kb == std::string::npos) continue;
      const Dim& x = a.shape[ka];
      if (x.is_static() && x == b.shape[kb] && r.sp_size > 1 && x.coef % r.sp_size == 0) return *it;
    }
    return 0;
  };
  const char la = letter_at(0), lb = letter_at(1);
  const bool seq_a = whole_sequence(a, r.in[0]), seq_b = whole_sequence(b, r.in[1]);
  RuleResult res;
  res.operands.assign(2, OperandChange::keep());
  if (seq_a && seq_b && la != lb && out_term.find(la) != std::string::npos &&
      out_term.find(lb) != std::string::npos && terms[1].find(la) == std::string::npos &&
      terms[0].find(lb) == std::string::npos) {
    const char h = heads_letter();
    if (h == 0) return std::nullopt;
    res.operands[0] = OperandChange::exchange(dim_of(terms[0], h), r.in[0].dim);
    res.operands[1] = OperandChange::exchange(dim_of(terms[1], h), r.in[1].dim);
    res.out = {Placement::shard(dim_of(out_term, h))};
    return res;
  }
  if (static_shard(a, r.in[0]) && seq_b && terms[1].find(la) != std::string::npos &&
      out_term.find(la) != std::string::npos && out_term.find(lb) == std::string::npos &&
      b.shape[terms[1].find(la)] == a.shape[static_cast<size_t>(r.in[0].dim)]) {
    res.operands[1] = OperandChange::exchange(dim_of(terms[1], la), r.in[1].dim);
    res.out = {Placement::shard(dim_of(out_term, la))};
    for (int d = 0; d < output_value(r, 0).rank(); ++d) {
      const Dim& s = output_value(r, 0).shape[static_cast<size_t>(d)];
      if (s.has_seq() && s.power == 1 && s.coef == 1 && s.offset == 0)
        res.expansion = Expansion::ToSequence;
    }
    return res;
  }
  return std::nullopt;
}

}  // namespace

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
  if (auto heads = einsum_by_heads(r, terms, out_term)) return *heads;
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
               "This looks like attention written by hand. autosp splits it by heads when both "
               "operands share a letter of the output (the heads) whose size is a multiple of the "
               "SP degree (" +
                   std::to_string(r.sp_size) + "); here none is.");
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

}  // namespace autosp::rule_kit
