"""Who is calling and what they may ask for: the API key (checked before anything costly is done
for the request), the SLO class a request is served in, and its scheduling priority.

Rules, with a known API key:

- The key's SLO class is a ceiling (no class on the key: the configured default class). An
  ``x-slo-class`` header is honoured only for a class no tighter than it: both its TTFT and its
  TBT targets at least the ceiling's (so interactive > standard > batch with the default
  classes). A header asking for a tighter class is served in the key's class, not refused.
- ``priority`` (vLLM's: lower is served first) is clamped to at least the key's
  ``min_priority`` (0 unless the admin gave the key a lower one): a tenant may defer its own
  requests, never put them ahead of others'.

Without a known key (open mode: ``require_api_key`` off and no key, or a key this server does
not know) the header and ``priority`` are taken as sent: without keys there are no tenants to
keep apart. An unknown ``x-slo-class`` is a 400 either way."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from redis.exceptions import RedisError

from gateway.auth import ApiKey, bearer
from gateway.errors import APIError, bus_error
from gateway.openai_models import SamplingFields
from gateway.state import GatewayState
from shared.policy import PRIORITY_POLICIES
from shared.slo import SloClass, default_class


@dataclass(frozen=True, slots=True)
class Caller:
    key: ApiKey | None  # None: anonymous (open mode)

    @property
    def tenant(self) -> str | None:
        return self.key.tenant if self.key else None

    @property
    def key_id(self) -> str | None:
        return self.key.key_id if self.key else None


async def authenticate(state: GatewayState, request: Request) -> Caller:
    """The request's API key; 401 when a key is required and this one is missing or unknown
    (counted, logged and slowed per source: gateway/auth_failures.py)."""
    token = bearer(request)
    try:
        key = await state.api_keys.lookup(token) if token else None
    except RedisError as exc:
        message = f"could not check the API key: {exc}"
        raise bus_error(message, state.settings.retry_after_s) from exc
    if key is None and state.settings.require_api_key:
        error = APIError(401, "a valid API key is required", code="invalid_api_key")
        raise await state.auth_failures.failed(request, "api_key", error)
    return Caller(key)


def served_class(state: GatewayState, caller: Caller, header: str | None) -> SloClass:
    classes = state.directory.slo_classes
    if header is not None and header not in classes:
        raise APIError(
            400, f"unknown SLO class {header[:64]!r}; known: {sorted(classes)[:32]}", "x-slo-class"
        )
    if caller.key is None:
        return classes[header] if header is not None else _default_class(state)
    ceiling = classes.get(caller.key.slo_class or "") or _default_class(state)
    if header is None:
        return ceiling
    asked = classes[header]
    no_tighter = asked.ttft_s >= ceiling.ttft_s and asked.tbt_s >= ceiling.tbt_s
    return asked if no_tighter else ceiling


def served_priority(caller: Caller, asked: int, policy: str) -> int:
    """``asked``, raised to the key's floor; a 400 for a priority the policy in force does not
    order by (as vLLM refuses one without ``--scheduling-policy priority``)."""
    if asked != 0 and policy not in PRIORITY_POLICIES:
        served_by = " or ".join(sorted(PRIORITY_POLICIES))
        message = (
            f"priority {asked}: the {policy} policy in force does not order requests by priority "
            f"({served_by} does); rank requests by SLO class instead (x-slo-class, or the API "
            "key's class)"
        )
        raise APIError(400, message, "priority")
    return asked if caller.key is None else max(asked, caller.key.min_priority)


def _default_class(state: GatewayState) -> SloClass:
    return default_class(state.directory.slo_classes, state.settings.default_slo_class)


async def admit(
    state: GatewayState, request: Request, body: SamplingFields, caller: Caller | None = None
) -> Caller:
    """The caller of a generation request, checked before anything costly is done for it: its
    key (unless the route authenticated it already: ``caller``), then the model it names (404
    for another)."""
    if caller is None:
        caller = await authenticate(state, request)
    if body.model is not None and body.model != state.model_name:
        name = body.model if len(body.model) <= 200 else f"{body.model[:200]}..."
        raise APIError(404, f"the model {name!r} does not exist", "model", "model_not_found")
    return caller
