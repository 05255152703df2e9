"""One definition each of the policy math in the product (shared/policy/__init__.py names
them), found by AST over every product package: a second VLT, blk(r), growth or packing
fails here. The one-request-at-a-time references live in tests/shared/policy_reference.py,
outside the product.

A definition is a function (a method or nested function too; ``@overload`` stubs aside)
whose name says the concept; private helpers in the canonical module are part of it. VLT is
also found by its formula: a product of ``beta_b`` or ``beta_f`` (the tolerance of §3).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("gateway", "control_plane", "data_plane", "shared", "superinfer", "lab")


class Concept(NamedTuple):
    module: str  # the canonical definition's file, relative to the repository root
    name: str
    pattern: re.Pattern[str]  # function names that define this concept


CONCEPTS = {
    "VLT": Concept("shared/policy/vlt.py", "vlt_array", re.compile(r"vlt|virtual_lag")),
    "blk(r)": Concept(
        "shared/policy/joining.py",
        "candidate_blocks",
        re.compile(r"(^|_)blk(_|$)|demand_blocks|candidate_blocks"),
    ),
    "growth": Concept("shared/policy/joining.py", "running_growth", re.compile(r"growth")),
    "packing": Concept("shared/policy/packing.py", "pack_columns", re.compile(r"pack")),
}
# Names that match a pattern but define something else, with why.
NOT_COPIES = {
    ("shared/policy/joining.py", "join_and_pack"): "chooses who joins, then calls pack_columns",
}
NOT_COPY_DIRS = {"packing": ("shared/protocol/",)}  # wire encoding: packing bytes, not a batch
_TOLERANCES = frozenset({"beta_b", "beta_f"})


def product_sources() -> dict[str, str]:
    sources: dict[str, str] = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            sources[path.relative_to(ROOT).as_posix()] = path.read_text()
    return sources


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_overload(node):
            yield node


def _is_overload(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    names = {
        d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", None)
        for d in node.decorator_list
    }
    return "overload" in names


def _uses_vlt_formula(node: ast.AST) -> bool:
    """A product with ``beta_b``/``beta_f`` (a name or an attribute) as one operand."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mult):
            for operand in (sub.left, sub.right):
                name = operand.attr if isinstance(operand, ast.Attribute) else None
                name = operand.id if isinstance(operand, ast.Name) else name
                if name in _TOLERANCES:
                    return True
    return False


def definitions(sources: Mapping[str, str]) -> dict[str, set[tuple[str, str]]]:
    """Per concept, the (file, function name) pairs that define it."""
    found: dict[str, set[tuple[str, str]]] = {concept: set() for concept in CONCEPTS}
    for path, source in sources.items():
        for node in _functions(ast.parse(source, path)):
            for concept, (module, _, pattern) in CONCEPTS.items():
                by_name = pattern.search(node.name) is not None
                by_formula = concept == "VLT" and _uses_vlt_formula(node)
                if not (by_name or by_formula) or (path, node.name) in NOT_COPIES:
                    continue
                if path == module and node.name.startswith("_"):
                    continue  # a helper of the canonical definition
                if any(path.startswith(d) for d in NOT_COPY_DIRS.get(concept, ())):
                    continue
                found[concept].add((path, node.name))
    return found


def test_the_product_defines_each_piece_of_policy_math_once() -> None:
    found = definitions(product_sources())
    for concept, (module, name, _) in CONCEPTS.items():
        assert found[concept] == {(module, name)}, f"{concept}: {sorted(found[concept])}"


def test_a_second_copy_is_found() -> None:
    sources = product_sources()
    copies = {
        "lab/sim/fake.py": "def vlt_scores(views, t, knobs):\n    return []\n",
        "data_plane/fake.py": "def lag(v, k):\n    return max(0.0, v.t - k.beta_f * v.slo)\n",
        "control_plane/fake.py": "class P:\n    def demand_blocks(self, v):\n        return 0\n",
        "shared/policy/fake.py": "def growth_blocks(v):\n    return 0\n",
        "gateway/fake.py": "def _pack_schedule(views):\n    return []\n",
    }
    found = definitions({**sources, **copies})
    assert ("lab/sim/fake.py", "vlt_scores") in found["VLT"]
    assert ("data_plane/fake.py", "lag") in found["VLT"]  # by its formula
    assert ("control_plane/fake.py", "demand_blocks") in found["blk(r)"]
    assert ("shared/policy/fake.py", "growth_blocks") in found["growth"]
    assert ("gateway/fake.py", "_pack_schedule") in found["packing"]
