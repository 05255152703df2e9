"""Command-line flags generated from a service's settings model, so that a setting is declared
once (its pydantic-settings field, also read from ``SUPERINFER_*``) and every command that
takes it as a flag agrees on its name and type."""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable
from typing import Any, Union, get_args, get_origin

from pydantic_settings import BaseSettings

_SCALARS = (bool, int, float, str)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def scalar_type(annotation: Any) -> type | None:
    """``int`` for ``int`` or ``int | None``; None for anything a flag cannot carry."""
    if annotation in _SCALARS:
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        if len(kinds) == 1 and kinds[0] in _SCALARS:
            return kinds[0]
    return None


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings_cls: type[BaseSettings],
    names: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> list[str]:
    """A flag per scalar field of ``settings_cls`` (only ``names`` when given, never
    ``exclude``: secrets stay out of command lines, which ``ps`` shows), default None (unset:
    the environment or the field's default decides). Returns the field names added."""
    wanted = None if names is None else set(names)
    skipped = set(exclude)
    added = []
    for name, field in settings_cls.model_fields.items():
        kind = scalar_type(field.annotation)
        if kind is None or name in skipped or (wanted is not None and name not in wanted):
            continue
        if kind is bool:
            parser.add_argument(
                flag_name(name), action=argparse.BooleanOptionalAction, default=None
            )
        else:
            parser.add_argument(flag_name(name), type=kind, default=None)
        added.append(name)
    missing = (wanted or set()) - set(added)
    if missing:
        raise ValueError(f"{settings_cls.__name__} has no scalar field(s) {sorted(missing)}")
    return added
