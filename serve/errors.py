"""The server's user-facing error: a problem the user can fix (a bad option, a port in use, an engine process that
could not start). One line, no traceback; ``labkit``'s exit table maps it to exit code 2, as it does its own
``UserError``. Errors of a request are the engine's ``RequestError`` and the protocol's ``ApiError``."""
from __future__ import annotations


class ServeError(Exception):
    """A problem the user of the server can fix; the message is one line."""
