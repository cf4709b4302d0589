// Rules for linear algebra (linear, matmul, einsum: attention by hand split by heads),
// embedding, sym_size, layer norm and factories.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rule_test.h"

namespace autosp {
namespace {

using namespace rule_test;  // NOLINT(build/namespaces): the shared helpers of the rule tests

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

}  // namespace
}  // namespace autosp
