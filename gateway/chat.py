"""Chat messages -> prompt text: the model's own jinja2 chat template (tokenizer_config.json)
rendered in a sandbox, or a plain default when the model has none."""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.tokenizer import TokenizerBundle


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception in the template) or failed."""


class ChatRenderer:
    def __init__(self, bundle: TokenizerBundle) -> None:
        self.bundle = bundle
        self._template: jinja2.Template | None = None
        if bundle.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(bundle.chat_template)

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            return _default(messages, add_generation_prompt)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bundle.bos_token,
                eos_token=self.bundle.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def _default(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """A plain transcript for models without a template (e.g. stories260K)."""
    if len(messages) == 1 and messages[0]["role"] == "user" and not add_generation_prompt:
        return str(messages[0]["content"])
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "\n".join(lines)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)
