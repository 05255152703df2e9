"""Build and run the control plane from settings."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from control_plane.service import ControlPlane
from control_plane.settings import ControlPlaneSettings
from shared.health import redis_reachable, serve_health
from shared.knobs import knobs_from_mapping, knobs_to_mapping, seed_knobs, write_knobs
from shared.slo import seed_slo_classes, slo_classes_from_mapping, write_slo_classes

log = structlog.get_logger(__name__)


class ControlPlaneCollector(Collector):
    """Prometheus metrics read from the control plane at scrape time."""

    def __init__(self, control: ControlPlane) -> None:
        self.control = control

    def collect(self) -> Iterator[Metric]:
        plans = CounterMetricFamily("superinfer_control_plane_plans", "plans published")
        plans.add_metric([], float(self.control.num_plans))
        yield plans
        malformed = CounterMetricFamily(
            "superinfer_control_plane_malformed_messages", "snapshots skipped (malformed)"
        )
        malformed.add_metric([], float(self.control.num_malformed))
        yield malformed
        version = GaugeMetricFamily(
            "superinfer_control_plane_knobs_version",
            "version of the knobs in use, by policy",
            labels=["policy"],
        )
        version.add_metric([self.control.knobs.policy], float(self.control.knobs_version))
        yield version
        leases = self.control.leases
        fenced = CounterMetricFamily(
            "superinfer_control_plane_plans_fenced",
            "plans the fence refused (lease lost, or the iteration already planned)",
        )
        fenced.add_metric([], float(self.control.num_fenced))
        owned = GaugeMetricFamily(
            "superinfer_control_plane_workers_owned", "workers whose lease this replica holds"
        )
        owned.add_metric([], float(len(leases.owned)))
        replicas = GaugeMetricFamily(
            "superinfer_control_plane_live_replicas", "control-plane replicas seen alive"
        )
        replicas.add_metric([], float(leases.num_live_replicas))
        lost = CounterMetricFamily(
            "superinfer_control_plane_leases_lost", "leases found held by another replica"
        )
        lost.add_metric([], float(leases.num_lost))
        yield from (fenced, owned, replicas, lost)
        reader = self.control.reader
        deltas = CounterMetricFamily(
            "superinfer_control_plane_snapshot_deltas", "snapshots rebuilt from a delta"
        )
        deltas.add_metric([], float(reader.num_deltas))
        missing = CounterMetricFamily(
            "superinfer_control_plane_snapshot_base_missing",
            "delta snapshots skipped: their base table is not held here (handover, restart)",
        )
        missing.add_metric([], float(reader.num_missing_base))
        read = CounterMetricFamily(
            "superinfer_control_plane_snapshot_bytes", "encoded snapshot bytes read and decoded"
        )
        read.add_metric([], float(reader.num_bytes))
        yield from (deltas, missing, read)


async def apply_config(
    redis: Redis,
    knobs: dict[str, Any] | None,
    classes: dict[str, Any] | None,
    overwrite: bool = False,
) -> None:
    """Write the knobs (atomically where Redis has none, unless ``overwrite``) and SLO classes
    unless Redis already has some (or ``overwrite``)."""
    if knobs and overwrite:  # every knob: those not given take their defaults, as documented
        _, version = await write_knobs(redis, knobs_to_mapping(knobs_from_mapping(knobs)))
        log.info("config_knobs_written", version=version)
    elif knobs:
        in_force, version = await seed_knobs(redis, knobs_from_mapping(knobs))
        log.info("config_knobs_in_force", version=version, policy=in_force.policy)
    if classes and overwrite:
        _, version = await write_slo_classes(redis, classes)
        log.info("config_slo_classes_written", version=version, classes=sorted(classes))
    elif classes and (version := await seed_slo_classes(redis, classes)):
        log.info("config_slo_classes_written", version=version, classes=sorted(classes))


async def _apply_config_with_retry(
    redis: Redis, settings: ControlPlaneSettings, stop: asyncio.Event
) -> None:
    if not settings.knobs and settings.slo_classes is None:
        return
    knobs_from_mapping(settings.knobs or {})  # a bad value fails the start, before any write
    if settings.slo_classes is not None:  # {} too: "at least one SLO class is needed"
        slo_classes_from_mapping(settings.slo_classes)
    backoff_s = 0.05
    while not stop.is_set():
        try:
            await apply_config(
                redis, settings.knobs, settings.slo_classes, settings.config_overwrite
            )
            return
        except RedisError as exc:
            log.error("redis_error", error=str(exc), retry_in_s=backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(2.0, backoff_s * 2)


async def serve(settings: ControlPlaneSettings, stop: asyncio.Event) -> None:
    redis = Redis.from_url(  # a Redis that hangs (not just dies) times out and is retried
        settings.redis_url,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
    )
    control = ControlPlane(settings, redis)
    registry = CollectorRegistry()
    registry.register(ControlPlaneCollector(control))

    async def ready() -> bool:
        return await redis_reachable(redis)

    try:
        async with serve_health(settings.health_port, ready, registry, settings.health_host):
            await _apply_config_with_retry(redis, settings, stop)
            await control.run(stop)
    finally:
        await redis.aclose()
