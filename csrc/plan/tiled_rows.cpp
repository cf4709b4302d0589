// Tiled MLP (SpConfig::tile_mlp): a row-wise block (an MLP, SwiGLU, the part of a norm that
// works on single rows) replaced by one node that runs it a chunk of rows at a time and
// recomputes each chunk in backward (python/autosp/tiled_rows.py), ALST's TiledMLP found on
// the user's unchanged model. A block is grown backwards from a linear (the down projection)
// through linears and elementwise ops whose results nothing outside the block reads; its
// operands are either "row" tensors (the same leading dims as the block's result up to the
// chunk dim, cut into chunks) or read whole (weights, biases, broadcast constants). Each row of
// the result is the computation one device does for that row, so the result is exact; the
// weights' gradients differ from the untiled ones only by the order of the sum over chunks.
// Runs on the emitted plan (after dead nodes are dropped), so the block's operands are what
// the plan placed there (parameters after their gradient syncs).
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "plan/plan_builder.h"

namespace autosp::plan_detail {

namespace {

int64_t itemsize(const std::string& dtype) {
  if (dtype == "f64" || dtype == "i64" || dtype == "c64") return 8;
  if (dtype == "f16" || dtype == "bf16" || dtype == "i16") return 2;
  if (dtype == "b8" || dtype == "i8" || dtype == "u8") return 1;
  return 4;
}

// Bytes of one index along `dim` (the dims after it, which must be static), 0 when opaque.
int64_t bytes_per_row(const Value& v, int dim) {
  int64_t n = itemsize(v.dtype);
  for (int i = dim + 1; i < v.rank(); ++i) {
    if (!v.shape[static_cast<size_t>(i)].is_static()) return 0;
    n *= v.shape[static_cast<size_t>(i)].coef;
  }
  return n;
}

// Attributes by which the plan changes how a copied op runs: a block replays the user's op as
// written, so a node carrying one stays out.
bool rewritten(const Node& n) {
  for (const char* a : {"local_dims", "rewrite_target", "reduction", "scale_by_sp", "unslice_dim",
                        "zero_padding", "refs", "mask_tiles", "head_chain"})
    if (n.has_attr(a)) return true;
  return false;
}

}  // namespace

void PlanBuilder::tile_rows() {
  const int nv = static_cast<int>(out_.values.size());
  std::vector<int> prod(static_cast<size_t>(nv), -1), uses(static_cast<size_t>(nv), 0);
  std::vector<std::vector<int>> readers(static_cast<size_t>(nv));
  for (size_t i = 0; i < out_.nodes.size(); ++i) {
    const Node& n = out_.nodes[i];
    for (int o : n.outputs) prod[static_cast<size_t>(o)] = static_cast<int>(i);
    for (int v : n.inputs)
      if (v >= 0) readers[static_cast<size_t>(v)].push_back(static_cast<int>(i));
    for (int64_t v : n.ints_attr("refs")) readers[static_cast<size_t>(v)].push_back(-1);
  }
  std::vector<bool> autocast(in_.nodes.size(), false), grad_on(in_.nodes.size(), true);
  int depth = 0;
  bool grad = true;
  for (const Node& m : in_.nodes) {
    depth += static_cast<int>(m.int_attr("autocast", 0));
    if (m.has_attr("grad_enabled")) grad = m.bool_attr("grad_enabled", true);
    autocast[static_cast<size_t>(m.id)] = depth > 0;
    grad_on[static_cast<size_t>(m.id)] = grad;
  }
  std::vector<bool> claimed(out_.nodes.size(), false);
  std::vector<Node> tiled;  // replacement node per root index (op empty: none)
  tiled.resize(out_.nodes.size());

  // A node the chunks can replay as the user wrote it: an original op, one result, not
  // rewritten by the plan, outside torch.autocast and torch.no_grad regions, no argument
  // computed in the graph, no in-place write into it or its aliases.
  auto replayable = [&](const Node& p) {
    const size_t i = static_cast<size_t>(&p - out_.nodes.data());
    if (claimed[i] || p.origin < 0 || p.outputs.size() != 1 || rewritten(p)) return false;
    const Node& o = in_.nodes[static_cast<size_t>(p.origin)];
    return !autocast[static_cast<size_t>(o.id)] && grad_on[static_cast<size_t>(o.id)] &&
           !o.bool_attr("scalar_from_graph", false) && !writes_into_first_operand(o) &&
           later_write_to_aliases(in_, o) == nullptr;
  };
  for (size_t r = out_.nodes.size(); r-- > 0;) {
    const Node& root = out_.nodes[r];
    if (root.op != "linear" || root.origin < 0 || claimed[r] || root.outputs.size() != 1) continue;
    const Value& y = val(root.outputs[0]);
    const Placement pl = placement(root.outputs[0]);
    if (y.rank() < 2 || !y.requires_grad || pl.is_partial() || pl.is_local()) continue;
    const int d = pl.is_shard() ? pl.dim : y.rank() - 2;
    if (d < 0 || d >= y.rank() - 1) continue;
    auto row_shaped = [&](const Value& v) {
      if (!v.is_tensor() || v.rank() != y.rank()) return false;
      for (int i = 0; i <= d; ++i)
        if (!(v.shape[static_cast<size_t>(i)] == y.shape[static_cast<size_t>(i)])) return false;
      return true;
    };
    // Read whole: no extent along the chunk dim (absent after broadcasting, or of size 1).
    auto whole = [&](int v) {
      const Value& x = val(v);
      const int at = d - (y.rank() - x.rank());
      return placement(v).is_replicate() && (at < 0 || x.shape[static_cast<size_t>(at)].is_one());
    };
    auto admissible = [&](int i) {
      const Node& p = out_.nodes[static_cast<size_t>(i)];
      if (!replayable(p)) return false;
      const Value& out = val(p.outputs[0]);
      if (!row_shaped(out) || !(placement(p.outputs[0]) == pl)) return false;
      if (p.op == "linear") return p.inputs.size() >= 2 && p.inputs[0] >= 0;
      return is_elementwise(p);
    };
    if (!replayable(root)) continue;
    // Grow backwards through admissible producers of row operands.
    std::set<int> members{static_cast<int>(r)};
    std::vector<int> work{static_cast<int>(r)};
    while (!work.empty()) {
      const Node& m = out_.nodes[static_cast<size_t>(work.back())];
      work.pop_back();
      const bool lin = m.op == "linear";
      for (size_t k = 0; k < m.inputs.size(); ++k) {
        const int v = m.inputs[k];
        if (v < 0 || (lin && k > 0)) continue;
        const int p = prod[static_cast<size_t>(v)];
        if (p >= 0 && !members.count(p) && row_shaped(val(v)) && admissible(p)) {
          members.insert(p);
          work.push_back(p);
        }
      }
    }
    // Drop members whose result is read outside the block (their result becomes an operand),
    // until none is.
    for (bool changed = true; changed;) {
      changed = false;
      for (auto it = members.begin(); it != members.end();) {
        const int i = *it;
        bool outside = false;
        if (i != static_cast<int>(r))
          for (int reader :
               readers[static_cast<size_t>(out_.nodes[static_cast<size_t>(i)].outputs[0])])
            outside = outside || reader < 0 || !members.count(reader);
        if (outside) {
          it = members.erase(it);
          changed = true;
        } else {
          ++it;
        }
      }
    }
    int linears = 0;
    for (int i : members) linears += out_.nodes[static_cast<size_t>(i)].op == "linear" ? 1 : 0;
    if (linears < 2) continue;
    // Operands: rows (cut into chunks) first, then those read whole.
    std::vector<int> order(members.begin(), members.end());  // node indices: program order
    std::vector<int> rows, wholes;
    std::map<int, int> member_at;
    for (size_t k = 0; k < order.size(); ++k) member_at[order[k]] = static_cast<int>(k);
    bool ok = true;
    for (int i : order) {
      const Node& m = out_.nodes[static_cast<size_t>(i)];
      for (size_t k = 0; k < m.inputs.size(); ++k) {
        const int v = m.inputs[k];
        if (v < 0 || member_at.count(prod[static_cast<size_t>(v)]) != 0) continue;
        const bool weight = m.op == "linear" && k > 0;
        if (!weight && row_shaped(val(v)) && placement(v) == pl) {
          if (std::find(rows.begin(), rows.end(), v) == rows.end()) rows.push_back(v);
        } else if (weight ? placement(v).is_replicate() : whole(v)) {
          if (std::find(wholes.begin(), wholes.end(), v) == wholes.end()) wholes.push_back(v);
        } else {
          ok = false;
        }
      }
    }
    if (!ok || rows.empty()) continue;
    int64_t in_width = 0, inner_width = 0;
    for (int v : rows) in_width += bytes_per_row(val(v), d);
    for (int i : order)
      if (i != static_cast<int>(r))
        inner_width += bytes_per_row(val(out_.nodes[static_cast<size_t>(i)].outputs[0]), d);
    const Node& first = in_.nodes[static_cast<size_t>(root.origin)];
    const std::string where =
        "'linear' at " + (first.loc.empty()
                              ? std::string("?")
                              : first.loc.file + ":" + std::to_string(first.loc.line));
    if (in_width <= 0 || inner_width <= in_width) {
      mlp_tiling_.push_back("not tiled: the row-wise block ending at " + where +
                            ": its intermediates are no wider than its inputs, so chunks save "
                            "nothing");
      continue;
    }
    std::vector<int64_t> origins, args;
    std::vector<int> operands = rows;
    operands.insert(operands.end(), wholes.begin(), wholes.end());
    for (int i : order) {
      const Node& m = out_.nodes[static_cast<size_t>(i)];
      origins.push_back(m.origin);
      args.push_back(static_cast<int64_t>(m.inputs.size()));
      for (int v : m.inputs) {
        if (v < 0) {
          args.push_back(-1);
          continue;
        }
        const int p = prod[static_cast<size_t>(v)];
        if (p >= 0 && member_at.count(p)) {
          args.push_back(-2 - member_at[p]);
          continue;
        }
        args.push_back(std::find(operands.begin(), operands.end(), v) - operands.begin());
      }
    }
    Node t = root;
    t.op = "tiled_rows";
    t.target = "autosp.tiled_rows";
    t.inputs = operands;
    t.attrs = {{"row_nodes", origins},
               {"row_args", args},
               {"row_inputs", static_cast<int64_t>(rows.size())},
               {"row_dim", static_cast<int64_t>(d)},
               {"row_in_bytes", in_width},
               {"row_inner_bytes", inner_width}};
    tiled[r] = std::move(t);
    for (int i : order) claimed[static_cast<size_t>(i)] = true;
    mlp_tiling_.push_back("tiled: the row-wise block ending at " + where + " (" +
                          std::to_string(order.size()) + " ops, " + std::to_string(linears) +
                          " linears, " + std::to_string(rows.size()) +
                          " row operands), in chunks along dim " + std::to_string(d));
  }
  std::reverse(mlp_tiling_.begin(), mlp_tiling_.end());  // program order
  std::vector<Node> kept;
  for (size_t i = 0; i < out_.nodes.size(); ++i) {
    if (!tiled[i].op.empty())
      kept.push_back(std::move(tiled[i]));
    else if (!claimed[i])
      kept.push_back(std::move(out_.nodes[i]));
  }
  for (size_t i = 0; i < kept.size(); ++i) kept[i].id = static_cast<int>(i);
  out_.nodes = std::move(kept);
}

}  // namespace autosp::plan_detail
