"""A passed preflight is remembered on the machine (``fedge.server.preflight``), so a second
``fedge demo`` of the same settings starts Flower's processes without importing torch first; a
refused one never is, and any change of setting, code or library is checked afresh."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedge.server import preflight as pf
from fedge.server.settings import RunSettings


@pytest.fixture()
def remembering(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FEDGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FEDGE_PREFLIGHT_CACHE", "on")
    return tmp_path / "preflight"


def _refusing(*_: object) -> None:
    raise AssertionError("the check ran")


def test_a_passed_preflight_is_remembered_and_a_changed_setting_is_checked_again(
        remembering: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = RunSettings(codec="qsgd:bits=4", run_dir="/somewhere/one")
    pf.preflight(settings, num_partitions=10)
    assert len(list(remembering.glob("preflight-*.json"))) == 1 and pf.passed_before(settings, 10)
    monkeypatch.setattr(pf, "_check", _refusing)
    pf.preflight(settings.replace(run_dir="/elsewhere"), num_partitions=10)  # the run directory is not the run
    for changed, count in ((settings.replace(codec="qsgd:bits=2"), 10), (settings, 9), (settings, None)):
        with pytest.raises(AssertionError, match="the check ran"):
            pf.preflight(changed, num_partitions=count)
        assert not pf.passed_before(changed, count)


def test_a_refused_setting_is_never_remembered(remembering: Path) -> None:
    for _ in range(2):
        with pytest.raises(ValueError, match="unknown server optimizer"):
            pf.preflight(RunSettings(server_opt="fedadm"), num_partitions=10)
    assert not list(remembering.glob("*.json"))


def test_a_change_to_fedges_code_or_a_library_is_another_key(remembering: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    settings = RunSettings()
    pf.preflight(settings, num_partitions=4)
    with monkeypatch.context() as edited:
        edited.setattr(pf, "_code_digest", lambda: "edited")
        assert not pf.passed_before(settings, 4)
    assert pf.passed_before(settings, 4)
    versions = pf._versions()
    monkeypatch.setattr(pf, "_versions", lambda: {**versions, "torch": "9.9.9"})
    assert not pf.passed_before(settings, 4)


def test_only_checks_that_depend_on_nothing_else_are_remembered(remembering: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin, a task that is user code, one that reads optional files, and the switch: checked every time."""
    for settings in (RunSettings(plugins="examples.plugins.geomedian"), RunSettings(task="fashion"),
                     RunSettings(task="tests.tasks.user_task:SineTask")):
        assert pf._verdict_path("preflight", settings, 4) is None, settings
    assert pf._verdict_path("preflight", RunSettings(task="synthetic:hidden=8"), 4) is not None
    monkeypatch.setenv("FEDGE_PREFLIGHT_CACHE", "off")
    assert pf._verdict_path("preflight", RunSettings(), 4) is None


def test_a_remembered_check_gives_its_warnings_again_and_a_damaged_record_is_checked_afresh(
        remembering: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def warns(settings: RunSettings, count: int | None) -> None:
        logging.getLogger("fedge.server.engine.algorithm").warning("codec %s is not contractive", settings.codec)

    monkeypatch.setattr(pf, "_check", warns)
    settings = RunSettings(codec="topk:ratio=0.01")
    with caplog.at_level(logging.WARNING, logger="fedge"):
        pf.preflight(settings, num_partitions=10)
        monkeypatch.setattr(pf, "_check", _refusing)
        pf.preflight(settings, num_partitions=10)
    said = [(r.name, r.getMessage()) for r in caplog.records]
    assert said == [("fedge.server.engine.algorithm", "codec topk:ratio=0.01 is not contractive")] * 2
    [record] = remembering.glob("preflight-*.json")
    record.write_text("{not json")
    with pytest.raises(AssertionError, match="the check ran"):
        pf.preflight(settings, num_partitions=10)
    record.write_text(json.dumps({"notes": [1], "warnings": []}))
    assert not pf.passed_before(settings, 10)


def test_the_advice_is_remembered_with_its_lines(remembering: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sparse = RunSettings(codec="dgc:ratio=0.01,sample=0.05+qsgd:bits=4", clients_per_round=10)
    [note] = pf.advise(sparse, 100)
    monkeypatch.setattr(pf, "_advice", _refusing)
    assert pf.advise(sparse, 100) == [note]


_PROBE = """
import sys, time
from fedge.launcher import sequence
def probe(self, *args, **kwargs):
    print("torch imported:", "torch" in sys.modules, flush=True)
    raise SystemExit(0)
sequence.FlowerLaunch.start_superlink = probe
from fedge.server.cli.main import main
main(["demo", "--export-bundle", "", "--clients", "4", "--rounds", "2", "--run-dir", sys.argv[1]])
"""


def test_a_second_demo_of_the_same_settings_imports_no_torch_before_the_superlink(tmp_path: Path) -> None:
    """The CLI's path to Flower's first process: the first run checks its settings (torch), a
    second one finds them checked and starts the SuperLink straight away."""
    env = {**os.environ, "FEDGE_CACHE_DIR": str(tmp_path / "cache"), "FEDGE_PREFLIGHT_CACHE": "on"}
    runs = [subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / f"run-{i}")], capture_output=True, text=True,
                           env=env, timeout=180, check=True).stdout for i in range(2)]
    said = [[line.split(":")[1].strip() for line in out.splitlines() if line.startswith("torch imported:")]
            for out in runs]
    assert said == [["True"], ["False"]], runs


def test_the_machine_keeps_a_bounded_number_of_remembered_checks(remembering: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pf, "KEEP", 3)
    monkeypatch.setattr(pf, "_check", lambda settings, count: None)
    for count in range(1, 6):
        pf.preflight(RunSettings(), num_partitions=count)
        time.sleep(0.02)  # the file system's clock ticks coarser than its nanoseconds
    assert len(list(remembering.glob("*.json"))) == 3
    assert [pf.passed_before(RunSettings(), c) for c in range(1, 6)] == [False, False, True, True, True]
