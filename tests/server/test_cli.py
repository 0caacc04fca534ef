import subprocess
import sys

from server.cli import main
from server.settings import OPTIONS


def test_help_lists_commands_and_every_option(capsys) -> None:
    out = subprocess.run([sys.executable, "-m", "server.cli", "demo", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for option in OPTIONS:
        assert f"--{option.key}" in out
    top = subprocess.run([sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "demo" in top and "local-cluster" in top


def test_bad_codec_fails_fast_with_a_clear_error(capsys, tmp_path) -> None:
    assert main(["demo", "--codec", "qsgd:bits=12", "--run-dir", str(tmp_path)]) == 2
    assert "qsgd bits must be in 2..8" in capsys.readouterr().err
    assert main(["demo", "--partitioning", "zipf", "--run-dir", str(tmp_path)]) == 2
    assert "unknown partitioning 'zipf'" in capsys.readouterr().err


def test_settings_command(capsys) -> None:
    assert main(["settings"]) == 0
    assert "clients-per-round" in capsys.readouterr().out


def test_cloud_train_builds_the_torchrun_command(capsys) -> None:
    assert main(["cloud-train", "--print", "--", "--out", "runs/c", "--epochs", "2"]) == 0
    single = capsys.readouterr().out.split()
    assert single[0].endswith("torchrun") and "--nproc-per-node=2" in single
    assert single[-6:] == ["-m", "deploy.train", "--out", "runs/c", "--epochs", "2"]
    assert main(["cloud-train", "--print", "--nnodes", "2", "--node-rank", "1",
                 "--rdzv-endpoint", "10.0.0.1:29400", "--", "--out", "x"]) == 0
    multi = capsys.readouterr().out.split()
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400"} <= set(multi)
    assert main(["cloud-train", "--print"]) == 2  # --out is required
