// Placements: how a value is laid out across the ranks of the SP group.
//
//   Replicate()          every rank holds the whole value
//   Shard(dim, inner)    every rank holds 1/P of the sequence factor of `dim`
//   Partial()            every rank holds a summand; the value is the sum over ranks
//   Local(bag)           a token-local value: dim `bag` lists a data-dependent selection of
//                        this rank's tokens (torch.where on a sharded mask, and what is
//                        computed row by row from it); the single-device value lists the
//                        selections of every rank. With `positions`, the values are
//                        positions inside this rank's chunk of a Shard(., inner) dim whose
//                        size is coef*S (the indices torch.where gives for that dim).
//
// A dim may be a merge of several factors (`logits.view(-1, V)` merges batch and
// sequence). The sequence factor of a sharded dim is located by `inner`, the product of
// the factors to its right inside that dim: for [B, S] viewed as [B*S], the merged dim 0
// is Shard(0, inner=1); for [S, B] viewed as [S*B] it is Shard(0, inner=B). Two shards
// combine elementwise only when both dim and inner agree.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ir/graph.h"

namespace autosp {

enum class PlacementKind { Replicate, Shard, Partial, Local };

struct Placement {
  PlacementKind kind = PlacementKind::Replicate;
  int dim = -1;
  int64_t inner = 1;
  bool positions = false;  // Local: the values are positions along a Shard(., inner) dim
  int64_t coef = 0;        // Local positions: that dim's size is coef*S

  static Placement replicate() { return {}; }
  static Placement shard(int dim, int64_t inner = 1) { return {PlacementKind::Shard, dim, inner}; }
  static Placement partial() { return {PlacementKind::Partial, -1, 1}; }
  static Placement local(int bag) { return {PlacementKind::Local, bag, 1}; }
  static Placement local_positions(int bag, int64_t inner, int64_t coef) {
    return {PlacementKind::Local, bag, inner, true, coef};
  }

  bool is_replicate() const { return kind == PlacementKind::Replicate; }
  bool is_shard() const { return kind == PlacementKind::Shard; }
  bool is_partial() const { return kind == PlacementKind::Partial; }
  bool is_local() const { return kind == PlacementKind::Local; }

  // "R", "S(1)", "S(0, inner=4)", "P", "L(0)", "L(0, positions of 2*S, inner=1)"
  std::string str() const;
  bool operator==(const Placement&) const = default;
};

// An error a user can hit: names the pass, the op, the user's source line, what was
// found and what was expected. Bound to Python as autosp._core.PlanError (a ValueError).
class PlanError : public std::invalid_argument {
 public:
  PlanError(const std::string& pass, const Node& node, const std::string& found,
            const std::string& expected, const std::string& hint = "");
  static std::string format(const std::string& pass, const Node& node, const std::string& found,
                            const std::string& expected, const std::string& hint);
};

}  // namespace autosp
