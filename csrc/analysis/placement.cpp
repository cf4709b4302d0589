#include "analysis/placement.h"

namespace autosp {

std::string Placement::str() const {
  switch (kind) {
    case PlacementKind::Replicate:
      return "R";
    case PlacementKind::Partial:
      return "P";
    case PlacementKind::Local:
      if (!positions) return "L(" + std::to_string(dim) + ")";
      return "L(" + std::to_string(dim) + ", positions of " +
             (coef == 1 ? std::string("S") : std::to_string(coef) + "*S") +
             ", inner=" + std::to_string(inner) + ")";
    case PlacementKind::Shard:
      break;
  }
  std::string s = "S(" + std::to_string(dim);
  if (inner != 1) s += ", inner=" + std::to_string(inner);
  return s + ")";
}

std::string PlanError::format(const std::string& pass, const Node& node, const std::string& found,
                              const std::string& expected, const std::string& hint) {
  std::string s = "[autosp:" + pass + "] op '" + node.op + "'";
  if (!node.target.empty() && node.target != node.op) s += " (" + node.target + ")";
  s += " at " + node.loc.str() + ": found " + found + "; expected " + expected + ".";
  if (!hint.empty()) s += " " + hint;
  return s;
}

PlanError::PlanError(const std::string& pass, const Node& node, const std::string& found,
                     const std::string& expected, const std::string& hint)
    : std::invalid_argument(format(pass, node, found, expected, hint)) {}

}  // namespace autosp
