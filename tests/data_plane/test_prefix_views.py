"""A waiting request's view follows the prefix cache as it changes (issue 29's stale views):
its computed tokens and shared HBM blocks are what :meth:`KVCacheManager.prefix_hits` says
now, not when it joined; and no plan admits a request the engine then un-admits
(``num_skipped_chunks`` stays 0) over random shared-prefix bursts with aborts and
evictions, for lvf and vllm, with and without the DRAM level (stories260K)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_plane.engine.config import EngineConfig
from data_plane.engine.engine import Engine
from data_plane.engine.llm import build_engine
from data_plane.engine.sampling import SamplingParams
from data_plane.models import load_model
from shared.policy import Knobs

BS = 4
SHORT = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def stories(stories_path: Path) -> Any:
    return load_model(str(stories_path))


class CheckedPlanner:
    """The engine's planner, checking first that the waiting requests' views it is given
    agree with the cache as it is now; keeps the last waiting views it saw."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.planner = engine.planner
        self.last_waiting: list[Any] = []

    def __call__(self, snapshot: Any) -> Any:
        assert_views_fresh(self.engine)
        self.last_waiting = list(self.engine.waiting.views())
        return self.planner(snapshot)


def _engine(loaded: Any, policy: str, num_hbm: int, dram: bool, max_num_seqs: int) -> Engine:
    config = EngineConfig(
        block_size=BS,
        num_hbm_blocks=num_hbm,
        num_dram_blocks=64 if dram else 0,
        max_num_batched_tokens=16,
        max_num_seqs=max_num_seqs,
        prefix_caching=True,
    )
    engine = build_engine(loaded, config, Knobs(policy=policy, b_xfer=8))
    engine.planner = CheckedPlanner(engine)
    return engine


def _live(engine: Engine, request: Any) -> tuple[int, int, int]:
    """(computed tokens, HBM blocks in use, DRAM blocks) its view must hold now."""
    if not request.reads_prefix_cache:
        return 0, 0, 0
    hits = engine.kv.prefix_hits(request.all_token_ids, request.block_keys)
    return hits.num_blocks * BS, hits.num_hbm_in_use, hits.num_dram


def assert_views_fresh(engine: Engine) -> None:
    """The waiting queue's views and columns agree with the cache as it is now."""
    columns = engine.waiting.column_arrays()
    pairs = zip(engine.waiting, engine.waiting.views(), strict=True)
    for index, (request, view) in enumerate(pairs):
        expected = _live(engine, request)
        assert (view.num_computed_tokens, view.num_blocks_hbm, view.num_blocks_dram) == expected
        got = (
            int(columns["num_computed_tokens"][index]),
            int(columns["num_blocks_hbm"][index]),
            int(columns["num_blocks_dram"][index]),
        )
        assert got == expected


def _step(engine: Engine) -> None:
    engine.step()
    assert engine.stats.num_skipped_chunks == 0, engine.stats


def test_a_waiting_request_sees_the_prefix_cached_after_it_joined(stories: Any) -> None:
    """Case A: B (A's prompt) joins before A's prefix is cached; once A has prefilled, the
    policy sees B with 28 computed tokens and 7 HBM blocks in use (32 tokens, blocks of 4)."""
    engine = _engine(stories, "vllm", num_hbm=64, dram=False, max_num_seqs=1)
    checked = engine.planner
    prompt = stories.tokenizer.encode("Once upon a time there was a little girl named Lily.")
    prompt = (prompt * 4)[:32]
    engine.add_request("a", prompt, SHORT)
    engine.add_request("b", prompt, SHORT)
    _step(engine)
    assert isinstance(checked, CheckedPlanner) and checked.last_waiting[1].num_computed_tokens == 0
    for _ in range(3):  # A's prefill: 16 tokens a step, then its first decode
        _step(engine)
    (view,) = checked.last_waiting
    assert (view.num_computed_tokens, view.num_blocks_hbm) == (28, 7)


@pytest.mark.parametrize("policy", ["vllm", "lvf"])
def test_a_promised_prefix_released_while_waiting_is_not_promised(
    stories: Any, policy: str
) -> None:
    """Case B: B waits behind A (its prompt) and D; A is aborted, so the blocks B's view
    counted as in use (free for B) are now evictable, or evicted by D's growth: no plan may
    admit B on them (before the fix vllm skipped a chunk with D of 16 to 22 tokens)."""
    prompt = (stories.tokenizer.encode("Once upon a time there was a dog.") * 8)[:32]
    for num_other in range(6, 24, 2):
        for num_warm in (2, 3, 4, 5):
            engine = _engine(stories, policy, num_hbm=12, dram=False, max_num_seqs=2)
            engine.add_request("a", prompt, SHORT)
            engine.add_request("d", list(reversed(prompt))[:num_other], SHORT)
            for _ in range(num_warm):
                _step(engine)
            engine.add_request("b", prompt, SHORT)
            _step(engine)
            engine.abort("a")
            for _ in range(60):
                if not engine.has_unfinished():
                    break
                _step(engine)
            assert not engine.has_unfinished()


PROMPTS_SEED = 7


def _prompt_family(loaded: Any) -> list[list[int]]:
    """Prompts sharing prefixes of several lengths (whole blocks and not)."""
    base = loaded.tokenizer.encode(
        "Once upon a time there was a little girl named Lily. She liked to play in the park."
    )
    rng = random.Random(PROMPTS_SEED)
    prompts = []
    for length in (9, 13, 16, 21, 28):
        for _ in range(2):
            suffix = [rng.randrange(3, 500) for _ in range(rng.randint(1, 6))]
            prompts.append(base[:length] + suffix)
    return prompts


@pytest.mark.parametrize("policy", ["vllm", "lvf"])
@pytest.mark.parametrize("dram", [False, True])
def test_random_shared_prefix_bursts_never_skip_a_chunk(
    stories: Any, policy: str, dram: bool
) -> None:
    prompts = _prompt_family(stories)

    @settings(
        max_examples=20,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        actions=st.lists(
            st.tuples(st.sampled_from(["add", "add", "add", "abort", "step"]), st.integers(0, 99)),
            min_size=10,
            max_size=60,
        ),
        num_hbm=st.integers(12, 24),
        max_num_seqs=st.integers(1, 4),
    )
    def check(actions: list[tuple[str, int]], num_hbm: int, max_num_seqs: int) -> None:
        engine = _engine(stories, policy, num_hbm, dram, max_num_seqs)
        live: list[str] = []
        for number, (action, value) in enumerate(actions):
            if action == "add":
                request_id = f"r{number}"
                engine.add_request(request_id, prompts[value % len(prompts)], SHORT)
                live.append(request_id)
            elif action == "abort" and live:
                engine.abort(live.pop(value % len(live)))
            else:
                _step(engine)
        for _ in range(500):
            if not engine.has_unfinished():
                break
            _step(engine)
        assert not engine.has_unfinished()
        if engine.kv.has_dram:
            engine.kv.drain()
        assert not engine.kv.tables
        check.evicted += engine.kv.hbm.counters.num_evicted_blocks  # type: ignore[attr-defined]

    check.evicted = 0  # type: ignore[attr-defined]
    check()
    assert check.evicted > 0  # type: ignore[attr-defined]  # evictions happened


def test_a_request_computing_prompt_logprobs_is_seen_uncached_after_a_preemption(
    stories: Any,
) -> None:
    """Its keys grow as it computes (its blocks are shared with others), but it never reads
    the cache: preempted by recompute, the policy sees it with nothing computed (before the
    fix its view counted 28 of its 32 prompt tokens as cached)."""
    engine = _engine(stories, "vllm", num_hbm=64, dram=False, max_num_seqs=2)
    checked = engine.planner
    prompt = (stories.tokenizer.encode("Once upon a time there was a little girl.") * 4)[:32]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("p", prompt, params)
    for _ in range(3):  # its prefill, 16 tokens a step, and its first token
        _step(engine)
    request = engine.requests["p"]
    assert request.output_token_ids and len(request.block_keys) == 8

    def preempt_p(snapshot: Any) -> Any:
        plan = checked(snapshot)
        plan.preempt_ids, plan.schedule = ["p"], []
        return plan

    engine.planner = preempt_p
    engine.step()
    engine.planner = checked
    _step(engine)
    assert isinstance(checked, CheckedPlanner)
    (view,) = checked.last_waiting
    assert (view.request_id, view.num_computed_tokens, view.num_blocks_hbm) == ("p", 0, 0)
