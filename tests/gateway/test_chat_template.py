"""Chat templates render as transformers renders them (loop controls, its tojson, strftime_now,
namespace, chat_template_kwargs, continue_final_message, its generation tag), and the
operator's template (a file or inline) replaces the model's, also behind a running gateway on
both lanes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from gateway.chat import ChatRenderer, ChatTemplateError, load_chat_template
from gateway.settings import GatewaySettings
from shared.tokenizer import ByteTokenizer, TokenizerBundle, load_tokenizer_bundle

API_JSON = {"content-type": "application/vnd.api+json"}  # JSON, but not for the fast lane

# Uses what transformers' environment adds to jinja2's: {% break %} / {% continue %}, tojson
# with indent / separators / sort_keys (non-ASCII kept, no HTML escaping), strftime_now,
# namespace, dict, and the variables tools, documents and a chat_template_kwargs entry.
TEMPLATE = """{{ bos_token }}{% set ns = namespace(turns=0) %}
{% for message in messages %}
{% if message.role == 'system' %}{% continue %}{% endif %}
{% if message.content == 'STOP' %}{% break %}{% endif %}
{% set ns.turns = ns.turns + 1 %}
<{{ message.role }}>{{ message | tojson(indent=2) }}
{{ message.content | tojson(sort_keys=true, separators=(',', ':')) }}</{{ message.role }}>
{% endfor %}
{{ dict(turns=ns.turns, year=strftime_now('%Y')) | tojson(sort_keys=true) }}
tools={{ tools }} documents={{ documents }} thinking={{ enable_thinking | default(true) }}
{% if add_generation_prompt %}<assistant>{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "skipped"},
    {"role": "user", "content": "Tim & Lily <3 café 😀 'quoted'"},
    {"role": "assistant", "content": "A ball."},
    {"role": "user", "content": "STOP"},
    {"role": "user", "content": "never rendered"},
]


def _renderer(template: str | None, override: str | None = None) -> ChatRenderer:
    bundle = TokenizerBundle(ByteTokenizer(), "m", template, "<s>", "</s>")
    return ChatRenderer(bundle, override)


def _transformers(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    rendered: Any = render_jinja_template(  # (texts, generation indices), typed as str
        [messages], chat_template=template, bos_token="<s>", eos_token="</s>", **kwargs
    )
    return str(rendered[0][0])


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(
    add_generation_prompt: bool, kwargs: dict[str, Any] | None
) -> None:
    ours = _renderer(TEMPLATE).render(MESSAGES, add_generation_prompt, False, kwargs)
    theirs = _transformers(
        TEMPLATE, MESSAGES, add_generation_prompt=add_generation_prompt, **(kwargs or {})
    )
    assert ours == theirs
    assert "café 😀" in ours and '"role": "user",\n  "content"' in ours
    assert "never rendered" not in ours and "skipped" not in ours
    assert ("thinking=False" in ours) == bool(kwargs)


def test_generation_tags_render_their_body_as_transformers_does() -> None:
    """Templates written for training mark the assistant's turns with transformers'
    ``{% generation %}`` tag: rendered as their body."""
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "<a>{{ m.content }}</a>{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}"
        "{% endfor %}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ours = _renderer(template).render(messages, False)
    assert ours == _transformers(template, messages) == "<u>Hi</u><a>Hello</a>"


@pytest.mark.parametrize("trim", ["", " | trim"])
def test_continue_final_message_as_transformers_does(trim: str) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content" + trim + " }}</s>{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once  "}]
    ours = _renderer(template).render(messages, False, True)
    assert ours == _transformers(template, messages, continue_final_message=True)
    assert ours.endswith("<assistant>Once" + ("" if trim else "  "))
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        _renderer("{{ messages[0].content }}").render(messages, False, True)


def test_template_failures_and_sandbox_escapes_are_client_errors() -> None:
    for template in (
        "{% set ns = namespace(_x=1) %}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ 1 / 0 }}",
        "{{ raise_exception('no tools here') }}",
    ):
        with pytest.raises(ChatTemplateError):
            _renderer(template).render([{"role": "user", "content": "x"}])
    assert _renderer("{{ dict.__class__ }}|{{ messages.pop }}|").render(MESSAGES) == "||"
    with pytest.raises(ChatTemplateError) as reserved:
        _renderer("{{ messages }}").render(MESSAGES, kwargs={"messages": []})
    assert reserved.value.param == "chat_template_kwargs"


def test_the_operator_template_is_a_file_or_inline(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text("file:{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "file:{{ messages[0].content }}"
    assert load_chat_template("{{ x }}" * 500) == "{{ x }}" * 500  # too long to be a path
    one = [{"role": "user", "content": "hi"}]
    assert _renderer("model:{{ bos_token }}", str(path)).render(one) == "file:hi"
    assert _renderer(None, "inline:{{ messages | length }}").render(one) == "inline:1"
    for bad in (str(tmp_path / "missing.jinja"), "chatml"):
        with pytest.raises(ValueError, match="neither an existing file nor a jinja2 template"):
            load_chat_template(bad)
    with pytest.raises(ValueError, match="does not compile"):
        _renderer(None, "{% for %}")


def test_a_bad_chat_template_setting_stops_the_gateway_at_start(tmp_path: Path) -> None:
    """Refused with the settings, before anything starts (serve's children included)."""
    with pytest.raises(ValueError, match=r"nope\.jinja"):
        GatewaySettings(admin_disabled=True, chat_template=str(tmp_path / "nope.jinja"))


def test_served_chat_uses_the_operator_template_on_both_lanes(
    tuned_gateway: str, stories_path: Path
) -> None:
    """The gateway in conftest renders TUNED_TEMPLATE: the chat's prompt tokens and greedy text
    are those of a completion of transformers' rendering, tokenized without BOS."""
    from tests.gateway.conftest import TUNED_TEMPLATE

    messages = [{"role": "user", "content": "Tim had a ball"}]
    kwargs = {"story": "Lily"}
    expected = _transformers(TUNED_TEMPLATE, messages, add_generation_prompt=True, **kwargs)
    prompt_ids = load_tokenizer_bundle(str(stories_path)).tokenizer.encode(expected, False)
    common = {"max_tokens": 12, "temperature": 0}
    reference = httpx.post(
        f"{tuned_gateway}/v1/completions", json={"prompt": prompt_ids, **common}, timeout=60
    ).json()
    chat = {"messages": messages, "chat_template_kwargs": kwargs, **common}
    url = f"{tuned_gateway}/v1/chat/completions"
    for response in (
        httpx.post(url, json=chat, timeout=60),  # the fast lane, then FastAPI's route
        httpx.post(url, content=json.dumps(chat).encode(), headers=API_JSON, timeout=60),
    ):
        out = response.json()
        assert out["usage"]["prompt_tokens"] == len(prompt_ids)
        assert out["choices"][0]["message"]["content"] == reference["choices"][0]["text"]
