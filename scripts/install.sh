#!/usr/bin/env bash
# Installs everything autosp needs on a fresh machine into ./.venv: system packages for
# the C++ tests (GoogleTest, clang-format), torch 2.13.0 (CPU), the build tools, and
# autosp itself (editable, with its C++ core compiled).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
command -v clang-format >/dev/null || need_apt+=(clang-format)
command -v ninja >/dev/null || need_apt+=(ninja-build)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "warning: missing ${need_apt[*]} (needed by the C++ tests); install them as root" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PY=.venv/bin/python
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first, pinned: a range would pull a multi-GB CUDA build.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja
"$PY" -m pip install -q --no-build-isolation -e ".[test,plot]"
"$PY" -c "import autosp, autosp._core; print('autosp', autosp.__version__, 'installed in .venv')"
