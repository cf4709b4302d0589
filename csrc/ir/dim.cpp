#include "ir/dim.h"

namespace autosp {

std::optional<Dim> Dim::divide(const Dim& other) const {
  if (is_opaque() || other.is_opaque() || other.coef == 0) return std::nullopt;
  if (power < other.power || coef % other.coef != 0) return std::nullopt;
  if (other.power > 0 && other.offset != offset) return std::nullopt;
  return Dim::seq(coef / other.coef, power - other.power, offset);
}

std::string Dim::str() const {
  if (is_opaque()) return "{" + opaque + "}";
  if (power == 0) return std::to_string(coef);
  std::string s = coef == 1 ? "" : std::to_string(coef) + "*";
  std::string base = "S";
  if (offset != 0) {
    base += (offset > 0 ? "+" : "") + std::to_string(offset);
    if (coef != 1 || power > 1) base = "(" + base + ")";
  }
  s += base;
  if (power > 1) s += "^" + std::to_string(power);
  return s;
}

Dim operator*(const Dim& a, const Dim& b) {
  const bool mixed = a.power > 0 && b.power > 0 && a.offset != b.offset;
  if (a.is_opaque() || b.is_opaque() || mixed)
    return Dim::expr("(" + a.str() + ")*(" + b.str() + ")");
  return Dim::seq(a.coef * b.coef, a.power + b.power, a.power > 0 ? a.offset : b.offset);
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
