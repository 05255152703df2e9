"""Control-plane settings (env prefix ``SUPERINFER_``)."""

from __future__ import annotations

import os
import socket
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ControlPlaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SUPERINFER_")

    redis_url: str = "redis://127.0.0.1:6379/0"
    read_block_ms: int = Field(default=200, ge=1)  # 0 would block the read forever
    # knob changes reach plans within this (target: 1 s)
    knobs_poll_s: float = Field(default=0.2, gt=0.0)
    heartbeat_ttl_s: int = Field(default=5, ge=1)
    # /health, /ready, /metrics on this port; None or 0: off
    health_port: int | None = Field(default=None, ge=0, le=65535)
    health_host: str = "0.0.0.0"
    # Knobs ({"policy": "lvf", "b_xfer": "auto", ...}) and SLO classes ({"interactive":
    # {"ttft_s": 1.0, "tbt_s": 0.05}, ...}), JSON in SUPERINFER_KNOBS / SUPERINFER_SLO_CLASSES
    # (a Helm ConfigMap): written to Redis at start when Redis has none yet; with
    # config_overwrite they replace what is there (admin API changes are lost at each start).
    knobs: dict[str, Any] | None = None
    slo_classes: dict[str, Any] | None = None
    config_overwrite: bool = False
    # every Redis call (longer than any blocking read's block time)
    redis_timeout_s: float = Field(default=5.0, gt=0.0)
    # Replicas (docs/scaling.md): each worker is planned by the one replica holding its lease.
    # Ids must differ between replicas (the chart uses the pod name); a restarted replica with
    # the same id adopts its own leases at once. Default: host name and process id (two
    # replicas on one host shared the host name, both planning every worker).
    replica_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # a dead replica's workers are taken over within about this
    lease_ttl_ms: int = Field(default=3000, ge=1)
    # renewal and rebalancing period: at most a third of the TTL (two renewals may be missed)
    lease_renew_s: float = Field(default=0.5, gt=0.0)
    # a worker without a snapshot or heartbeat this long is released (SUPERINFER_WORKER_RELEASE_S:
    # the gateway's worker_forget_s, which deletes a worker, is another setting)
    worker_release_s: float = Field(default=10.0, gt=0.0)

    @model_validator(mode="after")
    def _renewed_within_the_ttl(self) -> ControlPlaneSettings:
        """A lease renewed no sooner than it expires is lost at every period (the workers
        unplanned part of it, moving between replicas)."""
        if self.lease_renew_s * 1000.0 * 3 > self.lease_ttl_ms:
            raise ValueError(
                f"lease_renew_s {self.lease_renew_s} must be at most a third of lease_ttl_ms "
                f"{self.lease_ttl_ms} ms"
            )
        return self
