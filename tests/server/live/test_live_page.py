"""The live page's server and snapshot, on a run directory written as a run writes it: what the page
is sent equals the files, an unchanged run answers 304, the page is read-only, and beyond loopback
it needs TLS and a token."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fedge.server.live.server import LivePage, LivePageError
from fedge.server.live.snapshot import Snapshots, series_row
from fedge.server.run.metrics_log import MetricsLog

ROW = {"round": 1, "metric": "accuracy", "accuracy": 0.5, "loss": 1.2, "uplink_bytes": 100, "uplink_fp32_bytes": 800,
       "downlink_bytes": 900, "clients_sampled": 3, "clients_used": 2, "clients_failed": 1, "seconds": 1.5,
       "rejected": [{"node": 9, "kind": "timeout", "reason": "no reply"}], "device_resources": {"devices": 2}}


def _run_dir(tmp_path: Path, rows: int = 2, devices: int = 3) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"settings": {"rounds": 5, "codec": "qsgd:bits=4"}, "started_at": 1.0}))
    for r in range(1, rows + 1):
        MetricsLog(run / "metrics.jsonl").append({**ROW, "round": r, "accuracy": 0.5 + r / 100})
    ledger = {str(n): {"node": n, "partition": n - 7, "rounds": 2, "last_round": rows, "last_seen": 1e9}
              for n in range(7, 7 + devices)}
    (run / "devices.json").write_text(json.dumps({"step": rows, "devices": ledger}))
    return run


def test_the_snapshot_is_the_run_directory_and_merges_the_superlinks_node_list(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    leaf = run / "leaf-0"
    leaf.mkdir()
    MetricsLog(leaf / "metrics.jsonl").append({**ROW, "round": 4})
    online = [{"node-id": "7", "status": "online"}, {"node-id": "8", "status": "offline"},
              {"node-id": "99", "status": "online"}]
    snap = Snapshots(run, online=lambda: online).snapshot()
    assert [r["round"] for r in snap["rows"]] == [1, 2] and snap["rows"][1]["score"] == pytest.approx(0.52)
    assert snap["rows"][0]["refusals"] == {"timeout": 1} and snap["settings"]["codec"] == "qsgd:bits=4"
    status = {d["node"]: d.get("status") for d in snap["devices"]}
    assert status == {"7": "online", "8": "offline", "9": "unknown", "99": "online"}  # 99: connected, never asked
    assert snap["leaves"] == [{"name": "leaf-0", "round": 4, "score": 0.5, "metric": "accuracy", "clients_used": 2,
                               "devices": 0, "devices_list": []}]
    assert series_row(ROW)["score"] == 0.5


def test_the_server_sends_the_page_and_the_snapshot_and_304_for_an_unchanged_run(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    with LivePage(run) as page:
        html = urllib.request.urlopen(page.url, timeout=10).read().decode()
        assert "<title>Fedge · federation</title>" in html
        # offline: nothing loaded from elsewhere (the SVG namespace is a name, not a fetch)
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(|fetch\(["'](https?:)?//""", html)
        first = urllib.request.urlopen(page.url + "api/federation", timeout=10)
        etag, data = first.headers["ETag"], json.loads(first.read())
        assert [r["round"] for r in data["rows"]] == [1, 2] and len(data["devices"]) == 3
        again = urllib.request.Request(page.url + "api/federation", headers={"If-None-Match": etag})
        with pytest.raises(urllib.error.HTTPError) as unchanged:
            urllib.request.urlopen(again, timeout=10)
        assert unchanged.value.code == 304
        MetricsLog(run / "metrics.jsonl").append({**ROW, "round": 3})
        assert [r["round"] for r in json.loads(urllib.request.urlopen(again, timeout=10).read())["rows"]] == [1, 2, 3]
        post = urllib.request.Request(page.url + "api/federation", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10)
        assert refused.value.code == 405


def test_a_token_is_needed_when_set_and_beyond_loopback_tls_and_a_token_are(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    with pytest.raises(LivePageError, match="needs TLS"):
        LivePage(run, host="0.0.0.0")
    with LivePage(run, token="a-long-enough-token") as page:
        with pytest.raises(urllib.error.HTTPError) as no_token:
            urllib.request.urlopen(page.url.split("?")[0] + "api/federation", timeout=10)
        assert no_token.value.code == 401
        bearer = urllib.request.Request(page.url.split("?")[0] + "api/federation",
                                        headers={"Authorization": "Bearer a-long-enough-token"})
        assert json.loads(urllib.request.urlopen(bearer, timeout=10).read())["name"] == "run"
        assert urllib.request.urlopen(page.url, timeout=10).status == 200  # ?token= on the page's address


def test_over_tls_the_page_is_served_with_the_daemons_certificate(tmp_path: Path) -> None:
    import ssl

    from fedge.deploy.certs import init_ca, issue_server_certificate

    init_ca(tmp_path / "certs")
    issue_server_certificate(tmp_path / "certs", ["127.0.0.1"])
    run = _run_dir(tmp_path)
    tls = (tmp_path / "certs" / "server.crt", tmp_path / "certs" / "server.key")
    with LivePage(run, token="a-long-enough-token", tls=tls) as page:
        assert page.url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(tmp_path / "certs" / "ca.crt"))
        assert urllib.request.urlopen(page.url, timeout=10, context=trusted).status == 200
        with pytest.raises(OSError):  # plaintext is not answered (reset, or an error)
            urllib.request.urlopen(page.url.replace("https://", "http://"), timeout=10)
