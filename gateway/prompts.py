"""Prompt text -> token ids, never on the event loop: a chat's template is rendered and any text
tokenized on a small pool of threads, so one long prompt cannot stall other streams or /health;
prompts of up to ``SMALL_PROMPT_CHARS`` characters have a thread of their own, so they never
queue behind long ones (8 prompts of a million characters held a 5-word one for 8 s).
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
from gateway.logprobs_format import TokenNames
from gateway.openai_models import ChatCompletionRequest
from gateway.tools import history_messages
from shared.tokenizer import Tokenizer

T = TypeVar("T")
SMALL_PROMPT_CHARS = 16_384  # what a chat turn or a few-shot prompt holds: the fast lane's


class PromptEncoder:
    def __init__(
        self, tokenizer: Tokenizer, chat: ChatRenderer, max_chars: int, num_threads: int
    ) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_chars = max_chars
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tokenize")
        self._small_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-small")
        # one token's text (log-probabilities name tokens by it; a special token by its text,
        # as vLLM and the echoed prompt write it): cached, at most this many
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=65_536)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )
        token_bytes = functools.lru_cache(maxsize=65_536)(self._token_bytes)
        self.token_names = TokenNames(self.token_text, token_bytes)

    async def completion(self, prompt: Any) -> list[list[int]]:
        """A completion's prompts: text (tokenized with BOS) or token ids, or a batch of
        either (a list of texts or of token-id lists); every text's characters count
        against the limit together."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]  # one prompt
        if not prompt:
            raise APIError(400, "the prompt batch is empty", param="prompt")
        num_chars = sum(len(p) for p in prompt if isinstance(p, str))
        self._check_chars(num_chars, "prompt")
        for ids in (p for p in prompt if not isinstance(p, str)):
            self.check_ids(ids, "prompt")
        texts = [p for p in prompt if isinstance(p, str)]
        encoded = iter(await self._off_loop(num_chars, self._encode_all, texts) if texts else [])
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
        num_chars = sum(len(m["content"]) for m in messages)
        self._check_chars(num_chars, "messages")
        return await self._off_loop(num_chars, self._render_and_encode, body, messages, tools)

    async def text(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text`` tokenized as is (``/tokenize``): BOS only with ``add_special_tokens``."""
        self._check_chars(len(text), "prompt")
        return await self._off_loop(len(text), self._encode, text, add_special_tokens, "prompt")

    async def decode(self, token_ids: list[int], each: bool = False) -> list[str]:
        """The text of ``token_ids``, special tokens included (``/detokenize`` and an echoed
        token-id prompt, as vLLM's: Hugging Face's decode), then with ``each`` every token's piece
        as the vocabulary writes it (``/tokenize``'s token_strs, vLLM's
        ``convert_ids_to_tokens``: special tokens included); 400 for an id the tokenizer does
        not know."""
        return await self._off_loop(len(token_ids), self._decode, token_ids, each)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._small_pool.shutdown(wait=False, cancel_futures=True)

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
        tokenizer = self.tokenizer
        self.check_ids(token_ids, "tokens")  # a tokenizer drops what it does not know
        try:
            pieces = [tokenizer.token_piece(t) for t in token_ids] if each else []
            return [tokenizer.decode(token_ids, skip_special_tokens=False), *pieces]
        except (IndexError, KeyError, ValueError, OverflowError, TypeError) as exc:
            message = f"tokens: not ids of this tokenizer ({exc})"[:200]
            raise APIError(400, message, param="tokens") from exc

    def _token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes; its text's for an id past the tokenizer's vocabulary (a
        model's padding)."""
        try:
            return self.tokenizer.token_raw_bytes(token_id)
        except (ValueError, KeyError, IndexError):
            return self.token_text(token_id).encode()

    def check_ids(self, token_ids: list[int], param: str) -> None:
        """400 naming ``param`` for an id the tokenizer does not know (min/max: C speed)."""
        known = self.tokenizer.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= known):
            bad = next(t for t in token_ids if not 0 <= t < known)
            message = f"{param}: {bad} is not a token id of this model's tokenizer (0..{known - 1})"
            raise APIError(400, message, param=param)

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_chars:
            raise APIError(
                400,
                f"the prompt has {num_chars} characters; this server takes at most "
                f"{self.max_chars}",
                param=param,
                code="prompt_too_long",
            )

    async def _off_loop(self, size: int, work: Callable[..., T], *args: Any) -> T:
        """``work`` on a tokenizer thread: the small lane's when ``size`` (characters or
        ids) is at most ``SMALL_PROMPT_CHARS``, else the pool's."""
        pool = self._small_pool if size <= SMALL_PROMPT_CHARS else self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, work, *args)
