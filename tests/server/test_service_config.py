"""``fedge.toml`` checks (every rule a named error before anything starts) and the /metrics mapping."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedge.deploy.certs import init_ca, issue_server_certificate
from fedge.server.daemon.service_config import ServiceConfigError, load_service_config
from fedge.server.daemon.service_metrics import KIND_LABELS, ServiceMetrics, kind_label

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, service: str, run: str = "rounds = 2") -> Path:
    path = tmp_path / "fedge.toml"
    path.write_text(f"[service]\n{service}\n\n[run]\n{run}\n")
    return path


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    init_ca(tmp_path / "certs")
    issue_server_certificate(tmp_path / "certs", ["127.0.0.1", "fl.example.org"])
    return tmp_path / "certs"


TLS = 'tls-ca = "certs/ca.crt"\ntls-cert = "certs/server.crt"\ntls-key = "certs/server.key"'


def test_the_example_config_is_valid_once_its_files_exist(tmp_path: Path, certs: Path) -> None:
    text = (REPO / "server" / "daemon" / "fedge.example.toml").read_text()
    text = text.replace('"/var/lib/fedge"', f'"{tmp_path / "state"}"')
    text = text.replace('export-bundle = "/etc/fedge/signing/signing-key.pem"', "")
    (tmp_path / "fedge.toml").write_text(text)
    config = load_service_config(tmp_path / "fedge.toml")
    assert config.tls is not None and config.tls.node_auth and config.dial == "127.0.0.1:9093"
    assert config.settings.rounds == 100 and config.run_dir == tmp_path / "state" / "run"


def test_loopback_plaintext_is_fine_and_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    config = load_service_config(_write(tmp_path, 'address = "127.0.0.1:9093"\nstate-dir = "s"'))
    assert config.tls is None and config.state_dir == tmp_path / "s" and config.metrics_port == 9100


def test_plaintext_outside_loopback_needs_insecure_and_warns(tmp_path: Path, caplog) -> None:
    with pytest.raises(ServiceConfigError, match="not loopback"):
        load_service_config(_write(tmp_path, 'address = "0.0.0.0:9093"'))
    with caplog.at_level(logging.WARNING):
        config = load_service_config(_write(tmp_path, 'address = "0.0.0.0:9093"\ninsecure = true'))
    assert config.insecure and "plaintext SuperLink" in caplog.text


@pytest.mark.parametrize(
    ("service", "run", "words"),
    [
        ('address = "127.0.0.1"', "", "host:port"),
        ('address = "127.0.0.1:70000"', "", "1..65535"),
        ('adress = "127.0.0.1:9093"', "", "unknown \\[service\\] keys"),
        ("node-auth = true", "", "node-auth needs TLS"),
        ('tls-ca = "certs/ca.crt"', "", "TLS needs tls-ca, tls-cert and tls-key"),
        (TLS + "\ninsecure = true", "", "contradicts"),
        (TLS + '\ndial = "10.1.2.3:9093"', "", "names .* but the daemon dials '10.1.2.3'"),
        (TLS + '\nregister-keys = ["nope.pub"]', "", "does not exist"),
        ('register-keys = ["x.pub"]', "", "does not exist|needs node-auth"),
        ("stop-grace-seconds = 0", "", "positive number"),
        ("", "rounds = 2\nroundz = 3", "unknown setting 'roundz'"),
        ("", 'codec = "qsgd:bits=99"', "\\[run\\]"),
    ],
)
def test_each_rule_is_a_named_error(tmp_path: Path, certs: Path, service: str, run: str, words: str) -> None:
    with pytest.raises(ServiceConfigError, match=words):
        load_service_config(_write(tmp_path, service, run or "rounds = 2"))


def test_certificate_must_match_its_key_and_ca(tmp_path: Path, certs: Path) -> None:
    other = tmp_path / "other"
    init_ca(other)
    issue_server_certificate(other, ["127.0.0.1"])
    shutil.copy(other / "server.key", certs / "server.key")
    with pytest.raises(ServiceConfigError, match="does not belong"):
        load_service_config(_write(tmp_path, TLS))
    shutil.copy(other / "server.crt", certs / "server.crt")
    with pytest.raises(ServiceConfigError, match="not signed by"):
        load_service_config(_write(tmp_path, TLS))


def test_bad_toml_is_a_named_error(tmp_path: Path) -> None:
    (tmp_path / "fedge.toml").write_text("[service\n")
    with pytest.raises(ServiceConfigError, match="not valid TOML"):
        load_service_config(tmp_path / "fedge.toml")


def test_rows_become_prometheus_samples(tmp_path: Path) -> None:
    checkpoint = tmp_path / "state.pt"
    metrics = ServiceMetrics(checkpoint)
    row = {"round": 4, "accuracy": 0.9, "clients_used": 3, "uplink_bytes": 100, "downlink_bytes": 900,
           "seconds": 12.5, "declined": {"not-eligible": 2},
           "rejected": [{"node": 7, "kind": "timeout", "reason": "no reply within 60 s"},
                        {"node": 8, "kind": "invalid", "reason": "body length field says 9 bytes but 3 follow"},
                        {"node": 9, "kind": "invalid", "reason": "stale: the wording no longer decides"},
                        {"node": None, "reason": "aggregate not finite; round skipped"}]}
    metrics.observe_row(row)
    metrics.observe_row({**row, "round": 5, "rejected": []})
    from prometheus_client import generate_latest

    samples = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("fedge_rounds_completed_total", ())] == 2
    assert samples[("fedge_current_round", ())] == 5
    assert samples[("fedge_replies_used_total", ())] == 6
    assert samples[("fedge_uplink_bytes_total", ())] == 200
    assert samples[("fedge_replies_rejected_total", (("kind", "timeout"),))] == 1
    assert samples[("fedge_replies_rejected_total", (("kind", "invalid"),))] == 2  # by kind, not by the reason's words
    assert samples[("fedge_replies_rejected_total", (("kind", "stale"),))] == 0
    assert samples[("fedge_replies_rejected_total", (("kind", "step"),))] == 1
    assert samples[("fedge_replies_declined_total", (("kind", "not-eligible"),))] == 4
    assert samples[("fedge_round_duration_seconds_count", ())] == 2
    assert samples[("fedge_checkpoint_age_seconds", ())] == -1  # no checkpoint yet
    checkpoint.write_bytes(b"x")
    text = generate_latest(metrics.registry).decode()
    age = next(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "fedge_checkpoint_age_seconds")
    assert 0 <= age < 60


def test_kind_labels_are_a_closed_set() -> None:
    hostile = [{"kind": "x" * 10_000}, {"kind": "stale"}, {"kind": None}, {"kind": 3}, {"reason": "client error"},
               {"kind": "\u202e weird"}, {"kind": "not-eligible"}]
    labels = [kind_label(entry) for entry in hostile]
    assert set(labels) <= set(KIND_LABELS)
    assert labels == ["other", "stale", "step", "other", "step", "other", "other"]


def test_a_leafs_daemon_is_a_run_setting_away(tmp_path: Path) -> None:
    """A leaf in production: its daemon's ``[run]`` names the spool its root's bridge shares."""
    config = load_service_config(_write(tmp_path, 'address = "127.0.0.1:9093"\nstate-dir = "s"',
                                        'rounds = 100\nleaf-spool = "/var/lib/fedge/leaf/spool"'))
    assert config.settings.leaf_spool == "/var/lib/fedge/leaf/spool"


def test_the_live_page_beyond_loopback_needs_tls_and_a_token_file(tmp_path: Path, certs: Path) -> None:
    assert load_service_config(_write(tmp_path, "")).page_host == "127.0.0.1"  # default: loopback, no token
    assert load_service_config(_write(tmp_path, 'page-address = ""')).page_host is None
    with pytest.raises(ServiceConfigError, match="page-address 0.0.0.0:9101: beyond loopback the live page needs TLS"):
        load_service_config(_write(tmp_path, 'page-address = "0.0.0.0:9101"'))
    with pytest.raises(ServiceConfigError, match="needs page-token-file"):
        load_service_config(_write(tmp_path, f'page-address = "0.0.0.0:9101"\n{TLS}'))
    (tmp_path / "page.token").write_text("short\n")
    with pytest.raises(ServiceConfigError, match="at least 16 characters"):
        load_service_config(_write(tmp_path, f'page-address = "0.0.0.0:9101"\npage-token-file = "page.token"\n{TLS}'))
    (tmp_path / "page.token").write_text("a-token-of-enough-length\n")
    config = load_service_config(_write(tmp_path, f'page-address = "0.0.0.0:9101"\npage-token-file = "page.token"\n{TLS}'))
    assert config.page_token == "a-token-of-enough-length" and config.describe()["page"] == "https://0.0.0.0:9101/"
