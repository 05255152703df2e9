"""The official `openai` client against `superinfer serve` with stories260K: completions and
chat, streaming and not, usage, stop, max_tokens, seed; text checked against the model's
published reference output."""

from __future__ import annotations

from typing import Any

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.conftest import STORIES_REFERENCE_TEXT
from tests.served import Served

MODEL = "stories260K"


@pytest.fixture
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client: OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL


def test_greedy_completion_reproduces_the_reference_text(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="", max_tokens=40, temperature=0)
    text = out.choices[0].text
    assert len(text) > 60
    assert STORIES_REFERENCE_TEXT.startswith(text)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (1, 40)


def test_streamed_completion_equals_the_non_streamed_text(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "Tim had a red ball", "max_tokens": 60, "temperature": 0}
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}


def test_chat_stream_equals_chat_and_reports_usage(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Lily went to the park"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=50, temperature=0
    )  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=50,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content and streamed
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_string_ends_the_text_before_it(client: OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="", max_tokens=60, temperature=0, stop=["little girl"]
    )
    assert out.choices[0].text == "Once upon a time, there was a "
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="", max_tokens=60, temperature=0, stop=[" Lily", "park"], stream=True
    )
    text = "".join(c.choices[0].text for c in streamed)
    assert text == "Once upon a time, there was a little girl named"


def test_seed_makes_sampling_reproducible(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL, prompt="Once", max_tokens=40, temperature=1.0, seed=seed
        )
        return out.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_bad_requests_get_openai_errors(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="Once", max_tokens=10_000)
    assert "maximum context length" in str(too_long.value)
    with pytest.raises(BadRequestError):  # over the server's choices a request (128)
        client.completions.create(model=MODEL, prompt="Once", max_tokens=5, n=200)
    with pytest.raises(BadRequestError):
        client.completions.create(model=MODEL, prompt=[100_000], max_tokens=5)
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4", prompt="Once", max_tokens=5)
    # The server is unharmed: a good request right after succeeds.
    ok = client.completions.create(model=MODEL, prompt="", max_tokens=3, temperature=0)
    assert ok.choices[0].text


def test_an_assistant_message_sent_back_as_the_client_got_it_is_served(client: OpenAI) -> None:
    """``messages.append(reply.choices[0].message.model_dump())``, the agent loop's idiom,
    was a 400 ('messages.1.refusal' is not a field); the prompt is the role and content's."""
    question = {"role": "user", "content": "Lily"}
    reply = client.chat.completions.create(
        model=MODEL, messages=[question], max_tokens=4, temperature=0
    )
    dumped = reply.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= set(dumped)
    plain = {"role": "assistant", "content": reply.choices[0].message.content}
    follow = {"role": "user", "content": "Then"}
    common: Any = dict(model=MODEL, max_tokens=1, temperature=0)
    sent_back = client.chat.completions.create(messages=[question, dumped, follow], **common)
    reference = client.chat.completions.create(messages=[question, plain, follow], **common)
    assert sent_back.usage is not None and reference.usage is not None
    assert sent_back.usage.prompt_tokens == reference.usage.prompt_tokens
    parsed = {**dumped, "parsed": {"any": "thing"}}  # what beta.chat.completions.parse adds
    client.chat.completions.create(messages=[question, parsed, follow], **common)
    with pytest.raises(BadRequestError) as refused:
        audio = {**dumped, "audio": {"id": "audio_1"}}
        client.chat.completions.create(messages=[question, audio, follow], **common)
    assert (
        isinstance(refused.value.body, dict) and refused.value.body["param"] == "messages.1.audio"
    )


def test_a_model_is_retrieved_by_its_id(client: OpenAI) -> None:
    """``client.models.retrieve`` (GET /v1/models/{id}) was a 404 for the served model too."""
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(NotFoundError):
        client.models.retrieve("org/other-model")


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client: OpenAI) -> None:
    """``prompt_tokens_details.cached_tokens`` (OpenAI's; the Responses API's
    ``input_tokens_details``): the served system's blocks are 4 tokens, so a repeated prompt
    finds every full block of it but the one holding its last token."""
    prompt = [int(t) for t in range(5, 5 + 37)]  # token ids: no tokenizer in the count
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (37 - 1) // 4 * 4
