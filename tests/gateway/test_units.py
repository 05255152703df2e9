"""Gateway pieces without a server: chat templates, per-key limits, settings guard."""

from __future__ import annotations

import pytest

from gateway import limits
from gateway.app import create_app
from gateway.chat import ChatRenderer, ChatTemplateError
from gateway.errors import APIError
from gateway.limits import KeyLimiter
from gateway.settings import GatewaySettings
from shared.tokenizer import ByteTokenizer, TokenizerBundle

# The shape of Llama 3's template (tokenizer_config.json "chat_template").
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('tools are not supported') }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _renderer(template: str | None) -> ChatRenderer:
    return ChatRenderer(TokenizerBundle(ByteTokenizer(), "m", template, "<|begin_of_text|>"))


def test_model_chat_template_is_rendered() -> None:
    renderer = _renderer(LLAMA3_TEMPLATE)
    text = renderer.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_template_errors_are_client_errors_and_the_sandbox_holds() -> None:
    with pytest.raises(ChatTemplateError, match="tools are not supported"):
        _renderer(LLAMA3_TEMPLATE).render([{"role": "tool", "content": "x"}])
    hostile = _renderer("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        hostile.render([{"role": "user", "content": "x"}])


def test_default_template_without_one() -> None:
    text = _renderer(None).render([{"role": "user", "content": "Tim had a dog"}])
    assert text == "user: Tim had a dog\nassistant:"


def test_key_limiter_bounds_concurrency_and_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    limiter = KeyLimiter(max_concurrent=2, max_requests_per_s=3.0)
    limiter.acquire("k")
    limiter.acquire("k")
    with pytest.raises(APIError) as busy:
        limiter.acquire("k")
    assert busy.value.status_code == 429 and busy.value.headers == {"Retry-After": "1"}
    limiter.release("k")
    limiter.acquire("k")  # the third token of the burst
    limiter.release("k")
    limiter.release("k")
    with pytest.raises(APIError, match="requests/s"):
        limiter.acquire("k")  # burst spent
    limiter.acquire("other")  # other keys are independent
    now[0] += 0.34
    limiter.acquire("k")  # one token refilled


def test_key_limiter_forgets_idle_keys_and_keeps_busy_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """One bucket per key ever used (deleted keys too) only grew: idle refilled ones go
    (a new bucket is the same), a key with a request in flight stays limited."""
    now = [100.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    limiter = KeyLimiter(max_concurrent=1, max_requests_per_s=1.0)
    limiter.acquire("busy")  # in flight throughout
    for i in range(10_000):
        limiter.acquire(f"k{i}")
        limiter.release(f"k{i}")
        now[0] += 0.001  # 1,000 keys a second: a refill (1 s) spans 1,000
    assert len(limiter) <= 4_096  # at most twice the keys of one refill, not 10,002
    with pytest.raises(APIError, match="concurrent"):
        limiter.acquire("busy")


def test_admin_api_needs_a_token_or_an_explicit_opt_out() -> None:
    with pytest.raises(ValueError, match="admin token"):
        create_app(GatewaySettings(admin_token=None, admin_disabled=False))
    create_app(GatewaySettings(admin_token=None, admin_disabled=True))


def test_a_union_fields_error_is_the_type_that_got_furthest() -> None:
    """``prompt: [-1]`` is a token id below 0 (it was "Input should be a valid string")."""
    import json

    from pydantic import ValidationError

    from gateway.errors import validation_error_response
    from gateway.openai_models import CompletionRequest

    for prompt in ([-1], [[1, -2]]):
        with pytest.raises(ValidationError) as caught:
            CompletionRequest.model_validate({"prompt": prompt})
        error = json.loads(validation_error_response(list(caught.value.errors())).body)["error"]
        assert error["param"] == "prompt" and "greater than or equal to 0" in error["message"]


def test_a_value_no_union_member_takes_names_every_accepted_type() -> None:
    """``prompt: 5`` said only "Input should be a valid string" although lists are taken."""
    import json

    from pydantic import ValidationError

    from gateway.errors import validation_error_response
    from gateway.openai_models import CompletionRequest

    for prompt in (5, None, {"a": 1}):
        with pytest.raises(ValidationError) as caught:
            CompletionRequest.model_validate({"prompt": prompt})
        error = json.loads(validation_error_response(list(caught.value.errors())).body)["error"]
        assert error["param"] == "prompt"
        assert "a valid string" in error["message"] and "a valid list" in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("retry_after_s", 0),  # a full queue's wait read as "room": admission limits were off
        ("port", 70_000),  # uvicorn listened on 70000 - 65536
        ("output_block_ms", 0),  # Redis blocks forever
        ("max_queued_requests", 0),
        ("worker_dead_s", -1.0),
    ],
)
def test_settings_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        GatewaySettings(model="tiny-random", **{field: value})
