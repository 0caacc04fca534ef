"""``bench/at_commit.py`` runs a command on an earlier commit's code with this checkout's
environment, so a benchmark compares that commit and today's on one machine: ``fedge`` must then
come from the commit's tree alone, never from this checkout, and nothing may be left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worktrees() -> list[str]:
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list", "--porcelain"], capture_output=True,
                            text=True, check=True).stdout
    return [line for line in listed.splitlines() if line.startswith("worktree ")]


def test_the_command_imports_fedge_from_the_commits_tree_and_its_exit_status_passes_through() -> None:
    before = _worktrees()
    probe = ("import os, sys, fedge.coordinator.layer as m; print(os.path.realpath(m.__file__)); "
             "print(any(getattr(f, '__module__', '').startswith('__editable__') for f in sys.meta_path)); "
             "sys.exit(3)")
    done = subprocess.run([sys.executable, "bench/at_commit.py", "HEAD", "--", sys.executable, "-c", probe],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3, done.stderr[-2000:]
    where, editable = done.stdout.split()
    assert "fedge-at-commit-" in where and where.endswith("/tree/coordinator/layer.py"), where
    assert not where.startswith(str(ROOT)) and editable == "False"
    assert _worktrees() == before  # its worktree is removed
