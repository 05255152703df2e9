"""structlog set-up for the services and the CLI: JSON lines with a timestamp and level, on
stderr (stdout is the commands' own output: `superinfer generate --json`, serve's banner)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(json: bool = True, level: int = logging.INFO) -> None:
    renderer = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
