"""The engine's two user-facing errors: a configuration it cannot run, a request it cannot take.
Both carry a one-line message; callers map them by type (and RequestError by its code), never by text."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value a user chose is not usable; the message is one line."""


class RequestError(ValueError):
    """A request the engine cannot accept; one-line message and a machine-readable code the service
    maps to HTTP (every code is a client error): empty_prompt, token_out_of_vocabulary,
    context_length_exceeded, pool_too_small, invalid_<field> (a sampling parameter), invalid_request."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code
