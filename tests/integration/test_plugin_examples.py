"""The plugin examples (examples/plugins) in one run on Flower's simulation engine: every process
(the ServerApp, each ClientApp) loads them through the ``plugins`` setting, from the app bundle.
No edge bundle (``--export-bundle ""``): the export is tested on its own, and costs ~9 CPU-s a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedge.compression.wire import HEADER_SIZE

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"


@pytest.mark.integration
def test_all_three_plugins_run_on_the_simulation_engine(tmp_path, assert_no_leftovers) -> None:
    run = tmp_path / "run"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "fedge"), "demo", "--plugins", "int8_codec,geomedian,decaying_fedavg",
         "--codec", "int8sym", "--aggregator", "geomedian", "--algorithm", "fedavg_decay:decay=0.9",
         "--clients", "4", "--rounds", "3", "--export-bundle", "", "--run-dir", str(run)],
        cwd=PLUGINS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_no_leftovers(run / "flwr-home")
    for module in ("int8_codec.py", "geomedian.py", "decaying_fedavg.py"):  # they travelled in the bundle
        assert (run / "flwr-home" / "app" / module).is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    numel = 38_282  # the digits CNN
    assert all(r["codec"] == "int8sym" and r["aggregator"] == "geomedian:iterations=8" for r in rows)
    assert all(r["uplink_bytes"] == r["clients_used"] * (HEADER_SIZE + 4 + numel) and r["clients_used"] == 4
               for r in rows)  # every device encoded with the user codec; the coordinator decoded it
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "fedavg_decay:decay=0.9"
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.2, summary


@pytest.mark.integration
@pytest.mark.slow  # ~45 s: the default suite is at CI's 15 minutes; plugins on a real engine stay there
def test_a_plugin_algorithm_runs_with_secure_aggregation_on_the_simulation_engine(tmp_path, assert_no_leftovers) -> None:
    """The plugin's device handler is FedAvg's built on the device's layers: under secure aggregation
    its devices mask (the uplink is the masked ring elements plus the key agreement) and the
    unmasked sum trains the model."""
    run = tmp_path / "run"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "fedge"), "demo", "--plugins", "decaying_fedavg",
         "--algorithm", "fedavg_decay:decay=0.9", "--secure-aggregation", "secagg:bits=8,clip=0.2,weight-cap=256",
         "--clients", "4", "--rounds", "2", "--export-bundle", "", "--run-dir", str(run)],
        cwd=PLUGINS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_no_leftovers(run / "flwr-home")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    numel = 38_282  # the digits CNN
    assert len(rows) == 2
    for r in rows:
        assert r["clients_used"] == 4 and not r["rejected"] and r["secure_aggregation"].startswith("secagg"), r
        masked = 4 * (((numel + 1) * r["secagg_ring_bits"] + 7) // 8 + 17)  # + 1 weight digit, 17-byte header
        assert masked < r["uplink_bytes"] < masked + 4 * 10_000  # + keys, sealed shares and reveals
        assert r["train_loss"] is None  # nothing about any device's data in clear
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.2, summary
