"""The directory ``flwr run`` builds a Flower app bundle (FAB) from.

``flwr run`` walks and resolves every file under the directory it is given before it filters (flwr
1.41 ``collect_files``): a checkout with its ``.venv`` is some 50,000 files and 5-10 s per launch.
So an app is always submitted from a staged directory that holds only what the bundle carries:

* :func:`stage_packages`: a ``pyproject.toml`` and the *installed* packages' files, found by the
  import system (``importlib.util.find_spec``), so the same works from a wheel, a non-editable
  install and a checkout, and no package's ``__init__`` runs (``fedge.aggregation``'s imports
  torch, which the CLI would otherwise pay while Flower's processes start);
* :func:`stage_directory`: an app directory on disk (``pyproject.toml`` and the files its
  ``fab-include`` patterns name), e.g. a benchmark's standalone Flower app.

The code travels in the bundle, as Flower intends: the ServerApp and every ClientApp import the
same code, whatever version a device has installed.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterable
from importlib.resources.abc import Traversable
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10; flwr depends on tomli there
    import tomli as tomllib

__all__ = ["AppStagingError", "app_config", "stage_app", "stage_directory", "stage_module", "stage_packages"]

#: file types a Flower app bundle carries of a package (flwr's own FAB include patterns)
_BUNDLED_SUFFIXES = (".py", ".toml", ".json", ".md")


class AppStagingError(RuntimeError):
    """The app cannot be staged; the message says what is missing."""


def stage_packages(destination: Path, pyproject: str, packages: Iterable[str]) -> Path:
    """Write ``pyproject`` and copy each installed package (dotted name, e.g. ``fedge.server``) with
    its sub-packages to ``destination/<dotted/path>``; return ``destination``."""
    _fresh(destination)
    (destination / "pyproject.toml").write_text(pyproject, encoding="utf-8")
    for package in packages:
        try:  # its files, found without running its __init__ (which may import torch)
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError as err:
            raise AppStagingError(f"cannot stage {package}: {err}") from None
        if spec is None or not spec.submodule_search_locations:
            raise AppStagingError(f"cannot stage {package}: it is not an installed package")
        for root in spec.submodule_search_locations:
            _copy_tree(Path(root), destination.joinpath(*package.split(".")))
    return destination


def stage_directory(destination: Path, source: Path) -> Path:
    """Copy an app directory's ``pyproject.toml`` and the files its ``fab-include`` patterns name."""
    pyproject = source / "pyproject.toml"
    if not pyproject.is_file():
        raise AppStagingError(f"{source} is not a Flower app: it has no pyproject.toml")
    patterns = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"].get("fab-include")
    if not patterns:
        raise AppStagingError(f"{pyproject} has no [tool.flwr.app] fab-include patterns to stage the app with")
    _fresh(destination)
    shutil.copy2(pyproject, destination / "pyproject.toml")
    for pattern in patterns:
        for path in source.glob(pattern):
            if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
                target = destination / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    return destination


#: directories an app project may hold that never belong in its bundle (runs, environments, caches)
_SKIPPED_DIRS = {"runs", "__pycache__", ".venv", "venv", "node_modules", "build", "dist", "flwr-home"}


def app_config(source: Path) -> dict:
    """The ``[tool.flwr.app.config]`` table of an app project (the run settings it declares)."""
    pyproject = source / "pyproject.toml"
    if not pyproject.is_file():
        raise AppStagingError(f"{source} is not a Flower app: it has no pyproject.toml (make one with `fedge new`)")
    try:
        app = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["flwr"]["app"]
    except (KeyError, tomllib.TOMLDecodeError) as err:
        raise AppStagingError(f"{pyproject} has no valid [tool.flwr.app] table ({err})") from None
    return dict(app.get("config") or {})


def stage_app(destination: Path, source: Path) -> Path:
    """Copy an app project (``fedge new``): its ``pyproject.toml`` and the files a Flower app bundle
    carries (``.py``, ``.toml``, ``.json``, ``.md``), without run directories, environments or
    hidden directories, so that ``flwr run`` bundles only the app."""
    app_config(source)
    _fresh(destination)
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if any(part in _SKIPPED_DIRS or part.startswith(".") for part in relative.parts[:-1]):
            continue
        if path.is_file() and not path.is_symlink() and path.name.endswith(_BUNDLED_SUFFIXES):
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return destination


def stage_module(destination: Path, module: str) -> Path:
    """Copy a user's top-level module or package (a task's ``my_tasks.housing``: ``my_tasks``) into
    an app directory, so that every ServerApp and ClientApp process imports the same code."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        raise AppStagingError(f"cannot find module {module!r} to put in the app bundle (searched sys.path)")
    origin = Path(spec.origin)
    if {"site-packages", "dist-packages"} & set(origin.parts):
        return destination  # installed: every machine of the run installs it (or lacks it) itself
    if spec.submodule_search_locations:  # a package: the whole directory
        shutil.copytree(origin.parent, destination / module, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        shutil.copy2(origin, destination / origin.name)
    return destination


def _fresh(destination: Path) -> None:
    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir(parents=True)


def _copy_tree(source: Traversable, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.is_dir():
            if entry.name != "__pycache__":
                _copy_tree(entry, target / entry.name)
        elif entry.name.endswith(_BUNDLED_SUFFIXES):
            (target / entry.name).write_bytes(entry.read_bytes())
