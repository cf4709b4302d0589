// Golden-file comparison for pass tests.
//
//   EXPECT_GOLDEN("ulysses_mha_p2", text);
//
// compares `text` with tests/cpp/golden/ulysses_mha_p2.txt and, on a mismatch, fails with a
// line diff ("-" golden, "+" actual, two lines of context). With AUTOSP_UPDATE_GOLDEN=1 in
// the environment it rewrites the file instead (review the change with `git diff`).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#ifndef AUTOSP_GOLDEN_DIR
#error "AUTOSP_GOLDEN_DIR must point at tests/cpp/golden"
#endif

namespace autosp::testutil {

inline std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) lines.push_back(line);
  return lines;
}

// A line diff from the longest common subsequence; unchanged runs are cut to `context` lines
// around each change.
inline std::string line_diff(const std::string& expected, const std::string& actual,
                             size_t context = 2) {
  const auto a = split_lines(expected), b = split_lines(actual);
  std::vector<std::vector<int>> lcs(a.size() + 1, std::vector<int>(b.size() + 1, 0));
  for (size_t i = a.size(); i-- > 0;)
    for (size_t j = b.size(); j-- > 0;)
      lcs[i][j] = a[i] == b[j] ? lcs[i + 1][j + 1] + 1 : std::max(lcs[i + 1][j], lcs[i][j + 1]);
  std::vector<std::pair<char, std::string>> ops;
  size_t i = 0, j = 0;
  while (i < a.size() || j < b.size()) {
    if (i < a.size() && j < b.size() && a[i] == b[j]) {
      ops.push_back({' ', a[i++]});
      ++j;
    } else if (i < a.size() && (j == b.size() || lcs[i + 1][j] >= lcs[i][j + 1])) {
      ops.push_back({'-', a[i++]});
    } else {
      ops.push_back({'+', b[j++]});
    }
  }
  std::vector<bool> show(ops.size(), false);
  for (size_t k = 0; k < ops.size(); ++k) {
    if (ops[k].first == ' ') continue;
    const size_t lo = k >= context ? k - context : 0;
    for (size_t m = lo; m < std::min(ops.size(), k + context + 1); ++m) show[m] = true;
  }
  std::string out;
  bool gap = false;
  for (size_t k = 0; k < ops.size(); ++k) {
    if (!show[k]) {
      gap = true;
      continue;
    }
    if (gap && !out.empty()) out += "  ...\n";
    gap = false;
    out += ops[k].first;
    out += ' ';
    out += ops[k].second + "\n";
  }
  return out;
}

inline std::string golden_path(const std::string& name) {
  return std::string(AUTOSP_GOLDEN_DIR) + "/" + name + ".txt";
}

inline ::testing::AssertionResult matches_golden(const std::string& name,
                                                 const std::string& actual) {
  const std::string path = golden_path(name);
  const char* update = std::getenv("AUTOSP_UPDATE_GOLDEN");
  if (update && std::string(update) == "1") {
    std::ofstream os(path, std::ios::binary);
    os << actual;
    if (!os) return ::testing::AssertionFailure() << "could not write " << path;
    return ::testing::AssertionSuccess();
  }
  std::ifstream is(path, std::ios::binary);
  if (!is)
    return ::testing::AssertionFailure()
           << "missing golden file " << path << "; run with AUTOSP_UPDATE_GOLDEN=1 to create it";
  std::ostringstream golden;
  golden << is.rdbuf();
  if (golden.str() == actual) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "output differs from " << path << " (- golden, + actual; AUTOSP_UPDATE_GOLDEN=1 "
         << "rewrites it):\n"
         << line_diff(golden.str(), actual);
}

#define EXPECT_GOLDEN(name, actual) EXPECT_TRUE(::autosp::testutil::matches_golden(name, actual))

}  // namespace autosp::testutil
