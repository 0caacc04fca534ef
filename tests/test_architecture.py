"""The house rules, checked: every import of every package module against the arrows the README's
architecture section draws, so the layering cannot erode one convenient import at a time.

The README block (after the line "Import rules") lists ``unit -> allowed, units``; a unit is a layer
(``compression``) or a part of the coordinator (``server.engine``). A unit may always import itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("server", "edge_client", "aggregation", "compression", "deploy", "tasks", "protocol", "coordinator", "launcher", "privacy",
          "flower", "tracking")
#: third-party imports a pure or edge-side module must never make
FORBIDDEN = {
    "compression": {"flwr", "flwr_datasets"},
    "aggregation": {"flwr", "flwr_datasets"},
    "launcher": {"flwr", "torch"},
    "privacy": {"flwr", "flwr_datasets", "torch"},
    "tracking": {"flwr", "flwr_datasets", "torch"},
}


def _rules() -> dict[str, set[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"Import rules[^\n]*\n+```text\n(.*?)```", text, re.S)
    assert match, "README.md has no 'Import rules' block"
    rules: dict[str, set[str]] = {}
    for line in match.group(1).splitlines():
        if "->" not in line:
            continue
        unit, targets = (part.strip() for part in line.split("#")[0].split("->"))
        rules[unit] = {t.strip() for t in targets.split(",") if t.strip() and t.strip() != "nothing"}
    return rules


def _unit(parts: list[str]) -> str:
    """The coordinator's parts are units of their own: ``["server", "engine", "loop"]`` ->
    ``server.engine``, ``["server", "settings"]`` -> ``server.settings``; a layer is one unit."""
    if parts[0] == "server" and len(parts) > 1 and parts[1] != "__init__":
        return f"server.{parts[1]}"
    return parts[0]


def _imports() -> list[tuple[Path, str, list[str]]]:
    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    assert node.level == 0, f"{path}: relative import; use the fedge namespace"
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    found.append((path, name, list(path.relative_to(ROOT).with_suffix("").parts)))
    return found


def test_every_import_follows_the_arrows() -> None:
    rules = _rules()
    problems = []
    for path, name, parts in _imports():
        head = name.split(".")[0]
        if head in LAYERS:
            problems.append(f"{path.relative_to(ROOT)}: `{name}` is a bare top-level name; import fedge.{name}")
            continue
        if head != "fedge":
            continue
        source, target = _unit(parts), _unit(name.split(".")[1:])
        if target == source:
            continue
        allowed = rules.get(source)
        if allowed is None:
            problems.append(f"{path.relative_to(ROOT)}: unit {source} has no line in the README's import rules")
        elif target not in allowed:
            problems.append(f"{path.relative_to(ROOT)}: {source} -> {target} (`{name}`) is not an arrow of the README")
    assert not problems, "\n".join(problems)


def test_nothing_imports_the_cli_and_the_device_never_imports_the_coordinator() -> None:
    for path, name, parts in _imports():
        where = path.relative_to(ROOT)
        assert not (name.startswith("fedge.server.cli") and _unit(parts) != "server.cli"), f"{where} imports the CLI"
        assert not (parts[0] == "edge_client" and name.startswith("fedge.server")), f"{where} imports the coordinator"


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_pure_layers_stay_pure(layer: str) -> None:
    for path, name, parts in _imports():
        if parts[0] == layer:
            assert name.split(".")[0] not in FORBIDDEN[layer], f"{path.relative_to(ROOT)} imports {name}"


def _module_graph() -> dict[str, set[str]]:
    """Each package module's imports of other package modules, at module level (type-only imports
    included: a cycle of them is still two modules that cannot be read apart)."""
    paths = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            paths[".".join(["fedge", *parts[: -1 if parts[-1] == "__init__" else None]])] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree, found = ast.parse(path.read_text(encoding="utf-8")), set()
        blocks = [tree.body, *(node.body for node in tree.body if isinstance(node, (ast.If, ast.Try)))]
        for node in (node for block in blocks for node in block):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                found |= {node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[module] = {name for name in found if name in paths and name != module}
    return graph


def test_no_two_modules_import_each_other_even_through_others() -> None:
    graph, done, path = _module_graph(), set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("an import cycle: " + " -> ".join([*path[path.index(module):], module]))
        if module in done:
            return
        path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
