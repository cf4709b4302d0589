"""The shipped type stubs of autosp._core match the compiled module."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest


def test_core_stub_is_current(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("nanobind.stubgen")
    out = tmp_path / "_core.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "autosp._core", "-o", str(out)],
                   check=True)
    shipped = pathlib.Path(__file__).parent.parent / "python" / "autosp" / "_core.pyi"
    assert out.read_text() == shipped.read_text(), (
        "python/autosp/_core.pyi is stale: regenerate it with "
        "`python -m nanobind.stubgen -m autosp._core -o python/autosp/_core.pyi`"
    )
