// The core IR: symbolic sizes, attributes, graphs and the text printer.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "graph_builder.h"
#include "ir/dim.h"
#include "ir/graph.h"

namespace autosp {
namespace {

using testutil::C;
using testutil::GraphBuilder;
using testutil::S;

TEST(Dim, Constructors) {
  EXPECT_EQ(Dim::constant(64), (Dim{.coef = 64, .power = 0, .opaque = "", .offset = 0}));
  EXPECT_EQ(Dim::seq(), (Dim{.coef = 1, .power = 1, .opaque = "", .offset = 0}));
  EXPECT_EQ(Dim::seq(3, 2), (Dim{.coef = 3, .power = 2, .opaque = "", .offset = 0}));
  EXPECT_EQ(Dim::expr("s0 + 1"), (Dim{.coef = 0, .power = 0, .opaque = "s0 + 1", .offset = 0}));
}

TEST(Dim, Predicates) {
  EXPECT_TRUE(Dim::constant(1).is_one());
  EXPECT_FALSE(Dim::constant(2).is_one());
  EXPECT_FALSE(Dim::seq(1, 1).is_one());
  EXPECT_TRUE(Dim::constant(7).is_static());
  EXPECT_FALSE(Dim::constant(7).has_seq());
  EXPECT_TRUE(Dim::seq(2).has_seq());
  EXPECT_FALSE(Dim::seq(2).is_static());
  const Dim e = Dim::expr("s0 // 2");
  EXPECT_TRUE(e.is_opaque());
  EXPECT_FALSE(e.is_static());
  EXPECT_FALSE(e.has_seq());
  EXPECT_FALSE(e.is_one());
}

TEST(Dim, Str) {
  EXPECT_EQ(Dim::constant(64).str(), "64");
  EXPECT_EQ(Dim::constant(0).str(), "0");
  EXPECT_EQ(Dim::seq().str(), "S");
  EXPECT_EQ(Dim::seq(2).str(), "2*S");
  EXPECT_EQ(Dim::seq(1, 2).str(), "S^2");
  EXPECT_EQ(Dim::seq(4, 3).str(), "4*S^3");
  EXPECT_EQ(Dim::expr("s0 + 1").str(), "{s0 + 1}");
}

TEST(Dim, Multiply) {
  EXPECT_EQ(Dim::constant(2) * Dim::seq(), Dim::seq(2));
  EXPECT_EQ(Dim::seq(3) * Dim::seq(2), Dim::seq(6, 2));
  EXPECT_EQ(Dim::constant(4) * Dim::constant(16), Dim::constant(64));
  // An opaque factor makes the product opaque, keeping both sides readable.
  EXPECT_EQ(Dim::expr("s0 + 1") * Dim::constant(2), Dim::expr("({s0 + 1})*(2)"));
  EXPECT_EQ(Dim::seq(2) * Dim::expr("u"), Dim::expr("(2*S)*({u})"));
}

TEST(Dim, Divide) {
  EXPECT_EQ(Dim::seq(8).divide(Dim::constant(4)), Dim::seq(2));
  EXPECT_EQ(Dim::seq(8).divide(Dim::seq(2)), Dim::constant(4));
  EXPECT_EQ(Dim::seq(6, 2).divide(Dim::seq(3)), Dim::seq(2));
  EXPECT_EQ(Dim::constant(64).divide(Dim::constant(64)), Dim::constant(1));
  // Not a monomial with an integer coefficient.
  EXPECT_EQ(Dim::seq(3).divide(Dim::constant(2)), std::nullopt);
  EXPECT_EQ(Dim::constant(64).divide(Dim::seq()), std::nullopt);
  EXPECT_EQ(Dim::seq(4).divide(Dim::constant(0)), std::nullopt);
  EXPECT_EQ(Dim::expr("u").divide(Dim::constant(1)), std::nullopt);
  EXPECT_EQ(Dim::seq().divide(Dim::expr("u")), std::nullopt);
}

// S + offset: what slicing a few positions off the sequence leaves.
TEST(Dim, Offset) {
  const Dim s1 = Dim::seq(1, 1, -1);
  EXPECT_EQ(s1.str(), "S-1");
  EXPECT_EQ(Dim::seq(2, 1, -1).str(), "2*(S-1)");
  EXPECT_EQ(Dim::seq(1, 1, 3).str(), "S+3");
  EXPECT_TRUE(s1.has_seq());
  EXPECT_FALSE(s1 == Dim::seq());
  EXPECT_EQ(Dim::constant(2) * s1, Dim::seq(2, 1, -1));
  EXPECT_EQ(s1 * Dim::constant(2), Dim::seq(2, 1, -1));
  EXPECT_EQ(Dim::seq(2, 1, -1).divide(s1), Dim::constant(2));
  EXPECT_EQ(Dim::seq(4, 1, -1).divide(Dim::constant(2)), Dim::seq(2, 1, -1));
  // Factors of S with different offsets do not cancel or multiply.
  EXPECT_EQ(Dim::seq(2, 1, -1).divide(Dim::seq()), std::nullopt);
  EXPECT_EQ(Dim::seq(2).divide(s1), std::nullopt);
  EXPECT_TRUE((s1 * Dim::seq()).is_opaque());
  // A static size never carries an offset.
  EXPECT_EQ(Dim::seq(3, 0, -1), Dim::constant(3));
}

TEST(Dim, ProductAndShapeStr) {
  const std::vector<Dim> shape = {C(2), S(), C(4), C(16)};
  EXPECT_EQ(product(shape, 0, 4), Dim::seq(128));
  EXPECT_EQ(product(shape, 2, 4), Dim::constant(64));
  EXPECT_EQ(product(shape, 4, 4), Dim::constant(1));
  EXPECT_EQ(product(shape, 3, 99), Dim::constant(16));  // `end` is clamped to the shape
  EXPECT_EQ(product({C(2), Dim::expr("u")}, 0, 2), Dim::expr("(2)*({u})"));
  EXPECT_EQ(shape_str(shape), "[2, S, 4, 16]");
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(shape_str({S(2), Dim::expr("s0 + 1")}), "[2*S, {s0 + 1}]");
}

TEST(Attr, Str) {
  EXPECT_EQ(attr_str(Attr{int64_t{-3}}), "-3");
  EXPECT_EQ(attr_str(Attr{0.5}), "0.5");
  EXPECT_EQ(attr_str(Attr{true}), "true");
  EXPECT_EQ(attr_str(Attr{false}), "false");
  EXPECT_EQ(attr_str(Attr{std::string("mean")}), "\"mean\"");
  EXPECT_EQ(attr_str(Attr{std::vector<int64_t>{0, 2, 1, 3}}), "[0, 2, 1, 3]");
  EXPECT_EQ(attr_str(Attr{std::vector<int64_t>{}}), "[]");
}

TEST(SourceLoc, Str) {
  EXPECT_EQ((SourceLoc{.file = "model.py", .line = 30, .code = "x = self.embed(ids)"}).str(),
            "model.py:30  x = self.embed(ids)");
  EXPECT_EQ((SourceLoc{.file = "model.py", .line = 7, .code = ""}).str(), "model.py:7");
  EXPECT_EQ(SourceLoc{}.str(), "<unknown source>");
  EXPECT_TRUE(SourceLoc{}.empty());
}

TEST(Node, AttrAccessors) {
  Node n;
  n.attrs = {{"dim", int64_t{2}},
             {"flag", true},
             {"count", int64_t{0}},
             {"reduction", std::string("sum")},
             {"perm", std::vector<int64_t>{0, 2, 1}},
             {"p", 0.1}};
  EXPECT_TRUE(n.has_attr("dim"));
  EXPECT_FALSE(n.has_attr("missing"));

  EXPECT_EQ(n.int_attr("dim", -1), 2);
  EXPECT_EQ(n.int_attr("flag", -1), 1);        // a bool reads as 0/1
  EXPECT_EQ(n.int_attr("reduction", -1), -1);  // wrong type: the fallback
  EXPECT_EQ(n.int_attr("missing", 7), 7);

  EXPECT_TRUE(n.bool_attr("flag", false));
  EXPECT_TRUE(n.bool_attr("dim", false));  // a nonzero int reads as true
  EXPECT_FALSE(n.bool_attr("count", true));
  EXPECT_TRUE(n.bool_attr("p", true));  // a double is not a bool: the fallback
  EXPECT_FALSE(n.bool_attr("missing", false));

  EXPECT_EQ(n.str_attr("reduction", "mean"), "sum");
  EXPECT_EQ(n.str_attr("dim", "none"), "none");
  EXPECT_EQ(n.str_attr("missing", "mean"), "mean");

  EXPECT_EQ(n.ints_attr("perm"), (std::vector<int64_t>{0, 2, 1}));
  EXPECT_EQ(n.ints_attr("dim"), (std::vector<int64_t>{2}));  // one int reads as a list
  EXPECT_EQ(n.ints_attr("reduction"), (std::vector<int64_t>{}));
  EXPECT_EQ(n.ints_attr("missing"), (std::vector<int64_t>{}));
}

TEST(Graph, AddAndProducer) {
  Graph g;
  EXPECT_EQ(g.add_value(Value{.shape = {C(2), S()}, .dtype = "i64"}), 0);
  EXPECT_EQ(g.add_value(Value{.shape = {C(2), S(), C(8)}, .dtype = "f32"}), 1);
  EXPECT_EQ(g.add_value(Value{.kind = ValueKind::Symbol}), 2);
  EXPECT_EQ(g.add_node(Node{.op = "input", .outputs = {0}}), 0);
  EXPECT_EQ(g.add_node(Node{.op = "embedding", .inputs = {0}, .outputs = {1}}), 1);
  EXPECT_EQ(g.add_node(Node{.op = "sym_size", .inputs = {1}, .outputs = {2}}), 2);

  // add_value/add_node assign ids; everything else is kept as given.
  EXPECT_EQ(g.value(1), (Value{.id = 1, .shape = {C(2), S(), C(8)}, .dtype = "f32"}));
  EXPECT_EQ(g.nodes[1], (Node{.id = 1, .op = "embedding", .inputs = {0}, .outputs = {1}}));

  EXPECT_EQ(g.producer(0), 0);
  EXPECT_EQ(g.producer(1), 1);
  EXPECT_EQ(g.producer(2), 2);
  EXPECT_EQ(g.producer(3), -1);
  EXPECT_EQ(g.producer(-1), -1);
  EXPECT_THROW(g.value(3), std::out_of_range);
}

TEST(Graph, ProducerOfSecondOutput) {
  GraphBuilder b;
  const int x = b.input("x", {C(2), S(), C(8)}, "f32", "data");
  const auto halves = b.ops("split", {x}, {{C(2), S(), C(4)}, {C(2), S(), C(4)}}, {{"dim", 2}});
  EXPECT_EQ(b.graph.producer(halves[1]), 1);
  EXPECT_EQ(b.producer_of(halves[1]).op, "split");
}

TEST(Graph, Equality) {
  GraphBuilder a, b;
  for (GraphBuilder* gb : {&a, &b}) {
    const int x = gb->input("x", {C(2), S()}, "f32", "data");
    gb->output({gb->op("neg", {x}, {C(2), S()})});
  }
  EXPECT_EQ(a.graph, b.graph);
  b.graph.nodes[1].attrs["extra"] = true;
  EXPECT_NE(a.graph, b.graph);
  b.graph = a.graph;
  b.graph.values[1].shape[1] = S(2);
  EXPECT_NE(a.graph, b.graph);
  b.graph = a.graph;
  b.graph.nodes[1].loc.line += 1;
  EXPECT_NE(a.graph, b.graph);
}

// The example in graph_builder.h's header comment.
TEST(GraphBuilder, HeaderExample) {
  GraphBuilder b;
  const int ids = b.input("ids", {C(2), S()}, "i64", "data");
  const int w = b.param("embed.weight", {C(128), C(64)});
  const int x = b.at(30, "x = self.embed(ids)").op("embedding", {ids, w}, {C(2), S(), C(64)});
  b.output({x});
  EXPECT_EQ(print_graph(b.graph),
            "%0: i64[2, S] = input() {name=\"ids\", role=\"data\"}  # model.py:1\n"
            "%1: f32[128, 64] = input() {grad, name=\"embed.weight\", path=\"embed.weight\", "
            "role=\"param\"}  # model.py:2\n"
            "%2: f32[2, S, 64] = embedding(%0, %1) {grad}  # model.py:30\n"
            "() = output(%2)  # model.py:31\n");
  EXPECT_EQ(b.graph.nodes[2].loc,
            (SourceLoc{.file = "model.py", .line = 30, .code = "x = self.embed(ids)"}));
  EXPECT_EQ(b.graph.nodes[3].loc, (SourceLoc{.file = "model.py", .line = 31, .code = ""}));
}

TEST(PrintGraph, Format) {
  Graph g;
  const int x = g.add_value(Value{.shape = {C(2), S(), C(8)}, .dtype = "bf16"});
  const int n = g.add_value(Value{.kind = ValueKind::Symbol});
  const int o = g.add_value(Value{.kind = ValueKind::Other});
  const int a =
      g.add_value(Value{.shape = {C(2), S(), C(4)}, .dtype = "bf16", .requires_grad = true});
  const int c =
      g.add_value(Value{.shape = {C(2), S(), C(4)}, .dtype = "bf16", .requires_grad = true});
  g.add_node(Node{.op = "input", .outputs = {x}, .attrs = {{"role", std::string("data")}}});
  g.add_node(Node{.op = "sym_size",
                  .inputs = {x},
                  .outputs = {n},
                  .attrs = {{"dim", int64_t{1}}},
                  .loc = {.file = "m.py", .line = 3, .code = "n = x.size(1)"}});
  g.add_node(Node{.op = "nontensor", .outputs = {o}});
  g.add_node(Node{.op = "split",
                  .inputs = {x, -1},
                  .outputs = {a, c},
                  .attrs = {{"dim", int64_t{2}}, {"sizes", std::vector<int64_t>{4, 4}}}});
  g.add_node(Node{.op = "output", .inputs = {a, c}});
  EXPECT_EQ(print_graph(g),
            "%0: bf16[2, S, 8] = input() {role=\"data\"}\n"
            "%1: sym = sym_size(%0) {dim=1}  # m.py:3\n"
            "%2: obj = nontensor()\n"
            "%3: bf16[2, S, 4], %4: bf16[2, S, 4] = split(%0, None) {grad, dim=2, sizes=[4, 4]}\n"
            "() = output(%3, %4)\n");

  // Notes (the plan's placements) follow each value's type; empty notes print nothing.
  EXPECT_EQ(print_graph(g, {"S(1)", "R", "", "S(1)", "S(1)"}),
            "%0: bf16[2, S, 8] S(1) = input() {role=\"data\"}\n"
            "%1: sym R = sym_size(%0) {dim=1}  # m.py:3\n"
            "%2: obj = nontensor()\n"
            "%3: bf16[2, S, 4] S(1), %4: bf16[2, S, 4] S(1) = split(%0, None) {grad, dim=2, "
            "sizes=[4, 4]}\n"
            "() = output(%3, %4)\n");
  // Fewer notes than values: the rest print without one.
  EXPECT_EQ(print_graph(g, {"R"}).substr(0, 34), "%0: bf16[2, S, 8] R = input() {rol");
}

}  // namespace
}  // namespace autosp
