"""The warm child's Flower runtime installs each FAB once per node (``install_once``), with
Flower's own ``install_from_fab`` and a real FAB built by Flower from an app on disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.cli.install import install_from_fab

from fedge.edge_client.warm_executor import INSTALLED_NOTES, install_once

ECHO_APP = Path(__file__).resolve().parents[2] / "bench" / "flower_echo"


@pytest.fixture
def fab(tmp_path: Path) -> bytes:
    app = tmp_path / "app"
    shutil.copytree(ECHO_APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    return build_fab_from_disk(app)


def test_a_fab_is_extracted_and_checked_by_flower_once_then_its_directory_is_reused(fab, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    calls: list[int] = []

    def flower(fab_file, install_dir=None, skip_prompt=False):  # Flower's own, counted
        calls.append(len(fab_file))
        return install_from_fab(fab_file, install_dir, skip_prompt)

    install = install_once(flower)
    first = install(fab, skip_prompt=True)
    assert first.is_dir() and (first / "pyproject.toml").is_file() and calls == [len(fab)]
    assert install(fab, skip_prompt=True) == first and len(calls) == 1  # the next message: no extraction
    assert len(list((tmp_path / "home" / INSTALLED_NOTES).iterdir())) == 1
    # the directory gone (an operator cleaned the home): Flower installs it again, checks included
    shutil.rmtree(first)
    assert install(fab, skip_prompt=True) == first and first.is_dir() and len(calls) == 2
    # other bytes are another FAB: Flower checks them, and refuses a corrupt one as it always does
    with pytest.raises(Exception):
        install(fab[:-10] + b"\0" * 10, skip_prompt=True)
    assert len(calls) == 3
    # calls a warm child never makes pass through unchanged
    assert install(fab, tmp_path / "elsewhere", True).parent.parent == tmp_path / "elsewhere" and len(calls) == 4


def test_without_a_flower_home_every_call_is_flowers(fab, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FLWR_HOME", raising=False)
    calls: list[bool] = []
    install = install_once(lambda fab_file, install_dir=None, skip_prompt=False: calls.append(True) or tmp_path)
    install(fab, skip_prompt=True)
    install(fab, skip_prompt=True)
    assert calls == [True, True]
