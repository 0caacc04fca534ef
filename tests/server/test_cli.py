import subprocess
import sys

from fedge.server.cli.main import main
from fedge.server.settings import OPTIONS


def test_help_lists_commands_and_every_option(capsys) -> None:
    out = subprocess.run([sys.executable, "-m", "fedge.server.cli", "demo", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for option in OPTIONS:
        assert f"--{option.key}" in out
    top = subprocess.run([sys.executable, "-m", "fedge.server.cli", "--help"], capture_output=True, text=True,
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
    assert single[-6:] == ["-m", "fedge.deploy.train", "--out", "runs/c", "--epochs", "2"]
    assert main(["cloud-train", "--print", "--nnodes", "2", "--node-rank", "1",
                 "--rdzv-endpoint", "10.0.0.1:29400", "--", "--out", "x"]) == 0
    multi = capsys.readouterr().out.split()
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400"} <= set(multi)
    assert main(["cloud-train", "--print"]) == 2  # --out is required


def test_demo_exports_a_bundle_by_default_and_checks_export_options_early(capsys, tmp_path) -> None:
    from fedge.server.cli.main import build_parser

    assert build_parser().parse_args(["demo"]).export_bundle == "auto"
    assert build_parser().parse_args(["local-cluster"]).export_bundle == ""
    assert main(["demo", "--export-bundle", str(tmp_path / "no-such-key.pem"), "--run-dir", str(tmp_path)]) == 2
    assert "no-such-key.pem" in capsys.readouterr().err
    assert main(["demo", "--export-prune", "magic:x=1", "--run-dir", str(tmp_path)]) == 2
    assert "unknown pruning" in capsys.readouterr().err


def test_keys_and_export_commands(capsys, tmp_path, trained_model_file) -> None:
    assert main(["keys", "generate", "--out", str(tmp_path / "k")]) == 0
    assert main(["keys", "generate", "--out", str(tmp_path / "k")]) == 2  # never overwrites a key
    assert "refusing to overwrite" in capsys.readouterr().err
    code = main(["export", str(trained_model_file), "--sign-key", str(tmp_path / "k" / "signing-key.pem"),
                 "--out", str(tmp_path / "b"), "--quantize", "dynamic-int8"])
    assert code == 1 and "ConvInteger" in capsys.readouterr().out  # refused, with the reason
    assert not (tmp_path / "b" / "bundle.dsse.json").exists()


def test_every_setting_is_checked_before_any_process_starts(capsys, tmp_path) -> None:
    """Issue 9: these used to start the SuperLink and Ray and die with Flower's exit code 700."""
    cases = [
        (["--server-opt", "fedadm"], "unknown server optimizer 'fedadm'"),
        (["--downlink-codec", "qsgd:bits=8"], "do not compose exactly"),
        (["--clients", "100"], "cannot split task 'digits' into 100 clients"),
        (["--downlink-codec", "lattice:ratio=2"], "downlink ratio must be in (0, 1]"),
        (["--algorithm", "ring"], "unknown algorithm 'ring'"),
        (["--algorithm", "easgd:beta=2"], "beta must be in (0, 1]"),
        (["--algorithm", "gossip:topology=torus"], "2-D torus needs"),
        (["--algorithm", "gossip:topology=onepeer", "--clients", "6"], "power of two"),
        (["--algorithm", "gossip", "--server-opt", "fedadam"], "applies to algorithm fedavg and"),
    ]
    for flags, message in cases:
        assert main(["demo", *flags, "--run-dir", str(tmp_path / "never")]) == 2, flags
        assert message in capsys.readouterr().err, flags
    assert not (tmp_path / "never").exists()  # nothing was started or written


def test_a_tree_that_cannot_run_is_refused_before_any_process_starts(capsys, tmp_path) -> None:
    """``local-cluster --leaves``: the launcher's one rule, applied by the CLI first."""
    cases = [
        (["--leaves", "3", "--supernodes", "4"], "each leaf needs at least 2 of the 4 devices"),
        (["--leaves", "2", "--supernodes", "4", "--leaf-engine", "simulation", "--tls"],
         "a simulated leaf's devices do not connect to it"),
        (["--leaves", "2", "--supernodes", "4", "--leaf-sample", "-1"], "samples 0 (all) or more"),
        (["--leaves", "2", "--supernodes", "1000", "--leaf-engine", "simulation"],
         "cannot split task 'digits' into 1000 clients"),
    ]
    for flags, message in cases:
        assert main(["local-cluster", *flags, "--run-dir", str(tmp_path / "never")]) == 2, flags
        assert message in capsys.readouterr().err, flags
    assert not (tmp_path / "never").exists()
