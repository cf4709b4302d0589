// Slice hoisting (PlanBuilder::hoist_slice, see plan_builder.h): a replicated value that is
// only an elementwise / reshape / indexing chain away from a full-length computation is sliced
// by slicing the chain's operands, so that the chain runs on the local chunk.
#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "analysis/rules.h"
#include "plan/plan_builder.h"

namespace autosp::plan_detail {

std::optional<std::vector<std::optional<std::pair<int, int64_t>>>> PlanBuilder::local_along(
    const Node& p, int dim, int64_t inner) const {
  using Req = std::vector<std::optional<std::pair<int, int64_t>>>;
  if (p.outputs.size() != 1) return std::nullopt;
  const Value& out = val(p.outputs[0]);
  const int ro = out.rank();
  Req req(p.inputs.size());
  auto aligned = [&](size_t i) -> bool {
    const Value& in = val(p.inputs[i]);
    const int k = dim - (ro - in.rank());
    if (k < 0 || in.shape[static_cast<size_t>(k)].is_one()) return true;
    if (!(in.shape[static_cast<size_t>(k)] == out.shape[static_cast<size_t>(dim)])) return false;
    req[i] = std::make_pair(k, inner);
    return true;
  };
  const Locality locality = locality_of(p);
  if ((locality == Locality::Reshape || locality == Locality::Expand) && p.inputs.size() != 1)
    return std::nullopt;  // view_as / expand_as: the shape comes from the other operand, whole
  switch (locality) {
    case Locality::Reshape: {
      auto q = reshape_shard(out.shape, val(p.inputs[0]).shape, Placement::shard(dim, inner));
      if (!q) return std::nullopt;
      req[0] = std::make_pair(q->dim, q->inner);
      break;
    }
    case Locality::Expand:
      if (!aligned(0)) return std::nullopt;
      break;
    case Locality::Permute: {
      const auto perm = p.ints_attr("perm");
      if (dim >= static_cast<int>(perm.size())) return std::nullopt;
      req[0] = std::make_pair(static_cast<int>(perm[static_cast<size_t>(dim)]), inner);
      break;
    }
    case Locality::Index: {
      if (p.inputs.size() != 1) return std::nullopt;
      const auto dim_map = p.ints_attr("dim_map");
      const auto sliced = p.ints_attr("sliced_dims");
      int k = -1;
      for (size_t j = 0; j < dim_map.size(); ++j)
        if (dim_map[j] == dim) k = static_cast<int>(j);
      if (k < 0 || std::find(sliced.begin(), sliced.end(), k) != sliced.end()) return std::nullopt;
      req[0] = std::make_pair(k, inner);
      break;
    }
    case Locality::Cat: {
      int64_t cat_dim = p.int_attr("dim", 0);
      if (cat_dim < 0) cat_dim += ro;
      if (cat_dim == dim) return std::nullopt;
      for (size_t i = 0; i < p.inputs.size(); ++i) req[i] = std::make_pair(dim, inner);
      break;
    }
    case Locality::Elementwise:
      for (size_t i = 0; i < p.inputs.size(); ++i)
        if (p.inputs[i] >= 0 && val(p.inputs[i]).is_tensor() && !aligned(i)) return std::nullopt;
      break;
    // Local only with arguments rewritten per part (the diagonal, the sizes): mask tiles
    // replay them (mask_tiles.cpp); a slice is not moved through them.
    case Locality::Triangle:
    case Locality::Factory:
    case Locality::Eye:
    case Locality::None:
      return std::nullopt;
  }
  return req;
}

int PlanBuilder::hoist_slice(int v, int dim, int64_t inner, const SourceLoc& loc) {
  if (!hoist_ || val(v).requires_grad || !placement(v).is_replicate()) return -1;
  const int pi = out_.producer(v);
  if (pi < 0) return -1;
  const Node p = out_.nodes[static_cast<size_t>(pi)];
  if (p.origin < 0 || p.outputs.size() != 1) return -1;
  const Value out = val(v);
  for (size_t i = 0; i < p.inputs.size(); ++i) {
    if (p.inputs[i] < 0) continue;
    if (!placement(p.inputs[i]).is_replicate() || val(p.inputs[i]).requires_grad) return -1;
  }
  // The size arguments of expand / reshape are localised along sequence dims only
  // (local_dims): a slice of another dim (the heads) is not moved through them.
  const Locality locality = locality_of(p);
  if ((locality == Locality::Expand || locality == Locality::Reshape) &&
      !out.shape[static_cast<size_t>(dim)].has_seq())
    return -1;
  const auto req = local_along(p, dim, inner);
  if (!req) return -1;
  Node c = p;
  c.outputs.clear();
  for (size_t i = 0; i < p.inputs.size(); ++i)
    if ((*req)[i]) c.inputs[i] = slice(p.inputs[i], (*req)[i]->first, (*req)[i]->second, loc);
  c.attrs["clone"] = true;
  if (out.shape[static_cast<size_t>(dim)].has_seq())
    c.attrs["local_dims"] = std::vector<int64_t>{dim};
  c.outputs.push_back(new_value(out, Placement::shard(dim, inner)));
  const int id = c.outputs[0];
  out_.add_node(std::move(c));
  return id;
}

}  // namespace autosp::plan_detail
