#include "ir/dim.h"

namespace autosp {

std::optional<Dim> Dim::divide(const Dim& other) const {
  if (is_opaque() || other.is_opaque() || other.coef == 0) return std::nullopt;
  if (power < other.power || coef % other.coef != 0) return std::nullopt;
  return Dim{coef / other.coef, power - other.power, {}};
}

std::string Dim::str() const {
  if (is_opaque()) return "{" + opaque + "}";
  if (power == 0) return std::to_string(coef);
  std::string s = coef == 1 ? "" : std::to_string(coef) + "*";
  s += "S";
  if (power > 1) s += "^" + std::to_string(power);
  return s;
}

Dim operator*(const Dim& a, const Dim& b) {
  if (a.is_opaque() || b.is_opaque()) return Dim::expr("(" + a.str() + ")*(" + b.str() + ")");
  return Dim{a.coef * b.coef, a.power + b.power, {}};
}

Dim product(const std::vector<Dim>& dims, size_t begin, size_t end) {
  Dim p = Dim::constant(1);
  for (size_t i = begin; i < end && i < dims.size(); ++i) p = p * dims[i];
  return p;
}

std::string shape_str(const std::vector<Dim>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += shape[i].str();
  }
  return s + "]";
}

}  // namespace autosp
