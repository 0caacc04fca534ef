"""``ops/grafana/fedge-coordinator.json`` queries only what the daemon exports: every metric name in
its PromQL is a sample name of the daemon's registry (``fedge.server.daemon.service_metrics``; a
counter's ``_total``, a histogram's ``_bucket``), and every ``kind`` it filters on is a label the
daemon uses. A renamed metric fails here, not on an operator's empty panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from fedge.server.daemon.service_metrics import DECLINED_LABELS, KIND_LABELS, ServiceMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "ops" / "grafana" / "fedge-coordinator.json"


def _exported() -> set[str]:
    text = generate_latest(ServiceMetrics().registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_query_names_a_metric_the_daemon_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= 10
    exported = _exported()
    used = {name for expr in exprs for name in re.findall(r"\bfedge_[a-z_]+\b", expr)}
    assert used and used <= exported, f"not exported by the daemon: {sorted(used - exported)}"
    # what an operator needs to see: rounds, devices, bytes each way, replies by kind, round time, checkpoint
    assert {"fedge_current_round", "fedge_connected_nodes", "fedge_uplink_bytes_total", "fedge_downlink_bytes_total",
            "fedge_replies_rejected_total", "fedge_replies_declined_total", "fedge_round_duration_seconds_bucket",
            "fedge_checkpoint_age_seconds"} <= used
    for expr in exprs:  # a kind filter names a label the daemon uses
        for kind in re.findall(r'kind="([^"]+)"', expr):
            assert kind in KIND_LABELS + DECLINED_LABELS, kind
    assert all(panel["datasource"]["uid"] == "${DS_PROMETHEUS}" for panel in dashboard["panels"])
    assert [item["name"] for item in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
