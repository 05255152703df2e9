"""Build and run the worker from settings."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from data_plane.engine.config import EngineConfig
from data_plane.engine.engine import Engine
from data_plane.engine.llm import build_engine
from data_plane.models import load_model
from data_plane.service import Worker
from data_plane.settings import WorkerSettings
from shared.policy import Knobs


def build_worker_engine(settings: WorkerSettings) -> tuple[Engine, int]:
    """The engine for ``settings`` and its KV block size in bytes."""
    loaded = load_model(settings.model, settings.tokenizer, settings.dtype, settings.device)
    config = EngineConfig(
        block_size=settings.block_size,
        num_hbm_blocks=settings.num_hbm_blocks,
        hbm_kv_gib=settings.hbm_kv_gib,
        num_dram_blocks=settings.num_dram_blocks,
        dram_kv_gib=settings.dram_kv_gib,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        transfer_backend=settings.transfer_backend,
        device=settings.device,
    )
    engine = build_engine(loaded, config, Knobs(policy=settings.policy, b_xfer=settings.b_xfer))
    return engine, loaded.config.kv_bytes_per_token * settings.block_size


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    engine, block_bytes = build_worker_engine(settings)
    redis = Redis.from_url(settings.redis_url)
    try:
        await Worker(settings, engine, redis, block_bytes).run(stop)
    finally:
        engine.close()
        await redis.aclose()
