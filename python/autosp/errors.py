"""Errors autosp raises for problems a user can hit."""

from __future__ import annotations


class AutospError(ValueError):
    """A model, input or configuration autosp cannot compile exactly.

    The message names the pass, the op, the user's source line, what was found
    and what was expected.
    """
