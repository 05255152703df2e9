"""Log-probabilities, echo, batched prompts and ``n`` through the whole system (stories260K
behind ``serve``), with the official openai client and raw HTTP, against an independent
reference: llama2.c's forward pass over the checkpoint file (tests/stories_reference.py),
max abs difference <= 1e-3."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.served import Served
from tests.stories_reference import StoriesReference

MODEL = "stories260K"
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def reference(stories_path: Path) -> StoriesReference:
    return StoriesReference(stories_path)


@pytest.fixture
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _tokenize(served: Served, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": True}
    tokens: list[int] = httpx.post(f"{served.url}/tokenize", json=body).json()["tokens"]
    return tokens


def _text(served: Served, token_id: int) -> str:
    body = {"tokens": [token_id]}
    text: str = httpx.post(f"{served.url}/detokenize", json=body).json()["prompt"]
    return text


def test_chat_logprobs_match_the_reference(
    served: Served, client: OpenAI, reference: StoriesReference
) -> None:
    messages: Any = [{"role": "user", "content": "Once upon a time"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    tokenized = httpx.post(f"{served.url}/tokenize", json={"messages": messages}).json()["tokens"]
    ids = list(tokenized)
    for _ in range(8):  # the reference's greedy continuation
        ids.append(int(reference.logprobs(ids)[-1].argmax()))
    expected = reference.logprobs(ids)[len(tokenized) - 1 : -1]
    for position, entry in enumerate(content):
        token_id = ids[len(tokenized) + position]
        assert entry.token == _cached_text(served, token_id)
        row = expected[position]
        assert abs(entry.logprob - row[token_id].item()) <= TOLERANCE
        assert entry.bytes == list(entry.token.encode())
        top_values = row.topk(3).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values, abs=TOLERANCE)
        assert entry.token == entry.top_logprobs[0].token  # greedy: the most likely
    joined = b"".join(bytes(entry.bytes or []) for entry in content)  # OpenAI's use of them
    assert joined.decode() == out.choices[0].message.content


_TEXTS: dict[int, str] = {}


def _cached_text(served: Served, token_id: int) -> str:
    if token_id not in _TEXTS:
        _TEXTS[token_id] = _text(served, token_id)
    return _TEXTS[token_id]


def test_completions_echo_logprobs_are_what_lm_eval_reads(
    served: Served, reference: StoriesReference
) -> None:
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 0 or 1,
    temperature 0; token_logprobs[0] is null and the rest the prompt's, position by position.
    A larger vLLM ``prompt_logprobs`` fills its own field; the echoed maps keep N + 1."""
    prompt = _tokenize(served, "Once upon a time, there was a little girl")
    expected = reference.logprobs(prompt)
    for max_tokens, extra in ((0, {}), (1, {}), (1, {"prompt_logprobs": 3})):
        body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1,
                "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip
        out = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
        if extra:
            prompt_logprobs = out["choices"][0]["prompt_logprobs"]
            assert {len(entry) for entry in prompt_logprobs[1:]} <= {3, 4}
        logprobs = out["choices"][0]["logprobs"]
        num = len(prompt) + max_tokens
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == num
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for position in range(1, len(prompt)):
            want = expected[position - 1, prompt[position]].item()
            assert abs(logprobs["token_logprobs"][position] - want) <= TOLERANCE
            # the position's own token, then the most likely (OpenAI's and vLLM's N + 1)
            top = logprobs["top_logprobs"][position]
            assert 1 <= len(top) <= 2 and logprobs["tokens"][position] in top
            values = list(top.values())
            assert abs(values[0] - want) <= TOLERANCE
            assert abs(max(values) - expected[position - 1].max().item()) <= TOLERANCE
        # the echoed ids' text, BOS included (vLLM's decode, as /detokenize's)
        assert out["choices"][0]["text"].startswith("<s>Once upon a time")
        assert out["usage"]["completion_tokens"] == max_tokens
        offsets = logprobs["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0
        if max_tokens == 1:
            greedy = expected[-1].argmax().item()
            assert logprobs["tokens"][-1] == _cached_text(served, greedy)


def test_an_echo_only_prompt_may_fill_the_context(
    served: Served, reference: StoriesReference
) -> None:
    """lm-eval truncates a loglikelihood context to the model's max length: an echo-only
    request (max_tokens 0) of exactly max_model_len tokens is scored (it was a 400 saying
    max_tokens is 1); one token more is a 400 naming the prompt."""
    models = httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]
    max_model_len = models[0]["max_model_len"]
    story = _tokenize(served, "Once upon a time, there was a little girl named Lily.")
    prompt = (story * (max_model_len // len(story) + 1))[:max_model_len]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0,
            "temperature": 0}  # fmt: skip
    out = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
    assert out.status_code == 200, out.text
    logprobs = out.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == max_model_len and out.json()["usage"]["completion_tokens"] == 0
    last = reference.logprobs(prompt)[-2, prompt[-1]].item()  # the last prompt token's
    assert abs(logprobs[-1] - last) <= TOLERANCE
    over = httpx.post(
        f"{served.url}/v1/completions", json={**body, "prompt": [*prompt, prompt[0]]}, timeout=60
    )
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt", over.text
    assert "max_tokens is" not in over.json()["error"]["message"]


def test_completions_logprobs_stream_and_prompt_logprobs(
    served: Served, reference: StoriesReference
) -> None:
    prompt = _tokenize(served, "Tim and Sue")
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "logprobs": 2, "max_tokens": 6,
                            "temperature": 0, "ignore_eos": True}  # fmt: skip
    whole = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    streamed: list[float] = []
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                    streamed.extend(chunk["choices"][0]["logprobs"]["token_logprobs"])
    whole_logprobs = whole["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed == pytest.approx(whole_logprobs, abs=TOLERANCE)  # a prefix hit or not
    assert len(streamed) == 6
    vllm = httpx.post(
        f"{served.url}/v1/completions", json={**body, "prompt_logprobs": 1}, timeout=60
    ).json()["choices"][0]["prompt_logprobs"]
    expected = reference.logprobs(prompt)
    assert vllm[0] is None and len(vllm) == len(prompt)
    for position in range(1, len(prompt)):
        entry = vllm[position][str(prompt[position])]
        assert abs(entry["logprob"] - expected[position - 1, prompt[position]].item()) <= TOLERANCE
        assert entry["rank"] >= 1
    refused = {**body, "prompt_logprobs": 1, "stream": True}
    response = httpx.post(f"{served.url}/v1/completions", json=refused, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"


def test_batched_prompts_are_one_choice_each_in_order(served: Served, client: OpenAI) -> None:
    texts = ["Once upon a time", "Tim had a dog", "The sun"]
    batch = client.completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for choice, text in zip(batch.choices, texts, strict=True):
        alone = client.completions.create(model=MODEL, prompt=text, max_tokens=5, temperature=0)
        assert choice.text == alone.choices[0].text
    assert batch.usage is not None and batch.usage.completion_tokens == 15
    ids = [_tokenize(served, t) for t in texts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)


def _prefix_hits(served: Served) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("superinfer:prefix_cache_hits")
    )


def test_n_choices_are_seeded_reproducible_and_share_one_prefill(
    served: Served, client: OpenAI
) -> None:
    prompt = _tokenize(served, "Once upon a time, there was a little girl named Lily. She")
    hits_before = _prefix_hits(served)
    first = client.completions.create(
        model=MODEL, prompt=prompt, n=4, max_tokens=12, temperature=1.0, seed=11
    )
    again = client.completions.create(
        model=MODEL, prompt=prompt, n=4, max_tokens=12, temperature=1.0, seed=11
    )
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert first.id.startswith("cmpl-") and not first.id.endswith("-0")  # the response's own
    assert texts == [c.text for c in again.choices]  # reproducible with the seed
    assert len(set(texts)) > 1  # the samples differ
    assert first.usage is not None and first.usage.prompt_tokens == len(prompt)
    full_blocks = len(prompt) // 4 * 4  # the served system's block size is 4
    # Each request's 3 siblings found the first's prompt cached (full blocks); the workers'
    # counters reach /metrics with their heartbeats.
    deadline = time.monotonic() + 10
    while _prefix_hits(served) - hits_before < 2 * 3 * full_blocks:
        assert time.monotonic() < deadline, _prefix_hits(served) - hits_before
        time.sleep(0.2)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tim"}], n=2, max_tokens=4, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1]
