"""The admin API's bodies, validated by type before anything is done with them: a body or a
field of the wrong type (a list or an object where a string goes, a boolean where a number
goes, a lone surrogate in a text, a number out of range) is a 422 naming the field, never a
500. Numbers of SLO classes take the SLO knobs' range (shared/knobs.py KNOB_RANGES)."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from gateway.errors import APIError
from shared.knobs import KNOB_RANGES

MAX_TENANT_CHARS = 256
MAX_CLASS_NAME_CHARS = 64  # shared/slo.py's names: 1-64 of [A-Za-z0-9_.-]
_MAX_LOC_CHARS = 64
_LOW_S, _HIGH_S = KNOB_RANGES["slo_ttft_s"]

T = TypeVar("T")


def _encodable(text: str | None) -> str | None:
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError("text with a lone surrogate is not valid Unicode") from exc
    return text


class ApiKeyBody(BaseModel):
    """``POST /admin/v1/api-keys``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tenant: str = Field(min_length=1, max_length=MAX_TENANT_CHARS)
    slo_class: str | None = Field(default=None, max_length=MAX_CLASS_NAME_CHARS)
    min_priority: int = Field(default=0, ge=-(2**31), lt=2**31)

    _text = field_validator("tenant", "slo_class")(_encodable)


Seconds = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=_LOW_S, le=_HIGH_S)]


class SloClassBody(BaseModel):
    """One class of ``PUT /admin/v1/slo-classes``: its TTFT and TBT targets, in seconds."""

    model_config = ConfigDict(extra="forbid")

    ttft_s: Seconds
    tbt_s: Seconds


SLO_CLASSES = TypeAdapter(dict[str, SloClassBody])
KNOB_CHANGES = TypeAdapter(dict[str, Any])  # each knob's value is checked by shared/knobs.py


def validated(adapter: TypeAdapter[T], body: Any, param: str) -> T:
    """``body`` validated by ``adapter``; a 422 naming the first bad field otherwise."""
    try:
        return adapter.validate_python(body)
    except ValidationError as exc:
        raise _invalid(exc, param) from None


def validated_model(model: type[BaseModel], body: Any, param: str) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc, param) from None


def _invalid(exc: ValidationError, param: str) -> APIError:
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part)[:_MAX_LOC_CHARS] for part in first["loc"]) or param
    return APIError(422, f"{where}: {first['msg']}", param=where, code="invalid_body")
