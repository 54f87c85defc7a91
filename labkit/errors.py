"""Errors a user can cause.

Anything raised as a ``UserError`` ends the CLI with one red line on stderr and exit code 2,
never a traceback. Raise it for bad paths, unknown ids, a missing GPU for a CUDA-only step, ...
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (bad input, missing file, unavailable device)."""
