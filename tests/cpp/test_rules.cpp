// The op-rule registry: one focused test per rule family, reshape_shard's worked examples,
// and the text of every conflict a user can hit.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "analysis/placement.h"
#include "analysis/rules.h"
#include "graph_builder.h"
#include "plan_error.h"

namespace autosp {
namespace {

using testutil::C;
using testutil::contains;
using testutil::GraphBuilder;
using testutil::S;

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
Placement Sh(int dim, int64_t inner = 1) { return Placement::shard(dim, inner); }
const OperandChange Keep = OperandChange::keep();
OperandChange Slice(int dim, int64_t inner = 1) { return OperandChange::slice(dim, inner); }
OperandChange Exchange(int dim, int seq_dim) { return OperandChange::exchange(dim, seq_dim); }

// A RuleResult as a comparable value.
struct Outcome {
  std::vector<Placement> out;
  std::vector<OperandChange> operands;
  Attrs attr_updates = {};
  std::string expansion = {};
  bool operator==(const Outcome&) const = default;
};

void PrintTo(const Outcome& o, std::ostream* os) {
  *os << "{out=[";
  for (size_t i = 0; i < o.out.size(); ++i) *os << (i ? ", " : "") << o.out[i].str();
  *os << "], operands=[";
  for (size_t i = 0; i < o.operands.size(); ++i) {
    const OperandChange& c = o.operands[i];
    *os << (i ? ", " : "");
    switch (c.kind) {
      case OperandChange::Kind::Keep:
        *os << "Keep";
        break;
      case OperandChange::Kind::Slice:
        *os << "Slice(" << c.dim << ", inner=" << c.inner << ")";
        break;
      case OperandChange::Kind::ReducePartial:
        *os << "ReducePartial";
        break;
      case OperandChange::Kind::Exchange:
        *os << "Exchange(" << c.dim << ", seq " << c.gather_dim << ")";
        break;
    }
  }
  *os << "], attr_updates={";
  for (const auto& [k, a] : o.attr_updates) *os << k << "=" << attr_str(a) << " ";
  *os << "}, expansion=\"" << o.expansion << "\"}";
}

// Runs the rule of the node producing `out` (rule_for), with the given operand placements.
Outcome run_rule(const GraphBuilder& b, int out, std::vector<Placement> in, int64_t sp = 2) {
  const Node& n = b.graph.nodes.at(static_cast<size_t>(b.graph.producer(out)));
  const OpRule* rule = rule_for(n);
  if (!rule) throw std::logic_error("no rule for " + n.op);
  RuleResult r = rule->fn(RuleInput{b.graph, n, std::move(in), sp});
  return {r.out, r.operands, r.attr_updates, expansion_name(r.expansion)};
}

std::string rule_error(const GraphBuilder& b, int out, std::vector<Placement> in) {
  return plan_error([&] { run_rule(b, out, std::move(in)); });
}

// ---- placements, errors, registry ------------------------------------------------------

TEST(Placement, Str) {
  EXPECT_EQ(R.str(), "R");
  EXPECT_EQ(P.str(), "P");
  EXPECT_EQ(Sh(1).str(), "S(1)");
  EXPECT_EQ(Sh(0, 4).str(), "S(0, inner=4)");
  EXPECT_EQ(Sh(2), (Placement{.kind = PlacementKind::Shard, .dim = 2, .inner = 1}));
  EXPECT_NE(Sh(0, 2), Sh(0));
  EXPECT_TRUE(R.is_replicate() && Sh(0).is_shard() && P.is_partial());
}

TEST(PlanError, Format) {
  const Node n{.op = "softmax",
               .target = "torch.softmax",
               .loc = {.file = "model.py", .line = 12, .code = "p = x.softmax(1)"}};
  const PlanError e("placement", n, "x", "y", "A hint.");
  EXPECT_STREQ(e.what(),
               "[autosp:placement] op 'softmax' (torch.softmax) at model.py:12  p = x.softmax(1): "
               "found x; expected y. A hint.");
  // No target spelled differently, no hint, no source.
  EXPECT_EQ(PlanError::format("ulysses", Node{.op = "sdpa", .target = "sdpa"}, "a", "b", ""),
            "[autosp:ulysses] op 'sdpa' at <unknown source>: found a; expected b.");
  // A PlanError is an std::invalid_argument (bound to Python as a ValueError).
  EXPECT_THROW(throw PlanError("p", n, "a", "b"), std::invalid_argument);
}

TEST(Registry, FindRule) {
  const auto ops = registered_ops();
  EXPECT_TRUE(std::is_sorted(ops.begin(), ops.end()));
  for (const char* op :
       {"add", "mul", "sum", "mean", "softmax", "reshape", "permute", "index", "cat", "split",
        "linear", "matmul", "embedding", "sym_size", "layer_norm", "arange"})
    EXPECT_NE(find_rule(op), nullptr) << op;
  EXPECT_EQ(find_rule("my_custom_op"), nullptr);
  // Attention and cross-entropy are rows of the same table, with their own emitters and no
  // placement rule; eye has a locality (mask tiles replay it) but no rule.
  for (const char* op : {"sdpa", "flex_attention"}) {
    ASSERT_NE(find_rule(op), nullptr) << op;
    EXPECT_EQ(find_rule(op)->emitter, Emitter::Attention);
    EXPECT_EQ(find_rule(op)->fn, nullptr);
  }
  EXPECT_EQ(find_rule("cross_entropy")->emitter, Emitter::CrossEntropy);
  EXPECT_EQ(find_rule("eye")->fn, nullptr);
  EXPECT_EQ(find_rule("eye")->locality, Locality::Eye);
  EXPECT_TRUE(std::binary_search(ops.begin(), ops.end(), "sdpa"));
  EXPECT_FALSE(std::binary_search(ops.begin(), ops.end(), "eye"));

  EXPECT_EQ(find_rule("add")->partial, PartialBehaviour::Additive);
  EXPECT_EQ(find_rule("sub")->partial, PartialBehaviour::Additive);
  EXPECT_EQ(find_rule("mul")->partial, PartialBehaviour::Scale);
  EXPECT_EQ(find_rule("div")->partial, PartialBehaviour::Scale);
  EXPECT_EQ(find_rule("neg")->partial, PartialBehaviour::Unary);
  EXPECT_EQ(find_rule("sum")->partial, PartialBehaviour::Unary);
  EXPECT_EQ(find_rule("reshape")->partial, PartialBehaviour::Unary);
  EXPECT_EQ(find_rule("amax")->partial, PartialBehaviour::Reduce);
}

// The pointwise set is torch's (the bridge marks nodes from torch.Tag.pointwise): any op so
// marked takes the elementwise rule, and no pointwise name is registered in the core.
TEST(Registry, PointwiseNodesTakeTheElementwiseRule) {
  Node expm1{.op = "expm1", .attrs = {{"pointwise", true}}};
  ASSERT_NE(rule_for(expm1), nullptr);
  EXPECT_EQ(rule_for(expm1)->partial, PartialBehaviour::Reduce);
  EXPECT_EQ(rule_for(Node{.op = "expm1"}), nullptr);
  EXPECT_EQ(find_rule("exp"), nullptr);
  EXPECT_EQ(find_rule("silu"), nullptr);
  Node add{.op = "add", .attrs = {{"pointwise", true}}};
  EXPECT_EQ(rule_for(add)->partial, PartialBehaviour::Additive);  // the registered row wins
}

// The locality column, read by slice hoisting and mask tiling: elementwise for pointwise
// nodes and the elementwise rows (where, masked_fill, casts), none for ops that move or mix
// elements whatever their partial behaviour (sum is linear but not elementwise).
TEST(Registry, LocalityColumn) {
  Node expm1{.op = "expm1", .attrs = {{"pointwise", true}}};
  EXPECT_TRUE(is_elementwise(expm1));
  for (const char* op : {"add", "where", "masked_fill", "to", "alias", "clone"})
    EXPECT_TRUE(is_elementwise(Node{.op = op})) << op;
  for (const char* op : {"sum", "repeat", "repeat_interleave", "dropout", "matmul", "expm1"})
    EXPECT_FALSE(is_elementwise(Node{.op = op})) << op;
  EXPECT_EQ(locality_of(Node{.op = "reshape"}), Locality::Reshape);
  EXPECT_EQ(locality_of(Node{.op = "tril"}), Locality::Triangle);
  EXPECT_EQ(locality_of(Node{.op = "zeros"}), Locality::Factory);
  EXPECT_EQ(locality_of(Node{.op = "arange"}), Locality::None);
  EXPECT_EQ(locality_of(Node{.op = "my_custom_op"}), Locality::None);
}

TEST(SequenceDim, FirstDimLinearInS) {
  EXPECT_EQ(sequence_dim(Value{.shape = {C(2), S(), C(64)}}), 1);
  EXPECT_EQ(sequence_dim(Value{.shape = {S(2), C(64)}}), 0);
  EXPECT_EQ(sequence_dim(Value{.shape = {C(2), S(1, 2), S()}}), 2);  // S^2 is not a sequence dim
  EXPECT_EQ(sequence_dim(Value{.shape = {C(2), Dim::expr("s0 + 1")}}), -1);
  EXPECT_EQ(sequence_dim(Value{.shape = {C(2), C(64)}}), -1);
}

// ---- elementwise -----------------------------------------------------------------------

TEST(ElementwiseRule, BroadcastAndSliceReplicatedOperand) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int cos = b.input("cos", {C(1), S(), C(64)}, "f32", "buffer");
  const int table = b.input("table", {S(), C(64)}, "f32", "buffer");
  const int w = b.param("w", {C(64)});
  const int one = b.input("one", {C(2), C(1), C(64)}, "f32", "buffer");
  const int y1 = b.op("mul", {x, cos}, {C(2), S(), C(64)});
  const int y2 = b.op("add", {table, x}, {C(2), S(), C(64)});
  const int y3 = b.op("mul", {x, w}, {C(2), S(), C(64)});
  const int y4 = b.op("add", {x, one}, {C(2), S(), C(64)});
  const int y5 = b.op("sub", {x, x}, {C(2), S(), C(64)});
  const int y6 = b.op("exp", {x}, {C(2), S(), C(64)}, {{"pointwise", true}});

  // The replicated operand holds the whole sequence: it is sliced locally (no collective).
  EXPECT_EQ(run_rule(b, y1, {Sh(1), R}), (Outcome{{Sh(1)}, {Keep, Slice(1)}}));
  // Aligned from the right: dim 0 of a rank-2 operand is dim 1 of the output.
  EXPECT_EQ(run_rule(b, y2, {R, Sh(1)}), (Outcome{{Sh(1)}, {Slice(0), Keep}}));
  // Broadcast along a dim the operand lacks, or has size 1 in: nothing to slice.
  EXPECT_EQ(run_rule(b, y3, {Sh(1), R}), (Outcome{{Sh(1)}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, y4, {Sh(1), R}), (Outcome{{Sh(1)}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, y5, {Sh(1), Sh(1)}), (Outcome{{Sh(1)}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, y6, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}}));
  EXPECT_EQ(run_rule(b, y6, {R}), (Outcome{{R}, {Keep}}));
}

TEST(ElementwiseRule, MergedDimSlicesWithInner) {
  GraphBuilder b;
  const int x = b.input("x", {S(2), C(64)}, "f32", "data");
  const int m = b.input("m", {S(2), C(64)}, "f32", "buffer");
  const int y = b.op("mul", {x, m}, {S(2), C(64)});
  EXPECT_EQ(run_rule(b, y, {Sh(0, 2), R}), (Outcome{{Sh(0, 2)}, {Keep, Slice(0, 2)}}));
}

TEST(ElementwiseRule, ConflictingShards) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int t = b.input("t", {S(), C(2), C(64)}, "f32", "data");
  const int y = b.at(21, "y = x + t.transpose(0, 1)").op("add", {x, t}, {C(2), S(), C(64)});
  const std::string msg = rule_error(b, y, {Sh(1), Sh(0)});
  EXPECT_TRUE(contains(msg, "[autosp:placement] op 'add' at model.py:21  y = x + t.transpose"));
  EXPECT_TRUE(contains(msg,
                       "found input 0 f32[2, S, 64] placed S(1) and input 1 f32[S, 2, 64] "
                       "placed S(0), sharded on different output dims (S(1) vs S(0))"));
  EXPECT_TRUE(contains(msg, "expected operands sharded on the same sequence dim."));
}

TEST(ElementwiseRule, ReplicatedOperandOfAnotherLength) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int m = b.input("m", {C(2), S(2), C(64)}, "f32", "buffer");
  const int y = b.at(8).op("mul", {x, m}, {C(2), S(), C(64)});
  const std::string msg = rule_error(b, y, {Sh(1), R});
  EXPECT_TRUE(contains(msg, "op 'mul' at model.py:8:"));
  EXPECT_TRUE(contains(msg, "found input 1 f32[2, 2*S, 64] placed R whose dim 1 is 2*S"));
  EXPECT_TRUE(contains(msg, "expected size S or 1 along the sharded dim."));
}

// ---- reductions ------------------------------------------------------------------------

TEST(ReductionRule, OverOtherDimsKeepsTheShard) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int a = b.op("sum", {x}, {C(2), S()}, {{"dims", std::vector<int64_t>{-1}}});
  const int c = b.op("sum", {x}, {S()}, {{"dims", std::vector<int64_t>{0, 2}}});
  const int d =
      b.op("amax", {x}, {C(1), S(), C(64)}, {{"dims", std::vector<int64_t>{0}}, {"keepdim", true}});
  EXPECT_EQ(run_rule(b, a, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}}));
  EXPECT_EQ(run_rule(b, c, {Sh(1)}), (Outcome{{Sh(0)}, {Keep}}));  // dim 0 removed before it
  EXPECT_EQ(run_rule(b, d, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}}));  // keepdim: no shift
  EXPECT_EQ(run_rule(b, a, {R}), (Outcome{{R}, {Keep}}));
}

TEST(ReductionRule, SumOverSequenceIsPartialMeanExpands) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int s1 = b.op("sum", {x}, {C(2), C(64)}, {{"dims", std::vector<int64_t>{1}}});
  const int s_all = b.op("sum", {x}, {});
  const int m1 = b.op("mean", {x}, {C(2), C(64)}, {{"dims", std::vector<int64_t>{-2}}});
  const int m_all = b.op("mean", {x}, {});
  EXPECT_EQ(run_rule(b, s1, {Sh(1)}), (Outcome{{P}, {Keep}}));
  EXPECT_EQ(run_rule(b, s_all, {Sh(1)}), (Outcome{{P}, {Keep}}));
  // A mean is a local sum over the global count: the plan expands it.
  EXPECT_EQ(run_rule(b, m1, {Sh(1)}), (Outcome{{P}, {Keep}, {}, "mean_partial"}));
  EXPECT_EQ(run_rule(b, m_all, {Sh(1)}), (Outcome{{P}, {Keep}, {}, "mean_partial"}));
}

TEST(ReductionRule, NonLinearReductionOverSequenceIsAnError) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int y = b.at(40, "v = x.var(1)")
                    .target("torch.var")
                    .op("var", {x}, {C(2), C(64)}, {{"dims", std::vector<int64_t>{1}}});
  const std::string msg = rule_error(b, y, {Sh(1)});
  EXPECT_TRUE(contains(msg,
                       "[autosp:placement] op 'var' (torch.var) at model.py:40  "
                       "v = x.var(1): "));
  EXPECT_TRUE(contains(msg,
                       "found input 0 f32[2, S, 64] placed S(1), reduced along the sharded "
                       "sequence dim 1; expected a reduction that combines exactly across ranks"));
  EXPECT_TRUE(contains(msg, "'var' over the whole sequence is not supported"));
}

// amax, logsumexp, prod and max/min without indices reduce the local chunk and combine the
// ranks' results by the same reduction (sp.combine); over other dims the shard stays.
TEST(ReductionRule, CombinableReductionsOverSequence) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int m = b.op("amax", {x}, {C(2), C(64)}, {{"dims", std::vector<int64_t>{1}}});
  const int l = b.op("logsumexp", {x}, {C(2), C(64)}, {{"dims", std::vector<int64_t>{1}}});
  const auto vi =
      b.ops("max", {x}, {{C(2), C(64)}, {C(2), C(64)}}, {{"dims", std::vector<int64_t>{1}}});
  const Outcome combined{{R}, {Keep}, {}, "combine"};
  EXPECT_EQ(run_rule(b, m, {Sh(1)}), combined);
  EXPECT_EQ(run_rule(b, l, {Sh(1)}), combined);
  EXPECT_TRUE(contains(rule_error(b, vi[0], {Sh(1)}), "max/min without indices"));
  const int other = b.op("amax", {x}, {C(2), S()}, {{"dims", std::vector<int64_t>{2}}});
  EXPECT_EQ(run_rule(b, other, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}}));
}

// ---- along one dim (softmax, cumsum, ...) ------------------------------------------------

TEST(AlongDimRule, OtherDimKeepsShard) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), C(4), S(), S()}, "f32", "data");
  const int y = b.op("softmax", {x}, {C(2), C(4), S(), S()}, {{"dim", int64_t{-1}}});
  EXPECT_EQ(run_rule(b, y, {Sh(2)}), (Outcome{{Sh(2)}, {Keep}}));
  EXPECT_EQ(run_rule(b, y, {R}), (Outcome{{R}, {Keep}}));
}

TEST(AlongDimRule, ConflictErrorText) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int y = b.at(12, "p = x.softmax(1)")
                    .target("torch.softmax")
                    .op("softmax", {x}, {C(2), S(), C(64)}, {{"dim", int64_t{1}}});
  EXPECT_EQ(rule_error(b, y, {Sh(1)}),
            "[autosp:placement] op 'softmax' (torch.softmax) at model.py:12  p = x.softmax(1): "
            "found input 0 f32[2, S, 64] placed S(1), and the op works along dim 1; expected an "
            "op along a dim other than the sharded sequence dim. Each rank holds only its chunk "
            "of the sequence, so 'softmax' along it would be wrong; compute it before the "
            "sequence is sharded or inside attention.");
}

// cumsum/cumprod/logcumsumexp along a dim that is the sequence alone: the local scan and a
// cross-rank prefix (sp.scan). Along a merged dim ([2*S]) the scan would cross the other
// factor's blocks, so it stays an error.
TEST(AlongDimRule, ScansAlongTheSequence) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int flat = b.input("flat", {S(2), C(64)}, "f32", "data");
  const int c = b.op("cumsum", {x}, {C(2), S(), C(64)}, {{"dim", int64_t{1}}});
  const int l = b.op("logcumsumexp", {x}, {C(2), S(), C(64)}, {{"dim", int64_t{-2}}});
  const int merged = b.op("cumsum", {flat}, {S(2), C(64)}, {{"dim", int64_t{0}}});
  EXPECT_EQ(run_rule(b, c, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}, {}, "scan"}));
  EXPECT_EQ(run_rule(b, l, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}, {}, "scan"}));
  EXPECT_TRUE(contains(rule_error(b, merged, {Sh(0)}), "the op works along dim 0"));
  EXPECT_TRUE(contains(rule_error(b, merged, {Sh(0, 2)}), "the op works along dim 0"));
}

// ---- reshape -----------------------------------------------------------------------------

TEST(ReshapeShard, WorkedExamples) {
  // Merging batch and sequence ([2, S, V] -> [2*S, V]): S is the inner factor.
  EXPECT_EQ(reshape_shard({C(2), S(), C(128)}, {S(2), C(128)}, Sh(1)), Sh(0));
  // Merging sequence and a dim to its right ([S, 2, V] -> [2*S, V]): 2 lies inside.
  EXPECT_EQ(reshape_shard({S(), C(2), C(128)}, {S(2), C(128)}, Sh(0)), Sh(0, 2));
  // Splitting heads off the features.
  EXPECT_EQ(reshape_shard({C(2), S(), C(64)}, {C(2), S(), C(4), C(16)}, Sh(1)), Sh(1));
  EXPECT_EQ(reshape_shard({C(2), S(), C(4), C(16)}, {C(2), S(), C(64)}, Sh(1)), Sh(1));
  // Merging the features into the sequence dim, and flattening everything.
  EXPECT_EQ(reshape_shard({C(2), S(), C(64)}, {C(2), S(64)}, Sh(1)), Sh(1, 64));
  EXPECT_EQ(reshape_shard({C(2), S(), C(64)}, {S(128)}, Sh(1)), Sh(0, 64));
  // Undoing a merge puts the shard back.
  EXPECT_EQ(reshape_shard({S(2), C(128)}, {C(2), S(), C(128)}, Sh(0)), Sh(1));
  EXPECT_EQ(reshape_shard({S(2), C(128)}, {S(), C(2), C(128)}, Sh(0, 2)), Sh(0));
  // Adding a unit dim.
  EXPECT_EQ(reshape_shard({C(2), S()}, {S(2), C(1)}, Sh(1)), Sh(0));
  // A sliced sequence (S - 1 positions) merges and unmerges with its offset.
  const Dim s1 = Dim::seq(1, 1, -1);
  EXPECT_EQ(reshape_shard({C(2), s1, C(128)}, {Dim::seq(2, 1, -1), C(128)}, Sh(1)), Sh(0));
  EXPECT_EQ(reshape_shard({Dim::seq(2, 1, -1), C(128)}, {C(2), s1, C(128)}, Sh(0)), Sh(1));
  EXPECT_EQ(reshape_shard({C(2), s1, C(128)}, {S(2), C(128)}, Sh(1)), std::nullopt);
  // Non-shard placements pass through.
  EXPECT_EQ(reshape_shard({C(2), S()}, {S(2)}, R), R);
  EXPECT_EQ(reshape_shard({C(2), S()}, {S(2)}, P), P);
}

TEST(ReshapeShard, SplitsThatMustFail) {
  // [2*S] with batch outer cannot be read as [S, 2]: that interleaves the sequence.
  EXPECT_EQ(reshape_shard({S(2), C(64)}, {S(), C(2), C(64)}, Sh(0)), std::nullopt);
  // [S, 4] -> [4, S] is a reshape, not a transpose: the sequence factor is scrambled.
  EXPECT_EQ(reshape_shard({S(), C(4)}, {C(4), S()}, Sh(0)), std::nullopt);
  // Splitting S itself.
  EXPECT_EQ(reshape_shard({C(2), S()}, {C(2), C(2), Dim::expr("s0 // 2")}, Sh(1)), std::nullopt);
  // Opaque sizes right of the sequence.
  EXPECT_EQ(reshape_shard({S(), Dim::expr("u")}, {S(), Dim::expr("u")}, Sh(0)), std::nullopt);
}

TEST(ReshapeRule, LocalDimsAndError) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(128)}, "f32", "data");
  const int flat = b.op("reshape", {x}, {S(2), C(128)});
  const int heads = b.op("reshape", {x}, {C(2), S(), C(8), C(16)});
  const int bad = b.at(77, "y = x.view(S, 2, 128)").op("reshape", {flat}, {S(), C(2), C(128)});
  EXPECT_EQ(run_rule(b, flat, {Sh(1)}),
            (Outcome{{Sh(0)}, {Keep}, {{"local_dims", std::vector<int64_t>{0}}}}));
  EXPECT_EQ(run_rule(b, heads, {Sh(1)}),
            (Outcome{{Sh(1)}, {Keep}, {{"local_dims", std::vector<int64_t>{1}}}}));
  EXPECT_EQ(run_rule(b, flat, {R}), (Outcome{{R}, {Keep}}));
  const std::string msg = rule_error(b, bad, {Sh(0)});
  EXPECT_TRUE(contains(msg, "op 'reshape' at model.py:77  y = x.view(S, 2, 128): "));
  EXPECT_TRUE(contains(msg,
                       "found input 0 f32[2*S, 128] placed S(0) reshaped to [S, 2, 128], "
                       "which splits or reorders the sharded sequence factor"));
  EXPECT_TRUE(contains(msg, "expected a reshape that keeps the sequence factor whole"));
}

TEST(ExpandRule, LeadingDimsShiftTheShard) {
  GraphBuilder b;
  const int pos = b.input("pos", {S(), C(1)}, "i64", "data");
  const int y = b.op("expand", {pos}, {C(2), S(), S()});
  EXPECT_EQ(run_rule(b, y, {Sh(0)}),
            (Outcome{{Sh(1)}, {Keep}, {{"local_dims", std::vector<int64_t>{1}}}}));
}

// x.view_as(y) / x.expand_as(y) read y's local shape at run time: the result lies as y does,
// and a replicated x is cut to the part this rank's chunk of y takes.
TEST(ShapedLikeOperand, ViewAsAndExpandAs) {
  GraphBuilder b;
  const int x = b.input("x", {S(2), C(16)}, "f32", "data");
  const int h = b.input("h", {C(2), S(), C(16)}, "f32", "data");
  const int bias = b.input("bias", {C(1), C(1), C(16)}, "f32", "data");
  const int mask = b.input("mask", {C(2), S(), C(1)}, "f32", "data");
  const int flat = b.input("flat", {C(2), S(16)}, "f32", "data");
  const int v = b.at(9, "y = x.view_as(h)").op("reshape", {x, h}, {C(2), S(), C(16)});
  const int e = b.op("expand", {bias, h}, {C(2), S(), C(16)});
  const int m = b.op("expand", {mask, h}, {C(2), S(), C(16)});
  const int f = b.op("reshape", {flat, h}, {C(2), S(), C(16)});
  EXPECT_EQ(run_rule(b, v, {R, R}), (Outcome{{R}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, v, {Sh(0), Sh(1)}),
            (Outcome{{Sh(1)}, {Keep, Keep}, {{"local_dims", std::vector<int64_t>{1}}}}));
  EXPECT_EQ(run_rule(b, e, {R, Sh(1)}), (Outcome{{Sh(1)}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, m, {R, Sh(1)}), (Outcome{{Sh(1)}, {Slice(1), Keep}}));
  EXPECT_EQ(run_rule(b, f, {R, Sh(1)}), (Outcome{{Sh(1)}, {Slice(1, 16), Keep}}));
  // x = [2*S, 16] viewed as [2, S, 16]: its chunk is rows of both sequences, Shard(0) of
  // the merged dim with the batch outside.
  EXPECT_EQ(run_rule(b, v, {R, Sh(1)}), (Outcome{{Sh(1)}, {Slice(0), Keep}}));
  EXPECT_TRUE(contains(rule_error(b, v, {Sh(0), R}),
                       "found input 0 f32[2*S, 16] placed S(0) given the shape of input 1 "
                       "f32[2, S, 16] placed R, which this rank holds whole"));
}

// GQA written by hand: k.repeat_interleave(n_rep, dim=1) on [B, kv, S, D] sharded on S keeps the
// shard; along the sequence each rank repeats its own chunk (the repeats sit right of S).
TEST(RepeatRules, RepeatInterleaveAndRepeat) {
  GraphBuilder b;
  const int k = b.input("k", {C(2), C(2), S(), C(16)}, "f32", "data");
  const int reps = b.input("reps", {C(2)}, "i64", "data");
  const int heads = b.op("repeat_interleave", {k}, {C(2), C(4), S(), C(16)},
                         {{"dim", int64_t{1}}, {"repeats", int64_t{2}}});
  const int seq = b.op("repeat_interleave", {k}, {C(2), C(2), S(3), C(16)},
                       {{"dim", int64_t{2}}, {"repeats", int64_t{3}}});
  const int by_tensor =
      b.op("repeat_interleave", {k, reps}, {C(2), C(2), S(), C(16)}, {{"dim", int64_t{2}}});
  const int flat = b.op("repeat_interleave", {k}, {S(128)}, {{"repeats", int64_t{2}}});
  const int tiled = b.op("repeat", {k}, {C(3), C(2), C(2), S(2), C(16)},
                         {{"repeats", std::vector<int64_t>{3, 1, 1, 2, 1}}});
  EXPECT_EQ(run_rule(b, heads, {Sh(2)}), (Outcome{{Sh(2)}, {Keep}}));
  EXPECT_EQ(run_rule(b, heads, {R}), (Outcome{{R}, {Keep}}));
  EXPECT_EQ(run_rule(b, seq, {Sh(2)}), (Outcome{{Sh(2, 3)}, {Keep}}));
  EXPECT_EQ(run_rule(b, tiled, {Sh(2)}), (Outcome{{Sh(3)}, {Keep}}));
  EXPECT_TRUE(contains(rule_error(b, by_tensor, {Sh(2), R}),
                       "expected an int repeat count along the sequence dim"));
  EXPECT_TRUE(
      contains(rule_error(b, flat, {Sh(2)}), "flattened by repeat_interleave without a dim"));
  const int heads_by_tensor =
      b.op("repeat_interleave", {k, reps}, {C(2), C(4), S(), C(16)}, {{"dim", int64_t{1}}});
  EXPECT_TRUE(
      contains(rule_error(b, heads_by_tensor, {R, Sh(0)}), "expected replicated repeat counts"));
}

// Meta's complex RoPE: view_as_complex / view_as_real keep a leading shard.
TEST(ComplexViewRule, KeepsLeadingShard) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(4), C(8), C(2)}, "f32", "data");
  const int c = b.op("view_as_complex", {x}, {C(2), S(), C(4), C(8)}, {}, "c64");
  const int back = b.op("view_as_real", {c}, {C(2), S(), C(4), C(8), C(2)}, {}, "f32");
  EXPECT_EQ(run_rule(b, c, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}}));
  EXPECT_EQ(run_rule(b, back, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}}));
  EXPECT_TRUE(contains(rule_error(b, c, {Sh(4)}), "sharded in its (real, imaginary) dim"));
}

// MoE routing over flattened tokens [2*S, E]: one_hot, scatter and gather along the expert
// dim keep the token shard; a replicated operand is sliced; along the token dim, an error.
TEST(ScatterGatherRule, AlongOtherDims) {
  GraphBuilder b;
  const int probs = b.input("probs", {S(2), C(8)}, "f32", "data");
  const int idx = b.input("idx", {S(2), C(2)}, "i64", "data");
  const int w = b.input("w", {S(2), C(2)}, "f32", "data");
  const int hot = b.op("one_hot", {idx}, {S(2), C(2), C(8)}, {}, "i64");
  const int sc = b.op("scatter", {probs, idx, w}, {S(2), C(8)}, {{"dim", int64_t{1}}});
  const int ga = b.op("gather", {probs, idx}, {S(2), C(2)}, {{"dim", int64_t{1}}});
  const int tok = b.op("scatter", {probs, idx, w}, {S(2), C(8)}, {{"dim", int64_t{0}}});
  EXPECT_EQ(run_rule(b, hot, {Sh(0)}), (Outcome{{Sh(0)}, {Keep}}));
  EXPECT_EQ(run_rule(b, sc, {Sh(0), Sh(0), R}), (Outcome{{Sh(0)}, {Keep, Keep, Slice(0)}}));
  EXPECT_EQ(run_rule(b, ga, {R, Sh(0)}), (Outcome{{Sh(0)}, {Slice(0), Keep}}));
  EXPECT_TRUE(
      contains(rule_error(b, tok, {Sh(0), Sh(0), Sh(0)}), "moves values along the sharded dim 0"));
  const int table = b.input("table", {C(16), C(8)}, "f32", "buffer");
  const int rows = b.input("rows", {C(4)}, "i64", "buffer");
  const int sel = b.op("index_select", {probs, rows}, {S(2), C(4)}, {{"dim", int64_t{1}}});
  EXPECT_EQ(run_rule(b, sel, {Sh(0), R}), (Outcome{{Sh(0)}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, sel, {R, R}), (Outcome{{R}, {Keep, Keep}}));
  (void)table;
}

// einsum: the sequence letter kept in the output shards it; contracted, a partial sum; two
// sequence letters (hand-written attention) are split by a shared letter that divides P (the
// batch here), and refused without one.
TEST(EinsumRule, SequenceLetter) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(16)}, "f32", "data");
  const int w = b.param("w", {C(16), C(4), C(8)});
  const int pos = b.input("pos", {C(2), S(), C(16)}, "f32", "buffer");
  const int proj = b.op("einsum", {x, w}, {C(2), C(4), S(), C(8)}, {{"equation", "bsd,dhe->bhse"}});
  const int gram = b.op("einsum", {x, pos}, {C(16), C(16)}, {{"equation", "bsd,bse->de"}});
  const int attn = b.op("einsum", {x, x}, {C(2), S(), S()}, {{"equation", "bsd,btd->bst"}});
  const int implicit = b.op("einsum", {x, w}, {C(2), S(), C(4), C(8)}, {{"equation", "bsd,dhe"}});
  EXPECT_EQ(run_rule(b, proj, {Sh(1), R}), (Outcome{{Sh(2)}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, gram, {Sh(1), R}), (Outcome{{P}, {Keep, Slice(1)}}));
  EXPECT_EQ(run_rule(b, gram, {Sh(1), Sh(1)}), (Outcome{{P}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, attn, {Sh(1), Sh(1)}),
            (Outcome{{Sh(0)}, {Exchange(0, 1), Exchange(0, 1)}}));
  const int x3 = b.input("x3", {C(3), S(), C(16)}, "f32", "data");
  const int attn3 = b.op("einsum", {x3, x3}, {C(3), S(), S()}, {{"equation", "bsd,btd->bst"}});
  EXPECT_TRUE(contains(rule_error(b, attn3, {Sh(1), Sh(1)}), "sharded along different letters"));
  EXPECT_TRUE(contains(rule_error(b, implicit, {Sh(1), R}), "expected an explicit output"));
}

// ---- permute, index ------------------------------------------------------------------------

TEST(PermuteRule, FollowsTheSequenceDim) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(4), C(16)}, "f32", "data");
  const int t =
      b.op("permute", {x}, {C(2), C(4), S(), C(16)}, {{"perm", std::vector<int64_t>{0, 2, 1, 3}}});
  const int u =
      b.op("permute", {x}, {S(), C(16), C(2), C(4)}, {{"perm", std::vector<int64_t>{1, 3, 0, 2}}});
  EXPECT_EQ(run_rule(b, t, {Sh(1)}), (Outcome{{Sh(2)}, {Keep}}));
  EXPECT_EQ(run_rule(b, u, {Sh(1, 4)}), (Outcome{{Sh(0, 4)}, {Keep}}));
  EXPECT_EQ(run_rule(b, t, {R}), (Outcome{{R}, {Keep}}));
}

TEST(IndexRule, SlicesOtherDims) {
  GraphBuilder b;
  const int q = b.input("q", {C(2), C(4), S(), C(16)}, "f32", "data");
  // q[..., :8]
  const int half = b.op(
      "index", {q}, {C(2), C(4), S(), C(8)},
      {{"dim_map", std::vector<int64_t>{0, 1, 2, 3}}, {"sliced_dims", std::vector<int64_t>{3}}});
  // q[0]: dim 0 is gone, the sequence moves to dim 1.
  const int first = b.op(
      "index", {q}, {C(4), S(), C(16)},
      {{"dim_map", std::vector<int64_t>{-1, 0, 1, 2}}, {"sliced_dims", std::vector<int64_t>{0}}});
  EXPECT_EQ(run_rule(b, half, {Sh(2)}), (Outcome{{Sh(2)}, {Keep}}));
  EXPECT_EQ(run_rule(b, first, {Sh(2)}), (Outcome{{Sh(1)}, {Keep}}));
  EXPECT_EQ(run_rule(b, first, {R}), (Outcome{{R}, {Keep}}));
}

// A step-1 slice dropping positions at the ends of the sharded sequence is a shift: the
// result has S + offset positions (split unevenly), and sp.shift takes each rank's part.
TEST(IndexRule, SliceOfTheSequenceIsAShift) {
  GraphBuilder b;
  const int logits = b.input("logits", {C(2), S(), C(128)}, "f32", "data");
  auto slice = [&](std::vector<Dim> shape, int64_t start) {
    return b.op("index", {logits}, std::move(shape),
                {{"dim_map", std::vector<int64_t>{0, 1, 2}},
                 {"sliced_dims", std::vector<int64_t>{1}},
                 {"slice_starts", std::vector<int64_t>{start}}});
  };
  auto shift = [](int64_t start, int64_t offset, int64_t in_offset = 0) {
    return Outcome{{Sh(1)},
                   {Keep},
                   {{"shift_dim", int64_t{1}},
                    {"shift_start", start},
                    {"shift_offset", offset},
                    {"shift_in_offset", in_offset}},
                   "shift"};
  };
  // logits[:, :-1], logits[:, 1:], logits[:, 1:-1]
  EXPECT_EQ(run_rule(b, slice({C(2), Dim::seq(1, 1, -1), C(128)}, 0), {Sh(1)}), shift(0, -1));
  EXPECT_EQ(run_rule(b, slice({C(2), Dim::seq(1, 1, -1), C(128)}, 1), {Sh(1)}), shift(1, -1));
  EXPECT_EQ(run_rule(b, slice({C(2), Dim::seq(1, 1, -2), C(128)}, 1), {Sh(1)}), shift(1, -2));
  // Replicated: nothing to do.
  EXPECT_EQ(run_rule(b, slice({C(2), Dim::seq(1, 1, -1), C(128)}, 1), {R}), (Outcome{{R}, {Keep}}));
  // A padded conv's S + 2 outputs cut back to S.
  const int padded = b.input("padded", {C(2), Dim::seq(1, 1, 2), C(8)}, "f32", "data");
  const int cut = b.op("index", {padded}, {C(2), S(), C(8)},
                       {{"dim_map", std::vector<int64_t>{0, 1, 2}},
                        {"sliced_dims", std::vector<int64_t>{1}},
                        {"slice_starts", std::vector<int64_t>{0}}});
  EXPECT_EQ(run_rule(b, cut, {Sh(1)}), shift(0, 0, 2));
}

TEST(IndexRule, OtherSlicesOfTheSequenceAreErrors) {
  GraphBuilder b;
  const int logits = b.input("logits", {C(2), S(), C(128)}, "f32", "data");
  auto slice = [&](std::vector<Dim> shape, int64_t start) {
    return b.at(90, "logits = logits[:, -8:]")
        .target("getitem")
        .op("index", {logits}, std::move(shape),
            {{"dim_map", std::vector<int64_t>{0, 1, 2}},
             {"sliced_dims", std::vector<int64_t>{1}},
             {"slice_starts", std::vector<int64_t>{start}}});
  };
  // The last 8 positions (a static size), a step-2 slice (start -1), a start past the
  // dropped positions, and S // 2 (opaque) are not shifts.
  for (const int out :
       {slice({C(2), C(8), C(128)}, -1), slice({C(2), Dim::seq(1, 1, -1), C(128)}, -1),
        slice({C(2), Dim::seq(1, 1, -1), C(128)}, 2),
        slice({C(2), Dim::expr("s0//2"), C(128)}, 0)}) {
    const std::string msg = rule_error(b, out, {Sh(1)});
    EXPECT_TRUE(contains(msg,
                         "[autosp:placement] op 'index' (getitem) at model.py:90  "
                         "logits = logits[:, -8:]: "));
    EXPECT_TRUE(contains(msg,
                         "found input 0 f32[2, S, 128] placed S(1), indexed or sliced along "
                         "the sharded sequence dim 1; expected the sequence dim taken whole, or "
                         "a step-1 slice of S positions that drops a few at its ends"))
        << msg;
  }
  // An int index into the sequence removes the dim.
  const int one = b.op("index", {logits}, {C(2), C(128)},
                       {{"dim_map", std::vector<int64_t>{0, -1, 1}},
                        {"sliced_dims", std::vector<int64_t>{1}},
                        {"slice_starts", std::vector<int64_t>{-1}}});
  EXPECT_TRUE(contains(rule_error(b, one, {Sh(1)}), "indexed or sliced along the sharded"));
}

// A replicated table gathered by a sharded integer index (MoE: expert weights per token) is
// sharded like the index; a bool (data-dependent) index, or a sharded index into a sharded
// tensor (tokens moved between chunks), is refused.
TEST(IndexRule, ShardedIndexTensor) {
  GraphBuilder b;
  const int table = b.input("table", {C(128), C(64)}, "f32", "buffer");
  const int idx = b.input("idx", {C(2), S()}, "i64", "data");
  const int y = b.at(5).op("index", {table, idx}, {C(2), S(), C(64)},
                           {{"dim_map", std::vector<int64_t>{-1, 2}},
                            {"sliced_dims", std::vector<int64_t>{0}},
                            {"index_out", int64_t{0}},
                            {"index_bool", false}});
  EXPECT_EQ(run_rule(b, y, {R, Sh(1)}), (Outcome{{Sh(1)}, {Keep, Keep}}));
  const int mask = b.input("mask", {C(128)}, "b8", "data");
  const int z = b.at(6).op("index", {table, mask}, {Dim::expr("u0"), C(64)},
                           {{"dim_map", std::vector<int64_t>{-1, 1}},
                            {"sliced_dims", std::vector<int64_t>{0}},
                            {"index_dims", std::vector<int64_t>{0}},
                            {"index_out", int64_t{0}},
                            {"index_bool", true}});
  EXPECT_TRUE(contains(rule_error(b, z, {R, Sh(0)}),
                       "op 'index' at model.py:6: found input 0 f32[128, 64] placed R indexed by "
                       "the boolean input 1 b8[128] placed S(0); expected a mask over the sharded "
                       "sequence dim, sharded like it"));
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int tokens = b.at(7).op("index", {x, idx}, {C(2), S(), C(64)},
                                {{"dim_map", std::vector<int64_t>{-1, -1, 2}},
                                 {"sliced_dims", std::vector<int64_t>{0, 1}},
                                 {"index_out", int64_t{0}}});
  EXPECT_TRUE(
      contains(rule_error(b, tokens, {Sh(1), Sh(1)}), "indexed or sliced along the sharded"));
}

// ---- cat, stack, split --------------------------------------------------------------------

TEST(CatRule, SlicesReplicatedOperands) {
  GraphBuilder b;
  const int x1 = b.input("x1", {C(2), C(4), S(), C(8)}, "f32", "data");
  const int x2 = b.input("x2", {C(2), C(4), S(), C(8)}, "f32", "buffer");
  const int c = b.op("cat", {x1, x2}, {C(2), C(4), S(), C(16)}, {{"dim", int64_t{-1}}});
  const int st = b.op("stack", {x1, x2}, {C(2), C(2), C(4), S(), C(8)}, {{"dim", int64_t{1}}});
  EXPECT_EQ(run_rule(b, c, {Sh(2), R}), (Outcome{{Sh(2)}, {Keep, Slice(2)}}));
  EXPECT_EQ(run_rule(b, c, {Sh(2), Sh(2)}), (Outcome{{Sh(2)}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, c, {R, R}), (Outcome{{R}, {Keep, Keep}}));
  // stack inserts a dim at 1: the sequence moves from dim 2 to dim 3.
  EXPECT_EQ(run_rule(b, st, {R, Sh(2)}), (Outcome{{Sh(3)}, {Slice(2), Keep}}));
}

TEST(CatRule, AlongSequenceIsAnError) {
  GraphBuilder b;
  const int x1 = b.input("x1", {C(2), S(), C(8)}, "f32", "data");
  const int x2 = b.input("x2", {C(2), S(), C(8)}, "f32", "data");
  const int c = b.at(3).op("cat", {x1, x2}, {C(2), S(2), C(8)}, {{"dim", int64_t{1}}});
  EXPECT_TRUE(contains(rule_error(b, c, {Sh(1), Sh(1)}),
                       "op 'cat' at model.py:3: found input 0 f32[2, S, 8] placed S(1), "
                       "concatenated along its sharded sequence dim; expected concatenation "
                       "along another dim."));
  const int d = b.at(4).op("cat", {x1, x2}, {C(2), S(), C(16)}, {{"dim", int64_t{2}}});
  EXPECT_TRUE(contains(rule_error(b, d, {Sh(1), Sh(0, 2)}),
                       "found input 0 f32[2, S, 8] placed S(1) and input 1 f32[2, S, 8] placed "
                       "S(0, inner=2); expected operands sharded alike."));
}

TEST(SplitRule, OtherDimAndError) {
  GraphBuilder b;
  const int x = b.input("x", {C(3), C(2), S(), C(8)}, "f32", "data");
  const auto halves = b.ops("split", {x}, {{C(3), C(2), S(), C(4)}, {C(3), C(2), S(), C(4)}},
                            {{"dim", int64_t{3}}});
  const auto parts = b.ops("unbind", {x}, {{C(2), S(), C(8)}, {C(2), S(), C(8)}, {C(2), S(), C(8)}},
                           {{"dim", int64_t{0}}});
  const auto bad = b.at(9).ops(
      "chunk", {x},
      {{C(3), C(2), Dim::expr("s0 // 2"), C(8)}, {C(3), C(2), Dim::expr("s0 // 2"), C(8)}},
      {{"dim", int64_t{2}}});
  EXPECT_EQ(run_rule(b, halves[0], {Sh(2)}), (Outcome{{Sh(2), Sh(2)}, {Keep}}));
  EXPECT_EQ(run_rule(b, parts[0], {Sh(2)}), (Outcome{{Sh(1), Sh(1), Sh(1)}, {Keep}}));
  EXPECT_TRUE(contains(rule_error(b, bad[0], {Sh(2)}),
                       "op 'chunk' at model.py:9: found input 0 f32[3, 2, S, 8] placed S(2), "
                       "split along its sharded sequence dim; expected a split along another "
                       "dim."));
}

TEST(PadRule, PadsOtherDimsOnly) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(8)}, "f32", "data");
  const int ok = b.op("pad", {x}, {C(2), S(), C(10)}, {{"pad", std::vector<int64_t>{1, 1}}});
  const int bad = b.at(6).op("pad", {x}, {C(2), Dim::expr("s0 + 1"), C(8)},
                             {{"pad", std::vector<int64_t>{0, 0, 0, 1}}});
  EXPECT_EQ(run_rule(b, ok, {Sh(1)}), (Outcome{{Sh(1)}, {Keep}}));
  const std::string msg = rule_error(b, bad, {Sh(1)});
  EXPECT_TRUE(contains(msg,
                       "found input 0 f32[2, S, 8] placed S(1), padded along its sharded "
                       "sequence dim; expected padding along other dims only."));
  EXPECT_TRUE(contains(msg, "pad the full-length labels"));
}

// A conv along the sharded sequence reads a halo from its neighbours and runs unpadded.
TEST(Conv1dRule, HaloAlongTheSequence) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), C(8), S()}, "f32", "data");
  const int w = b.input("w", {C(8), C(1), C(4)}, "f32", "param");
  auto conv = [&](std::vector<Dim> out, int64_t left, int64_t right, int64_t stride = 1) {
    return b.at(12, "y = self.conv(x)")
        .op("conv1d", {x, w}, std::move(out),
            {{"stride", stride},
             {"dilation", int64_t{1}},
             {"kernel", int64_t{4}},
             {"pad_left", left},
             {"pad_right", right}});
  };
  auto halo = [](int64_t left, int64_t right, int64_t last_pad) {
    return Outcome{{Sh(2)},
                   {Keep, Keep},
                   {{"halo_left", left}, {"halo_right", right}, {"halo_last_pad", last_pad}},
                   "halo"};
  };
  // Causal (padding 3 both sides, the output cut back to S later): 3 back, none ahead.
  EXPECT_EQ(run_rule(b, conv({C(2), C(8), Dim::seq(1, 1, 3)}, 3, 3), {Sh(2), R}), halo(3, 0, 3));
  // 'same' (1 left, 2 right): 1 back, 2 ahead; valid: 3 ahead, S - 3 outputs.
  EXPECT_EQ(run_rule(b, conv({C(2), C(8), S()}, 1, 2), {Sh(2), R}), halo(1, 2, 2));
  EXPECT_EQ(run_rule(b, conv({C(2), C(8), Dim::seq(1, 1, -3)}, 0, 0), {Sh(2), R}), halo(0, 3, 0));
  // Replicated input: nothing to do; the sequence in the batch dim passes through.
  EXPECT_EQ(run_rule(b, conv({C(2), C(8), Dim::seq(1, 1, 3)}, 3, 3), {R, R}),
            (Outcome{{R}, {Keep, Keep}}));
  const int tokens = b.input("t", {S(2), C(8), C(16)}, "f32", "data");
  const int per_token = b.op("conv1d", {tokens, w}, {S(2), C(8), C(13)},
                             {{"stride", int64_t{1}},
                              {"dilation", int64_t{1}},
                              {"kernel", int64_t{4}},
                              {"pad_left", int64_t{0}},
                              {"pad_right", int64_t{0}}});
  EXPECT_EQ(run_rule(b, per_token, {Sh(0), R}), (Outcome{{Sh(0)}, {Keep, Keep}}));
  // Strided, and sharded weights, are refused.
  const std::string strided =
      rule_error(b, conv({C(2), C(8), Dim::expr("s0//2")}, 1, 1, 2), {Sh(2), R});
  EXPECT_TRUE(contains(strided,
                       "op 'conv1d' at model.py:12  y = self.conv(x): found input 0 "
                       "f32[2, 8, S] placed S(2), convolved along its sharded dim 2 "
                       "(stride 2, padding 1/1, dilation*(kernel-1) 3)"))
      << strided;
  EXPECT_TRUE(contains(rule_error(b, conv({C(2), C(8), S()}, 1, 2), {Sh(2), Sh(2)}),
                       "as the conv's weight or bias"));
}

TEST(TrilRule, SequenceInTheMatrixIsAnError) {
  GraphBuilder b;
  const int x = b.input("x", {S(), C(4), C(4)}, "f32", "data");
  const int m = b.input("m", {C(4), S(), S()}, "f32", "data");
  const int ok = b.op("tril", {x}, {S(), C(4), C(4)});
  const int bad = b.at(2).op("triu", {m}, {C(4), S(), S()});
  EXPECT_EQ(run_rule(b, ok, {Sh(0)}), (Outcome{{Sh(0)}, {Keep}}));
  EXPECT_TRUE(contains(rule_error(b, bad, {Sh(1)}),
                       "found input 0 f32[4, S, S] placed S(1), whose last two dims hold the "
                       "sharded sequence; expected a replicated matrix."));
}

// ---- linear algebra ----------------------------------------------------------------------

TEST(LinearRule, ShardedActivationReplicatedWeights) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int w = b.param("w", {C(32), C(64)});
  const int bias = b.param("b", {C(32)});
  const int y = b.op("linear", {x, w, bias}, {C(2), S(), C(32)});
  // Weights stay whole; their gradient sync is the plan's business, not the rule's.
  EXPECT_EQ(run_rule(b, y, {Sh(1), R, R}), (Outcome{{Sh(1)}, {Keep, Keep, Keep}}));
  EXPECT_EQ(run_rule(b, y, {R, R, R}), (Outcome{{R}, {Keep, Keep, Keep}}));
}

TEST(LinearRule, Errors) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), C(64), S()}, "f32", "data");
  const int w = b.input("w", {C(32), S()}, "f32", "data");
  const int y = b.at(14, "y = self.proj(x)")
                    .target("torch.nn.functional.linear")
                    .op("linear", {x, w}, {C(2), C(64), C(32)});
  EXPECT_TRUE(contains(rule_error(b, y, {Sh(2), R}),
                       "op 'linear' (torch.nn.functional.linear) at model.py:14  "
                       "y = self.proj(x): found input 0 f32[2, 64, S] placed S(2), sharded along "
                       "its feature (contraction) dim; expected the sequence in a leading dim."));
  EXPECT_TRUE(contains(rule_error(b, y, {R, Sh(1)}),
                       "found input 1 f32[32, S] placed S(1) (a weight or bias); expected "
                       "replicated weights and bias."));
}

TEST(MatmulRule, ShardedRowsAndBatchDims) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int w = b.input("w", {C(64), C(32)}, "f32", "buffer");
  const int y = b.op("matmul", {x, w}, {C(2), S(), C(32)});
  EXPECT_EQ(run_rule(b, y, {Sh(1), R}), (Outcome{{Sh(1)}, {Keep, Keep}}));

  // The sequence as a batch dim: the replicated side is sliced along it too.
  const int a = b.input("a", {C(2), S(), C(4), C(16)}, "f32", "data");
  const int c = b.input("c", {C(2), S(), C(16), C(8)}, "f32", "buffer");
  const int z = b.op("matmul", {a, c}, {C(2), S(), C(4), C(8)});
  EXPECT_EQ(run_rule(b, z, {Sh(1), R}), (Outcome{{Sh(1)}, {Keep, Slice(1)}}));

  // Columns of the right operand.
  const int k = b.input("k", {C(2), C(16), S()}, "f32", "data");
  const int q = b.input("q", {C(2), C(4), C(16)}, "f32", "buffer");
  const int qk = b.op("matmul", {q, k}, {C(2), C(4), S()});
  EXPECT_EQ(run_rule(b, qk, {R, Sh(2)}), (Outcome{{Sh(2)}, {Keep, Keep}}));
}

TEST(MatmulRule, ContractionOverSequenceIsPartial) {
  GraphBuilder b;
  const int xt = b.input("xt", {C(2), C(64), S()}, "f32", "data");
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int gram = b.op("matmul", {xt, x}, {C(2), C(64), C(64)});
  EXPECT_EQ(run_rule(b, gram, {Sh(2), Sh(1)}), (Outcome{{P}, {Keep, Keep}}));
  EXPECT_EQ(run_rule(b, gram, {Sh(2), R}), (Outcome{{P}, {Keep, Slice(1)}}));
  EXPECT_EQ(run_rule(b, gram, {R, Sh(1)}), (Outcome{{P}, {Slice(2), Keep}}));
}

// Attention written by hand: q @ k.transpose(-2, -1) with both operands sharded along the
// sequence exchanges both to a group of heads (the scores split by heads), and probs @ v
// exchanges v to the same heads and sends the result back to the sequence layout.
TEST(MatmulRule, HandWrittenAttentionIsSplitByHeads) {
  GraphBuilder b;
  const int q = b.input("q", {C(2), C(4), S(), C(16)}, "f32", "data");
  const int kt = b.input("kt", {C(2), C(4), C(16), S()}, "f32", "data");
  const int v = b.input("v", {C(2), C(4), S(), C(16)}, "f32", "data");
  const int scores = b.op("matmul", {q, kt}, {C(2), C(4), S(), S()});
  EXPECT_EQ(run_rule(b, scores, {Sh(2), Sh(3)}),
            (Outcome{{Sh(1)}, {Exchange(1, 2), Exchange(1, 3)}}));
  const int o = b.op("matmul", {scores, v}, {C(2), C(4), S(), C(16)});
  EXPECT_EQ(run_rule(b, o, {Sh(1), Sh(2)}),
            (Outcome{{Sh(1)}, {Keep, Exchange(1, 2)}, {}, "to_sequence"}));
  EXPECT_EQ(run_rule(b, o, {Sh(1), R}), (Outcome{{Sh(1)}, {Keep, Slice(1)}, {}, "to_sequence"}));
  // [B * H, S, D] batched as in fairseq: the merged batch dim is the group.
  const int q3 = b.input("q3", {C(8), S(), C(16)}, "f32", "data");
  const int k3 = b.input("k3", {C(8), C(16), S()}, "f32", "data");
  const int s3 = b.op("matmul", {q3, k3}, {C(8), S(), S()});
  EXPECT_EQ(run_rule(b, s3, {Sh(1), Sh(2)}), (Outcome{{Sh(0)}, {Exchange(0, 1), Exchange(0, 2)}}));
  // The same written with einsum.
  const Attrs qk_eq = {{"equation", std::string("bhqd,bhkd->bhqk")}};
  const int es = b.op("einsum", {q, v}, {C(2), C(4), S(), S()}, qk_eq);
  EXPECT_EQ(run_rule(b, es, {Sh(2), Sh(2)}), (Outcome{{Sh(1)}, {Exchange(1, 2), Exchange(1, 2)}}));
  const Attrs pv_eq = {{"equation", std::string("bhqk,bhkd->bhqd")}};
  const int eo = b.op("einsum", {es, v}, {C(2), C(4), S(), C(16)}, pv_eq);
  EXPECT_EQ(run_rule(b, eo, {Sh(1), Sh(2)}),
            (Outcome{{Sh(1)}, {Keep, Exchange(1, 2)}, {}, "to_sequence"}));
}

// Neither heads nor batch splitting over the SP degree (3 heads, batch 1, P = 2): the error,
// which the gather fallback turns into a run on the whole sequence. (With batch 2 the batch
// is the group.)
TEST(MatmulRule, HandWrittenAttentionError) {
  GraphBuilder b;
  const int q = b.input("q", {C(1), C(3), S(), C(16)}, "f32", "data");
  const int kt = b.input("kt", {C(1), C(3), C(16), S()}, "f32", "data");
  const int scores = b.at(52, "scores = q @ k.transpose(-2, -1)")
                         .target("operator.matmul")
                         .op("matmul", {q, kt}, {C(1), C(3), S(), S()});
  EXPECT_EQ(rule_error(b, scores, {Sh(2), Sh(3)}),
            "[autosp:placement] op 'matmul' (operator.matmul) at model.py:52  "
            "scores = q @ k.transpose(-2, -1): found input 0 f32[1, 3, S, 16] placed S(2) and "
            "input 1 f32[1, 3, 16, S] placed S(3): both operands are sharded along the sequence "
            "in different output dims; expected at most one sequence-sharded operand in a matmul. "
            "This looks like attention written by hand (q @ k.transpose(-2, -1)). autosp splits "
            "it by heads when the operands share a batch dim (the heads) whose size is a multiple "
            "of the SP degree (2); here none is.");
}

TEST(MatmulRule, VectorOperandIsAnError) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int v = b.input("v", {C(64)}, "f32", "buffer");
  const int y = b.op("matmul", {x, v}, {C(2), S()});
  EXPECT_TRUE(contains(rule_error(b, y, {Sh(1), R}),
                       "found a matrix-vector product with a sharded operand; expected operands "
                       "of rank >= 2."));
}

// One operand sharded along the contraction dim, the other along one of its own output dims:
// the local operands disagree on the contraction length (S/P on one side, S on the other), so
// no local matmul computes the output block or a partial sum of it. The plan must say so.
TEST(MatmulRule, ContractionShardMeetsOutputShard) {
  GraphBuilder b;
  const int probs = b.input("probs", {C(2), S(), S()}, "f32", "data");  // rows sharded
  const int v = b.input("v", {C(2), S(), C(16)}, "f32", "data");        // contraction sharded
  const int y = b.at(60, "o = probs @ v").op("matmul", {probs, v}, {C(2), S(), C(16)});
  const int a = b.input("a", {C(2), C(4), S()}, "f32", "data");  // contraction sharded
  const int m = b.input("m", {C(2), S(), S()}, "f32", "data");   // columns sharded
  const int z = b.at(61, "o = a @ m").op("matmul", {a, m}, {C(2), C(4), S()});
  Outcome oy, oz;
  bool threw_y = false, threw_z = false;
  try {
    oy = run_rule(b, y, {Sh(1), Sh(1)});
  } catch (const PlanError&) {
    threw_y = true;
  }
  try {
    oz = run_rule(b, z, {Sh(2), Sh(2)});
  } catch (const PlanError&) {
    threw_z = true;
  }
  EXPECT_TRUE(threw_y && threw_z)
      << "rule_matmul accepts a contraction-dim shard meeting an output-dim "
         "shard: probs[2,S,S] S(1) @ v[2,S,16] S(1) -> "
      << (threw_y ? std::string("PlanError") : oy.out[0].str())
      << ", a[2,4,S] S(2) @ m[2,S,S] S(2) -> "
      << (threw_z ? std::string("PlanError") : oz.out[0].str())
      << "; expected a PlanError naming the op (the local matmul would fail at run "
         "time: contraction length S/P on one side, S on the other)";
  EXPECT_TRUE(contains(rule_error(b, y, {Sh(1), Sh(1)}), "op 'matmul' at model.py:60"));
  EXPECT_TRUE(contains(rule_error(b, z, {Sh(2), Sh(2)}), "op 'matmul' at model.py:61"));
}

// ---- embedding, sym_size, layer_norm -------------------------------------------------------

TEST(EmbeddingRule, SeedsTheShardBySlicingIds) {
  GraphBuilder b;
  const int ids = b.input("ids", {C(2), S()}, "i64", "data");
  const int table = b.param("embed.weight", {C(128), C(64)});
  const int x = b.op("embedding", {ids, table}, {C(2), S(), C(64)}, {}, "f32");
  // The full-length ids are checked against the table's 128 rows before the slice.
  EXPECT_EQ(run_rule(b, x, {R, R}),
            (Outcome{{Sh(1)}, {OperandChange::checked_slice(1, 128), Keep}}));
  EXPECT_EQ(run_rule(b, x, {Sh(1), R}), (Outcome{{Sh(1)}, {Keep, Keep}}));

  // Ids without a sequence dim stay replicated.
  const int pos = b.input("pos", {C(2), C(16)}, "i64", "data");
  const int y = b.op("embedding", {pos, table}, {C(2), C(16), C(64)}, {}, "f32");
  EXPECT_EQ(run_rule(b, y, {R, R}), (Outcome{{R}, {Keep, Keep}}));

  const int bad = b.at(30).op("embedding", {pos, ids}, {C(2), C(16), S()}, {}, "f32");
  EXPECT_TRUE(contains(rule_error(b, bad, {R, Sh(1)}),
                       "op 'embedding' at model.py:30: found input 1 i64[2, S] placed S(1) (the "
                       "embedding table); expected a replicated table."));
}

TEST(SymSizeRule, ScalesTheShardedSize) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int n = b.symbol("sym_size", {x}, {{"dim", int64_t{1}}});
  const int m = b.symbol("sym_size", {x}, {{"dim", int64_t{-1}}});
  EXPECT_EQ(run_rule(b, n, {Sh(1)}), (Outcome{{R}, {Keep}, {{"scale_by_sp", true}}}));
  EXPECT_EQ(run_rule(b, m, {Sh(1)}), (Outcome{{R}, {Keep}}));
  EXPECT_EQ(run_rule(b, n, {R}), (Outcome{{R}, {Keep}}));
  // S - 1 positions split unevenly: the global size comes from unit * (S + offset).
  const int y = b.input("y", {Dim::seq(2, 1, -1), C(64)}, "f32", "data");
  const int k = b.symbol("sym_size", {y}, {{"dim", int64_t{0}}});
  EXPECT_EQ(
      run_rule(b, k, {Sh(0)}),
      (Outcome{
          {R},
          {Keep},
          {{"scale_by_sp", true}, {"scale_unit", int64_t{2}}, {"scale_offset", int64_t{-1}}}}));
  const int count =
      b.at(7, "n = y.numel()").symbol("sym_size", {y}, {{"whole", std::string("numel")}});
  EXPECT_TRUE(contains(rule_error(b, count, {Sh(0)}), "whose element count is asked"));
}

TEST(LayerNormRule, NormalisesOutsideTheSequence) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(64)}, "f32", "data");
  const int w = b.param("ln.weight", {C(64)});
  const int bias = b.param("ln.bias", {C(64)});
  const int y = b.op("layer_norm", {x, w, bias}, {C(2), S(), C(64)}, {{"norm_dims", int64_t{1}}});
  const int z = b.at(70, "z = F.layer_norm(x, x.shape[1:])")
                    .op("layer_norm", {x}, {C(2), S(), C(64)}, {{"norm_dims", int64_t{2}}});
  EXPECT_EQ(run_rule(b, y, {Sh(1), R, R}), (Outcome{{Sh(1)}, {Keep, Keep, Keep}}));
  EXPECT_EQ(run_rule(b, y, {R, R, R}), (Outcome{{R}, {Keep, Keep, Keep}}));
  EXPECT_TRUE(contains(rule_error(b, z, {Sh(1)}),
                       "op 'layer_norm' at model.py:70  z = F.layer_norm(x, x.shape[1:]): found "
                       "input 0 f32[2, S, 64] placed S(1), normalised over dims >= 1; expected "
                       "normalisation over dims that do not hold the sharded sequence."));
}

TEST(FactoryRule, AlwaysReplicated) {
  GraphBuilder b;
  const int pos = b.op("arange", {}, {S()}, {}, "i64");
  EXPECT_EQ(run_rule(b, pos, {}), (Outcome{{R}, {}}));
}

// ---- token-local regions (rules_local.cpp) ----------------------------------------------

Outcome run_local(const GraphBuilder& b, int out, std::vector<Placement> in) {
  const Node& n = b.graph.nodes.at(static_cast<size_t>(b.graph.producer(out)));
  RuleResult r = local_rule(RuleInput{b.graph, n, std::move(in), 2});
  return {r.out, r.operands, r.attr_updates, expansion_name(r.expansion)};
}

std::string local_error(const GraphBuilder& b, int out, std::vector<Placement> in) {
  return plan_error([&] { run_local(b, out, std::move(in)); });
}

TEST(TokenLocal, WhereGatherExpertIndexAdd) {
  // MoE routing on [B*S, C] tokens: torch.where on the [E, B*S] mask of one expert, the rows
  // it selects through the expert, index_add_ back: sharded again.
  GraphBuilder b;
  const Dim T = Dim::seq(2), U = Dim::expr("u0");
  const Placement L0 = Placement::local(0), Pos = Placement::local_positions(0, 1, 2);
  EXPECT_EQ(L0.str(), "L(0)");
  EXPECT_EQ(Pos.str(), "L(0, positions of 2*S, inner=1)");
  const int flat = b.input("flat", {T, C(8)}, "f32", "data");
  const int mask = b.input("mask", {C(4), T}, "bool", "data");
  const int w = b.param("w", {C(8), C(8)});
  const auto nz = b.ops("nonzero", {mask}, {{U}, {U}}, {{"as_tuple", true}}, "i64");
  EXPECT_EQ(run_rule(b, nz[0], {Sh(1)}), (Outcome{{L0, Pos}, {Keep}}));
  EXPECT_EQ(run_rule(b, nz[0], {R}), (Outcome{{R, R}, {Keep}}));
  auto index = [&](int x, std::vector<int> idx, std::vector<Dim> out, std::vector<int64_t> dims) {
    std::vector<int> ins{x};
    ins.insert(ins.end(), idx.begin(), idx.end());
    std::vector<int64_t> dim_map(out.size() + dims.size() - 1, -1);
    return b.op("index", ins, std::move(out),
                {{"dim_map", dim_map},
                 {"sliced_dims", dims},
                 {"index_dims", dims},
                 {"index_out", int64_t{0}},
                 {"index_bool", false}});
  };
  const int rows = index(flat, {nz[1]}, {U, C(8)}, {0});
  EXPECT_EQ(run_local(b, rows, {Sh(0), Pos}), (Outcome{{L0}, {Keep, Keep}}));
  // A replicated [B*S, C] is sliced to this rank's tokens first.
  EXPECT_EQ(run_local(b, rows, {R, Pos}), (Outcome{{L0}, {Slice(0), Keep}}));
  const int y = b.op("linear", {rows, w}, {U, C(8)});
  EXPECT_EQ(run_local(b, y, {L0, R}), (Outcome{{L0}, {Keep, Keep}}));
  const int back = b.op("index_add", {flat, nz[1], y}, {T, C(8)}, {{"dim", int64_t{0}}});
  EXPECT_EQ(run_local(b, back, {Sh(0), Pos, L0}), (Outcome{{Sh(0)}, {Keep, Keep, Keep}}));
  // A sum over the routed rows is a per-rank summand; other dims stay local.
  const int total = b.op("sum", {y}, {}, {{"dims", std::vector<int64_t>{0, 1}}});
  EXPECT_EQ(run_local(b, total, {L0}), (Outcome{{P}, {Keep}}));
  const int per_row = b.op("sum", {y}, {U}, {{"dims", std::vector<int64_t>{1}}});
  EXPECT_EQ(run_local(b, per_row, {L0}), (Outcome{{L0}, {Keep}}));
}

TEST(TokenLocal, BooleanMaskSelectsEachRanksRows) {
  // h[keep] with h [B, S, C] and keep [B, S]: each rank keeps the selected rows of its chunk.
  GraphBuilder b;
  const Dim U = Dim::expr("u0");
  const int h = b.input("h", {C(2), S(), C(8)}, "f32", "data");
  const int keep = b.input("keep", {C(2), S()}, "bool", "data");
  const int rows = b.op("index", {h, keep}, {U, C(8)},
                        {{"dim_map", std::vector<int64_t>{-1, -1, 1}},
                         {"sliced_dims", std::vector<int64_t>{0, 1}},
                         {"index_dims", std::vector<int64_t>{0}},
                         {"index_out", int64_t{0}},
                         {"index_bool", true}});
  const Placement L0 = Placement::local(0);
  EXPECT_EQ(run_rule(b, rows, {Sh(1), Sh(1)}), (Outcome{{L0}, {Keep, Keep}}));
  // A replicated mask (or tensor) is sliced to the chunk first.
  EXPECT_EQ(run_rule(b, rows, {Sh(1), R}), (Outcome{{L0}, {Keep, Slice(1)}}));
  EXPECT_EQ(run_rule(b, rows, {R, Sh(1)}), (Outcome{{L0}, {Slice(1), Keep}}));
  EXPECT_EQ(run_rule(b, rows, {R, R}), (Outcome{{R}, {Keep, Keep}}));
  // Sharded along different dims: refused.
  EXPECT_NE(rule_error(b, rows, {Sh(1), Sh(0)}).find("sharded like it"), std::string::npos);
}

TEST(TokenLocal, RowMixingAndWrongPositionsAreRefused) {
  GraphBuilder b;
  const Dim T = Dim::seq(2), U = Dim::expr("u0");
  const Placement L0 = Placement::local(0);
  const int rows = b.input("rows", {U, C(8)}, "f32", "data");
  const int flat = b.input("flat", {T, C(8)}, "f32", "data");
  const auto sorted = b.at(7, "y = y.sort(dim=0).values")
                          .ops("sort", {rows}, {{U, C(8)}, {U, C(8)}}, {{"dim", int64_t{0}}});
  std::string msg = local_error(b, sorted[0], {L0});
  EXPECT_NE(msg.find("op 'sort'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("token-local"), std::string::npos) << msg;
  const int mean = b.op("mean", {rows}, {}, {{"dims", std::vector<int64_t>{0}}});
  EXPECT_NE(local_error(b, mean, {L0}).find("a sum over the selection"), std::string::npos);
  // Positions found along an S-sized dim do not index a 2*S one.
  const int pos = b.input("pos", {U}, "i64", "data");
  const int picked = b.op("index", {flat, pos}, {U, C(8)},
                          {{"dim_map", std::vector<int64_t>{-1, 1}},
                           {"sliced_dims", std::vector<int64_t>{0}},
                           {"index_dims", std::vector<int64_t>{0}},
                           {"index_out", int64_t{0}},
                           {"index_bool", false}});
  msg = local_error(b, picked, {Sh(0), Placement::local_positions(0, 1, 1)});
  EXPECT_NE(msg.find("the positions index the sequence dim they were found in"), std::string::npos)
      << msg;
  // A local value next to a sharded one lists different tokens.
  const int mixed = b.op("add", {rows, flat}, {U, C(8)});
  EXPECT_NE(local_error(b, mixed, {L0, Sh(0)}).find("replicated values only"), std::string::npos);
  // nonzero as one [n, ndim] matrix on a sharded mask.
  const int mask = b.input("mask", {C(4), T}, "bool", "data");
  const int nz = b.op("nonzero", {mask}, {U, C(2)}, {{"as_tuple", false}}, "i64");
  EXPECT_NE(rule_error(b, nz, {Sh(1)}).find("as_tuple=True"), std::string::npos);
}

}  // namespace
}  // namespace autosp
