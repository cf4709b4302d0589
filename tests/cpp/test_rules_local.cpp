// The token-local rule (rules_local.cpp): MoE routing on each rank's own tokens.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rule_test.h"

namespace autosp {
namespace {

using namespace rule_test;  // NOLINT(build/namespaces): the shared helpers of the rule tests

// ---- token-local regions (rules_local.cpp) ----------------------------------------------

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
