// The core graph IR: values with symbolic shapes, nodes with canonical op names,
// attributes and the user's source location.
//
// The Python bridge builds a Graph from a Dynamo FX graph (one Node per FX node, in
// topological order). Passes return a new Graph; `print_graph` renders it as text for
// golden tests and for users who ask to see what a pass did:
//
//   %0: i64[2, S] = input() {role="data"}
//   %1: f32[128, 64] = input() {grad, role="param"}
//   %2: f32[2, S, 64] = embedding(%0, %1)  # model.py:30  x = self.embed(ids)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "ir/dim.h"

namespace autosp {

using Attr = std::variant<int64_t, double, bool, std::string, std::vector<int64_t>>;
using Attrs = std::map<std::string, Attr>;

std::string attr_str(const Attr& a);

enum class ValueKind { Tensor, Symbol, Other };

struct Value {
  int id = -1;
  ValueKind kind = ValueKind::Tensor;
  std::vector<Dim> shape;  // tensors only
  std::string dtype;       // "f32", "bf16", "i64", ...
  bool requires_grad = false;

  int rank() const { return static_cast<int>(shape.size()); }
  bool is_tensor() const { return kind == ValueKind::Tensor; }
  bool operator==(const Value&) const = default;
};

struct SourceLoc {
  std::string file;
  int line = 0;
  std::string code;

  bool empty() const { return file.empty(); }
  std::string str() const;  // "model.py:30  x = self.embed(ids)"
  bool operator==(const SourceLoc&) const = default;
};

struct Node {
  int id = -1;
  std::string op;            // canonical op name, e.g. "linear", "view", "sp.all_to_all"
  std::string target;        // the op as the user wrote it, e.g. "torch.nn.functional.linear"
  std::vector<int> inputs;   // value ids; -1 for an absent optional operand
  std::vector<int> outputs;  // value ids
  Attrs attrs;
  SourceLoc loc;
  int origin = -1;  // id of the node in the input graph this node came from; -1 if inserted

  bool has_attr(const std::string& name) const { return attrs.count(name) != 0; }
  int64_t int_attr(const std::string& name, int64_t fallback) const;
  bool bool_attr(const std::string& name, bool fallback) const;
  std::string str_attr(const std::string& name, const std::string& fallback) const;
  std::vector<int64_t> ints_attr(const std::string& name) const;
  bool operator==(const Node&) const = default;
};

struct Graph {
  std::vector<Value> values;  // indexed by id
  std::vector<Node> nodes;    // topological order

  // Adds a value and returns its id.
  int add_value(Value v);
  // Appends a node (its id is assigned) and returns its index in `nodes`.
  int add_node(Node n);

  const Value& value(int id) const { return values.at(static_cast<size_t>(id)); }
  // Index into `nodes` of the node producing `value_id`, or -1 for none.
  int producer(int value_id) const;

  bool operator==(const Graph&) const = default;
};

// Renders the graph. `value_notes` (optional, indexed by value id) is printed after
// each value's type; the SP plan uses it to show placements: `%2: f32[2, S, 64] S(1)`.
std::string print_graph(const Graph& g, const std::vector<std::string>& value_notes = {});

}  // namespace autosp
