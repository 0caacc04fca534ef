"""Every name a benchmark takes from Fedge exists, checked in seconds for all of them.

``bench/aggregation.py`` once called ``StreamingMean.add_payload`` after the method had been renamed,
and nothing noticed. The engine benchmarks' smoke runs (``tests/test_bench_smoke.py``, ``HEAVY``) take
half a minute to three minutes each, too long for the default suite on two cores; this test reads
every ``bench/*.py`` instead and resolves what it uses of Fedge: each ``from fedge... import name``,
each attribute read off an imported Fedge module or class (``RunSettings.from_run_config``), and each
method called on a local variable bound to an imported class (``mean = StreamingMean(...);
mean.add_payload(...)``: the rename above). Each benchmark's ``--help`` is parsed too (its imports
and its argument parser run). What it cannot see (an instance attribute set in ``__init__``, a
keyword argument) the smoke runs in ``make test-slow`` still catch.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.name for p in (ROOT / "bench").glob("*.py"))


def _instance_attributes(cls: type) -> set[str]:
    """Names an instance of ``cls`` has from its class, its dataclass fields, ``__slots__`` and the
    ``self.x = ...`` assignments of its methods (read from the source, as a reader would)."""
    names = set(dir(cls)) | set(getattr(cls, "__dataclass_fields__", {}))
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__slots__", ()))
        try:
            source = ast.parse(Path(getattr(sys.modules[klass.__module__], "__file__", None) or "").read_text())
        except (KeyError, OSError, SyntaxError, TypeError, IsADirectoryError):
            continue
        for node in ast.walk(source):
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                for inner in ast.walk(node):
                    targets = inner.targets if isinstance(inner, ast.Assign) else (
                        [inner.target] if isinstance(inner, (ast.AnnAssign, ast.AugAssign)) else [])
                    for target in targets:
                        for leaf in ast.walk(target):
                            if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                                    and leaf.value.id == "self"):
                                names.add(leaf.attr)
    return names


def unresolved(path: Path) -> list[str]:
    """What ``path`` uses of Fedge that does not exist: ``"line N: name"`` each."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, object] = {}  # local name -> the Fedge module or object it was imported as
    missing: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fedge":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name == "*":
                    continue
                if not hasattr(module, alias.name):
                    try:
                        value: object = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"line {node.lineno}: {node.module}.{alias.name}")
                        continue
                else:
                    value = getattr(module, alias.name)
                bound[alias.asname or alias.name] = value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fedge":
                    try:
                        bound[alias.asname or alias.name] = importlib.import_module(alias.name)
                    except ImportError:
                        missing.append(f"line {node.lineno}: {alias.name}")
    # variables bound to an instance of an imported Fedge class: name = Class(...)
    instances: dict[str, type] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                and isinstance(bound.get(node.value.func.id), type)):
            instances[node.targets[0].id] = bound[node.value.func.id]  # type: ignore[assignment]
    attributes: dict[type, set[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        name = node.value.id
        if name in instances:
            cls = instances[name]
            known = attributes.setdefault(cls, _instance_attributes(cls))
            if node.attr not in known:
                missing.append(f"line {node.lineno}: {name}.{node.attr} ({cls.__name__} has no {node.attr!r})")
        elif name in bound and not hasattr(bound[name], node.attr):
            target = bound[name]
            if isinstance(target, type) and node.attr in _instance_attributes(target):
                continue
            missing.append(f"line {node.lineno}: {name}.{node.attr}")
    return missing


@pytest.mark.parametrize("name", BENCHES)
def test_every_name_a_benchmark_takes_from_fedge_exists(name: str) -> None:
    missing = unresolved(ROOT / "bench" / name)
    assert not missing, f"bench/{name} uses what Fedge does not have:\n" + "\n".join(missing)


def test_the_check_finds_a_renamed_method(tmp_path: Path) -> None:
    """The rename that went unnoticed, written as the benchmark had it: found."""
    bench = tmp_path / "old_aggregation.py"
    bench.write_text("from fedge.aggregation.streaming_mean import StreamingMean\n"
                     "mean = StreamingMean(10)\nmean.add_payload(b'')\nmean.add(None)\n")
    assert unresolved(bench) == ["line 3: mean.add_payload (StreamingMean has no 'add_payload')"]


def test_every_heavy_benchmark_parses_its_help() -> None:
    """One process for the benchmarks whose smoke runs are in ``make test-slow`` only (the others run
    in the default suite): each module imported and its parser built (its ``main`` with ``--help``,
    which exits 0 before any work)."""
    from tests.test_bench_smoke import HEAVY

    script = (
        "import runpy, sys\n"
        "sys.path.insert(0, 'bench')  # as when run as a script: its own directory first\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    sys.argv = [name, '--help']\n"
        "    try:\n"
        "        runpy.run_path(name, run_name='__main__')\n"
        "    except SystemExit as done:\n"
        "        if done.code not in (0, None):\n"
        "            failed.append(f'{name}: exit {done.code}')\n"
        "    except Exception as err:\n"
        "        failed.append(f'{name}: {type(err).__name__}: {err}')\n"
        "    else:\n"
        "        failed.append(f'{name}: ran without exiting on --help')\n"
        "print('FAILED', failed) if failed else print('ok')\n"
        "sys.exit(1 if failed else 0)\n"
    )
    benches = [f"bench/{name}" for name in sorted(HEAVY)]
    done = subprocess.run([sys.executable, "-c", script, *benches], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
