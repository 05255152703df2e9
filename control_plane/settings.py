"""Control-plane settings (env prefix ``SUPERINFER_``)."""

from __future__ import annotations

from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict


class ControlPlaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SUPERINFER_")

    redis_url: str = "redis://127.0.0.1:6379/0"
    read_block_ms: int = 200
    knobs_poll_s: float = 0.2  # knob changes reach plans within this (target: 1 s)
    heartbeat_ttl_s: int = 5
    health_port: int | None = None  # /health, /ready, /metrics on this port; None or 0: off
    health_host: str = "0.0.0.0"
    # Knobs ({"policy": "lvf", "b_xfer": "auto", ...}) and SLO classes ({"interactive":
    # {"ttft_s": 1.0, "tbt_s": 0.05}, ...}), JSON in SUPERINFER_KNOBS / SUPERINFER_SLO_CLASSES
    # (a Helm ConfigMap): written to Redis at start when Redis has none yet; with
    # config_overwrite they replace what is there (admin API changes are lost at each start).
    knobs: dict[str, Any] | None = None
    slo_classes: dict[str, Any] | None = None
    config_overwrite: bool = False
    redis_timeout_s: float = 5.0  # every Redis call (longer than any blocking read's block time)
