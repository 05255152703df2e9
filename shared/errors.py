"""Errors every package may raise and the CLI answers: no imports, so any process can use it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting or model a service cannot start with; the message says what to change, and
    the CLI prints it as one line (``error: ...``, status 2), not a traceback."""
