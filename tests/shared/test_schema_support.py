"""A JSON schema the grammar engine would compile and then not enforce is refused (a 400 naming
the keyword, never a 200 whose output breaks the schema); the keywords it does enforce pass.
Judged against xgrammar itself: for every keyword let through, a value that breaks it is not
accepted by the compiled grammar while a value that keeps it is."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.tools import _required_output
from shared.grammar import GrammarError, build_grammar
from shared.sampling import StructuredOutput
from shared.schema_support import unenforced_keyword

xgrammar = pytest.importorskip("xgrammar")
testing = pytest.importorskip("xgrammar.testing")

OBJ_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
ENFORCED: dict[str, tuple[dict[str, Any], str, str]] = {  # schema, a breaking, a keeping value
    "multipleOf": ({"type": "integer", "multipleOf": 5}, "7", "10"),
    "minProperties": ({"type": "object", "properties": OBJ_AB, "minProperties": 2},
                      '{"a": 1}', '{"a": 1, "b": 2}'),
    "maxProperties": ({"type": "object", "properties": OBJ_AB, "maxProperties": 1},
                      '{"a": 1, "b": 2}', '{"a": 1}'),
    "allOf of one": ({"allOf": [{"type": "integer", "minimum": 3}]}, "1", "4"),
    "minimum": ({"type": "integer", "minimum": 3}, "1", "4"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 3}, "3", "2.5"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]", "[1, 2]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}], "items": False},
                    "[1]", '["a"]'),
    "const": ({"const": "x"}, '"y"', '"x"'),
    "local $ref": ({"$defs": {"p": {"type": "integer"}}, "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]},
                   '{"a": "s"}', '{"a": 1}'),
    "format": ({"type": "string", "format": "date"}, '"hello"', '"2024-01-02"'),
    "minLength": ({"type": "string", "minLength": 3}, '"ab"', '"abc"'),
    "type list": ({"type": ["integer", "null"]}, '"s"', "null"),
}  # fmt: skip
UNENFORCED: dict[str, dict[str, Any]] = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}},
    "not": {"type": "integer", "not": {"const": 3}},
    "if": {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}},
    "dependentRequired": {"type": "object", "properties": OBJ_AB,
                          "dependentRequired": {"a": ["b"]}},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "allOf": {"allOf": [{"type": "object", "required": ["a"]}, {"type": "object",
                                                                "required": ["b"]}]},
    "anyOf": {"type": "object", "properties": OBJ_AB, "anyOf": [{"required": ["a"]}]},
    "maxLength": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
    "format": {"type": "string", "format": "email", "maxLength": 6},
    "enum": {"type": "integer", "enum": ["x", 1]},
    "required": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"],
                 "additionalProperties": False},
    "$ref": {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}},
}  # fmt: skip


def _grammar(schema: dict[str, Any]) -> Any:
    return build_grammar(StructuredOutput("json", json.dumps(schema)))


@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_keywords_let_through_are_enforced(name: str) -> None:
    schema, breaking, keeping = ENFORCED[name]
    assert unenforced_keyword(schema) is None
    grammar = _grammar(schema)
    assert not testing._is_grammar_accept_string(grammar, breaking)
    assert testing._is_grammar_accept_string(grammar, keeping)


@pytest.mark.parametrize("name", sorted(UNENFORCED))
def test_keywords_the_engine_would_skip_are_refused(name: str) -> None:
    nested = {"type": "object", "properties": {"inner": UNENFORCED[name]}}
    for schema, where in ((UNENFORCED[name], "schema"), (nested, "schema.properties.inner")):
        with pytest.raises(GrammarError, match=name.replace("$", r"\$")) as refused:
            _grammar(schema)
        assert where in str(refused.value)


def test_a_property_named_like_a_keyword_is_only_a_name() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "integer"}}, "required": ["not"]}
    assert unenforced_keyword(schema) is None
    assert testing._is_grammar_accept_string(_grammar(schema), '{"not": 1}')


def test_required_tool_calls_keep_each_tool_s_root_references() -> None:
    """tool_choice "required" wraps every tool's parameters in one array schema: a "#" or
    "#/properties/..." reference of a tool still means that tool's root (it meant the array:
    a valid tool refused, a recursive one filled with arrays of calls)."""
    pinned = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 6},
                             "b": {"$ref": "#/properties/a"}}}  # fmt: skip
    kids = {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}
    tree = {"type": "object", "additionalProperties": False, "required": ["label", "kids"],
            "properties": {"label": {"type": "string", "maxLength": 5}, "kids": kids}}  # fmt: skip
    output = _required_output({"f": {"parameters": pinned}, "g": {"parameters": tree}}, True)
    grammar = build_grammar(output)
    accepts = testing._is_grammar_accept_string
    assert accepts(grammar, '[{"name": "f", "parameters": {"a": 5, "b": 6}}]')
    assert not accepts(grammar, '[{"name": "f", "parameters": {"a": 5, "b": 9}}]')
    leaf = '{"label": "y", "kids": []}'
    assert accepts(grammar, f'[{{"name": "g", "parameters": {{"label": "x", "kids": [{leaf}]}}}}]')
    assert not accepts(grammar, '[{"name": "g", "parameters": {"label": "x", "kids": [[]]}}]')
