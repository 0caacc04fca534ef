"""Watching a real run, the two ways a person does: ``fedge demo --live --tracking ...`` on Flower's
simulation engine (one run serves both checks).

- The live page in a real headless browser (the distribution's ``chromium-headless-shell``) while
  the rounds go on: what it shows (the round, the held-out accuracy, the bytes, the devices) is
  what ``metrics.jsonl`` and ``devices.json`` held at that round. A screenshot is saved.
- Both tracking sinks read back with their own readers (TensorBoard's event reader, MLflow's
  client on the run's SQLite store): every round's every figure is the row's, and the final files
  are MLflow artifacts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: the browsers this test drives, the distribution's first (``make test`` installs it where it can)
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
PACKAGE = "chromium-headless-shell"


def _browser() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        message = f"no headless Chromium here: install the distribution's {PACKAGE} (apt-get install {PACKAGE})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def _browse(browser: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The page as Chromium renders it after its first fetches (virtual time: no waiting for real seconds)."""
    return subprocess.run([browser, "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                           "--window-size=1280,1500", *args, url], capture_output=True, text=True, timeout=120)


def _text(dom: str, element: str) -> str:
    match = re.search(rf'id="{element}">([^<]*)<', dom)
    assert match, f"the page has no #{element}:\n{dom[:3000]}"
    return match.group(1)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fmt_bytes(b: float) -> str:  # the page's own formatting (page.html fmtBytes)
    return (f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.1f} kB" if b >= 1e3
            else f"{b:g} B")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_live_page_in_a_browser_and_both_tracking_sinks_show_the_run(tmp_path: Path) -> None:
    browser = _browser()
    run_dir = tmp_path / "run"
    demo = subprocess.Popen([str(Path(sys.executable).parent / "fedge"), "demo", "--rounds", "8", "--clients", "3",
                             "--clients-per-round", "3", "--local-epochs", "3", "--run-dir", str(run_dir), "--live",
                             "--tracking", f"tensorboard:{tmp_path / 'tb'};mlflow:{(tmp_path / 'mlruns').as_uri()}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, lines = None, []
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            line = demo.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            found = re.search(r"live page: (http://127\.0\.0\.1:\d+/)", line)
            url = found.group(1) if found else None
        assert url, "".join(lines)[-3000:]
        while len(_rows(run_dir)) < 2 and demo.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_rows(run_dir)) >= 2, "the run wrote fewer than two rounds"
        before = len(_rows(run_dir))
        dom = _browse(browser, url, "--dump-dom").stdout
        after = _rows(run_dir)
        shown = int(re.search(r'data-round="(\d+)"', dom).group(1))  # type: ignore[union-attr]
        assert before <= shown <= len(after), (before, shown, len(after))
        rows = after[:shown]
        assert _text(dom, "score") == f"{100 * rows[-1]['accuracy']:.2f}%"
        assert _text(dom, "bytes") == (f"{_fmt_bytes(sum(r['uplink_bytes'] for r in rows))} / "
                                       f"{_fmt_bytes(sum(r['downlink_bytes'] for r in rows))}")
        ledger = json.loads((run_dir / "devices.json").read_text())
        assert _text(dom, "devices") == str(len(ledger["devices"]))
        nodes = set(re.findall(r"<tr><td>(\d+)</td><td>\d+</td>", dom))  # the devices table's node column
        assert nodes == set(ledger["devices"]), (nodes, set(ledger["devices"]))
        shot = _browse(browser, url, f"--screenshot={tmp_path / 'live-page.png'}")
        assert shot.returncode == 0 and (tmp_path / "live-page.png").stat().st_size > 10_000, shot.stderr[-2000:]
        assert demo.wait(timeout=300) == 0
        _tracked_as_written(run_dir, tmp_path / "tb" / "run", (tmp_path / "mlruns").as_uri())
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def _tracked_as_written(run_dir: Path, events_dir: Path, mlflow_uri: str) -> None:
    """TensorBoard's event reader and MLflow's client (on a plain-file store: the default SQLite one
    is ``tests/tracking``'s) see every round's figures as the row has them (TensorBoard stores
    float32), the settings as parameters and the final files as artifacts."""
    import numpy as np
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedge.tracking import row_scalars

    rows = _rows(run_dir)
    assert [r["round"] for r in rows] == list(range(1, 9))
    expected = {r["round"]: row_scalars(r) for r in rows}
    assert {"accuracy", "loss", "uplink_bytes", "downlink_bytes", "compression_ratio"} <= set(expected[1])
    events = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    events.Reload()
    names = set().union(*(set(s) for s in expected.values()))
    assert set(events.Tags()["scalars"]) == names
    for name in names:
        got = {e.step: e.value for e in events.Scalars(name)}
        assert got == {step: np.float32(s[name]) for step, s in expected.items() if name in s}, name
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store the run named
    client = MlflowClient(tracking_uri=mlflow_uri)
    run = client.get_run(json.loads((run_dir / "mlflow-run.json").read_text())["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["codec"] == json.loads((run_dir / "config.json").read_text())["settings"]["codec"]
    for name in names:
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert history == {step: s[name] for step, s in expected.items() if name in s}, name
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"model.pt", "plot.png", "summary.json", "bundle"}
