"""``fedge-edge join --check``: everything a device can get wrong is refused (exit 2, one line naming the
option) before anything connects; a good setup prints a data summary and exits 0 without connecting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedge.deploy.certs import init_ca, make_node_key
from fedge.edge_client.edge_cli import main


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("device")
    ca = init_ca(root / "ca")
    key = make_node_key(root / "keys", "device-1")
    rng = np.random.default_rng(0)
    data = root / "own.npz"
    np.savez(data, x=rng.random((20, 1, 8, 8), dtype=np.float32), y=np.arange(20) % 10)
    bad_labels = root / "bad-labels.npz"
    np.savez(bad_labels, x=rng.random((4, 1, 8, 8), dtype=np.float32), y=np.array([0, 1, 2, 10]))
    not_a_cert = root / "not-a-cert.pem"
    not_a_cert.write_text("hello\n")
    return {"ca": ca, "key": key.private_key, "public": key.public_key, "data": data,
            "bad_labels": bad_labels, "not_a_cert": not_a_cert, "state": root / "state"}


def _check(device: dict[str, Path], *extra: str, data: Path | None = None) -> list[str]:
    return ["join", "--check", "--superlink", "coordinator.example.org:9092", "--data", str(data or device["data"]),
            "--state-dir", str(device["state"]), *extra]


def test_a_good_device_passes_the_check_without_connecting(device, capsys) -> None:
    code = main(_check(device, "--root-cert", str(device["ca"]), "--auth-key", str(device["key"])))
    err = capsys.readouterr().err
    assert code == 0, err
    assert "data ok: 20 samples of task digits" in err and "labels [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in err
    assert not device["state"].exists()  # --check touches nothing


@pytest.mark.parametrize(
    ("extra", "data_key", "words"),
    [
        ((), None, "give --root-cert"),
        (("--insecure", "--root-cert", "{ca}"), None, "--insecure contradicts"),
        (("--root-cert", "{not_a_cert}"), None, "not a readable PEM certificate"),
        (("--root-cert", "{ca}", "--auth-key", "{public}"), None, "not a readable OpenSSH private key"),
        (("--root-cert", "{ca}", "--auth-key", "{ca}"), None, "not a readable OpenSSH private key"),
        (("--root-cert", "{ca}", "--threads", "0"), None, "--threads must be >= 1"),
        (("--root-cert", "{ca}"), "bad_labels", "label"),
        (("--root-cert", "{ca}", "--task", "no-such-task"), None, "--task"),
        (("--root-cert", "{ca}", "--when", "charging,sunny"), None, "unknown condition(s) ['sunny']"),
        (("--root-cert", "{ca}", "--max-mb-per-day", "-1"), None, "--max-rounds-per-day and --max-mb-per-day"),
        # pinned device code (the default): Flower's subprocess isolation would run the FAB's code
        (("--root-cert", "{ca}", "--isolation", "subprocess"), None, "--isolation subprocess runs the ClientApp"),
        (("--root-cert", "{ca}", "--app", "no_such_module:app"), None, "is not installed on this device"),
        (("--root-cert", "{ca}", "--app", "fedge.edge_client.app"), None, "--app must be MODULE:ATTRIBUTE"),
        (("--root-cert", "{ca}", "--allow-module", "not a module"), None, "--allow-module"),
        (("--root-cert", "{ca}", "--trusted-entities", "{state}/none.yaml"), None, "--trusted-entities"),
    ],
)
def test_each_mistake_is_refused_with_its_reason(device, capsys, extra, data_key, words) -> None:
    args = [a.format(**{k: str(v) for k, v in device.items()}) for a in extra]
    code = main(_check(device, *args, data=device[data_key] if data_key else None))
    err = capsys.readouterr().err
    assert code == 2
    assert words in err, err
    assert "Traceback" not in err


def test_a_superlink_without_a_port_is_refused(device, capsys) -> None:
    args = ["join", "--check", "--superlink", "coordinator", "--data", str(device["data"]), "--insecure"]
    assert main(args) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_an_endorsement_from_another_ca_is_refused_at_the_check(tmp_path, capsys) -> None:
    """The key's endorsement (its secure-aggregation identity's issuer) must be the federation's
    CA: an endorsement from another one is found by --check, not by the first secure round."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ca = init_ca(ours)
    init_ca(theirs)
    key = make_node_key(theirs, "device-1")  # endorsed by the other CA
    rng = np.random.default_rng(0)
    data = tmp_path / "own.npz"
    np.savez(data, x=rng.random((10, 1, 8, 8), dtype=np.float32), y=np.arange(10) % 10)
    args = ["join", "--check", "--superlink", "h:1", "--data", str(data), "--state-dir", str(tmp_path / "s"),
            "--root-cert", str(ca), "--auth-key", str(key.private_key)]
    assert main(args) == 2
    assert "not endorsed by the operator's CA" in capsys.readouterr().err
    good = make_node_key(ours, "device-2")
    assert good.endorsement is not None and good.endorsement.exists()
    args[-1] = str(good.private_key)
    assert main(args) == 0, capsys.readouterr().err


def _joined(tmp_path: Path, name: str, *, opt_out: bool = False) -> dict:
    """The node config ``fedge-edge join`` gives a device with an identity the operator's CA issued
    and no policy flags (``--no-default-policy`` with ``opt_out``)."""
    from fedge.edge_client.join import JoinOptions, _node_config

    certs = tmp_path / "certs"
    if not (certs / "ca.crt").exists():
        init_ca(certs)
    key = make_node_key(certs, name)
    data = tmp_path / "own.npz"
    np.savez(data, x=np.zeros((4, 1, 8, 8), np.float32), y=np.arange(4))
    return _node_config(JoinOptions(superlink="127.0.0.1:9092", data=data, root_cert=certs / "ca.crt",
                                    auth_key=key.private_key, state_dir=tmp_path / name, no_default_policy=opt_out))


def test_an_issued_identity_is_safe_by_default(tmp_path) -> None:
    """Privacy audit 3, defaults: a device joined with only an issued identity requires secure
    aggregation, three participants and a 2/3 share threshold; it refuses a round in clear and a
    secure round of two. Its owner may opt out, explicitly; a device without an issued identity
    keeps what its owner set. Every device is pinned to its installed ClientApp."""
    from tests.server.in_process_grid import InProcessGrid
    from tests.server.test_engine import _engine, _start

    devices = {i: _joined(tmp_path, f"device-{i}") for i in range(2)}
    config = devices[0]
    assert config["require-secure-aggregation"] == "true" and config["min-participants"] == 3
    assert config["min-threshold"] == 0.66 and config["device-code"] == "pinned"
    assert config["client-app"] == "fedge.edge_client.app:app"
    clear = _engine(tmp_path / "clear", rounds=1, clients_per_round=2)
    row = clear.run(InProcessGrid(2, node_config=devices), _start(clear)).rows[-1]
    assert row.clients_used == 0 and row.extra["failures"] == {"policy": 2}
    ca = tmp_path / "certs" / "ca.crt"
    two = _engine(tmp_path / "two", rounds=1, clients_per_round=2,
                  secure_aggregation=f"secagg:bits=8,clip=0.2,weight-cap=256,issuer={ca}")
    row = two.run(InProcessGrid(2, node_config=devices), _start(two)).rows[-1]
    assert row.clients_used == 0 and {entry["kind"] for entry in row.rejected} == {"policy"}
    assert all("rounds of at least 3" in entry["reason"] for entry in row.rejected)
    opted = _joined(tmp_path, "device-9", opt_out=True)
    assert "require-secure-aggregation" not in opted and opted["no-default-policy"] == "true"
