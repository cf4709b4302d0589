#include "ir/graph.h"

#include <sstream>

namespace autosp {

std::string attr_str(const Attr& a) {
  std::ostringstream os;
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) {
          os << (v ? "true" : "false");
        } else if constexpr (std::is_same_v<T, std::string>) {
          os << '"' << v << '"';
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          os << '[';
          for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
          os << ']';
        } else {
          os << v;
        }
      },
      a);
  return os.str();
}

std::string SourceLoc::str() const {
  if (empty()) return "<unknown source>";
  std::string s = file + ":" + std::to_string(line);
  if (!code.empty()) s += "  " + code;
  return s;
}

int64_t Node::int_attr(const std::string& name, int64_t fallback) const {
  auto it = attrs.find(name);
  if (it == attrs.end()) return fallback;
  if (auto p = std::get_if<int64_t>(&it->second)) return *p;
  if (auto b = std::get_if<bool>(&it->second)) return *b ? 1 : 0;
  return fallback;
}

bool Node::bool_attr(const std::string& name, bool fallback) const {
  auto it = attrs.find(name);
  if (it == attrs.end()) return fallback;
  if (auto p = std::get_if<bool>(&it->second)) return *p;
  if (auto i = std::get_if<int64_t>(&it->second)) return *i != 0;
  return fallback;
}

std::string Node::str_attr(const std::string& name, const std::string& fallback) const {
  auto it = attrs.find(name);
  if (it == attrs.end()) return fallback;
  if (auto p = std::get_if<std::string>(&it->second)) return *p;
  return fallback;
}

std::vector<int64_t> Node::ints_attr(const std::string& name) const {
  auto it = attrs.find(name);
  if (it == attrs.end()) return {};
  if (auto p = std::get_if<std::vector<int64_t>>(&it->second)) return *p;
  if (auto i = std::get_if<int64_t>(&it->second)) return {*i};
  return {};
}

int Graph::add_value(Value v) {
  v.id = static_cast<int>(values.size());
  values.push_back(std::move(v));
  return values.back().id;
}

int Graph::add_node(Node n) {
  n.id = static_cast<int>(nodes.size());
  nodes.push_back(std::move(n));
  return static_cast<int>(nodes.size()) - 1;
}

int Graph::producer(int value_id) const {
  for (size_t i = 0; i < nodes.size(); ++i)
    for (int o : nodes[i].outputs)
      if (o == value_id) return static_cast<int>(i);
  return -1;
}

namespace {

std::string value_type(const Value& v) {
  switch (v.kind) {
    case ValueKind::Symbol:
      return "sym";
    case ValueKind::Other:
      return "obj";
    case ValueKind::Tensor:
      break;
  }
  return v.dtype + shape_str(v.shape);
}

}  // namespace

std::string print_graph(const Graph& g, const std::vector<std::string>& value_notes) {
  std::ostringstream os;
  for (const Node& n : g.nodes) {
    for (size_t i = 0; i < n.outputs.size(); ++i) {
      const Value& v = g.value(n.outputs[i]);
      os << (i ? ", " : "") << '%' << v.id << ": " << value_type(v);
      if (static_cast<size_t>(v.id) < value_notes.size() && !value_notes[v.id].empty())
        os << ' ' << value_notes[v.id];
    }
    if (n.outputs.empty()) os << "()";
    os << " = " << n.op << '(';
    for (size_t i = 0; i < n.inputs.size(); ++i) {
      os << (i ? ", " : "");
      if (n.inputs[i] < 0)
        os << "None";
      else
        os << '%' << n.inputs[i];
    }
    os << ')';
    std::vector<std::string> attrs;
    for (const auto& [k, a] : n.attrs) attrs.push_back(k + "=" + attr_str(a));
    for (int o : n.outputs)
      if (g.value(o).requires_grad) {
        attrs.insert(attrs.begin(), "grad");
        break;
      }
    if (!attrs.empty()) {
      os << " {";
      for (size_t i = 0; i < attrs.size(); ++i) os << (i ? ", " : "") << attrs[i];
      os << '}';
    }
    if (!n.loc.empty()) os << "  # " << n.loc.file << ':' << n.loc.line;
    os << '\n';
  }
  return os.str();
}

}  // namespace autosp
