"""`/admin/v1`: SLO knobs and classes (validated: a bad value is a 422 and nothing changes),
workers, one request's lifecycle, API keys (a tenant, an SLO class that is the key's ceiling, a
``min_priority``: the lowest priority value its requests may ask for, 0 by default). Every
route needs the admin bearer token."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request

from gateway.auth import check_admin, create_api_key, delete_api_key
from gateway.errors import APIError
from gateway.state import GatewayState
from shared import streams
from shared.knobs import knobs_to_mapping, read_knobs, write_knobs
from shared.policy import kv_usage
from shared.slo import read_slo_classes, write_slo_classes


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def _admin(request: Request) -> None:
    check_admin(request, _state(request).settings.admin_token)


router = APIRouter(prefix="/admin/v1", dependencies=[Depends(_admin)])


@router.get("/knobs")
async def get_knobs(request: Request) -> dict[str, Any]:
    knobs, version = await read_knobs(_state(request).redis)
    return {"version": version, "knobs": knobs_to_mapping(knobs)}


@router.put("/knobs")
async def put_knobs(request: Request, changes: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    state = _state(request)
    try:
        knobs, version = await write_knobs(state.redis, changes)
    except ValueError as exc:
        raise APIError(422, str(exc), param="knobs", code="invalid_knob") from exc
    state.directory.knobs, state.directory.knobs_version = knobs, version
    return {"version": version, "knobs": knobs_to_mapping(knobs)}


@router.get("/slo-classes")
async def get_slo_classes(request: Request) -> dict[str, Any]:
    classes, version = await read_slo_classes(_state(request).redis)
    return {"version": version, "classes": {n: _class(c) for n, c in classes.items()}}


@router.put("/slo-classes")
async def put_slo_classes(
    request: Request, body: Annotated[dict[str, Any], Body()]
) -> dict[str, Any]:
    state = _state(request)
    try:
        classes, version = await write_slo_classes(state.redis, body)
    except ValueError as exc:
        raise APIError(422, str(exc), param="slo_classes", code="invalid_slo_class") from exc
    state.directory.slo_classes, state.directory.slo_classes_version = classes, version
    return {"version": version, "classes": {n: _class(c) for n, c in classes.items()}}


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
    raw = await _state(request).redis.hgetall(streams.request_lifecycle_key(request_id))
    if not raw:
        raise APIError(404, f"no record of request {request_id!r}", code="not_found")
    return {"request_id": request_id, "lifecycle": {_text(k): _value(v) for k, v in raw.items()}}


@router.post("/api-keys")
async def post_api_key(request: Request, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    state = _state(request)
    tenant, slo_class = body.get("tenant"), body.get("slo_class")
    min_priority = body.get("min_priority", 0)
    if not isinstance(tenant, str) or not tenant:
        raise APIError(422, "tenant must be a non-empty string", param="tenant")
    if slo_class is not None and slo_class not in state.directory.slo_classes:
        raise APIError(422, f"unknown SLO class {slo_class!r}", param="slo_class")
    if type(min_priority) is not int or not -(2**31) <= min_priority < 2**31:
        raise APIError(422, "min_priority must be a 32-bit integer", param="min_priority")
    key, info = await create_api_key(state.redis, tenant, slo_class, min_priority)
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
