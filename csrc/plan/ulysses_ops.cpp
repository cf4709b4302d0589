// The Ulysses plan builder's op-specific emitters: attention (the all-to-all exchange),
// scans and reductions across ranks, shifts and convolution halos (the loss: loss.cpp).
#include <algorithm>
#include <numeric>
#include <set>
#include <stdexcept>

#include "plan/plan_builder.h"

namespace autosp::plan_detail {

void PlanBuilder::emit_cross_rank(const Node& n, std::vector<int> ins, const NodePlacement& d) {
  // The local reduction is one per-rank term of the combined result, which sp.combine
  // reduces with the op itself (not a sum); the plan prints it as P.
  const bool scan = d.expansion == Expansion::Scan;
  const Placement local = d.results.at(0);
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

void PlanBuilder::emit_shift(const Node& n, std::vector<int> ins, const NodePlacement& res) {
  const int64_t d = std::get<int64_t>(res.attr_updates.at("shift_dim"));
  const int64_t start = std::get<int64_t>(res.attr_updates.at("shift_start"));
  // Starting after position 0, each rank's part is a copy (it takes the next rank's first
  // positions), not a view: a later in-place write through it, or into the tensor it was
  // sliced from, would not reach the other.
  if (start > 0) {
    if (const Node* w = later_write_to_aliases(in_, n))
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
  copy_node(n, ins, res.results, {{"unslice_dim", d}});
}

void PlanBuilder::emit_halo(const Node& n, std::vector<int> ins, const NodePlacement& res) {
  const Placement p = placement(ins[0]);
  Value v = val(ins[0]);
  v.shape.at(static_cast<size_t>(p.dim)) = Dim::expr("S/P + halo");
  Attrs attrs{{"dim", int64_t{p.dim}}};
  for (const char* k : {"halo_left", "halo_right", "halo_last_pad"})
    attrs[std::string(k).substr(5)] = res.attr_updates.at(k);
  ins[0] = emit("sp.halo", {ins[0]}, attrs, {{v, p}}, n.loc)[0];
  copy_node(n, ins, res.results, {{"zero_padding", true}});
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

void PlanBuilder::emit_sdpa(const Node& n) {
  const NodePlacement& d = prop_.nodes.at(static_cast<size_t>(n.id));
  std::vector<int> args = mapped_inputs(n);
  // Replicated attention, or attention on the gathered sequence (propagate_ops.cpp).
  if (d.results.empty() || d.results[0].is_replicate()) {
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i] >= 0) args[i] = apply_steps(n, i, args[i]);
    copy_node(n, args, d.results, {});
    return;
  }
  const int64_t Hq = in_.value(n.inputs[0]).shape.at(1).coef;
  // An [S, S] SDPA mask computed from O(S) operands is not materialised: the tiled attention
  // replays its chain on each tile of query rows (mask_tiles.cpp).
  std::optional<MaskTiles> tiles;
  std::vector<int> exchanged;  // positions whose last step is the all-to-all to heads
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] < 0) continue;
    const std::vector<Step>& steps = d.steps.at(i);
    const bool mask_whole = std::all_of(steps.begin(), steps.end(), [](const Step& s) {
      return s.kind == Step::Kind::GradSync || s.kind == Step::Kind::ToSequence ||
             s.kind == Step::Kind::ReducePartial;
    });
    args[i] = apply_steps(n, i, args[i], /*skip_exchange=*/true);
    if (!steps.empty() && steps.back().kind == Step::Kind::Exchange)
      exchanged.push_back(static_cast<int>(i));
    if (i == 3 && n.op == "sdpa" && args.size() == 4 && mask_whole &&
        placement(args[3]).is_replicate()) {
      const Value& m = val(args[3]);
      const int r = m.rank();
      const bool square = r >= 2 && m.shape[static_cast<size_t>(r - 2)].has_seq() &&
                          m.shape[static_cast<size_t>(r - 1)].has_seq();
      const bool per_head = r >= 3 && m.shape[static_cast<size_t>(r - 3)].is_static() &&
                            m.shape[static_cast<size_t>(r - 3)].coef == Hq && Hq > 1;
      if (square && !per_head && !m.requires_grad) tiles = mask_tiles(args[3], r - 2);
    }
  }
  auto exchange_group = [&](const std::vector<int>& positions) {
    std::vector<int> xs;
    for (int i : positions) xs.push_back(args[static_cast<size_t>(i)]);
    const std::vector<int> ys = exchange(xs, 1, 2, n.loc);
    for (size_t j = 0; j < positions.size(); ++j) args[static_cast<size_t>(positions[j])] = ys[j];
  };
  if (cfg_.fuse_qkv) {
    if (!exchanged.empty()) exchange_group(exchanged);
  } else {
    for (int i : exchanged) exchange_group({i});
  }
  Attrs updates;
  if (tiles) {
    args.resize(3);
    args.insert(args.end(), tiles->leaves.begin(), tiles->leaves.end());
    updates["mask_tiles"] = tiles->chain;
    updates["mask_leaf_dims"] = tiles->leaf_dims;
  }
  // Every output ([B, H, S, D] attention, [B, H, S] logsumexp) goes back to the sequence
  // layout; exchanges of outputs nobody reads are dropped as dead code.
  const int idx = copy_node(n, args, d.results, updates);
  const std::vector<int> outs = out_.nodes[static_cast<size_t>(idx)].outputs;
  for (size_t j = 0; j < outs.size(); ++j) {
    if (d.via.at(j).empty()) continue;
    const int back = emit("sp.all_to_all", {outs[j]},
                          {{"scatter_dim", int64_t{2}},
                           {"gather_dim", int64_t{1}},
                           {"gather_coef", Hq},
                           {"gather_power", int64_t{0}}},
                          {{val(outs[j]), d.outputs[j]}}, n.loc)[0];
    vmap_[static_cast<size_t>(n.outputs[j])] = back;
  }
}

}  // namespace autosp::plan_detail
