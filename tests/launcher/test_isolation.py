"""Choosing how a SuperNode runs its messages: warm where it can run, subprocess with a logged reason
where it cannot; the flags each choice gives ``flower-supernode`` and the warm process."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from fedge.launcher.processes import module_argv

from fedge.edge_client.warm_executor import WarmNode
from fedge.launcher import isolation


def test_warm_runs_here_and_is_chosen() -> None:
    assert isolation.warm_unavailable() is None  # Linux with this Flower
    assert isolation.choose_isolation("warm") == "warm"
    assert isolation.choose_isolation("subprocess") == "subprocess"


def test_where_warm_cannot_run_the_choice_falls_back_to_subprocess_and_says_why(monkeypatch, caplog) -> None:
    monkeypatch.setattr(isolation.sys, "platform", "darwin")
    with caplog.at_level(logging.WARNING, logger="fedge.launcher.isolation"):
        assert isolation.choose_isolation("warm") == "subprocess"
    assert "macOS" in caplog.text and "subprocess isolation" in caplog.text
    monkeypatch.setattr(isolation.sys, "platform", "linux")
    monkeypatch.delattr(isolation.os, "fork")
    assert "os.fork" in (isolation.warm_unavailable() or "")


def test_an_unknown_isolation_is_refused() -> None:
    with pytest.raises(ValueError, match="warm, subprocess"):
        isolation.choose_isolation("thread")


def test_the_secret_is_made_once_owner_only(tmp_path: Path) -> None:
    path = isolation.write_secret(tmp_path / "s" / "superexec.secret")
    first = path.read_bytes()
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert isolation.write_secret(path).read_bytes() == first


def test_flags_for_each_isolation(tmp_path: Path) -> None:
    assert isolation.supernode_isolation_argv("subprocess", None) == []
    assert isolation.supernode_isolation_argv("warm", tmp_path / "s") == [
        "--isolation", "process", "--superexec-auth-secret-file", str(tmp_path / "s")]
    with pytest.raises(ValueError):
        isolation.supernode_isolation_argv("warm", None)
    argv = isolation.warm_executor_argv([("127.0.0.1:9094", tmp_path / "h0"), ("127.0.0.1:9095", None)],
                                        tmp_path / "s", ledger=tmp_path / "l.jsonl", partitions=True)
    assert argv[:3] == module_argv("fedge.edge_client.warm_executor")  # its directory off the import path
    assert "del sys.path[0]" in argv[2] and "'fedge.edge_client.warm_executor'" in argv[2]
    assert ["--node", f"127.0.0.1:9094={tmp_path / 'h0'}"] == argv[argv.index("--node"):argv.index("--node") + 2]
    assert "127.0.0.1:9095" in argv and "--partitions" in argv and str(tmp_path / "l.jsonl") in argv
    # what the warm process parses back
    node = WarmNode.parse(f"127.0.0.1:9094={tmp_path / 'h0'}")
    assert node.address == "127.0.0.1:9094" and node.flwr_home == (tmp_path / "h0").resolve()
    with pytest.raises(ValueError):
        WarmNode.parse("nohostport")


def test_a_warm_process_without_codec_kernels_skips_the_codec_warm_up(monkeypatch, caplog) -> None:
    """The warm-up exists to compile numba's kernels once before the fork; where there are none (a
    device's install, ``FEDGE_KERNELS=off``) it would only touch pages each child may never use
    (15 MiB of the warm process's RSS, docs/capacity.md), so it is skipped and the reason logged."""
    from fedge.compression import kernels, warmup
    from fedge.edge_client.warm_executor import WarmExecutor

    warmed: list[bool] = []
    monkeypatch.setenv("FEDGE_PAGE_RELEASE", "off")  # this test's own process keeps its pages
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: warmed.append(True) or [])
    executor = WarmExecutor([WarmNode.parse("127.0.0.1:1")], preload=())
    monkeypatch.setattr(kernels, "available", lambda: False)
    with caplog.at_level(logging.INFO, logger="fedge.edge.warm"):
        executor.warm_up()
    assert warmed == [] and "no codec kernels to warm" in caplog.text
    monkeypatch.setattr(kernels, "available", lambda: True)
    executor.warm_up()
    assert warmed == [True]
