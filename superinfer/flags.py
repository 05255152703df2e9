"""Command-line flags generated from a service's settings model, so that a setting is declared
once (its pydantic-settings field, also read from ``SUPERINFER_*``) and every command that
takes it as a flag agrees on its name and type."""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Callable, Iterable
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

_SCALARS = (bool, int, float, str)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (``--knobs '{"policy": "lvf"}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is needed")
    return value


def json_list(text: str) -> list[Any]:
    """A flag's JSON list (``--allowed-origins '["https://app.example"]'``, as vLLM's)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("a JSON list is needed")
    return value


def _with_words(kind: type, words: tuple[str, ...]) -> Callable[[str], Any]:
    """``kind`` or one of ``words`` (``auto``), passed on as text for the settings to read."""

    def convert(text: str) -> Any:
        return text if text.strip().lower() in words else kind(text)

    convert.__name__ = kind.__name__  # argparse names the type in its error
    return convert


def scalar_type(annotation: Any) -> type | None:
    """``int`` for ``int`` or ``int | None``; ``str`` for a ``Literal`` of strings (or one or
    None); None for anything else."""
    if annotation in _SCALARS:
        return annotation
    if get_origin(annotation) is Literal and all(isinstance(a, str) for a in get_args(annotation)):
        return str
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        if len(kinds) == 1:
            return scalar_type(kinds[0])
    return None


def _literal_choices(annotation: Any) -> list[str] | None:
    for arg in (annotation, *get_args(annotation)):
        if get_origin(arg) is Literal:
            return list(get_args(arg))
    return None


def flag_kwargs(field: FieldInfo) -> dict[str, Any] | None:
    """``argparse.add_argument``'s keywords for a settings field: scalars (a ``Literal`` as
    choices; an int that also takes the words in its ``json_schema_extra["flag_words"]``, as
    B_xfer's ``auto``), switches, JSON objects for dict fields and JSON lists for list fields;
    None for none of these."""
    annotation = field.annotation
    kind = scalar_type(annotation)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if kind is not None:
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        words = tuple(str(w) for w in extra.get("flag_words", ()))  # type: ignore[union-attr]
        if words:
            return {
                "type": _with_words(kind, words),
                "metavar": f"{{{kind.__name__},{','.join(words)}}}",
            }
        return {"type": kind, "choices": _literal_choices(annotation)}
    kinds = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    if len(kinds) == 1 and (kinds[0] is dict or get_origin(kinds[0]) is dict):
        return {"type": _json_object, "metavar": "JSON"}
    if annotation is list or get_origin(annotation) is list:
        return {"type": json_list, "metavar": "JSON"}
    return None


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings_cls: type[BaseSettings],
    names: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> list[str]:
    """A flag per field of ``settings_cls`` (:func:`flag_kwargs`; only ``names`` when given,
    never ``exclude``: secrets stay out of command lines, which ``ps`` shows), default None
    (unset: the environment or the field's default decides). Returns the field names added."""
    wanted = None if names is None else set(names)
    skipped = set(exclude)
    added = []
    for name, field in settings_cls.model_fields.items():
        kwargs = flag_kwargs(field)
        if kwargs is None or name in skipped or (wanted is not None and name not in wanted):
            continue
        parser.add_argument(flag_name(name), default=None, **kwargs)
        added.append(name)
    missing = (wanted or set()) - set(added)
    if missing:
        raise ValueError(f"{settings_cls.__name__} has no such field(s) {sorted(missing)}")
    return added
