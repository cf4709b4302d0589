// The op table (registry, locality column), and the elementwise, reduction and along-dim rule
// families; the other families are in test_rules_*.cpp. Each conflict a user can hit is
// tested with its text.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rule_test.h"

namespace autosp {
namespace {

using namespace rule_test;  // NOLINT(build/namespaces): the shared helpers of the rule tests

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

}  // namespace
}  // namespace autosp
