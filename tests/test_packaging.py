"""One package, installable anywhere: the wheel installs ``fedge`` and nothing generic, and the
installed wheel runs the demo and a local cluster from a directory full of a user's look-alike files.

The install test is the real thing a new user does: build the wheel, make a fresh virtual
environment, ``pip install 'fedge-….whl[platform]'`` (pinned by constraints.txt, so the CPU torch on
this machine), then run the ``fedge`` it installed from an empty directory holding ``server.py``,
``task.py``, ``tasks.py`` and ``compression.py`` files that abort if imported.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_architecture import LAYERS  # the one list of the product's folders

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
USER_FILES = ("server", "task", "tasks", "compression")
_QUIET = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def test_the_package_list_names_every_folder() -> None:
    """pyproject.toml lists packages explicitly (the folders map into ``fedge``): a new sub-package
    must be listed, or the wheel would lack it while the editable checkout still works."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"fedge." + ".".join(d.relative_to(ROOT).parts)
               for layer in LAYERS for d in [ROOT / layer, *(ROOT / layer).rglob("*")]
               if d.is_dir() and (d / "__init__.py").is_file()}
    assert set(tool["packages"]) == folders
    assert tool["package-dir"] == {f"fedge.{layer}": layer for layer in LAYERS}


def source_tree(where: Path) -> Path:
    """A copy of what the wheel is built from (the working tree, not HEAD): building in place would
    leave setuptools' build/ and egg-info directories in the checkout."""
    import shutil

    tree = where / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        tree.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, tree / layer, ignore=ignore)
    return tree


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source_tree(out))],
                   check=True, timeout=300, env={**os.environ, **_QUIET})
    (path,) = out.glob("fedge-*.whl")
    return path


def test_the_wheel_installs_fedge_and_nothing_generic(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"fedge", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert "fedge/__init__.py" not in names  # a namespace: no code of its own
    for module in ("fedge/server/app.py", "fedge/server/engine/loop.py", "fedge/edge_client/app.py",
                   "fedge/launcher/sequence.py", "fedge/server/daemon/fedge.example.toml",
                   "fedge/server/cli/templates/regression/task.py", "fedge/server/cli/templates/classification/pyproject.toml"):
        assert module in names


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding the built wheel with its platform extra (made once)."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"),
                    f"{wheel}[platform]"], check=True, timeout=900, env={**os.environ, **_QUIET})
    return venv


def _user_directory(tmp_path: Path, venv: Path) -> tuple[Path, dict[str, str]]:
    """A directory of user files that abort if imported, and an environment whose PATH is the venv's."""
    user = tmp_path / "my-app"
    user.mkdir()
    for name in USER_FILES:
        (user / f"{name}.py").write_text(f'raise SystemExit("the user\'s {name}.py was imported")\n')
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return user, env


def _fedge(venv: Path, user: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run([str(venv / "bin" / "fedge"), *args], cwd=user, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"fedge {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def readme_commands(readme: str) -> list[str]:
    """The commands of a README's ``bash`` blocks, one per line, without their comments."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def _trains(venv: Path, user: Path, env: dict[str, str], *args: str) -> None:
    out = _fedge(venv, user, env, *args, "--run-dir", str(user / args[0]))
    assert "held-out accuracy" in out
    summary = json.loads((user / args[0] / "summary.json").read_text())
    assert summary["rounds"] == int(args[-1]) and summary["final_accuracy"] > 0.5, summary


# The deployment engine from the wheel (a SuperLink and two SuperNodes) under `make test-slow` (time
# budget); the default suite runs it from the editable install (tests/integration/test_deployment_engine.py).
@pytest.mark.integration
@pytest.mark.slow
def test_the_installed_wheel_runs_a_local_cluster(installed: Path, tmp_path: Path) -> None:
    user, env = _user_directory(tmp_path, installed)
    _trains(installed, user, env, "local-cluster", "--supernodes", "2", "--rounds", "2")
    logs = "".join(p.read_text(errors="replace") for p in user.rglob("*.log"))
    assert "was imported" not in logs


@pytest.fixture(params=["editable", pytest.param("wheel", marks=pytest.mark.slow)])
def fedge_install(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """Where ``fedge`` comes from: the checkout's own environment (the default suite: the same
    commands, without building and installing a wheel, 85 s) or the built wheel in a fresh
    environment (``make test-slow``, and ``clean-clone-check wheel`` before a release)."""
    if request.param == "wheel":
        return "wheel", request.getfixturevalue("installed")
    return "editable", Path(sys.prefix)


@pytest.mark.integration
@pytest.mark.xdist_group("flwr-default-federation")  # `flwr run .` uses Flower's fixed local ports
@pytest.mark.timeout(900)
def test_the_installed_wheel_runs_anywhere(fedge_install: tuple[str, Path], tmp_path: Path) -> None:
    kind, venv = fedge_install
    user, env = _user_directory(tmp_path, venv)

    def fedge(*args: str) -> str:
        return _fedge(venv, user, env, *args)

    # a new user's project: `fedge new myapp && cd myapp`, then each command of its README exactly
    # as written (Flower's own `flwr run .` on its default local federation, Fedge's demo, a cluster),
    # beside user files with generic names that abort if anything of Fedge's imports them (the app
    # directory is first on every process's path; its own task.py is the one module that is its)
    fedge("new", "myapp")
    app = user / "myapp"
    for name in USER_FILES:
        if not (app / f"{name}.py").exists():
            (app / f"{name}.py").write_text(f'raise SystemExit("the user\'s {name}.py was imported")\n')
    home = tmp_path / "flwr-home"
    from fedge.launcher.environment import flower_environment
    from tests.flower_home import run_flwr, stop_flower_home

    commands = readme_commands((app / "README.md").read_text())
    assert [c.split()[:2] for c in commands] == [["flwr", "run"], ["fedge", "demo"], ["fedge", "local-cluster"]]
    app_env = {**flower_environment(home, env), "PATH": env["PATH"]}  # the wheel's flwr and fedge
    try:
        for command in commands + ["flwr list"]:  # and the README's way to find the run
            done = run_flwr(["bash", "-c", command], cwd=app, env=app_env, home=home, timeout=900)
            assert done.returncode == 0, f"{command}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    finally:
        stop_flower_home(home)  # flwr leaves its SuperLink running on Flower's fixed ports
    (summary_path,) = app.glob("runs/run-*/summary.json")  # where the README says `flwr run .` writes
    trained = json.loads(summary_path.read_text())
    assert trained["final_accuracy"] > 0.6, trained  # wine, 3 classes, 2 devices
    (demo,) = app.glob("runs/demo-*")
    assert json.loads((demo / "summary.json").read_text())["final_accuracy"] > 0.6
    # `fedge demo --app .` exported a signed bundle that a device verifies with the key beside it
    verified = subprocess.run([str(venv / "bin" / "fedge-edge"), "verify", str(demo / "bundle"), "--trusted-key",
                               str(demo / "keys" / "signing-key.pub.pem"),
                               "--state", str(tmp_path / "device-state.json")],  # this device's own anti-rollback record
                              cwd=app, env=env, capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]
    (cluster,) = app.glob("runs/cluster-*")
    assert json.loads((cluster / "summary.json").read_text())["rounds"] == 3
    assert "was imported" not in "".join(p.read_text(errors="replace") for p in app.rglob("*.log"))
    # no user file was imported (each would have aborted its process), and the fedge that ran is the wheel's
    logs = "".join(p.read_text(errors="replace") for p in user.rglob("*.log"))
    assert "was imported" not in logs
    # a user's program in that directory (its cwd first on sys.path) imports every layer of fedge
    layers = "; ".join(f"import fedge.{layer}" for layer in LAYERS)
    done = subprocess.run([str(venv / "bin" / "python"), "-c", f"{layers}; import fedge.server.app, fedge.edge_client.app"],
                          cwd=user, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    probe = ("import importlib.util, json, fedge.server.app as app; "
             f"print(json.dumps([importlib.util.find_spec(n) is None for n in {list(LAYERS)!r}] + [app.__file__]))")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    *missing, location = json.loads(done.stdout)
    assert all(missing), f"a generic top-level name is importable: {dict(zip(LAYERS, missing))}"
    assert location.startswith(str(venv) if kind == "wheel" else str(ROOT))


def test_installing_fedge_beside_the_current_flower_keeps_that_flower(tmp_path: Path) -> None:
    """An app environment that already has a supported Flower (this one: 1.42.0 as constraints.txt
    pins it, or the release `make flower-compat` installed) gets Fedge and nothing else: pip resolves every requirement against what is
    installed, offline, and would have to replace Flower if the pin excluded it."""
    from importlib.metadata import version

    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--quiet", "--report", str(report), f"{ROOT}[platform]"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    would_install = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert set(would_install) == {"fedge"}, would_install
    from fedge.protocol.flower_release import SUPPORTED

    assert ".".join(version("flwr").split(".")[:2]) in SUPPORTED  # `make test`: 1.42; `make flower-compat`: each
