"""The layering, checked on the source (every import statement, function-level ones too):
services import ``shared`` and themselves only; ``shared`` imports nothing of ours; the offline
tools (``lab``) are imported only by the CLI, the benches and the tests; no import cycle among
our modules, at module level or through function-level (lazy) imports."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("gateway", "data_plane", "control_plane")
OURS = (*SERVICES, "shared", "lab", "superinfer", "bench", "tests")
LAB_USERS = ("lab", "superinfer", "bench", "tests")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in OURS:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(tree: ast.AST, top_level_only: bool) -> Iterator[str]:
    nodes = ast.iter_child_nodes(tree) if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _first_party(name: str) -> str | None:
    top = name.split(".")[0]
    return top if top in OURS else None


def test_services_import_shared_only_and_shared_imports_none_of_ours() -> None:
    wrong = []
    for name, path in _modules().items():
        owner = name.split(".")[0]
        if owner not in (*SERVICES, "shared"):
            continue
        for target in _imports(ast.parse(path.read_text()), top_level_only=False):
            top = _first_party(target)
            if top is not None and top not in (owner, "shared"):
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_only_the_cli_benches_and_tests_import_the_tools() -> None:
    wrong = []
    for name, path in _modules().items():
        if name.split(".")[0] in LAB_USERS:
            continue
        for target in _imports(ast.parse(path.read_text()), top_level_only=False):
            if _first_party(target) == "lab":
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _import_graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in _imports(ast.parse(path.read_text()), top_level_only=top_level_only):
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def test_no_import_cycles_at_module_level() -> None:
    graph = _import_graph(top_level_only=True)
    cycles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, cycles


def test_no_import_cycles_counting_lazy_imports() -> None:
    """Every import statement counts (in functions, under ``TYPE_CHECKING``): a lazy import
    that only hides a circle fails here; the shared types go in a module of their own."""
    graph = _import_graph(top_level_only=False)
    cycles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, cycles


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on long chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components


def test_the_engine_core_stands_without_torch() -> None:
    """The loop, its queues, the executor contract and the sampling parameters import no torch
    (the model runner, the sampler and the KV tensors do)."""
    import subprocess
    import sys

    code = "import sys, data_plane.engine.engine; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_services_reach_the_policies_through_one_door() -> None:
    """Services plan through ``shared.policy``'s registry (make_plan / plan_handles), never
    a policy module of their own choosing."""
    policies = {"shared.policy.lvf", "shared.policy.vllm", "shared.policy.joining"}
    wrong = []
    for name, path in _modules().items():
        if name.split(".")[0] not in SERVICES:
            continue
        for target in _imports(ast.parse(path.read_text()), top_level_only=False):
            if target in policies or any(target.startswith(p + ".") for p in policies):
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(sorted(set(wrong)))
