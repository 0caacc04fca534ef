"""The device side for real: `fedge keys`, `fedge export` and `fedge-edge` as processes; no torch on the edge."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def _run(*command: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO)


def test_edge_modules_import_no_torch() -> None:
    code = ("import sys, edge_client.edge_cli, edge_client.inference, deploy.bundle, deploy.keys, deploy.atomic; "
            "heavy = [m for m in ('torch', 'flwr', 'onnx', 'sklearn') if m in sys.modules]; "
            "assert not heavy, heavy")
    done = _run(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr


def test_keys_export_verify_infer_end_to_end(tmp_path: Path, trained_model_file: Path, rogue_keypair) -> None:
    keys, bundle, state = tmp_path / "keys", tmp_path / "bundle", tmp_path / "state.json"
    assert _run(str(BIN / "fedge"), "keys", "generate", "--out", str(keys)).returncode == 0
    done = _run(str(BIN / "fedge"), "export", str(trained_model_file), "--sign-key", str(keys / "signing-key.pem"),
                "--out", str(bundle), "--prune", "unstructured:sparsity=0.5")
    assert done.returncode == 0, done.stderr + done.stdout
    public = str(keys / "signing-key.pub.pem")

    done = _run(str(BIN / "fedge-edge"), "verify", str(bundle), "--trusted-key", public, "--state", str(state))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["verified"] and report["round"] == 5 and report["quantization"] == "int8"
    assert json.loads(state.read_text())["digits"]["round"] == 5
    done = _run(str(BIN / "fedge-edge"), "verify", str(bundle), "--trusted-key", public, "--state", str(state),
                "--install", str(tmp_path / "device"))
    assert done.returncode == 0 and (tmp_path / "device" / "digits" / "model.onnx").exists(), done.stderr

    from fedge.tasks import make_task

    test = make_task("digits").test_data()
    np.save(tmp_path / "x.npy", test.x[:16].numpy())
    done = _run(str(BIN / "fedge-edge"), "infer", str(bundle), "--trusted-key", public, "--state", str(state),
                "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["batch"] == 16 and report["latency_p50_ms"] > 0
    assert np.mean(np.array(report["predictions"]) == test.y[:16].numpy()) >= 0.8
    assert np.load(tmp_path / "y.npy").shape == (16, 10)

    done = _run(str(BIN / "fedge-edge"), "verify", str(bundle), "--trusted-key", str(rogue_keypair[1]),
                "--state", str(state))
    assert done.returncode == 3 and "SignatureError" in done.stderr

    np.save(tmp_path / "bad.npy", np.zeros((2, 64), np.float32))
    done = _run(str(BIN / "fedge-edge"), "infer", str(bundle), "--trusted-key", public, "--state", str(state),
                "--input", str(tmp_path / "bad.npy"))
    assert done.returncode == 2 and "InputError" in done.stderr


@pytest.mark.slow
def test_edge_extra_installs_without_torch(tmp_path: Path) -> None:
    """`pip install '.[edge]'` into a fresh venv (from the package registry): no torch, and it works."""
    env_dir = tmp_path / "edge-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    source = tmp_path / "src"
    # Build from a copy so the install leaves nothing behind in the working tree.
    subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(tmp_path / "src.tar"), "HEAD"],
                   check=True)
    source.mkdir()
    subprocess.run(["tar", "-xf", str(tmp_path / "src.tar"), "-C", str(source)], check=True)
    done = _run(python, "-m", "pip", "install", "--quiet", "-c", str(REPO / "constraints.txt"), f"{source}[edge]",
                timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    installed = _run(python, "-m", "pip", "list", "--format=json").stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert "onnxruntime" in names and "cryptography" in names
    assert not names & {"torch", "flwr", "onnx", "scikit-learn"}, sorted(names)
    done = _run(str(env_dir / "bin" / "fedge-edge"), "--help")
    assert done.returncode == 0 and "verify" in done.stdout
