// Layer replication for the memory model: the memory graph of an L-layer decoder from the
// trace of a shorter one.
//
// Tracing a training step with S symbolic costs seconds per decoder layer (AOTAutograd's
// symbolic shapes), so a 32-layer model would take minutes. Decoder layers are identical, so
// the planner traces three of them and this pass builds the graph of L layers from it:
//
//   1. label every node with its layer (MemoryNode::layer): seeds come from the trace (module
//      paths, parameter names); unlabeled nodes take the layer of their inputs, or of their
//      users when the inputs disagree or have none; what stays unlabeled is outside layers;
//   2. take layer 1 (a middle layer: a layer before it and a layer after it) as the template
//      and find its interface: the one value it reads from layer 0 (the hidden state), the one
//      value layer 2 reads from it, the one gradient it reads from layer 2's backward and the
//      one gradient layer 0's backward reads from it;
//   3. insert L - 3 copies of the template between layers 1 and 2, each reading the previous
//      copy's hidden state and the next copy's gradient, in the places a full trace puts them:
//      the parameters after the template's parameters, the forward after its forward, the
//      backward (in reverse layer order) before its backward;
//   4. grow the values outside layers that gather one value per layer (a gradient bucket
//      spanning layers: a cat of every parameter's gradient, then its all-reduce) by one
//      template's share per copy.
//
// Anything that does not fit this picture (two hidden states, a value outside layers that
// reads a layer in some other way, a layer that reads a layer two away) is an error: the
// caller then traces all L layers.
//
// Example: Llama-3.2-1B for SP 8 traced with 3 layers has 1,135 nodes; the 16-layer graph
// built from it has 5,555. On small models tests/test_planner.py checks that the built graph
// is the full trace's node for node, with equal predictions for every strategy.
#pragma once

#include <cstdint>

#include "plan/memory.h"

namespace autosp {

// MemoryNode::layer values other than a layer index.
inline constexpr int32_t kLayerUnknown = -1;  // no label from the trace: inferred by label_layers
inline constexpr int32_t kNoLayer = -2;       // outside every layer (embedding, head, loss, ...)

// The layer of every node: the seeds in MemoryNode::layer, completed as step 1 above describes
// (kNoLayer for what is outside layers; never kLayerUnknown).
std::vector<int32_t> label_layers(const MemoryGraph& graph);

// The graph of `num_layers` layers built from `traced` (a trace of 3 or more layers, with
// layer seeds), as described above. Nodes keep their order; copies are named "<name>#<layer>"
// and their RematNode::layer is renumbered ("layers.1" -> "layers.<k>"), as are the layers
// after them. num_layers == the traced count returns the graph labelled.
// Throws std::invalid_argument ("[memory] cannot replicate layers: ...") when the traced
// graph does not have the structure above, or num_layers is below the traced count.
MemoryGraph replicate_layers(const MemoryGraph& traced, int32_t num_layers);

}  // namespace autosp
