// The Ulysses plan's loss emitter: cross-entropy over each rank's tokens, reduced over the
// group (placed by propagate_ops.cpp), and its tiled form (SpConfig::tile_loss).
//
// Tiled loss: ALST-style, on the user's unchanged model. The logits of a language model's
// loss are [tokens, vocab]: at 128k tokens per rank and a 128k vocabulary, 64 GiB in fp32.
// When the loss's logits come from a linear (lm_head) through row-wise ops only (casts such
// as .float(), pointwise ops with constant operands such as soft-capping, reshapes keeping
// the class dim), the cross_entropy node takes the linear's operands instead (attribute
// head_chain) and the apply stage runs linear, those ops and the loss one chunk of rows at a
// time, recomputing each chunk in backward (tiled_loss.py); logits also read elsewhere
// (returned by the model, a z-loss) are still made for that reader. Each
// row's loss is the computation one device does for that row, so the result is the untiled
// loss up to the order of the sum over rows.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "plan/plan_builder.h"

namespace autosp::plan_detail {

namespace {

std::string where(const Node& n) {
  return n.loc.empty() ? "'" + n.op + "'"
                       : "'" + n.op + "' at " + n.loc.file + ":" + std::to_string(n.loc.line);
}

}  // namespace

std::optional<PlanBuilder::HeadTile> PlanBuilder::head_tile(const Node& ce) {
  if (!cfg_.tile_loss) return std::nullopt;
  if (uses_.empty()) {
    uses_.assign(in_.values.size(), 0);
    for (const Node& m : in_.nodes) {
      for (int v : m.inputs)
        if (v >= 0) uses_[static_cast<size_t>(v)] += 1;
      for (int64_t v : m.ints_attr("refs")) uses_[static_cast<size_t>(v)] += 1;
    }
    int depth = 0;  // torch.autocast regions (nontensor markers, attribute autocast +1 / -1)
    for (const Node& m : in_.nodes) {
      depth += static_cast<int>(m.int_attr("autocast", 0));
      in_autocast_.push_back(depth > 0);
    }
  }
  auto refuse = [&](const std::string& why) -> std::optional<HeadTile> {
    loss_tiling_.push_back("not tiled: cross_entropy " + where(ce) + ": " + why);
    return std::nullopt;
  };
  if (ce.inputs.size() > 2 && ce.inputs[2] >= 0) return refuse("it has class weights");
  const Value& targets = in_.value(ce.inputs[1]);
  if (is_float(targets.dtype))
    return refuse("its targets are class probabilities (" + targets.dtype +
                  shape_str(targets.shape) + "), not one class index per row");
  if (targets.rank() != 1)
    return refuse("its targets are " + shape_str(targets.shape) +
                  ", not one per row of [tokens, "
                  "classes] logits");
  if (ce.bool_attr("scalar_from_graph", false))
    return refuse("an argument of it is computed in the graph (ignore_index from a size?)");
  if (in_autocast_[static_cast<size_t>(ce.id)])
    return refuse("it runs under torch.autocast, which the chunks would not replay");
  const Value& logits = in_.value(ce.inputs[0]);
  if (logits.rank() != 2 || !logits.shape[1].is_static())
    return refuse("its logits are " + shape_str(logits.shape) +
                  ", not [tokens, classes] with a static number of classes");
  const Dim classes = logits.shape[1];
  bool shared = false;           // a value of the chain is read elsewhere too
  std::vector<int64_t> chain;    // from the loss back to the linear
  std::vector<int64_t> regroup;  // per chain node: 1 for a reshape (a chunk keeps its rows)
  int v = ce.inputs[0];
  for (;;) {
    const int p = in_.producer(v);
    if (p < 0) return refuse("its logits are an input of the graph, not computed in it");
    const Node& m = in_.nodes[static_cast<size_t>(p)];
    // A value of the chain may be read elsewhere (returned logits, a z-loss): it then stays
    // for that reader, and the loss recomputes the chain chunk by chunk.
    shared = shared || uses_[static_cast<size_t>(v)] > 1;
    if (in_autocast_[static_cast<size_t>(m.id)])
      return refuse(where(m) + " runs under torch.autocast, which the chunks would not replay");
    // A later in-place write into h, the logits or a view of them: the chunks, computed from h
    // at the loss, would not see it.
    if (const Node* w = later_write_to_aliases(in_, m))
      return refuse(
          "the in-place '" + w->op + "' " +
          (w->loc.empty() ? "" : "at " + w->loc.file + ":" + std::to_string(w->loc.line)) +
          " writes into a value of the projection's chain or a view of it");
    if (m.op == "linear") {
      const Value& out = in_.value(m.outputs[0]);
      if (out.shape.empty() || !(out.shape.back() == classes))
        return refuse("the projection " + where(m) + " makes " + shape_str(out.shape));
      bool operands_grad = false;
      for (int i : m.inputs)
        operands_grad = operands_grad || (i >= 0 && in_.value(i).requires_grad);
      // torch.no_grad around the projection, .detach() or a constant fill after it: the loss
      // carries no gradient into h and the weight, which the tiled op would give it.
      for (int64_t c : chain)
        if (in_.value(in_.nodes[static_cast<size_t>(c)].outputs[0]).requires_grad != operands_grad)
          return refuse(
              "gradients stop between the projection and the loss (torch.no_grad, "
              ".detach() or a fill)");
      if (out.requires_grad != operands_grad)
        return refuse("the projection " + where(m) + " runs without gradients (torch.no_grad)");
      chain.push_back(m.id);
      regroup.push_back(0);
      break;
    }
    const bool one_operand =
        m.outputs.size() == 1 && !m.inputs.empty() && m.inputs[0] >= 0 &&
        std::count_if(m.inputs.begin(), m.inputs.end(), [](int i) { return i >= 0; }) == 1;
    const Value& in = one_operand ? in_.value(m.inputs[0]) : logits;
    const Value& out = in_.value(m.outputs[0]);
    const bool elementwise = is_elementwise(m) && in.shape == out.shape;
    const bool regroups = locality_of(m) == Locality::Reshape && !in.shape.empty() &&
                          !out.shape.empty() && in.shape.back() == classes &&
                          out.shape.back() == classes;
    if (!one_operand || m.has_attr("refs") || writes_into_first_operand(m) ||
        !(elementwise || regroups) || (!regroups && m.bool_attr("scalar_from_graph", false)))
      return refuse("the op " + where(m) +
                    " between the projection and the loss is not a row-wise op of the logits "
                    "alone (a cast, a pointwise op with constant operands, a reshape keeping "
                    "the class dim)");
    chain.push_back(m.id);
    regroup.push_back(regroups ? 1 : 0);
    v = m.inputs[0];
  }
  std::reverse(chain.begin(), chain.end());
  std::reverse(regroup.begin(), regroup.end());
  const Node& linear = in_.nodes[static_cast<size_t>(chain.front())];
  // The linear's copy in the plan: its operands as the plan placed them (grad syncs included).
  const int made = mapped(linear.outputs[0]);
  const int at = made < 0 ? -1 : out_.producer(made);
  if (at < 0 || out_.nodes[static_cast<size_t>(at)].origin != linear.id)
    return refuse("the projection " + where(linear) + " was rewritten by the plan");
  HeadTile tile;
  tile.chain = std::move(chain);
  tile.regroup = std::move(regroup);
  tile.inputs = out_.nodes[static_cast<size_t>(at)].inputs;
  tile.inputs.resize(3, -1);
  shared = shared || uses_[static_cast<size_t>(linear.outputs[0])] > 1;
  loss_tiling_.push_back("tiled: cross_entropy " + where(ce) + " over the projection " +
                         where(linear) + " (" + std::to_string(tile.chain.size() - 1) +
                         " row-wise ops between" +
                         (shared ? "; its logits are also read elsewhere, so they are still made "
                                   "once for that, and the loss recomputes them chunk by chunk"
                                 : "") +
                         ")");
  return tile;
}

int PlanBuilder::copy_loss(const Node& n, std::vector<int> args, const Placement& out, Attrs attrs,
                           const std::optional<HeadTile>& tile) {
  if (tile) {
    args.resize(2);
    args[0] = -1;  // the logits: never made
    args.insert(args.end(), tile->inputs.begin(), tile->inputs.end());
    attrs["head_chain"] = tile->chain;
    attrs["head_regroup"] = tile->regroup;
    attrs["loss_chunks"] = cfg_.loss_chunks;
  }
  return copy_node(n, std::move(args), {out}, attrs);
}

void PlanBuilder::emit_cross_entropy(const Node& n) {
  const NodePlacement& d = prop_.nodes.at(static_cast<size_t>(n.id));
  const std::optional<HeadTile> tile = head_tile(n);
  std::vector<int> args = mapped_inputs(n);
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i] >= 0) args[i] = apply_steps(n, i, args[i]);
  if (d.results.at(0).is_replicate()) {
    copy_loss(n, args, Placement::replicate(), {}, tile);
    return;
  }
  emit_loss_over_tokens(n, args, d.results[0], tile);
}

void PlanBuilder::emit_loss_over_tokens(const Node& n, const std::vector<int>& args,
                                        const Placement& per_token,
                                        const std::optional<HeadTile>& tile) {
  const std::string reduction = n.str_attr("reduction", "mean");
  if (reduction == "none") {
    copy_loss(n, args, per_token, {}, tile);
    return;
  }
  if (reduction == "sum") {
    copy_loss(n, args, Placement::partial(), {}, tile);
    return;
  }
  // mean: local sum over this rank's tokens / the number of valid tokens in the group.
  const int idx =
      copy_loss(n, args, Placement::partial(), {{"reduction", std::string("sum")}}, tile);
  const int ce = out_.nodes[static_cast<size_t>(idx)].outputs[0];
  if (is_float(val(args[1]).dtype)) {
    // Class probabilities as targets: no index is ignored, the mean is over every position,
    // the global count of the input's dims but the classes (dim 1, or 0 of a 1-D input).
    const Value& x = in_.value(n.inputs[0]);
    Dim count = Dim::constant(1);
    for (int d = 0; d < x.rank(); ++d)
      if (d != (x.rank() > 1 ? 1 : 0)) count = count * x.shape[static_cast<size_t>(d)];
    if (count.is_opaque())
      throw PlanError(kPass, n, "a mean over " + count.str() + " positions",
                      "sizes that are multiples of S");
    Attrs divisor{{"divisor_coef", count.coef}, {"divisor_power", int64_t{count.power}}};
    if (count.offset != 0) divisor["divisor_offset"] = count.offset;
    const int q = emit("div", {ce}, divisor, {{val(ce), Placement::partial()}}, n.loc)[0];
    vmap_[static_cast<size_t>(n.outputs[0])] = q;
    return;
  }
  if (n.bool_attr("ignore_index_from_graph", false))
    throw PlanError(kPass, n, "an ignore_index computed in the graph (from a size or a tensor)",
                    "a constant ignore_index for a mean cross-entropy",
                    "The mean divides by the targets not ignored across the SP group, which the "
                    "plan counts with the ignore_index it reads at compile time. Pass a constant "
                    "(-100), or use reduction='sum' and divide by your own count.");
  Value count_v;
  count_v.kind = ValueKind::Tensor;
  count_v.dtype = "i64";
  const int count =
      emit("sp.count_valid", {args[1]}, {{"ignore_index", n.int_attr("ignore_index", -100)}},
           {{count_v, Placement::replicate()}}, n.loc)[0];
  const int q = emit("div", {ce, count}, {}, {{val(ce), Placement::partial()}}, n.loc)[0];
  vmap_[static_cast<size_t>(n.outputs[0])] = q;
}

}  // namespace autosp::plan_detail
