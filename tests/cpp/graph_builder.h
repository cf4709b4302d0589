// A tiny fluent builder for core IR graphs in tests.
//
//   GraphBuilder b;
//   int ids = b.input("ids", {C(2), S()}, "i64", "data");
//   int w = b.param("embed.weight", {C(128), C(64)});
//   int x = b.at(30, "x = self.embed(ids)").op("embedding", {ids, w}, {C(2), S(), C(64)});
//   b.output({x});
//   print_graph(b.graph) ==
//     "%0: i64[2, S] = input() {name=\"ids\", role=\"data\"}  # model.py:1\n"
//     "%1: f32[128, 64] = input() {grad, name=\"embed.weight\", path=\"embed.weight\", "
//     "role=\"param\"}  # model.py:2\n"
//     "%2: f32[2, S, 64] = embedding(%0, %1) {grad}  # model.py:30\n"
//     "() = output(%2)  # model.py:31\n"
//
// Every node gets a source location in "model.py": the line given by `at`, otherwise the
// line after the previous node's. An op's output dtype defaults to its first floating-point
// input's (else its first tensor input's); a floating-point output requires grad when an
// input does.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "analysis/placement.h"
#include "ir/graph.h"

namespace autosp {

// GoogleTest printers, so that a failed EXPECT_EQ shows "S(1)" rather than raw bytes.
inline void PrintTo(const Dim& d, std::ostream* os) { *os << d.str(); }
inline void PrintTo(const Placement& p, std::ostream* os) { *os << p.str(); }

}  // namespace autosp

namespace autosp::testutil {

// EXPECT_TRUE(contains(error_text, "found ...")) shows both strings when it fails.
inline ::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\n  text: " << text << "\n  lacks: " << part;
}

inline Dim C(int64_t n) { return Dim::constant(n); }
inline Dim S(int64_t coef = 1, int power = 1) { return Dim::seq(coef, power); }

class GraphBuilder {
 public:
  Graph graph;

  // The source location (and optionally the user's spelling of the op) of the next node.
  GraphBuilder& at(int line, std::string code = "") {
    line_ = line - 1;
    code_ = std::move(code);
    return *this;
  }
  GraphBuilder& target(std::string t) {
    target_ = std::move(t);
    return *this;
  }

  int input(const std::string& name, std::vector<Dim> shape, const std::string& dtype,
            const std::string& role, bool requires_grad = false) {
    Value v;
    v.shape = std::move(shape);
    v.dtype = dtype;
    v.requires_grad = requires_grad;
    Attrs attrs{{"name", name}, {"role", role}};
    if (role == "param") attrs["path"] = name;  // the module path the bridge passes
    return add("input", {}, {std::move(v)}, std::move(attrs))[0];
  }
  int param(const std::string& name, std::vector<Dim> shape, const std::string& dtype = "f32") {
    return input(name, std::move(shape), dtype, "param", /*requires_grad=*/true);
  }
  int buffer(const std::string& name, std::vector<Dim> shape, const std::string& dtype = "f32") {
    return input(name, std::move(shape), dtype, "buffer");
  }

  int op(const std::string& op, std::vector<int> inputs, std::vector<Dim> shape, Attrs attrs = {},
         std::string dtype = "") {
    return ops(op, std::move(inputs), {std::move(shape)}, std::move(attrs), std::move(dtype))[0];
  }

  // An op with one output per entry of `shapes` (split, unbind, max with indices, ...).
  std::vector<int> ops(const std::string& op, std::vector<int> inputs,
                       std::vector<std::vector<Dim>> shapes, Attrs attrs = {},
                       std::string dtype = "") {
    bool grad = false;
    std::string first_tensor, first_float;
    for (int i : inputs) {
      if (i < 0) continue;
      const Value& v = graph.value(i);
      grad = grad || v.requires_grad;
      if (!v.is_tensor()) continue;
      if (first_tensor.empty()) first_tensor = v.dtype;
      if (first_float.empty() && is_float(v.dtype)) first_float = v.dtype;
    }
    if (dtype.empty()) dtype = !first_float.empty() ? first_float : first_tensor;
    if (dtype.empty()) dtype = "f32";
    std::vector<Value> outs;
    for (auto& shape : shapes) {
      Value v;
      v.shape = std::move(shape);
      v.dtype = dtype;
      v.requires_grad = grad && is_float(dtype);
      outs.push_back(std::move(v));
    }
    return add(op, std::move(inputs), std::move(outs), std::move(attrs));
  }

  // An op returning a symbolic int (sym_size, sym_arith).
  int symbol(const std::string& op, std::vector<int> inputs, Attrs attrs = {}) {
    Value v;
    v.kind = ValueKind::Symbol;
    return add(op, std::move(inputs), {std::move(v)}, std::move(attrs))[0];
  }

  void output(std::vector<int> inputs) { add("output", std::move(inputs), {}, {}); }

  static bool is_float(const std::string& dtype) {
    return dtype == "f32" || dtype == "bf16" || dtype == "f16" || dtype == "f64";
  }

  // The node that produced value `id`.
  Node& producer_of(int id) { return graph.nodes.at(static_cast<size_t>(graph.producer(id))); }

 private:
  int line_ = 0;
  std::string code_;
  std::string target_;

  std::vector<int> add(const std::string& op, std::vector<int> inputs, std::vector<Value> outs,
                       Attrs attrs) {
    Node n;
    n.op = op;
    n.target = target_.empty() ? op : target_;
    n.inputs = std::move(inputs);
    n.attrs = std::move(attrs);
    n.loc = SourceLoc{"model.py", ++line_, code_};
    for (Value& v : outs) n.outputs.push_back(graph.add_value(std::move(v)));
    code_.clear();
    target_.clear();
    std::vector<int> ids = n.outputs;
    graph.add_node(std::move(n));
    return ids;
  }
};

}  // namespace autosp::testutil
