"""DuplexKV on the cpu backend: lossless rotation, eager sync, no leaks, transfer budget."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_plane.engine.config import EngineConfig
from data_plane.engine.llm import build_engine, generate
from data_plane.engine.request import RequestStatus
from data_plane.engine.sampling import SamplingParams
from data_plane.kv.geometry import KVGeometry
from data_plane.kv.manager import SYNCED
from data_plane.kv.prefix_cache import ROOT_KEY
from data_plane.kv.tiered import KVCacheManager
from data_plane.models import load_model
from data_plane.transfer.base import BlockCopy
from data_plane.transfer.cpu import CpuTransferEngine
from shared.policy import Knobs, Plan, RequestState, Snapshot, make_plan

BS = 4


@pytest.fixture(scope="module")
def stories(stories_path: Path):
    return load_model(str(stories_path))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", seed=3)


class RandomRotations:
    """vLLM's plan plus random rotations: running requests rotate out and rotary ones are held
    back at random iterations (the engine decides nothing; this planner does)."""

    def __init__(self, seed: int, p_out: float, p_hold: float) -> None:
        self.rng = random.Random(seed)
        self.p_out = p_out
        self.p_hold = p_hold

    def __call__(self, snapshot: Snapshot) -> Plan:
        plan = make_plan(snapshot, Knobs(policy="vllm"))
        plan.resume_ids = [r for r in plan.resume_ids if self.rng.random() > self.p_hold]
        leaving = set(plan.preempt_ids)
        for view in snapshot.requests:
            if (  # still-loading ones too: the engine recomputes those (stale remote plans)
                view.state is RequestState.RUNNING
                and view.request_id not in leaving
                and self.rng.random() < self.p_out
            ):
                plan.rotate_out_ids.append(view.request_id)
        out = set(plan.rotate_out_ids)
        plan.schedule = [c for c in plan.schedule if c.request_id not in out]
        return plan


def _prompts(loaded) -> list[list[int]]:
    tok = loaded.tokenizer
    return [
        tok.encode(t)
        for t in ("Tim had a dog", "", "The sun", "Lily and Ben went to the", "One day a big")
    ]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
    ] * 2 + [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]


def _reference(loaded) -> list[list[int]]:
    engine = build_engine(loaded, EngineConfig(block_size=BS, num_hbm_blocks=512))
    return [r.token_ids for r in generate(engine, _prompts(loaded), _params())]


def _rotating_run(loaded, seed: int, p_out: float, p_hold: float, b_xfer: int):
    config = EngineConfig(
        block_size=BS, num_hbm_blocks=40, num_dram_blocks=200, max_num_batched_tokens=16
    )
    engine = build_engine(loaded, config, Knobs(policy="vllm", b_xfer=b_xfer))
    engine.planner = RandomRotations(seed, p_out, p_hold)
    tokens: dict[str, list[int]] = {}
    for index, (prompt, params) in enumerate(zip(_prompts(loaded), _params(), strict=True)):
        engine.add_request(f"r{index}", prompt, params)
        tokens[f"r{index}"] = []
    for _ in range(20_000):
        if not engine.has_unfinished():
            break
        for output in engine.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        for table in engine.kv.tables.values():  # the block counters the snapshot reads
            assert (table.num_hbm, table.num_dram) == table.recount()
        STATUSES_SEEN.update(assert_status_matches_kv(engine))
    else:
        raise AssertionError(f"no progress: {engine.stats}")
    engine.kv.drain()
    return engine, list(tokens.values())


STATUSES_SEEN: set[RequestStatus] = set()


def assert_status_matches_kv(engine) -> set[RequestStatus]:
    """Each request's status (which the engine changes only on the KV layer's answers and
    events) agrees with its block table: resident exactly when no copy in is pending and it
    is not rotated out; rotating out exactly while evictions are in flight."""
    kv = engine.kv
    for request_id, request in engine.requests.items():
        table = kv.table(request_id)
        if request.status in (RequestStatus.RUNNING, RequestStatus.LOADING):
            assert request.resident == kv.is_resident(request_id), request
        elif request.status is RequestStatus.ROTATING_OUT:
            assert table is not None and table.rotated_out and table.num_pending_evict > 0
        elif request.status is RequestStatus.ROTARY:
            assert table is not None and table.rotated_out and table.num_pending_evict == 0
    return {r.status for r in engine.requests.values()}


@pytest.mark.parametrize("model_name", ["stories", "tiny"])
def test_lossless_rotation_random_schedules(
    model_name: str, request: pytest.FixtureRequest
) -> None:
    loaded = request.getfixturevalue(model_name)
    reference = _reference(loaded)

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        seed=st.integers(0, 2**31),
        p_out=st.floats(0.02, 0.3),
        p_hold=st.floats(0, 0.6),
        b_xfer=st.integers(2, 64),
    )
    def check(seed: int, p_out: float, p_hold: float, b_xfer: int) -> None:
        engine, tokens = _rotating_run(loaded, seed, p_out, p_hold, b_xfer)
        assert tokens == reference
        kv = engine.kv
        assert kv.has_dram
        assert kv.hbm.num_free == kv.hbm.num_blocks and kv.dram.num_free == kv.dram.num_blocks
        assert kv.tiered_stats.max_blocks_per_iteration <= b_xfer
        check.rotations += engine.stats.num_rotations_out

    check.rotations = 0
    STATUSES_SEEN.clear()
    check()
    assert check.rotations > 200  # requests rotated out and back in many times
    assert {RequestStatus.LOADING, RequestStatus.ROTATING_OUT, RequestStatus.ROTARY} <= (
        STATUSES_SEEN
    )  # every copy state was visited


def _manager(
    num_hbm: int = 16,
    num_dram: int = 16,
    b_xfer: int = 64,
    transfer=None,
    engine_cls: type[CpuTransferEngine] = CpuTransferEngine,
):
    geometry = KVGeometry(
        num_layers=2, block_size=BS, num_kv_heads=2, head_dim=4, dtype=torch.float32
    )
    hbm = torch.randn(num_hbm, *geometry.block_shape)
    dram = torch.zeros(num_dram, *geometry.block_shape)
    transfer = transfer or engine_cls(hbm, dram)
    return KVCacheManager(num_hbm, num_dram, BS, transfer, b_xfer_blocks=b_xfer), hbm, dram


def _fill(kv: KVCacheManager, request_id: str, num_tokens: int) -> list[int]:
    ids = kv.ensure_hbm(request_id, 0, num_tokens)
    assert ids is not None
    kv.on_computed(request_id, num_tokens)
    return list(ids)


def test_rotating_out_fully_synced_request_moves_zero_bytes() -> None:
    kv, hbm, dram = _manager()
    ids = _fill(kv, "a", 3 * BS)
    kv.issue_transfers()
    kv.drain()
    assert kv.tiered_stats.blocks_synced == 3
    before = kv.transfer.stats.bytes_d2h
    assert kv.rotate_out("a") is not None
    kv.drain()
    assert kv.transfer.stats.bytes_d2h == before
    assert kv.tiered_stats.blocks_dropped == 3
    assert kv.hbm.num_free == 16
    table = kv.table("a")
    assert table is not None
    for index, dram_id in enumerate(table.dram_ids):
        assert torch.equal(dram[dram_id], hbm[ids[index]])


def test_rotating_out_moves_exactly_the_unsynced_blocks() -> None:
    kv, _, _ = _manager()
    _fill(kv, "a", 2 * BS + 1)  # two full blocks (synced below) and a partial tail
    kv.issue_transfers()
    kv.drain()
    before = kv.transfer.stats.blocks_d2h
    assert kv.rotate_out("a") is not None
    kv.drain()
    assert kv.transfer.stats.blocks_d2h - before == 1
    kv2, _, _ = _manager()
    _fill(kv2, "b", 2 * BS + 1)  # nothing synced yet: all three move at rotate-out
    assert kv2.rotate_out("b") is not None
    kv2.drain()
    assert kv2.transfer.stats.blocks_d2h == 3


def test_rotate_in_restores_bytes_and_waits_for_copies() -> None:
    kv, hbm, _ = _manager()
    ids = _fill(kv, "a", 2 * BS + 2)
    original = hbm[ids].clone()
    assert kv.rotate_out("a") is not None
    assert kv.rotate_in("a") is None or kv.table("a").num_pending_evict == 0  # type: ignore[union-attr]
    kv.issue_transfers()
    kv.drain()
    hbm.zero_()
    assert kv.rotate_in("a")  # blocks being copied in
    assert not kv.is_resident("a")
    kv.issue_transfers()
    kv.drain()
    assert kv.is_resident("a")
    table = kv.table("a")
    assert table is not None
    assert torch.equal(hbm[[h for h in table.hbm_ids if h is not None]], original)


def test_a_request_still_loading_is_not_parked() -> None:
    """Its queued loads target HBM blocks that parking would free: refused, and the request
    that gets those blocks next keeps its own KV when the loads would have run."""
    kv, hbm, _ = _manager(num_hbm=2, b_xfer=1)
    _fill(kv, "a", 2 * BS)
    kv.issue_transfers()
    kv.drain()
    assert kv.rotate_out("a") == 0  # every block synced: parked at once
    assert kv.rotate_in("a") == 2  # two loads queued, one issued per iteration
    assert kv.rotate_out("a") is None
    kv.free("a")  # what the engine does instead: recompute it
    b_ids = kv.ensure_hbm("b", 0, 2 * BS)
    assert b_ids is not None
    hbm[list(b_ids)] = 2.0
    for _ in range(3):
        kv.issue_transfers()
        kv.drain()
        kv.poll()
    assert bool((hbm[list(b_ids)] == 2.0).all())


def test_a_second_rotation_waits_for_the_first_loads_to_count() -> None:
    """A request is resident only when its own loads are done (the count is not reset by a
    later rotate-in)."""
    kv, _, _ = _manager(num_hbm=4, b_xfer=1)
    _fill(kv, "a", 2 * BS)
    kv.issue_transfers()
    kv.drain()
    assert kv.rotate_out("a") == 0 and kv.rotate_in("a") == 2
    kv.issue_transfers()  # the first load in flight, the second queued
    assert kv.rotate_out("a") is None and not kv.is_resident("a")
    for _ in range(3):
        kv.issue_transfers()
        kv.drain()
        kv.poll()
    table = kv.table("a")
    assert table is not None and table.num_pending_h2d == 0 and kv.is_resident("a")


class GatedEngine(CpuTransferEngine):
    """Copies wait for a gate, so a test can act while they are in flight."""

    def __init__(self, hbm: torch.Tensor, dram: torch.Tensor) -> None:
        super().__init__(hbm, dram)
        self.gate = threading.Event()

    def submit(self, h2d: list[BlockCopy], d2h: list[BlockCopy]):
        gate = self.gate
        self._h2d.submit(gate.wait)
        self._d2h.submit(gate.wait)
        return super().submit(h2d, d2h)


def test_abort_during_in_flight_transfer_leaks_nothing() -> None:
    geometry = KVGeometry(2, BS, 2, 4, torch.float32)
    hbm = torch.randn(16, *geometry.block_shape)
    dram = torch.zeros(16, *geometry.block_shape)
    gated = GatedEngine(hbm, dram)
    kv, _, _ = _manager(transfer=gated)
    _fill(kv, "a", 3 * BS + 1)
    _fill(kv, "b", 2 * BS)
    assert kv.rotate_out("a") is not None
    kv.issue_transfers()  # syncs + evictions in flight, gated
    kv.poll()
    kv.free("a")
    kv.free("b")
    assert kv.hbm.num_free < 16  # busy blocks are not reused while copies run
    gated.gate.set()
    kv.drain()
    assert kv.hbm.num_free == 16 and kv.dram.num_free == 16


def test_transfer_budget_caps_blocks_per_iteration() -> None:
    kv, _, _ = _manager(num_hbm=32, num_dram=32, b_xfer=3)
    _fill(kv, "a", 10 * BS)
    iterations = 0
    while kv.num_queued_blocks:
        kv.issue_transfers()
        kv.wait_for_progress()  # one batch in flight at a time
        kv.poll()
        iterations += 1
    assert max(kv.tiered_stats.per_iteration_blocks) == 3
    assert iterations >= 4 and kv.tiered_stats.blocks_synced == 10


def test_dram_pool_grows_as_chunks_are_pinned() -> None:
    from data_plane.kv.host_pool import ChunkedPinner, allocate_host_pool

    gate = threading.Semaphore(0)
    registered: list[tuple[int, int]] = []

    def slow_register(pointer: int, nbytes: int) -> None:
        if registered:
            gate.acquire()  # the first chunk pins at once, the rest when the test allows
        registered.append((pointer, nbytes))

    geometry = KVGeometry(2, BS, 2, 4, torch.float32)
    hbm = torch.zeros(8, *geometry.block_shape)
    dram = allocate_host_pool(12, geometry.block_shape, geometry.dtype)
    assert dram.data_ptr() % 4096 == 0 and not dram.any()
    unregistered: list[int] = []
    pinner = ChunkedPinner(
        dram, chunk_blocks=4, register=slow_register, unregister=unregistered.append
    )
    ready = pinner.pin_first_chunk()
    pinner.start()
    kv = KVCacheManager(
        8,
        12,
        BS,
        CpuTransferEngine(hbm, dram),
        b_xfer_blocks=8,
        num_dram_blocks_ready=ready,
        pinner=pinner,
    )
    assert kv.num_free_dram_blocks == 4  # serving starts with the first chunk
    gate.release()
    gate.release()
    pinner.join()
    kv.poll()
    assert kv.num_free_dram_blocks == 12 and pinner.done
    assert [n for _, n in registered] == [4 * geometry.block_bytes] * 3
    assert registered[1][0] == dram[4].data_ptr()
    pinner.close()
    assert sorted(unregistered) == sorted(p for p, _ in registered)


def test_copy_in_flight_for_a_freed_request_leaves_its_new_table_alone() -> None:
    """Preempted by recompute while its eager syncs were in flight, then admitted again with a
    shorter table: the old copies' completion must not touch the new table (it used to raise
    IndexError in the middle of an engine step)."""
    gate = threading.Event()

    class GatedEngine(CpuTransferEngine):
        def submit(self, h2d: list[BlockCopy], d2h: list[BlockCopy]) -> Any:
            gate.wait()  # the copies wait for the gate
            return super().submit(h2d, d2h)

    kv, _, _ = _manager(engine_cls=GatedEngine)
    _fill(kv, "a", 4 * BS)  # four full blocks: four eager syncs queued
    issuing = threading.Thread(target=kv.issue_transfers)
    issuing.start()
    kv.free("a")  # preempted by recompute while the syncs are being issued
    _fill(kv, "a", 1)  # admitted again: a one-block table
    gate.set()
    issuing.join()
    kv.drain()
    table = kv.tables["a"]
    assert len(table.sync) == 1 and table.num_pending_evict == 0
    kv.free("a")
    kv.drain()
    assert kv.hbm.num_free == kv.hbm.num_blocks and kv.dram.num_free == kv.dram.num_blocks


@pytest.mark.parametrize("policy", ["swap", "edf"])
@pytest.mark.parametrize("seed", [1, 2, 3, 7])
def test_swap_policies_under_pressure_are_lossless(stories, policy: str, seed: int) -> None:
    """vLLM V0's swap mode (and edf, which swaps too) on 24 HBM blocks: a victim is often a
    request still swapping in (the newest running); outputs equal an unpressed run's and
    every block ends free."""
    rng = random.Random(seed)
    texts = ["Tim had a dog", "The sun", "Lily and Ben went to the", "One day a big", "She saw"]
    requests = [
        (
            stories.tokenizer.encode(rng.choice(texts))
            + [rng.randrange(1, 500) for _ in range(rng.randrange(12))],
            SamplingParams(max_tokens=rng.randrange(8, 40), temperature=0, ignore_eos=True),
            rng.randrange(30),
        )
        for _ in range(10)
    ]
    config = EngineConfig(block_size=BS, num_hbm_blocks=512)
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    reference = generate(build_engine(stories, config), prompts, params)
    config = EngineConfig(
        block_size=BS,
        num_hbm_blocks=24,
        num_dram_blocks=200,
        max_num_batched_tokens=16,
        prefix_caching=False,
    )
    engine = build_engine(stories, config, Knobs(policy=policy, b_xfer=2))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    for step in range(5_000):
        for index, (prompt, params, arrival) in enumerate(requests):
            if arrival == step:
                engine.add_request(f"r{index}", prompt, params)
        if step > 30 and not engine.has_unfinished():
            break
        for output in engine.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        for table in engine.kv.tables.values():
            assert table.num_pending_h2d >= 0 and (table.num_hbm, table.num_dram) == table.recount()
    assert list(tokens.values()) == [r.token_ids for r in reference]
    assert engine.stats.num_rotations_out > 0
    engine.kv.drain()
    kv = engine.kv
    assert kv.hbm.num_free == kv.hbm.num_blocks and kv.dram.num_free == kv.dram.num_blocks


def test_a_block_skipped_while_dram_was_full_is_synced_once_it_has_room() -> None:
    kv, _, _ = _manager(num_hbm=16, num_dram=4)
    _fill(kv, "b", 2 * BS)  # two DRAM blocks for b's syncs
    _fill(kv, "a", 3 * BS)  # a's third block finds DRAM full
    kv.issue_transfers()
    kv.drain()
    assert kv.tiered_stats.blocks_synced == 4
    kv.free("b")
    assert kv.ensure_hbm("a", 3 * BS, 3 * BS + 1) is not None
    kv.on_computed("a", 3 * BS + 1)  # the next step: DRAM has room again
    kv.issue_transfers()
    kv.drain()
    table = kv.table("a")
    assert table is not None and table.sync[:3] == [SYNCED] * 3
    assert kv.tiered_stats.blocks_synced == 5
    before = kv.transfer.stats.blocks_d2h
    assert kv.rotate_out("a") is not None
    kv.drain()
    assert kv.transfer.stats.blocks_d2h - before == 1  # only the partial tail moves


def test_syncs_turned_into_evictions_are_indexed_in_dram() -> None:
    geometry = KVGeometry(2, BS, 2, 4, torch.float32)
    hbm = torch.randn(16, *geometry.block_shape)
    dram = torch.zeros(16, *geometry.block_shape)
    kv = KVCacheManager(16, 16, BS, CpuTransferEngine(hbm, dram), 64, prefix_caching=True)
    tokens = list(range(100, 100 + 3 * BS))
    keys = kv.prefix_keys(tokens)
    assert kv.ensure_hbm("a", 0, len(tokens)) is not None
    kv.on_computed("a", len(tokens), tokens, keys)  # three syncs queued, none issued
    assert kv.rotate_out("a") is not None  # ... they become evictions
    kv.issue_transfers()
    kv.drain()
    assert kv.tiered_stats.blocks_evicted == 3
    parents = [ROOT_KEY, *keys[:-1]]
    for index, (key, parent) in enumerate(zip(keys, parents, strict=True)):
        block_tokens = tokens[index * BS : (index + 1) * BS]
        assert kv.dram.cached_block(key, parent, block_tokens) is not None, index
