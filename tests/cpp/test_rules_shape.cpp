// Rules for shapes: reshape (reshape_shard's worked examples), expand, repeat, complex views,
// scatter/gather.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rule_test.h"

namespace autosp {
namespace {

using namespace rule_test;  // NOLINT(build/namespaces): the shared helpers of the rule tests

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

}  // namespace
}  // namespace autosp
