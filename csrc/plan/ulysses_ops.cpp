// The Ulysses plan builder's op-specific emitters: attention (the all-to-all exchange),
// scans and reductions across ranks, shifts and convolution halos (the loss: loss.cpp).
#include <algorithm>
#include <numeric>
#include <set>
#include <stdexcept>

#include "plan/plan_builder.h"

namespace autosp::plan_detail {

void PlanBuilder::emit_cross_rank(const Node& n, std::vector<int> ins, bool scan) {
  // The local reduction is one per-rank term of the combined result, which sp.combine
  // reduces with the op itself (not a sum); the plan prints it as P.
  const Placement local = scan ? placement(ins[0]) : Placement::partial();
  // A chunk whose elements are all -inf has a local logsumexp of -inf, whose backward is NaN
  // (one device never forms it): the local step is a guarded logsumexp.
  Attrs local_attrs;
  if (!scan && n.op == "logsumexp") local_attrs["guarded_logsumexp"] = true;
  const int idx = copy_node(n, ins, {local}, local_attrs);
  const int y = out_.nodes[static_cast<size_t>(idx)].outputs[0];
  Attrs attrs{{"op", n.op}};
  if (scan) attrs["dim"] = int64_t{local.dim};
  const int out = emit(scan ? "sp.scan" : "sp.combine", {y}, attrs,
                       {{val(y), scan ? local : Placement::replicate()}}, n.loc)[0];
  vmap_[static_cast<size_t>(n.outputs[0])] = out;
}

void PlanBuilder::emit_shift(const Node& n, std::vector<int> ins, const RuleResult& res) {
  const int64_t d = std::get<int64_t>(res.attr_updates.at("shift_dim"));
  const int64_t start = std::get<int64_t>(res.attr_updates.at("shift_start"));
  // Starting after position 0, each rank's part is a copy (it takes the next rank's first
  // positions), not a view: a later in-place write through it, or into the tensor it was
  // sliced from, would not reach the other.
  if (start > 0) {
    if (const Node* w = later_write_to_aliases(n))
      throw PlanError(kPass, *w,
                      "an in-place '" + w->op +
                          "' that writes, after it, into the sequence slice " + "at " + n.loc.file +
                          ":" + std::to_string(n.loc.line) +
                          " (which starts after position 0) or into the tensor it was sliced from",
                      "no in-place writes through a slice that starts after position 0 of the "
                      "sharded sequence",
                      "Under sequence parallelism that slice is a copy on each rank; write out of "
                      "place (y = torch.cat([...]) or x * mask) instead.");
  }
  const int64_t offset = std::get<int64_t>(res.attr_updates.at("shift_offset"));
  const int64_t in_offset = std::get<int64_t>(res.attr_updates.at("shift_in_offset"));
  Value v = val(ins[0]);
  v.shape.at(static_cast<size_t>(d)) = Dim::seq(1, 1, offset);
  ins[0] = emit("sp.shift", {ins[0]},
                {{"dim", d}, {"start", start}, {"offset", offset}, {"in_offset", in_offset}},
                {{v, placement(ins[0])}}, n.loc)[0];
  copy_node(n, ins, res.out, {{"unslice_dim", d}});
}

const Node* PlanBuilder::later_write_to_aliases(const Node& n) const {
  static const std::set<std::string> views = {"reshape", "permute",         "expand",
                                              "index",   "alias",           "split",
                                              "unbind",  "view_as_complex", "view_as_real"};
  std::set<int> alias(n.inputs.begin(), n.inputs.begin() + 1);
  alias.insert(n.outputs.begin(), n.outputs.end());
  for (bool grew = true; grew;) {
    grew = false;
    for (const Node& m : in_.nodes) {
      if (m.inputs.empty() || m.inputs[0] < 0) continue;
      if (!views.count(m.op) && !writes_into_first_operand(m)) continue;
      const bool in = alias.count(m.inputs[0]) > 0;
      const bool out = std::any_of(m.outputs.begin(), m.outputs.end(),
                                   [&](int o) { return alias.count(o) > 0; });
      if (in == out) continue;  // both or neither: nothing new
      const size_t before = alias.size();
      alias.insert(m.inputs[0]);
      alias.insert(m.outputs.begin(), m.outputs.end());
      grew = grew || alias.size() != before;
    }
  }
  bool after = false;
  for (const Node& m : in_.nodes) {
    if (m.id == n.id)
      after = true;
    else if (after && writes_into_first_operand(m) && !m.inputs.empty() && alias.count(m.inputs[0]))
      return &m;
  }
  return nullptr;
}

void PlanBuilder::emit_halo(const Node& n, std::vector<int> ins, const RuleResult& res) {
  const Placement p = placement(ins[0]);
  Value v = val(ins[0]);
  v.shape.at(static_cast<size_t>(p.dim)) = Dim::expr("S/P + halo");
  Attrs attrs{{"dim", int64_t{p.dim}}};
  for (const char* k : {"halo_left", "halo_right", "halo_last_pad"})
    attrs[std::string(k).substr(5)] = res.attr_updates.at(k);
  ins[0] = emit("sp.halo", {ins[0]}, attrs, {{v, p}}, n.loc)[0];
  copy_node(n, ins, res.out, {{"zero_padding", true}});
}

void PlanBuilder::emit_mean_partial(const Node& n, std::vector<int> ins) {
  const Value& x = val(ins[0]);
  std::vector<int> dims;
  for (int64_t d : n.ints_attr("dims")) dims.push_back(static_cast<int>(d < 0 ? d + x.rank() : d));
  if (dims.empty())
    for (int d = 0; d < x.rank(); ++d) dims.push_back(d);
  Dim count = Dim::constant(1);
  for (int d : dims) count = count * x.shape[static_cast<size_t>(d)];
  if (count.is_opaque())
    throw PlanError(kPass, n, "a mean over dims of size " + count.str(),
                    "sizes that are multiples of S");
  Node s = n;
  s.op = "sum";
  const int idx =
      copy_node(s, ins, {Placement::partial()}, {{"rewrite_target", std::string("sum")}});
  const int sum_out = out_.nodes[static_cast<size_t>(idx)].outputs[0];
  Attrs divisor{{"divisor_coef", count.coef}, {"divisor_power", int64_t{count.power}}};
  if (count.offset != 0) divisor["divisor_offset"] = count.offset;  // coef * (S + offset)^power
  const int q = emit("div", {sum_out}, divisor, {{val(sum_out), Placement::partial()}}, n.loc)[0];
  vmap_[static_cast<size_t>(n.outputs[0])] = q;
}

std::optional<PlanError> PlanBuilder::heads_refusal(const Node& n,
                                                    const std::vector<int>& ins) const {
  const int64_t P = cfg_.sp_size;
  const Dim& hq = val(ins[0]).shape.at(1);
  if (!hq.is_static() || hq.coef % P != 0)
    return PlanError(
        kPass, n, hq.str() + " query heads for an SP degree of " + std::to_string(P),
        "a number of query heads divisible by the SP degree (" + hq.str() + " % " +
            std::to_string(P) + (hq.is_static() ? " = " + std::to_string(hq.coef % P) : "") + ")",
        "Ulysses splits attention heads across the SP group; choose an SP degree that divides "
        "the number of heads (unsupported='gather', the default, runs this attention on the "
        "all-gathered sequence instead).");
  const int64_t Hq = hq.coef;
  for (int i = 1; i < 3; ++i) {
    const Dim& h = val(ins[i]).shape.at(1);
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

void PlanBuilder::emit_sdpa(const Node& n) {
  std::vector<int> ins = mapped_inputs(n);
  for (int& v : ins) {
    if (v >= 0) v = to_sequence(v, n.loc);  // values split by heads (heads.cpp)
    if (v >= 0 && placement(v).is_partial()) v = reduce_partial(v, n.loc);
  }
  const int P = static_cast<int>(cfg_.sp_size);
  bool any_shard = false;
  for (int v : ins) any_shard = any_shard || placement(v).is_shard();
  if (!any_shard) {
    copy_node(n, ins, {Placement::replicate()}, {});
    return;
  }
  if (n.op == "sdpa" && n.has_attr("dropout_p"))
    throw PlanError(kPass, n, "attention dropout (dropout_p > 0)", "dropout_p=0 under Ulysses",
                    "Each rank runs H/P heads and would draw its attention-dropout mask from the "
                    "same random state as every other rank; apply dropout outside attention.");
  // A copy: emit() below appends to the value table, which would leave a reference dangling.
  const Value q = val(ins[0]);
  if (q.rank() != 4)
    throw PlanError(kPass, n,
                    "query of rank " + std::to_string(q.rank()) + " " + shape_str(q.shape),
                    "[batch, heads, seq, head_dim] query, key and value");
  for (int i = 0; i < 3; ++i) {
    Placement p = placement(ins[i]);
    const Dim& len = val(ins[i]).shape.at(2);
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
                          " " + shape_str(val(ins[i]).shape) + " placed " + p.str(),
                      "the sequence in dim 2 (S(2)) or a replicated tensor");
  }
  // What Ulysses cannot split by heads (query heads not divisible by P, key/value heads that no
  // repetition fits, a flex mod reading the head index) runs on the all-gathered sequence:
  // exact, like any op without a sequence-parallel form (decide.cpp), or refused with
  // unsupported="error".
  if (std::optional<PlanError> refused = heads_refusal(n, ins)) {
    std::vector<int> full = gathered_inputs(n, ins, *refused);  // throws it when not allowed
    copy_node(n, full, std::vector<Placement>(n.outputs.size(), Placement::replicate()), {});
    gathered_ops_.push_back(refused->what());
    return;
  }
  // A full-length query with sharded key/value (a query computed on the gathered sequence):
  // this rank's chunk of it, like any replicated operand meeting sharded ones.
  if (!placement(ins[0]).is_shard()) {
    if (!val(ins[0]).shape.at(2).has_seq())
      throw PlanError(kPass, n,
                      "a replicated query " + shape_str(q.shape) + " with sharded key/value",
                      "a query sharded along the sequence, or a full-length one");
    ins[0] = slice(ins[0], 2, 1, n.loc);
  }
  const int64_t Hq = q.shape[1].coef;  // static and divisible by P (heads_refusal)
  std::vector<int> args = ins;
  std::vector<int> exchange;  // positions in args that go through the all-to-all
  for (int i = 0; i < 3; ++i) {
    int v = args[i];
    const Dim& h = val(v).shape[1];
    if (!h.is_static())
      throw PlanError(kPass, n, "a heads dim of size " + h.str(), "a static number of heads");
    int64_t H = h.coef;
    if (i > 0 && H != Hq) {
      // One key/value head broadcasts against every query head (multi-query attention,
      // as SDPA broadcasts it without enable_gqa): handled as GQA.
      if ((!n.bool_attr("enable_gqa", false) && H != 1) || Hq % H != 0)
        throw PlanError(
            kPass, n,
            std::to_string(H) + " key/value heads for " + std::to_string(Hq) + " query heads",
            "equal heads, or enable_gqa=True with query heads a multiple of key/value heads");
      if (H % P != 0) {
        // Fewer KV heads than ranks: repeat each KV head so that every rank receives the
        // KV head its query heads attend to (heads_refusal checked that this fits).
        const int64_t f = P / std::gcd(H, static_cast<int64_t>(P));
        Value rv = val(v);
        rv.shape[1] = Dim::constant(H * f);
        v = emit("sp.repeat_heads", {v}, {{"dim", int64_t{1}}, {"repeats", f}},
                 {{rv, placement(v)}}, n.loc)[0];
      }
    }
    if (placement(v).is_shard())
      exchange.push_back(i);
    else
      v = slice(v, 1, 1, n.loc);  // replicated full-length k/v: keep the local heads
    args[i] = v;
  }
  // Masks (sdpa's attn_mask; flex_attention's block mask tensors, then its mods' buffers)
  // apply to the whole sequence, which every rank sees after the exchange: they stay
  // replicated, and a per-head mask keeps this rank's heads.
  const bool flex = n.op == "flex_attention";
  const size_t per_head_end =
      flex ? 3 + static_cast<size_t>(n.int_attr("block_mask_inputs", 0)) : args.size();
  // An [S, S] SDPA mask computed from O(S) operands is not materialised: the tiled attention
  // replays its chain on each tile of query rows (mask_tiles.cpp).
  std::optional<MaskTiles> tiles;
  if (!flex && args.size() == 4 && args[3] >= 0 && placement(args[3]).is_replicate()) {
    const Value& m = val(args[3]);
    const int r = m.rank();
    const bool square = r >= 2 && m.shape[static_cast<size_t>(r - 2)].has_seq() &&
                        m.shape[static_cast<size_t>(r - 1)].has_seq();
    const bool per_head = r >= 3 && m.shape[static_cast<size_t>(r - 3)].is_static() &&
                          m.shape[static_cast<size_t>(r - 3)].coef == Hq && Hq > 1;
    if (square && !per_head && !m.requires_grad) tiles = mask_tiles(args[3], r - 2);
  }
  for (size_t i = 3; i < args.size() && !tiles; ++i) {
    if (args[i] < 0) continue;
    const Placement pm = placement(args[i]);
    if (!pm.is_replicate()) {
      const PlanError refused(kPass, n, "an attention mask placed " + pm.str(),
                              "a replicated (full-length) mask",
                              "Build the mask from full-length positions (as single-device code "
                              "does).");
      // A mask computed from sharded activations (a per-key bias): the gather fallback
      // gives every rank the whole of it.
      args[i] = gathered_inputs(n, {args[i]}, refused)[0];
      gathered_ops_.push_back(refused.what());
    }
    const Value& m = val(args[i]);
    // The heads dim: dim 1 of flex's block mask tensors ([B, H, blocks...]); for an SDPA mask,
    // which broadcasts against [B, H, S, S] from the right, the third dim from the end.
    const int hd = flex ? 1 : m.rank() - 3;
    if (i < per_head_end && hd >= 0 && hd < m.rank() &&
        m.shape[static_cast<size_t>(hd)].is_static() &&
        m.shape[static_cast<size_t>(hd)].coef == Hq && Hq > 1)
      args[i] = slice(args[i], hd, 1, n.loc);  // this rank's heads (behind a gradient sync)
    else
      // The whole mask on every rank, used by this rank's heads only: its gradient is this
      // rank's part, summed over ranks by the sync.
      args[i] = grad_sync_if_replicated(args[i], n.loc);
  }
  const Dim seq = q.shape[2];
  auto exchange_group = [&](std::vector<int> positions) {
    std::vector<int> xs;
    std::vector<std::pair<Value, Placement>> outs;
    for (int i : positions) {
      xs.push_back(args[i]);
      outs.push_back({val(args[i]), Placement::shard(1)});
    }
    auto ys = emit("sp.all_to_all", xs,
                   {{"scatter_dim", int64_t{1}},
                    {"gather_dim", int64_t{2}},
                    {"gather_coef", seq.coef},
                    {"gather_power", int64_t{seq.power}}},
                   outs, n.loc);
    for (size_t j = 0; j < positions.size(); ++j) args[positions[j]] = ys[j];
  };
  if (cfg_.fuse_qkv) {
    exchange_group(exchange);
  } else {
    for (int i : exchange) exchange_group({i});
  }
  for (size_t i = 0; i < 3; ++i) args[i] = grad_sync_if_replicated(args[i], n.loc);
  // Every output ([B, H, S, D] attention, [B, H, S] logsumexp) goes back to the sequence
  // layout; exchanges of outputs nobody reads are dropped as dead code.
  Attrs updates;
  if (tiles) {
    args.resize(3);
    args.insert(args.end(), tiles->leaves.begin(), tiles->leaves.end());
    updates["mask_tiles"] = tiles->chain;
    updates["mask_leaf_dims"] = tiles->leaf_dims;
  }
  const int idx =
      copy_node(n, args, std::vector<Placement>(n.outputs.size(), Placement::shard(1)), updates);
  const std::vector<int> outs = out_.nodes[static_cast<size_t>(idx)].outputs;
  for (size_t j = 0; j < outs.size(); ++j) {
    if (val(outs[j]).rank() < 3) continue;
    const int back = emit("sp.all_to_all", {outs[j]},
                          {{"scatter_dim", int64_t{2}},
                           {"gather_dim", int64_t{1}},
                           {"gather_coef", Hq},
                           {"gather_power", int64_t{0}}},
                          {{val(outs[j]), Placement::shard(2)}}, n.loc)[0];
    vmap_[static_cast<size_t>(n.outputs[j])] = back;
  }
}

}  // namespace autosp::plan_detail
