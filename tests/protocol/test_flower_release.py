"""The supported Flower releases: one list (``fedge.protocol.flower_release.SUPPORTED``) that the
pins, the compatibility run and the refusal all follow, and a clear error on any other release."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedge.protocol.flower_release import SUPPORTED, UNTESTED_ENV, UnsupportedFlowerError, check_flower, supported_range

ROOT = Path(__file__).resolve().parents[2]


def test_supported_releases_pass_and_others_are_refused_with_the_range(monkeypatch, caplog) -> None:
    assert supported_range() == ">=1.41,<1.43"
    for release in ("1.41.0", "1.42.0", "1.42.7"):
        assert check_flower(release) == release
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    for release in ("1.40.0", "1.43.0", "2.0.0"):
        with pytest.raises(UnsupportedFlowerError, match=re.escape(f"Flower {release} is not a release") + r".*>=1\.41,<1\.43"):
            check_flower(release)
    monkeypatch.setenv(UNTESTED_ENV, "1")  # trying the next release before it is added: a warning
    assert check_flower("1.43.0") == "1.43.0" and "not a release Fedge is tested with" in caplog.text


def test_the_pins_the_compatibility_run_and_the_docs_follow_the_one_list() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    pins = [d for deps in extras.values() for d in deps if re.match(r"flwr(\[|>|=|<)", d)]
    assert pins and all(p.endswith(supported_range()) for p in pins), pins
    constraints = (ROOT / "constraints.txt").read_text()
    (pinned,) = re.findall(r"^flwr==(\S+)$", constraints, flags=re.M)
    assert pinned.startswith(SUPPORTED[-1] + ".")  # `make test` runs on the newest supported release
    (releases,) = re.findall(r"^FLOWER_RELEASES \?= (.+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert [".".join(r.split(".")[:2]) for r in releases.split()] == list(SUPPORTED)
    for doc in ("README.md", "docs/flower.md"):
        assert f"flwr{supported_range()}" in (ROOT / doc).read_text(), doc


def test_fedge_flower_refuses_an_untested_release_on_import() -> None:
    """In a fresh interpreter whose Flower reports 1.43.0: importing fedge.flower fails at once with
    the range, before anything of Flower is read."""
    probe = ("import importlib.metadata as m; real = m.version; "
             "m.version = lambda name: '1.43.0' if name == 'flwr' else real(name); "
             "import fedge.flower")
    env = {k: v for k, v in os.environ.items() if k != UNTESTED_ENV}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "UnsupportedFlowerError: Flower 1.43.0 is not a release Fedge is tested with" in done.stderr, done.stderr[-800:]
