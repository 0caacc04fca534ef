"""Run a command on the code of an earlier commit, with this checkout's environment, so a benchmark
can compare that commit and today's side by side on one machine (a target set on another machine
is then checked as a ratio measured here, not against a figure this machine cannot reproduce).

    .venv/bin/python bench/at_commit.py 2cc4c73^ -- .venv/bin/python bench/clientapp_cpu.py --isolation warm

The commit is checked out in a temporary git worktree and the command runs there; ``fedge`` then
imports from that worktree: a temporary package whose sub-packages are links to its folders (the
``package-dir`` map of this checkout's pyproject.toml) comes first on ``PYTHONPATH``, for the
command and every process it starts, and this checkout's editable install is taken off the import
path there (a module the commit lacks fails to import; it never comes from today's code). A relative
``.venv/...`` program is this checkout's. The commit's own dependencies are not installed: a commit
whose requirements differ from this checkout's may fail to import, and then says so. So are this
checkout's console scripts (``.venv/bin/fedge``): each calls the entry point this checkout names, and
a commit whose entry point had another name (``main`` before ``run``) fails through it with an
ImportError; run that commit's code with ``python -c`` or ``-m`` instead. The command runs in the
worktree, which is removed after it: give an output path outside it (absolute).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shim(worktree: Path, into: Path) -> Path:
    """A directory holding a ``fedge`` package whose sub-packages are ``worktree``'s folders."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = into / "fedge"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")  # a regular package: found before the editable finder
    for name, folder in mapping.items():
        (package / name.split(".", 1)[1]).symlink_to(worktree / folder, target_is_directory=True)
    # and no fallback to this checkout: its editable finder would import a module the commit lacks from here
    (into / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not getattr(f, '__module__', '').startswith('__editable__')]\n")
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commit", help="the commit whose code the command runs on (any git revision)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, run in the worktree")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --")
    if command[0].startswith(".venv/"):
        command[0] = str(ROOT / command[0])
    with tempfile.TemporaryDirectory(prefix="fedge-at-commit-") as temp:
        worktree = Path(temp) / "tree"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", "--quiet", str(worktree), args.commit], check=True)
        try:
            path = shim(worktree, Path(temp) / "shim")
            paths = [str(path), os.environ.get("PYTHONPATH")]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
            print(f"at {args.commit}: {' '.join(command)}", file=sys.stderr, flush=True)
            return subprocess.run(command, cwd=worktree, env=env).returncode
        finally:
            subprocess.run([*git, "remove", "--force", str(worktree)], check=False)


if __name__ == "__main__":
    sys.exit(main())
