// Rules for indexing and sequence-position ops: permute, index (shifts), cat/stack/split, pad,
// conv1d (halos), tril.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rule_test.h"

namespace autosp {
namespace {

using namespace rule_test;  // NOLINT(build/namespaces): the shared helpers of the rule tests

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

}  // namespace
}  // namespace autosp
