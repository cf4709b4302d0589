// MemoryGraphBuilder: hand-built memory graphs for the memory model's tests.
#pragma once

#include <string>
#include <vector>

#include "plan/layers.h"
#include "plan/memory.h"

namespace autosp {

// Builds a MemoryGraph the way the planner does: users, fusible_user and args derived from
// each node's inputs.
class MemoryGraphBuilder {
 public:
  struct Spec {
    std::string name;
    std::string target;  // RematNode::target (default: the name)
    MemoryRole role = MemoryRole::kCompute;
    RematOpKind kind = RematOpKind::kCheap;
    SeqBytes bytes;  // allocation and save cost
    std::vector<int32_t> inputs;
    bool fw = true;
    bool tangent = false;
    std::string layer;
    int32_t layer_index = kLayerUnknown;  // MemoryNode::layer (a seed for plan/layers.h)
    int32_t alias_of = -1;
    bool gradient = false;
    bool forward_output = false;
    bool non_contiguous = false;  // RematNode::contiguous
  };

  int32_t add(const Spec& s) {
    MemoryNode m;
    m.role = s.role;
    m.save_bytes = s.bytes;
    m.alloc_bytes = s.alias_of >= 0 ? SeqBytes{} : s.bytes;
    m.alias_of = s.alias_of;
    m.gradient = s.gradient;
    m.forward_output = s.forward_output;
    m.layer = s.layer_index;
    RematNode& f = m.facts;
    f.name = s.name;
    f.target = s.target.empty() ? s.name : s.target;
    f.layer = s.layer;
    f.kind = s.role == MemoryRole::kCompute ? s.kind : RematOpKind::kInput;
    f.required_fw = s.fw;
    f.required_bw = !s.fw;
    f.tangents_closure = s.tangent;
    f.primal_input = s.role == MemoryRole::kParameter || s.role == MemoryRole::kInput;
    f.static_lifetime = s.role == MemoryRole::kParameter;
    f.fusible = f.kind == RematOpKind::kCheap || f.kind == RematOpKind::kView;
    f.contiguous = !s.non_contiguous;
    f.aliases = s.alias_of;
    const int32_t id = static_cast<int32_t>(graph.nodes.size());
    for (int32_t in : s.inputs) {
      RematNode& producer = graph.nodes[in].facts;
      producer.users.push_back(id);
      producer.fusible_user.push_back(producer.fusible && f.fusible);
      f.args.push_back(in);
    }
    graph.nodes.push_back(m);
    return id;
  }

  MemoryGraph graph;
};

}  // namespace autosp
