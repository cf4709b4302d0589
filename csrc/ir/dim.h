// Symbolic tensor sizes.
//
// A size is a monomial in the shifted sequence length: `coef * (S + offset)^power`. Static
// sizes have power 0 (and offset 0). A nonzero offset is what slicing a few positions off the
// sequence leaves (`logits[:, :-1]` has S - 1 positions; a causal conv's padded output has
// S + k - 1). Anything else the tracer produced (`S // 2`, `S^2 + 1`) is kept as opaque
// text: the core can print it and compare it for equality, but never reasons about it.
//
//   Dim::constant(64).str()  == "64"
//   Dim::seq().str()         == "S"
//   Dim::seq(2).str()        == "2*S"
//   (Dim::constant(2) * Dim::seq()) == Dim::seq(2)
//   Dim::seq(8).divide(Dim::constant(4)) == Dim::seq(2)
//   Dim::seq(2, 1, -1).str()  == "2*(S-1)"
//   Dim::seq(2, 1, -1).divide(Dim::seq(1, 1, -1)) == Dim::constant(2)
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace autosp {

struct Dim {
  int64_t coef = 0;
  int power = 0;
  std::string opaque;  // non-empty: an expression the core does not model
  int64_t offset = 0;  // S + offset; 0 whenever power == 0

  static Dim constant(int64_t n) { return Dim{n, 0, {}, 0}; }
  static Dim seq(int64_t coef = 1, int power = 1, int64_t offset = 0) {
    return Dim{coef, power, {}, power == 0 ? 0 : offset};
  }
  static Dim expr(std::string text) { return Dim{0, 0, std::move(text), 0}; }

  bool is_opaque() const { return !opaque.empty(); }
  bool is_static() const { return opaque.empty() && power == 0; }
  bool has_seq() const { return opaque.empty() && power > 0; }
  bool is_one() const { return is_static() && coef == 1; }

  // Exact division of monomials; nullopt when the quotient is not a monomial with an
  // integer coefficient (or either side is opaque, or both hold S with different offsets).
  std::optional<Dim> divide(const Dim& other) const;

  std::string str() const;
  bool operator==(const Dim&) const = default;
};

Dim operator*(const Dim& a, const Dim& b);

// Product of a range of dims; opaque if any factor is.
Dim product(const std::vector<Dim>& dims, size_t begin, size_t end);

std::string shape_str(const std::vector<Dim>& shape);

}  // namespace autosp
