"""structlog set-up for the services: JSON lines with a timestamp and level."""

from __future__ import annotations

import logging

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
    )
