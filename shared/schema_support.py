"""The JSON-schema keywords the grammar engine (xgrammar) enforces, and a check that refuses a
schema relying on one it would silently skip: a 400 naming the keyword instead of a 200 whose
output breaks the schema (xgrammar 0.2 compiles ``uniqueItems``, ``not``, ``if``, a second
``allOf`` branch, ``anyOf`` beside ``type``, a length beside ``pattern`` or ``format``... and
then ignores them; measured per keyword, docs/coming-from-vllm.md)."""

from __future__ import annotations

from typing import Any

# Compiled, then ignored (or, patternProperties, enforced wrongly): refused anywhere.
UNENFORCED_KEYWORDS = frozenset(
    {
        "contains", "minContains", "maxContains", "not", "if", "then", "else",
        "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
        "unevaluatedItems", "patternProperties", "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip
_BRANCHES = ("anyOf", "oneOf")
_VALIDATION = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minProperties", "maxProperties", "propertyNames",
    }
)  # fmt: skip
_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "array": (list,),
    "object": (dict,),
}


def unenforced_keyword(schema: Any, where: str = "schema") -> str | None:
    """Why ``schema`` cannot be enforced as written (the first reason, with its place), or
    None."""
    if not isinstance(schema, dict):
        return None
    problem = _node_problem(schema, where)
    if problem is not None:
        return problem
    for key, child in _subschemas(schema):
        problem = unenforced_keyword(child, f"{where}.{key}")
        if problem is not None:
            return problem
    return None


def _node_problem(node: dict[str, Any], where: str) -> str | None:
    for key in sorted(UNENFORCED_KEYWORDS & set(node)):
        return f"{where}: the keyword {key!r} is not enforced by this server's grammar engine"
    if node.get("uniqueItems") is True:
        return f"{where}: 'uniqueItems' is not enforced by this server's grammar engine"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return f"{where}: 'allOf' of more than one schema is not enforced; merge them into one"
    branches = [key for key in _BRANCHES if key in node]
    siblings = sorted(_VALIDATION & set(node))
    if branches and siblings:
        return (
            f"{where}: {branches[0]!r} beside {siblings[0]!r} is not enforced (the grammar "
            f"engine keeps only the branches); repeat {siblings[0]!r} inside each branch"
        )
    lengths = sorted({"minLength", "maxLength"} & set(node))
    for rule in ("pattern", "format"):
        if rule in node and lengths:
            return f"{where}: {lengths[0]!r} beside {rule!r} is not enforced; use a pattern"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{where}: '$ref' {ref[:80]!r} is not local (only '#...' references are served)"
    return _type_problem(node, where)


def _type_problem(node: dict[str, Any], where: str) -> str | None:
    """``enum`` values outside ``type`` (the engine emits them anyway), and, with no other
    properties allowed, a ``required`` name that ``properties`` lacks (nothing can match)."""
    types = node.get("type")
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    allowed = tuple(t for name in names for t in _JSON_TYPES.get(name, ()))
    if allowed and isinstance(node.get("enum"), list):
        for value in node["enum"]:
            is_bool = isinstance(value, bool)
            if not isinstance(value, allowed) or (is_bool and "boolean" not in names):
                return f"{where}: enum value {value!r:.40} is not of type {types}"
    given_properties, given_required = node.get("properties"), node.get("required")
    properties: dict[str, Any] = given_properties if isinstance(given_properties, dict) else {}
    required: list[Any] = given_required if isinstance(given_required, list) else []
    if node.get("additionalProperties") is False:
        missing = [name for name in required if name not in properties]
        if missing:
            return f"{where}: required {missing[0]!r:.60} is not among its properties"
    return None


def _subschemas(node: dict[str, Any]) -> list[tuple[str, Any]]:
    """The schemas inside ``node``, each with its place (data such as enum values is not)."""
    found: list[tuple[str, Any]] = []
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            found += [(f"{key}.{name}", child) for name, child in node[key].items()]
    for key in ("items", "additionalProperties", "propertyNames"):
        if isinstance(node.get(key), dict):
            found.append((key, node[key]))
    for key in ("prefixItems", "anyOf", "oneOf", "allOf", "items"):
        if isinstance(node.get(key), list):
            found += [(f"{key}.{index}", child) for index, child in enumerate(node[key])]
    return found
