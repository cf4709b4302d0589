#!/usr/bin/env bash
# The whole test suite: C++ (GoogleTest via ctest, plain and with ASan+UBSan), the
# clang-format check, and pytest (multi-rank tests run real Gloo groups on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
JOBS=${JOBS:-2}

echo "== C++ core: ctest"
cmake -S . -B build/ctest -G Ninja -DAUTOSP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/ctest -j "$JOBS"
ctest --test-dir build/ctest --output-on-failure

echo "== C++ core: ctest under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake -S . -B build/ctest-asan -G Ninja -DAUTOSP_BUILD_TESTS=ON -DAUTOSP_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build/ctest-asan -j "$JOBS"
ctest --test-dir build/ctest-asan --output-on-failure

echo "== clang-format"
files=$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'python/src/*.cpp' 'tests/cpp/*.h' 'tests/cpp/*.cpp')
clang-format --dry-run --Werror $files

echo "== pytest"
"$PY" -m pytest -q --durations=25 tests "$@"
