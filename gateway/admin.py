"""`/admin/v1`: SLO knobs and classes (validated: a bad value is a 422 and nothing changes),
workers, one request's lifecycle, API keys (a tenant, an SLO class that is the key's ceiling, a
``min_priority``: the lowest priority value its requests may ask for, 0 by default). Every
route needs the admin bearer token (a wrong one is counted, logged and slowed per source:
gateway/auth_failures.py). Every body is validated by type (gateway/admin_bodies.py): a wrong
one is a 422, never a 500. Removing SLO classes that keys name is a 409 listing the keys unless
``?force=true`` (checked and written in one transaction that watches the keys, as a key's class
is checked in one that watches the classes); a key is deleted by its whole id only."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from redis.exceptions import WatchError

from gateway.admin_bodies import (
    KNOB_CHANGES,
    SLO_CLASSES,
    ApiKeyBody,
    validated,
    validated_model,
)
from gateway.auth import (
    UnknownSloClassError,
    check_admin,
    create_api_key,
    delete_api_key,
    is_key_id,
    keys_by_class,
)
from gateway.errors import APIError
from gateway.state import GatewayState
from shared import streams
from shared.knobs import MAX_WRITE_ATTEMPTS, KnobError, knobs_to_json, read_knobs, write_knobs
from shared.policy import kv_usage
from shared.slo import (
    default_class,
    queue_slo_classes_write,
    read_slo_classes,
    slo_classes_write_args,
)
from shared.streams import API_KEYS_KEY


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def _admin(request: Request) -> None:
    state = _state(request)
    try:
        check_admin(request, state.settings.admin_token)
    except APIError as error:
        raise await state.auth_failures.failed(request, "admin", error) from None


router = APIRouter(prefix="/admin/v1", dependencies=[Depends(_admin)])
MAX_REQUEST_ID_CHARS = 256


@router.get("/knobs")
async def get_knobs(request: Request) -> dict[str, Any]:
    """The stored knobs; a stored value that does not validate (written by hand) is a 409
    naming it (services keep the last valid knobs; a PUT of that knob repairs it)."""
    try:
        knobs, version = await read_knobs(_state(request).redis)
    except KnobError as exc:
        message = f"the stored knob {exc.knob!r} does not validate ({exc}); PUT a valid value"
        raise APIError(409, message, param=exc.knob, code="invalid_stored_knob") from exc
    return {"version": version, "knobs": knobs_to_json(knobs)}


@router.put("/knobs")
async def put_knobs(request: Request, body: Annotated[Any, Body()]) -> dict[str, Any]:
    state = _state(request)
    changes = validated(KNOB_CHANGES, body, "knobs")
    if not changes:  # nothing to change: no new version (dashboards annotate each one)
        return await get_knobs(request)
    try:
        knobs, version = await write_knobs(state.redis, changes)
    except ValueError as exc:
        param = exc.knob if isinstance(exc, KnobError) else "knobs"
        raise APIError(422, str(exc), param=param, code="invalid_knob") from exc
    state.directory.knobs, state.directory.knobs_version = knobs, version
    return {"version": version, "knobs": knobs_to_json(knobs)}


@router.get("/slo-classes")
async def get_slo_classes(request: Request) -> dict[str, Any]:
    classes, version = await read_slo_classes(_state(request).redis)
    return {"version": version, "classes": {n: _class(c) for n, c in classes.items()}}


@router.put("/slo-classes")
async def put_slo_classes(
    request: Request, body: Annotated[Any, Body()], force: bool = False
) -> dict[str, Any]:
    """Replace the classes. A class that keys name (or the default class, while keys name
    none) may go only with ``force``: those keys are then served in the default class (the
    loosest when the default is gone too) until a class of their name comes back."""
    state = _state(request)
    specs = validated(SLO_CLASSES, body, "slo_classes")
    raw = {name: spec.model_dump() for name, spec in specs.items()}
    try:
        classes, args = slo_classes_write_args(raw)
    except ValueError as exc:
        raise APIError(422, str(exc), param="slo_classes", code="invalid_slo_class") from exc
    version, stranded = await _replace_classes(state, set(classes), args, force)
    state.directory.slo_classes, state.directory.slo_classes_version = classes, version
    reply: dict[str, Any] = {
        "version": version,
        "classes": {n: _class(c) for n, c in classes.items()},
    }
    if stranded:
        served_in = default_class(classes, state.settings.default_slo_class)
        reply["forced"] = {"keys": stranded, "served_in": served_in.name}
    return reply


async def _replace_classes(
    state: GatewayState, kept: set[str], args: list[str | bytes], force: bool
) -> tuple[int, dict[str, list[str]]]:
    """Write the classes unless keys name one it removes (and not ``force``), in a transaction
    that watches the keys: a key created meanwhile naming a removed class retries the check."""
    async with state.redis.pipeline(transaction=True) as pipe:
        for _ in range(MAX_WRITE_ATTEMPTS):
            try:
                await pipe.watch(API_KEYS_KEY)
                stranded = _stranded(await keys_by_class(pipe), kept, state)
                if stranded and not force:
                    listed = {name: ids[:20] for name, ids in stranded.items()}
                    message = (
                        f"API keys use SLO classes this removes: {listed}; delete or replace "
                        "those keys first, or PUT with ?force=true to serve them in the default "
                        "class"
                    )
                    raise APIError(409, message, param="slo_classes", code="slo_class_in_use")
                pipe.multi()
                queue_slo_classes_write(pipe, args)
                (version,) = await pipe.execute()
                return int(version), stranded
            except WatchError:
                continue
    message = f"API keys changed under {MAX_WRITE_ATTEMPTS} attempts to replace the classes"
    raise APIError(409, message, param="slo_classes", code="conflict")


def _stranded(
    by_class: dict[str | None, list[str]], kept: set[str], state: GatewayState
) -> dict[str, list[str]]:
    """The ids of the keys, by the class they name, that ``kept`` would leave without it
    (under the default class's name for keys that name none, when it is not kept)."""
    default = state.settings.default_slo_class
    stranded = {name: ids for name, ids in by_class.items() if name and name not in kept}
    if None in by_class and default not in kept:
        stranded.setdefault(default, []).extend(by_class[None])
    return {name: sorted(ids) for name, ids in stranded.items() if name is not None}


@router.get("/workers")
async def get_workers(request: Request) -> dict[str, Any]:
    state = _state(request)
    alive = {s.worker_id for s in state.directory.alive()}
    workers = []
    for status in state.directory.statuses.values():
        row = asdict(status)
        row["alive"] = status.worker_id in alive
        row["kv_usage_hbm"] = kv_usage(status.num_hbm_blocks, status.num_free_hbm_blocks)
        row["kv_usage_dram"] = kv_usage(status.num_dram_blocks, status.num_free_dram_blocks)
        row["predicted_lag_s"] = state.directory.predicted_lag_s(status)
        workers.append(row)
    return {"workers": workers, "control_plane_alive": state.directory.control_plane_alive}


@router.get("/requests/{request_id}")
async def get_request(request_id: str, request: Request) -> dict[str, Any]:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise APIError(404, "no record of that request (the id is too long)", code="not_found")
    raw = await _state(request).redis.hgetall(streams.request_lifecycle_key(request_id))
    if not raw:
        raise APIError(404, f"no record of request {request_id!r}", code="not_found")
    return {"request_id": request_id, "lifecycle": {_text(k): _value(v) for k, v in raw.items()}}


@router.post("/api-keys")
async def post_api_key(request: Request, body: Annotated[Any, Body()]) -> dict[str, Any]:
    state = _state(request)
    fields: ApiKeyBody = validated_model(ApiKeyBody, body, "api_key")
    tenant, slo_class, min_priority = fields.tenant, fields.slo_class, fields.min_priority
    try:
        key, info = await create_api_key(state.redis, tenant, slo_class, min_priority)
    except UnknownSloClassError as exc:
        raise APIError(422, str(exc), param="slo_class") from exc
    state.api_keys.clear()  # here at once; other gateways at their next refresh
    return {
        "api_key": key,
        "key_id": info.key_id,
        "tenant": tenant,
        "slo_class": slo_class,
        "min_priority": min_priority,
    }


@router.delete("/api-keys/{key_id}")
async def remove_api_key(key_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    if not is_key_id(key_id):
        message = "key_id must be a whole key id: the 16 hex digits given at its creation"
        raise APIError(422, message, param="key_id", code="invalid_key_id")
    if not await delete_api_key(state.redis, key_id):
        raise APIError(404, "no such API key", code="not_found")
    state.api_keys.clear()  # here at once; other gateways at their next refresh
    return {"deleted": key_id}


def _class(c: Any) -> dict[str, float]:
    return {"ttft_s": c.ttft_s, "tbt_s": c.tbt_s}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _value(value: bytes | str) -> str | float:
    text = _text(value)
    try:
        return float(text)
    except ValueError:
        return text
