// Attention masks as recipes over query tiles (PlanBuilder::mask_tiles, see plan_builder.h).
//
// Under Ulysses every rank attends with all S queries of its heads, so a mask built as an
// [S, S] (or [B, 1, S, S]) tensor costs O(S^2) memory on every rank, whatever the SP degree:
// 16 GiB of booleans at S = 128k. Masks are nearly always computed from O(S) ingredients
// (positions compared with each other, a [B, S] padding mask, tril of ones) by ops that are
// local along the query dim. Such a mask is not computed whole: the chain of ops is recorded,
// and sp's tiled attention (python/autosp/tiled_attention.py) replays it on each tile of query
// rows, so a rank holds at most one [B, 1, tile, S] mask at a time.
#include <algorithm>
#include <functional>
#include <map>
#include <utility>

#include "plan/plan_builder.h"

namespace autosp::plan_detail {

namespace {

// How a chain node's replay on a tile of rows [start, end) differs from the op as written.
enum How : int64_t {
  kPlain = 0,        // the operands' tiles give the result's tile
  kExpandSize = 1,   // expand: the query dim's size argument becomes -1 (keep the operand's)
  kFactorySize = 2,  // ones/zeros/full/empty: the query dim's size argument becomes end - start
  kTrilRows = 3,     // tril/triu with the query dim as rows: diagonal + start
  kTrilCols = 4,     // tril/triu with the query dim as columns: diagonal - start
  kEyeRows = 5,      // eye(n[, m]) with the query dim as rows: rows [start, end) of it
  kReshapeSize = 6,  // view/reshape keeping the query dim whole: its size argument -> end - start
};

// Attributes through which python/autosp/apply.py changes an op when it copies it: a node
// carrying one is not replayed as written.
bool changed_when_applied(const Node& p) {
  for (const char* a : {"rewrite_target", "reduction", "local_dims", "zero_padding", "unslice_dim",
                        "random_dim", "guarded_logsumexp", "scale_by_sp", "clone", "inplace"})
    if (p.has_attr(a)) return true;
  return false;
}

int seq_dims(const Value& v) {
  int n = 0;
  for (const Dim& d : v.shape) n += d.has_seq() ? 1 : 0;
  return n;
}

}  // namespace

std::optional<PlanBuilder::MaskTiles> PlanBuilder::mask_tiles(int mask, int qdim) const {
  // Replaying the chain later in program order could read a tensor an in-place op changed in
  // between (the reason hoist_slice is off in such graphs).
  if (!hoist_) return std::nullopt;
  MaskTiles t;
  std::map<std::pair<int, int>, bool> seen;
  std::function<bool(int, int)> walk = [&](int v, int d) -> bool {
    const Value& x = val(v);
    if (!x.is_tensor() || x.requires_grad || !placement(v).is_replicate()) return false;
    if (d >= 0 && x.shape[static_cast<size_t>(d)].is_one()) d = -1;  // broadcast: read whole
    if (auto it = seen.find({v, d}); it != seen.end()) return it->second;
    auto leaf = [&]() {
      // An operand the tiles read as it is, or sliced along the query dim: it must be O(S),
      // or the point is lost.
      if (seq_dims(x) > 1) return false;
      t.leaves.push_back(v);
      t.leaf_dims.push_back(d);
      return true;
    };
    const int pi = out_.producer(v);
    if (d < 0 || pi < 0) return seen[{v, d}] = leaf();
    const Node& p = out_.nodes[static_cast<size_t>(pi)];
    // A tensor read for its metadata only (refs: x.to(y), x.type_as(y)) is replayed as y's
    // dtype for a cast; other such reads are not replayed.
    if (p.origin < 0 || p.outputs.size() != 1 || changed_when_applied(p) ||
        (p.has_attr("refs") && p.op != "to"))
      return seen[{v, d}] = leaf();
    const int rank = x.rank();
    int64_t how = kPlain;
    std::vector<std::optional<std::pair<int, int64_t>>> req(p.inputs.size());
    const Locality locality = locality_of(p);
    if (locality == Locality::Triangle && !p.inputs.empty()) {
      how = d == rank - 2 ? kTrilRows : d == rank - 1 ? kTrilCols : kPlain;
      req[0] = std::make_pair(d, int64_t{1});
    } else if (locality == Locality::Factory && p.inputs.empty()) {
      how = kFactorySize;
    } else if (locality == Locality::Eye && p.inputs.empty() && rank == 2 && d == 0) {
      how = kEyeRows;
    } else if (locality == Locality::Reshape) {
      // A reshape that keeps the query dim whole (unsqueeze, view(1, 1, S, S)) replays on the
      // tile with the tile's length at that dim. Which argument holds it is known for
      // view/reshape with sizes (attribute size_args) and size-free calls (size_free).
      const bool sized = p.bool_attr("size_args", false);
      if (p.inputs.size() != 1 || !(sized || p.bool_attr("size_free", false)))
        return seen[{v, d}] = leaf();
      const Value& in = val(p.inputs[0]);
      const auto q = reshape_shard(x.shape, in.shape, Placement::shard(d, 1));
      if (!q || q->inner != 1 ||
          !(in.shape[static_cast<size_t>(q->dim)] == x.shape[static_cast<size_t>(d)]))
        return seen[{v, d}] = leaf();
      // squeeze(d) of the query dim does nothing at full length (S > 1) but would drop a
      // tile of one row.
      const auto squeezed = p.ints_attr("squeeze_dims");
      if (std::find(squeezed.begin(), squeezed.end(), q->dim) != squeezed.end())
        return seen[{v, d}] = leaf();
      req[0] = std::make_pair(q->dim, int64_t{1});
      how = sized ? kReshapeSize : kPlain;
    } else if (auto r = local_along(p, d, 1)) {
      req = *r;
      if (locality == Locality::Expand) how = kExpandSize;
    } else {
      return seen[{v, d}] = leaf();
    }
    std::vector<int64_t> ins;
    for (size_t i = 0; i < p.inputs.size(); ++i) {
      const int in = p.inputs[i];
      const int di = req[i] ? req[i]->first : -1;
      if (in >= 0 && !walk(in, di)) return seen[{v, d}] = false;
      ins.push_back(in);
      ins.push_back(in >= 0 && di >= 0 && val(in).shape[static_cast<size_t>(di)].is_one() ? -1
                                                                                          : di);
    }
    t.chain.insert(t.chain.end(),
                   {int64_t{p.origin}, how, int64_t{d}, static_cast<int64_t>(p.inputs.size())});
    t.chain.insert(t.chain.end(), ins.begin(), ins.end());
    t.chain.push_back(v);
    return seen[{v, d}] = true;
  };
  if (!walk(mask, qdim) || t.chain.empty()) return std::nullopt;
  return t;
}

}  // namespace autosp::plan_detail
