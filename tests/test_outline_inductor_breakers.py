"""Breaker findings around ``regions=True`` with Inductor (and the ``autosp train`` CLI that
exposes it). Every regions + Inductor configuration tried was exact (see the breaker report);
what is pinned here are the real bugs found on the way."""

from __future__ import annotations

import pytest


def test_train_help_prints() -> None:
    """``autosp train --help`` crashed with ``TypeError: %o format: an integer is required, not
    dict``: the help of --host-memory-gib (train/config.py, "0: 80% of this machine's memory")
    holds a bare ``%``, which argparse expands as a format ("% o"). The way to find the
    ``--regions`` flag and its options must print and exit 0."""
    import contextlib
    import io

    from autosp import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    assert "--regions" in out.getvalue()


def test_hf_module_stack_path_names_the_decoder_layer() -> None:
    """transformers wraps LlamaForCausalLM.forward in a decorator taking ``*args``, so Dynamo's
    nn_module_stack paths read ``L['args'][0].model.layers.1.mlp`` (scratch probe: every node
    of HF Llama). dotted_path strips only the ``L['args']`` root and keeps ``[0]``, giving
    ``0.model.layers.1.mlp``, and layer_of_path then puts the whole model in one layer "0":
    ``regions=True`` on HF Llama outlined nothing (``compiled.last_compile.outlined`` ==
    ``['0: not outlined: no other layer is alike']``, exact but silently flat), and every
    per-layer decision keyed by _layer_of (remat facts, offload of layer outputs) sees one
    layer."""
    from autosp.fx_source import dotted_path
    from autosp.remat_facts import layer_of_path

    for path in ("L['args'][0].model.layers.1.mlp", "L['self'].model.layers[1].mlp"):
        assert layer_of_path(dotted_path(path)) == "model.layers.1", (path, dotted_path(path))
