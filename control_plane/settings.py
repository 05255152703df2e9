"""Control-plane settings (env prefix ``SUPERINFER_``)."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class ControlPlaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SUPERINFER_")

    redis_url: str = "redis://127.0.0.1:6379/0"
    read_block_ms: int = 200
    knobs_poll_s: float = 0.2  # knob changes reach plans within this (target: 1 s)
    heartbeat_ttl_s: int = 5
