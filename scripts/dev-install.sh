#!/usr/bin/env bash
# Rebuild the C++ extension into the active venv (incremental). Serialised with a lock so
# that several shells can call it at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec flock /tmp/autosp-build.lock "$PY" -m pip install --no-build-isolation --no-deps -q -e .
