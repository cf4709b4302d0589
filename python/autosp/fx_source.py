"""Where an FX node of a Dynamo graph comes from in the user's code: the dotted path of a
parameter or module in the user's model (from Dynamo's sources and module stacks), a graph
input's name, and the user's source line of a node (the innermost frame outside torch). Used
by the bridge, the error messages and the passes that group nodes by layer."""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.fx as fx

from autosp import _core

_SOURCE_KEY = re.compile(r"""\[['"]?([^'"\]]+)['"]?\]""")
# The root local, and the index into it when the module came in through ``*args`` (a
# decorator over ``forward``, as transformers puts on its models: ``L['args'][0].model...``).
#: What Dynamo puts in a module path inside a nested compile region (autosp.dynamo_regions):
#: ``L['self'].layers.3.forward.__self__.mlp`` is module ``layers.3.mlp``.
REGION_SELF = ".forward.__self__"
_SOURCE_ROOT = re.compile(r"""^[LG]\[['"]?(?:args['"]?\]\[\d+\]|\w+['"]?\])""")


def dotted_path(name: str) -> str:
    """A Dynamo source or module-stack path as a dotted path in the user's module:
    ``L['self']._modules['layers']._modules['3']._parameters['weight']`` -> ``layers.3.weight``,
    ``L['self'].layers[3].self_attn`` -> ``layers.3.self_attn``, and
    ``L['args'][0].model.layers[3]`` -> ``model.layers.3`` (a module passed as ``*args``), and
    ``L['self'].layers.3.forward.__self__.mlp`` -> ``layers.3.mlp`` (inside a nested compile
    region, autosp.dynamo_regions)."""
    name = _SOURCE_ROOT.sub("", name).replace(REGION_SELF, "")
    name = re.sub(r"\._(modules|parameters|buffers)\b", "", name)
    name = _SOURCE_KEY.sub(r".\1", name)
    return ".".join(part for part in name.split(".") if part)


def module_path(node: fx.Node) -> str:
    """The dotted path of a parameter or buffer placeholder in the user's module, from Dynamo's
    source (see dotted_path); "" when Dynamo recorded no source."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return ""
    name = source.name
    return dotted_path(name() if callable(name) else str(name))


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)')


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _file_name(path: str) -> str:
    """A source file as errors name it: its path under site-packages, else its base name."""
    return path.split("site-packages/")[-1] if "site-packages/" in path else os.path.basename(path)


def source_loc(node: fx.Node) -> Any:
    """The innermost frame of the node's stack trace that is not inside torch itself."""
    loc = _core.SourceLoc()
    trace = node.meta.get("stack_trace") or ""
    frames = [f for f in _FRAME.findall(trace) if not f[0].startswith(_TORCH_DIR)] or _FRAME.findall(trace)
    if frames:
        file, line, code = frames[-1]
        loc.file = _file_name(file)
        loc.line = int(line)
        loc.code = code.strip()
    return loc


def input_name(n: fx.Node) -> str:
    """The user's name of a graph input (Dynamo's source, ``L['input_ids']``), else the node's."""
    try:
        name = n.meta["grapharg"].source.name
    except (KeyError, AttributeError):
        return str(n.target)
    return str(name() if callable(name) else name)


def where_size_fixed(inputs: list[fx.Node], dim: int) -> str:
    """Where Dynamo fixed dim ``dim`` of one of the graph inputs ``inputs`` to a constant while
    tracing, as ``"model.py:16 in forward: <the line>"``; "" where the trace did not record it.
    Read from the trace's ShapeEnv: the user's stack where the length was specialised
    (``specialization_stacks``, its innermost frame outside torch), else the place of the
    replacement (``replacements_slocs``). Never raises: it only adds to an error message."""
    try:
        return _where_size_fixed(inputs, dim)
    except Exception:  # noqa: BLE001 - an older or newer ShapeEnv; the error goes out without it
        return ""


def _where_size_fixed(inputs: list[fx.Node], dim: int) -> str:
    from torch._guards import detect_fake_mode

    def name(source: Any) -> str:
        return str(source.name() if callable(source.name) else source.name)

    fake = detect_fake_mode([n.meta.get("example_value", n.meta.get("val")) for n in inputs])
    env = getattr(fake, "shape_env", None)
    if env is None:
        return ""
    replacements = env.replacements
    wanted = {f"{input_name(n)}.size()[{dim}]" for n in inputs}
    for sym, sources in env.var_to_sources.items():
        if not any(name(s) in wanted for s in sources):
            continue
        chain = [sym]  # the symbol, and those it was merged into before one was fixed
        while getattr(replacements.get(chain[-1]), "is_Symbol", False) and len(chain) < 64:
            chain.append(replacements[chain[-1]])
        if not getattr(replacements.get(chain[-1]), "is_number", False):
            continue
        stacks = getattr(env, "specialization_stacks", {})
        for s in chain:
            for source in env.var_to_sources.get(s, []):
                frames = [f for f in stacks.get(source) or [] if not f.filename.startswith(_TORCH_DIR)]
                if frames:
                    f = frames[-1]
                    code = (f.line or "").strip()
                    return f"{_file_name(f.filename)}:{f.lineno} in {f.name}" + (f": {code}" if code else "")
        loc = getattr(getattr(env, "replacements_slocs", {}).get(chain[-1]), "maybe_user_loc", None)
        if loc:  # "code  # path:line in function", the path shortened by torch
            code, _, place = str(loc).rpartition("  # ")
            path, colon, rest = place.strip().partition(":")
            return f"{_file_name(path)}{colon}{rest}" + (f": {code.strip()}" if code.strip() else "")
    return ""
