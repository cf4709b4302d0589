// Placement propagation for the ops with their own emitter (see propagate.h): attention
// (Ulysses: the sequence exchanged for a group of heads around the kernel) and cross-entropy
// (the loss over each rank's tokens); and the printed propagation.
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "plan/propagator.h"

namespace autosp {

namespace plan_detail {

std::optional<PlanError> Propagator::heads_refusal(const Node& n,
                                                   const std::vector<Operand>& ops) const {
  const int64_t P = cfg_.sp_size;
  const Dim hq = val(ops[0]).shape.at(1);
  if (!hq.is_static() || hq.coef % P != 0)
    return PlanError(
        kPass, n, hq.str() + " query heads for an SP degree of " + std::to_string(P),
        "a number of query heads divisible by the SP degree (" + hq.str() + " % " +
            std::to_string(P) + (hq.is_static() ? " = " + std::to_string(hq.coef % P) : "") + ")",
        "Ulysses splits attention heads across the SP group; choose an SP degree that divides "
        "the number of heads (unsupported='gather', the default, runs this attention on the "
        "all-gathered sequence instead).");
  const int64_t Hq = hq.coef;
  for (size_t i = 1; i < 3; ++i) {
    const Dim h = val(ops[i]).shape.at(1);
    if (!h.is_static() || h.coef == Hq || Hq % h.coef != 0 || h.coef % P == 0) continue;
    const int64_t H = h.coef;
    const int64_t f = P / std::gcd(H, P);
    if (Hq % (H * f) != 0)
      return PlanError(kPass, n,
                       std::to_string(H) + " key/value heads, " + std::to_string(Hq) +
                           " query heads, SP degree " + std::to_string(P),
                       "key/value heads that can be repeated to a multiple of the SP degree "
                       "dividing the query heads");
  }
  if (n.op == "flex_attention" && n.bool_attr("reads_head_index", false))
    return PlanError(kPass, n, "a score_mod or mask_mod that reads the head index h",
                     "mods that do not depend on h",
                     "Ulysses gives each rank H/P heads, and flex_attention passes the rank's "
                     "local head index to the mods; pass per-head values through q/k/v "
                     "instead (unsupported='gather', the default, runs this attention on the "
                     "all-gathered sequence).");
  return std::nullopt;
}

void Propagator::decide_attention(const Node& n) {
  std::vector<Operand> ops = operands(n);
  bool any_shard = false;
  for (Operand& o : ops) {
    to_sequence(o);  // values split by heads
    reduce(o);
    any_shard = any_shard || (o.present() && o.p.is_shard());
  }
  NodePlacement d;
  if (!any_shard) {
    d.results.assign(n.outputs.size(), Placement::replicate());
    d.outputs = d.results;
    return finish(n, ops, std::move(d));
  }
  if (n.op == "sdpa" && n.has_attr("dropout_p"))
    throw PlanError(kPass, n, "attention dropout (dropout_p > 0)", "dropout_p=0 under Ulysses",
                    "Each rank runs H/P heads and would draw its attention-dropout mask from the "
                    "same random state as every other rank; apply dropout outside attention.");
  const Value q = val(ops[0]);
  if (q.rank() != 4)
    throw PlanError(kPass, n,
                    "query of rank " + std::to_string(q.rank()) + " " + shape_str(q.shape),
                    "[batch, heads, seq, head_dim] query, key and value");
  for (size_t i = 0; i < 3; ++i) {
    const Value v = val(ops[i]);
    const Placement p = ops[i].p;
    const Dim& len = v.shape.at(2);
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
                          " " + shape_str(v.shape) + " placed " + p.str(),
                      "the sequence in dim 2 (S(2)) or a replicated tensor");
  }
  // What Ulysses cannot split by heads (query heads not divisible by P, key/value heads that no
  // repetition fits, a flex mod reading the head index) runs on the all-gathered sequence:
  // exact, like any op without a sequence-parallel form, or refused with unsupported="error".
  if (std::optional<PlanError> refused = heads_refusal(n, ops)) {
    gather_all(n, ops, *refused);  // throws it when not allowed
    out_.gathered.push_back(refused->what());
    d.results.assign(n.outputs.size(), Placement::replicate());
    d.outputs = d.results;
    return finish(n, ops, std::move(d));
  }
  // A full-length query with sharded key/value (a query computed on the gathered sequence):
  // this rank's chunk of it, like any replicated operand meeting sharded ones.
  if (!ops[0].p.is_shard()) {
    if (!q.shape.at(2).has_seq())
      throw PlanError(kPass, n,
                      "a replicated query " + shape_str(q.shape) + " with sharded key/value",
                      "a query sharded along the sequence, or a full-length one");
    slice(ops[0], 2, 1);
  }
  const int64_t P = cfg_.sp_size;
  const int64_t Hq = q.shape[1].coef;  // static and divisible by P (heads_refusal)
  for (size_t i = 0; i < 3; ++i) {
    const Dim h = val(ops[i]).shape[1];
    if (!h.is_static())
      throw PlanError(kPass, n, "a heads dim of size " + h.str(), "a static number of heads");
    const int64_t H = h.coef;
    if (i > 0 && H != Hq) {
      // One key/value head broadcasts against every query head (multi-query attention,
      // as SDPA broadcasts it without enable_gqa): handled as GQA.
      if ((!n.bool_attr("enable_gqa", false) && H != 1) || Hq % H != 0)
        throw PlanError(
            kPass, n,
            std::to_string(H) + " key/value heads for " + std::to_string(Hq) + " query heads",
            "equal heads, or enable_gqa=True with query heads a multiple of key/value heads");
      // Fewer KV heads than ranks: repeat each KV head so that every rank receives the KV
      // head its query heads attend to (heads_refusal checked that this fits).
      if (H % P != 0) step(ops[i], {Step::Kind::RepeatHeads, 1, 1, P / std::gcd(H, P)});
    }
    if (ops[i].p.is_shard())
      step(ops[i], {Step::Kind::Exchange, 1, 1, 2});
    else
      slice(ops[i], 1, 1);  // replicated full-length k/v: keep the local heads
  }
  // Masks (sdpa's attn_mask; flex_attention's block mask tensors, then its mods' buffers)
  // apply to the whole sequence, which every rank sees after the exchange: they stay
  // replicated, and a per-head mask keeps this rank's heads.
  const bool flex = n.op == "flex_attention";
  const size_t per_head_end =
      flex ? 3 + static_cast<size_t>(n.int_attr("block_mask_inputs", 0)) : ops.size();
  for (size_t i = 3; i < ops.size(); ++i) {
    if (!ops[i].present()) continue;
    if (!ops[i].p.is_replicate()) {
      const PlanError refused(kPass, n, "an attention mask placed " + ops[i].p.str(),
                              "a replicated (full-length) mask",
                              "Build the mask from full-length positions (as single-device code "
                              "does).");
      // A mask computed from sharded activations (a per-key bias): the gather fallback
      // gives every rank the whole of it.
      std::vector<Operand> mask = {ops[i]};
      gather_all(n, mask, refused);
      ops[i] = std::move(mask[0]);
      out_.gathered.push_back(refused.what());
    }
    const Value m = val(ops[i]);
    // The heads dim: dim 1 of flex's block mask tensors ([B, H, blocks...]); for an SDPA mask,
    // which broadcasts against [B, H, S, S] from the right, the third dim from the end.
    const int hd = flex ? 1 : m.rank() - 3;
    if (i < per_head_end && hd >= 0 && hd < m.rank() &&
        m.shape[static_cast<size_t>(hd)].is_static() &&
        m.shape[static_cast<size_t>(hd)].coef == Hq && Hq > 1)
      slice(ops[i], hd, 1);  // this rank's heads (behind a gradient sync)
    else
      // The whole mask on every rank, used by this rank's heads only: its gradient is this
      // rank's part, summed over ranks by the sync.
      grad_sync(ops[i]);
  }
  // Every output ([B, H, S, D] attention, [B, H, S] logsumexp) goes back to the sequence
  // layout.
  d.results.assign(n.outputs.size(), Placement::shard(1));
  d.outputs = d.results;
  d.via.assign(n.outputs.size(), "");
  for (size_t j = 0; j < n.outputs.size(); ++j) {
    if (in_.value(n.outputs[j]).rank() < 3) continue;
    d.outputs[j] = Placement::shard(2);
    d.via[j] = "sp.all_to_all";
  }
  finish(n, ops, std::move(d));
}

void Propagator::decide_loss(const Node& n) {
  std::vector<Operand> ops = operands(n);
  for (Operand& o : ops) {
    to_sequence(o);  // values split by heads
    reduce(o);
  }
  const Placement px = ops.at(0).p;
  const Placement pt = ops.at(1).p;
  NodePlacement d;
  if (px.is_replicate() && pt.is_replicate()) {
    d.results = d.outputs = {Placement::replicate()};
    return finish(n, ops, std::move(d));
  }
  if (ops.size() > 2 && ops[2].present())
    throw PlanError(kPass, n, "a class-weight tensor", "cross-entropy without class weights",
                    "Weighted cross-entropy is not supported under sequence parallelism yet.");
  const Value x = val(ops[0]);
  const Value t = val(ops[1]);
  Placement per_token;
  if (px.is_local() && px.dim == 0 && x.rank() == 2 && pt.is_local() && pt.dim == 0 &&
      t.shape.at(0) == x.shape.at(0)) {
    // Rows selected on each rank (logits[mask], labels[mask]): per-row losses stay local,
    // their sum is partial, their mean divides by the valid targets of every rank.
    per_token = Placement::local(0);
  } else {
    if (px.is_local())
      throw PlanError(kPass, n,
                      "logits " + shape_str(x.shape) + " placed " + px.str() +
                          " (rows selected on each rank) and targets " + shape_str(t.shape) +
                          " placed " + pt.str(),
                      "targets selected like the logits",
                      "Select both with the same positions (torch.where on a mask over "
                      "activations). A mask built from the labels alone is replicated: compute "
                      "the loss with reduction='none' and average it with the mask instead.");
    if (!px.is_shard() || px.dim == 1 || (x.rank() > 1 && px.dim == 0 && x.rank() != 2) ||
        (x.rank() == 2 && px.dim != 0))
      throw PlanError(kPass, n, "logits " + shape_str(x.shape) + " placed " + px.str(),
                      "logits sharded along the token dim ([N, C] sharded on N)");
    // Class indices lack the class dim (1); class probabilities have the logits' shape.
    const int tdim = px.dim == 0 || is_float(t.dtype) ? px.dim : px.dim - 1;
    if (pt.is_shard() && !(pt == Placement::shard(tdim, px.inner)))
      throw PlanError(kPass, n, "targets placed " + pt.str() + " and logits placed " + px.str(),
                      "targets sharded like the logits' token dim");
    if (pt.is_replicate()) slice(ops[1], tdim, px.inner);
    per_token = Placement::shard(tdim, px.inner);
  }
  // Per token for reduction none; partial for sum, and for mean: the local sum over the
  // number of valid targets in the group.
  const bool none = n.str_attr("reduction", "mean") == "none";
  d.results = d.outputs = {none ? per_token : Placement::partial()};
  finish(n, ops, std::move(d));
}

}  // namespace plan_detail

std::string print_placements(const Graph& in, const Propagation& p) {
  std::ostringstream os;
  for (const Node& n : in.nodes) {
    if (n.op == "nontensor" || n.op == "sym_size" || n.op == "sym_arith") continue;
    const NodePlacement& d = p.nodes.at(static_cast<size_t>(n.id));
    os << (n.op == "output"
               ? "output"
               : "%" + std::to_string(n.outputs.empty() ? -1 : n.outputs[0]) + " = " + n.op)
       << '(';
    for (size_t i = 0, shown = 0; i < n.inputs.size(); ++i) {
      if (n.inputs[i] < 0 || !in.value(n.inputs[i]).is_tensor()) continue;
      os << (shown++ ? ", " : "") << '%' << n.inputs[i] << ':' << d.operands.at(i).str();
      if (!d.steps.at(i).empty()) {
        os << '[';
        for (size_t s = 0; s < d.steps[i].size(); ++s)
          os << (s ? "+" : "") << step_op(d.steps[i][s].kind);
        os << ']';
      }
    }
    os << ')';
    if (!n.outputs.empty()) {
      os << " ->";
      for (size_t i = 0; i < n.outputs.size(); ++i) {
        os << (i ? ", " : " ") << '%' << n.outputs[i] << ':' << d.outputs.at(i).str();
        if (!d.via.at(i).empty()) os << '[' << d.via[i] << ']';
      }
    }
    if (!n.loc.empty()) os << "  # " << n.loc.file << ':' << n.loc.line;
    os << '\n';
  }
  return os.str();
}

}  // namespace autosp
