"""Errors autosp raises, and how an internal failure is reported.

Every error a user sees from autosp is an :class:`AutospError`. A problem with the user's
model, inputs or configuration says what was found and what was expected. Any other
exception raised inside autosp's own code while compiling is an autosp bug:
:func:`stage` turns it into an AutospError that says so, names the stage, the FX node
being processed (recorded by :func:`at_node`) with its op and the user's source line, and
chains the original exception as ``__cause__``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

#: How the messages of autosp's passes and checks begin, ``[autosp:<pass>]`` (the remat
#: solver's and the planner's begin ``[remat]`` and ``[plan]``). A check that runs inside the
#: compiled step fails as PyTorch's RuntimeError whose message begins so.
MESSAGE_MARK = "[autosp:"


class AutospError(ValueError):
    """A model, input or configuration autosp cannot compile exactly, or an internal
    autosp error (its message then says so).

    The message names the pass, the op, the user's source line, what was found
    and what was expected.
    """


class AutospGatherWarning(UserWarning):
    """Some ops had no sequence-parallel form for their sharded inputs and run on the
    all-gathered full sequence on every rank (``autosp.compile(..., unsupported="gather")``):
    exact, but their activations are not split. The message names each op and source line."""


class AutospHookWarning(UserWarning):
    """A global module hook (``torch.nn.modules.module.register_module_forward_hook`` and the
    like) was registered after the model was compiled: the compiled graph runs without it."""


# The (stage, node) being processed, innermost last; set by at_node.
_NODE: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "autosp_node", default=()
)
_ATTR = "_autosp_node"  # where at_node leaves the (stage, node) on an escaping exception


@contextlib.contextmanager
def at_node(stage: str, node: Any) -> Iterator[None]:
    """Record that ``stage`` is processing the FX ``node`` while the block runs (``node``
    may also be a short text for what has no FX node, e.g. an inserted SP op, or None).

    An exception escaping the block (other than an AutospError) keeps the innermost
    node it escaped from, so that :func:`stage` can name the op and the source line::

        for node in gm.graph.nodes:
            with at_node("bridge", node):
                convert(node)
    """
    token = _NODE.set(_NODE.get() + ((stage, node),))
    try:
        yield
    except Exception as e:
        if not isinstance(e, AutospError) and getattr(e, _ATTR, None) is None:
            with contextlib.suppress(Exception):  # exceptions that refuse attributes
                setattr(e, _ATTR, (stage, node))
        raise
    finally:
        _NODE.reset(token)


def current_node() -> tuple[str, Any] | None:
    """The innermost ``(stage, node)`` recorded by :func:`at_node`, or None."""
    stack = _NODE.get()
    return stack[-1] if stack else None


def describe_node(node: Any) -> str:
    """``node 'add' (call_function _operator.add) at model.py:41  x = a + b`` for an FX
    node; a text is returned as is."""
    if isinstance(node, str):
        return node
    try:
        target = node.target
        what = target if isinstance(target, str) else getattr(target, "__qualname__", None) or str(target)
        module = getattr(target, "__module__", None)
        if module and not isinstance(target, str):
            what = f"{module}.{what}"
        text = f"node '{node.name}' ({node.op} {what})"
        from autosp.fx_source import source_loc

        loc = str(source_loc(node)).strip()
        return f"{text} at {loc}" if loc else text
    except Exception:  # noqa: BLE001 - a description must never fail
        return repr(node)


def _backend_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is Inductor's own failure (its lowering, code generation or C++/CUDA
    compiler), not one of autosp's stages."""
    try:
        from torch._inductor import exc as inductor_exc
    except ImportError:
        return False
    kinds = tuple(getattr(inductor_exc, name) for name in
                  ("InductorError", "LoweringException", "CppCompileError", "CUDACompileError")
                  if isinstance(getattr(inductor_exc, name, None), type))
    return isinstance(exc, kinds)


def internal_error(stage_name: str, exc: BaseException) -> AutospError:
    """The AutospError for an unexpected exception ``exc`` in ``stage_name``."""
    where = getattr(exc, _ATTR, None) or current_node()
    at = ""
    if where is not None and where[1] is not None:
        at = f" while processing {describe_node(where[1])}"
        if where[0] != stage_name:
            at += f" (in {where[0]})"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if _backend_failure(exc):
        return AutospError(
            f"[autosp:{stage_name}] the backend compiler (Inductor) failed{at}: "
            f"{type(exc).__name__}: {first}. Compile with backend='aot_eager' to run without "
            "Inductor; a failure of Inductor's on the graph autosp made is autosp's to fix too: "
            "please report it to the autosp developers with this message and the chained "
            "traceback above."
        )
    return AutospError(
        f"[autosp:{stage_name}] internal error{at}: {type(exc).__name__}: {first}. "
        "This is a bug in autosp, not in your model: please report it to the autosp "
        "developers with this message and the chained traceback above."
    )


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Run an autosp compilation stage: an AutospError passes through; any other
    exception becomes an internal-error AutospError chained to it (``raise ... from e``)."""
    try:
        yield
    except AutospError:
        raise
    except Exception as e:
        raise internal_error(name, e) from e
