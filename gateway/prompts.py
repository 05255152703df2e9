"""Prompt text -> token ids, never on the event loop: a chat's template is rendered and any text
tokenized on a small pool of threads, so one long prompt cannot stall other streams or /health.
Text longer than ``max_prompt_chars`` is a 400 before anything is rendered or tokenized (a
chat's message text is counted first, its rendered prompt again); text that is not valid
Unicode is a 400 too (the request models already refuse lone surrogates by field)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.chat import ChatRenderer, ChatTemplateError
from gateway.errors import APIError
from gateway.openai_models import ChatCompletionRequest
from gateway.tools import history_messages
from shared.tokenizer import Tokenizer

T = TypeVar("T")


class PromptEncoder:
    def __init__(
        self, tokenizer: Tokenizer, chat: ChatRenderer, max_chars: int, num_threads: int
    ) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_chars = max_chars
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tokenize")
        # one token's text (log-probabilities name tokens by it): cached, at most this many
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=65_536)(
            lambda token_id: tokenizer.decode([token_id])
        )

    async def completion(self, prompt: Any) -> list[list[int]]:
        """A completion's prompts: text (tokenized with BOS) or token ids, or a batch of
        either (a list of texts or of token-id lists); every text's characters count
        against the limit together."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]  # one prompt
        if not prompt:
            raise APIError(400, "the prompt batch is empty", param="prompt")
        self._check_chars(sum(len(p) for p in prompt if isinstance(p, str)), "prompt")
        texts = [p for p in prompt if isinstance(p, str)]
        encoded = iter(await self._off_loop(self._encode_all, texts) if texts else [])
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompt]

    async def chat_completion(
        self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """A chat's messages (and ``tools``, for the template to render) through the chat
        template, then tokenized (BOS only without a template: templates write their own)."""
        if body.continue_final_message and body.add_generation_prompt:
            message = "continue_final_message needs add_generation_prompt: false"
            raise APIError(400, message, param="continue_final_message")
        messages = history_messages(body)
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        return await self._off_loop(self._render_and_encode, body, messages, tools)

    async def text(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text`` tokenized as is (``/tokenize``): BOS only with ``add_special_tokens``."""
        self._check_chars(len(text), "prompt")
        return await self._off_loop(self._encode, text, add_special_tokens, "prompt")

    async def decode(self, token_ids: list[int], each: bool = False) -> list[str]:
        """The text of ``token_ids`` (``/detokenize``), then with ``each`` that of every token
        alone (``/tokenize``'s token_strs); 400 for an id the tokenizer does not know."""
        return await self._off_loop(self._decode, token_ids, each)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- on a tokenizer thread ----------------------------------------------------------

    def _render_and_encode(
        self,
        body: ChatCompletionRequest,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> list[int]:
        try:
            text = self.chat.render(
                messages,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
                tools,
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        self._check_chars(len(text), "messages")
        return self._encode(text, not self.chat.has_template, "messages")

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(text, True, "prompt") for text in texts]

    def _encode(self, text: str, add_bos: bool, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_bos=add_bos)
        except UnicodeError as exc:  # a lone surrogate the models did not see (a template's)
            raise APIError(400, f"{param}: the text is not valid Unicode", param=param) from exc

    def _decode(self, token_ids: list[int], each: bool) -> list[str]:
        decode = self.tokenizer.decode
        known = self.tokenizer.vocab_size
        unknown = [t for t in token_ids if not 0 <= t < known]
        if unknown:  # a tokenizer drops what it does not know: never a silent ""
            message = f"tokens: {unknown[0]} is not an id of this tokenizer (0..{known - 1})"
            raise APIError(400, message, param="tokens")
        try:
            return [decode(token_ids), *(decode([t]) for t in token_ids if each)]
        except (IndexError, KeyError, ValueError, OverflowError, TypeError) as exc:
            message = f"tokens: not ids of this tokenizer ({exc})"[:200]
            raise APIError(400, message, param="tokens") from exc

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_chars:
            raise APIError(
                400,
                f"the prompt has {num_chars} characters; this server takes at most "
                f"{self.max_chars}",
                param=param,
                code="prompt_too_long",
            )

    async def _off_loop(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)
