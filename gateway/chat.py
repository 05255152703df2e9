"""Chat messages -> prompt text: the model's own jinja2 chat template (tokenizer_config.json),
or the operator's (``chat_template``: a file, or the template itself), or a plain default when
there is none.

Templates run in the environment transformers gives them (``apply_chat_template``): sandboxed,
``trim_blocks`` and ``lstrip_blocks``, ``{% break %}`` / ``{% continue %}``, a ``tojson`` that
keeps non-ASCII text and takes ``indent``, ``separators`` and ``sort_keys``, ``strftime_now``,
``raise_exception``, and ``dict`` / ``namespace`` that cannot reach Python internals. They see
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools`` and
``documents`` (None: tools are not served) and the request's ``chat_template_kwargs``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.tokenizer import TokenizerBundle

# Appended to the final message for continue_final_message; the text is cut where it lands.
_CONTINUE_TAG = "<|superinfer:continue|> "


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception in the template) or failed."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class ChatRenderer:
    def __init__(self, bundle: TokenizerBundle, override: str | None = None) -> None:
        """``override`` (a file or a template) replaces the model's template; ValueError when
        it is neither, or when the template does not compile."""
        self.bundle = bundle
        source = load_chat_template(override) if override is not None else bundle.chat_template
        self.source = source  # the template served (None: the plain default)
        self._template: jinja2.Template | None = None
        if source:
            try:
                self._template = _environment().from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"the chat template does not compile: {exc}") from exc

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt; with ``continue_final_message`` it ends inside the last message, for
        the model to go on with it; ``tools`` for templates that render them."""
        if self._template is None:
            return _default(messages, add_generation_prompt, tools)
        if kwargs and "messages" in kwargs:
            raise ChatTemplateError(
                "chat_template_kwargs cannot set 'messages'", "chat_template_kwargs"
            )
        if continue_final_message:
            messages = [*messages[:-1], {**messages[-1]}]
            messages[-1]["content"] = f"{messages[-1]['content']}{_CONTINUE_TAG}"
        variables = {
            "bos_token": self.bundle.bos_token,
            "eos_token": self.bundle.eos_token,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **(kwargs or {}),
            "messages": messages,
        }
        try:
            text = self._template.render(variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except Exception as exc:  # the template's own arithmetic, a bad kwarg type...
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return _cut_at_tag(text) if continue_final_message else text


def load_chat_template(value: str) -> str:
    """A template given as a file path or as its text (vLLM's --chat-template): an existing
    file is read; otherwise a value with ``{`` in it is the template itself."""
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # too long for a path, a NUL in it: an inline template
        is_file = False
    if is_file:
        return Path(value).read_text()
    if "{" in value:
        return value
    raise ValueError(
        f"chat_template {value[:200]!r} is neither an existing file nor a jinja2 template"
    )


def _cut_at_tag(text: str) -> str:
    where = text.rfind(_CONTINUE_TAG.strip())
    if where < 0:
        raise ChatTemplateError(
            "the chat template drops the final message, so it cannot be continued",
            "continue_final_message",
        )
    if text.startswith(_CONTINUE_TAG, where):
        return text[:where]
    return text[:where].rstrip()  # the template trimmed the message: trim what precedes too


def _default(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """A plain transcript for models without a template (e.g. stories260K): the tools and a
    message's tool calls as JSON lines."""
    if (
        len(messages) == 1
        and messages[0]["role"] == "user"
        and not add_generation_prompt
        and not tools
    ):
        return str(messages[0]["content"])
    lines = [f"tools: {json.dumps(tools)}"] if tools else []
    for m in messages:
        calls = f" tool_calls: {json.dumps(m['tool_calls'])}" if m.get("tool_calls") else ""
        lines.append(f"{m['role']}: {m['content']}{calls}")
    if add_generation_prompt:
        lines.append("assistant:")
    return "\n".join(lines)


# ---- the template environment ------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag, used by
    templates made for training): rendered as its body, as ``apply_chat_template`` does
    when no assistant mask is asked for."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it a set)

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)  # the tag's name
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace
    )
    return env


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as json.dumps writes it (jinja2's own tojson escapes <, >, & and ' for HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without handing the template the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace()`` without underscore-prefixed attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        super().__init__(attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        super().__setitem__(name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")
