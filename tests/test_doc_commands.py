"""Every command a document shows in a code block parses with its real parser, exactly as written.

``tests/test_docs.py`` checks that the commands name subcommands and flags that exist (inline
mentions such as `fedge demo --ray-address` included). This file goes further for the commands of
code blocks (fenced ``bash``/``sh``/``shell``/``console`` or untagged blocks, and indented blocks)
and of the systemd units:

- ``fedge`` and ``fedge-edge`` commands are parsed by the CLI's own ``parse_args`` (a wrong value
  type, a missing value or a bad choice fails here), and ``fedge cloud-train``'s arguments after
  ``--`` by the trainer's own parser (``fedge.deploy.train.parse_args``);
- every ``fedge demo`` / ``fedge local-cluster`` command runs the CLI's preflight
  (:func:`fedge.server.cli.main.prepare_run`): the settings are built and every component of the
  run is built once, so a command the CLI would refuse (digits split 1,000 ways) fails here;
- every ``bench/<script>.py`` command is parsed by that script's own parser (its ``main`` runs up to
  its ``parse_args`` and stops there).

Placeholders in capitals are replaced by one example value each (:data:`EXAMPLES`). Commands that
cannot be checked here are listed in :data:`NOT_CHECKED`, with the reason, in one place.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from fedge.deploy.train import parse_args as trainer_args
from fedge.edge_client.edge_cli import build_parser as edge_parser
from fedge.server.cli.main import build_parser as fedge_parser
from fedge.server.cli.main import prepare_run
from tests.test_docs import DOCS, ROOT, UNITS, _segments, _shell_parts, _unit_commands

#: fenced blocks whose lines are commands (``text`` blocks are output and diagrams)
_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
_SHELL_TAGS = {"", "bash", "sh", "shell", "console"}
_BENCH = re.compile(r"(?:^|\s)(?:\S*python3?\s+)?(bench/\w+\.py)\b(.*)$")

#: one example value for each placeholder the docs write in capitals
EXAMPLES = {"N": "4", "K": "0", "L": "2", "DIR": "app", "HOST:PORT": "127.0.0.1:29500",
            "HEAD_IP:6379": "10.0.0.1:6379"}

#: programs a shell block may run that are not checked here, and why: the one list of exceptions
NOT_RUN_HERE = {
    "install": "needs root (the operator's install steps); the units it installs are checked by tests/test_docs.py",
    "useradd": "needs root", "chown": "needs root", "systemctl": "needs root and systemd",
    "cd": "changes the directory the next lines run in",
    "ray": "starts a Ray cluster across machines",
    "pip": "installs packages; tests/test_packaging.py installs the wheel the same way",
    "make": "the project's own targets, which CI runs",
    "source": "activates the virtual environment",
    "src=$PWD": "remembers the checkout's directory",
    "tensorboard": "TensorBoard's viewer (a server); tests/tracking reads the same files with its event reader",
    "mlflow": "MLflow's UI (a server); tests/tracking reads the same store with MlflowClient",
}

#: commands (by a substring of the command) that are not run through the preflight here, and why
NOT_CHECKED = {
    "--app": "runs a user's Flower app directory, which the docs make with `fedge new` first",
    "--init runs/cloud/model.pt": "needs the model `fedge cloud-train` writes first",
    "--plugins my_codecs": "names a user's own plugin modules, for illustration",
}


def _blocks(text: str) -> list[str]:
    """The code blocks of a Markdown text that show commands: shell or untagged fenced blocks, and
    indented blocks (four spaces after a blank line, outside fences)."""
    found = [body for tag, body in _FENCE.findall(text) if tag in _SHELL_TAGS]
    current: list[str] = []
    blank = True
    for line in _FENCE.sub("", text).splitlines():
        if line.startswith("    ") and (blank or current):
            current.append(line[4:])
        elif current:
            found.append("\n".join(current))
            current = []
        blank = not line.strip()
    if current:
        found.append("\n".join(current))
    return found


def _lines(text: str) -> list[str]:
    """Logical command lines (continuations joined, comments and prompts cut)."""
    return [line.split(" #")[0].strip().removeprefix("$ ") for block in _blocks(text)
            for line in block.replace("\\\n", " ").splitlines()]


def shown_commands() -> dict[str, list[str]]:
    """``fedge``/``fedge-edge`` commands and ``bench/`` commands of every document's code blocks
    and of the systemd units, by file."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        commands = []
        for line in _lines(doc.read_text(encoding="utf-8")):
            bench = _BENCH.search(line)
            commands += [f"{bench.group(1)}{bench.group(2)}"] if bench else _segments(line)
        found[doc.relative_to(ROOT).as_posix()] = commands
    for unit in UNITS:
        found[unit.relative_to(ROOT).as_posix()] = _unit_commands(unit.read_text(encoding="utf-8"))
    return found


def _tokens(command: str) -> list[str]:
    tokens = shlex.split(command)
    if ">" in tokens:  # a redirect: the shell's, not the command's
        tokens = tokens[:tokens.index(">")]
    return [EXAMPLES.get(token, token) for token in tokens]


def _refused(call):  # type: ignore[no-untyped-def]
    """``(call(), "")``, or ``(None, the parser's last line)`` when an argparse parser refused."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return call(), ""
        except SystemExit:
            lines = err.getvalue().strip().splitlines()
            return None, lines[-1] if lines else "refused"


class _Parsed(Exception):
    """Raised from a benchmark's ``parse_args`` once it parsed: the benchmark does not run."""


def _bench_problem(command: str) -> str | None:
    script, *argv = _tokens(command)
    path = ROOT / script
    if not path.is_file():
        return f"{script} does not exist"
    spec = importlib.util.spec_from_file_location(f"_doc_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    sys.modules[spec.name] = module  # as an import would: dataclasses and pickling look the module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    original = argparse.ArgumentParser.parse_args
    refused: list[str] = []

    def parse_only(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        parsed, why = _refused(lambda: original(self, args))
        if parsed is None:
            refused.append(why)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_only  # type: ignore[method-assign]
    saved_argv = sys.argv
    sys.argv = [script, *argv]
    try:
        try:
            module.main(argv) if "argv" in module.main.__code__.co_varnames[:1] else module.main()
        except _Parsed:
            pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv = saved_argv
        sys.modules.pop(spec.name, None)
    return refused[0] if refused else None


def problems(command: str, tmp_path: Path) -> list[str]:
    """What is wrong with one shown command (empty: it parses, and a run command passes the preflight)."""
    try:
        tokens = _tokens(command)
    except ValueError as err:  # an unterminated quote
        return [f"`{command}`: {err}"]
    if len(tokens) == 1 and tokens[0] in ("fedge", "fedge-edge"):
        return []  # the program named in a unit's comment, not a command
    if tokens[0].startswith("bench/"):
        why = _bench_problem(command)
        return [f"`{command}`: {why}"] if why else []
    rest: list[str] = []
    if "--" in tokens:
        tokens, rest = tokens[:tokens.index("--")], tokens[tokens.index("--") + 1:]
    parser = fedge_parser() if tokens[0] == "fedge" else edge_parser()
    args, why = _refused(lambda: parser.parse_args(tokens[1:]))
    if args is None:
        return [f"`{command}`: {why}"]
    if rest and rest not in (["..."], ["…"]):
        trained, why = _refused(lambda: trainer_args(rest))
        if trained is None:
            return [f"`{command}`: the trainer's arguments: {why}"]
    if tokens[0] == "fedge" and getattr(args, "command", None) in ("demo", "local-cluster"):
        if any(key in command for key in NOT_CHECKED):
            return []
        args.run_dir = str(tmp_path / "run")
        nodes = args.clients if args.command == "demo" else args.supernodes
        plugins = str(ROOT / "examples" / "plugins")  # the docs run the example plugins from there
        sys.path.insert(0, plugins)
        try:
            prepare_run(args, "simulation" if args.command == "demo" else "deployment", nodes)
        except Exception as err:  # noqa: BLE001 - whatever the CLI would refuse with
            return [f"`{command}`: the CLI's preflight refuses it: {err}"]
        finally:
            sys.path.remove(plugins)
    return []


def _flwr_problem(argv: list[str]) -> str | None:
    """A ``flwr`` command parsed by Flower's own CLI (typer/click), without running it; ``flwr run``
    must stream (``--stream``), or the reader sees the run submitted and no training."""
    import click
    import typer
    from flwr.cli.app import app

    group = typer.main.get_command(app)
    try:
        context = group.make_context("flwr", list(argv))
        command = group.get_command(context, argv[0])  # type: ignore[attr-defined]
        if command is None:
            return f"flwr has no command {argv[0]!r}"
        command.make_context(argv[0], list(argv[1:]), parent=context)
    except click.ClickException as err:
        return err.format_message()
    if argv[0] == "run" and "--stream" not in argv:
        return "`flwr run` without --stream returns once the run is submitted: the reader sees no training"
    return None


def shell_lines() -> dict[str, list[str]]:
    """Every command of every tagged shell block (``bash``, ``sh``, ``shell``, ``console``), split
    at ``&&`` and ``;``, by file: what a reader would type."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        lines = []
        for tag, body in _FENCE.findall(doc.read_text(encoding="utf-8")):
            if tag not in _SHELL_TAGS - {""}:
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip().removeprefix("$ ")
                if line and not line.startswith("#"):
                    lines += [part.strip() for part in _shell_parts(line, pipes=False) if part.strip()]
        found[doc.relative_to(ROOT).as_posix()] = lines
    return found


def line_problem(line: str) -> str | None:
    """Why a shell line is neither checked here nor a listed exception (None: it is one of them)."""
    try:
        words = shlex.split(line.split(">")[0])
    except ValueError as err:
        return f"`{line}`: {err}"
    while words and (re.fullmatch(r"[A-Za-z_]+=\S*", words[0]) and words[0] not in NOT_RUN_HERE
                     or words[0] in ("sudo", "time", "exec")):
        words = words[1:]
    if not words:
        return None
    program = words[0].split("/")[-1]
    if program in ("fedge", "fedge-edge") or _BENCH.search(line):
        return None  # parsed above (test_every_shown_command_parses_with_its_real_parser)
    if program in ("python", "python3") and words[1:2] == ["-c"]:
        return None  # the data one-liner, run by tests/test_docs.py
    if program == "flwr":
        why = _flwr_problem(words[1:])
        return f"`{line}`: {why}" if why else None
    if program in NOT_RUN_HERE or words[0] in NOT_RUN_HERE or (program in ("python", "python3")
                                                               and words[1:3] == ["-m", "venv"]):
        return None
    return f"`{line}`: {program} is neither checked here nor in NOT_RUN_HERE"


@pytest.mark.parametrize("where", sorted(shell_lines()))
def test_every_shell_line_is_checked_or_a_listed_exception(where: str) -> None:
    found = [p for line in shell_lines()[where] if (p := line_problem(line))]
    assert not found, "\n".join(found)


def checkout_paths_after_cd(lines: list[str]) -> list[str]:
    """The lines of one shell block that name a checkout-relative path (``ops/fedge-serve.service``)
    after the block has changed into an absolute directory outside the checkout (``cd /etc/fedge``),
    where that path no longer resolves."""
    problems, away = [], None
    for line in lines:
        try:
            words = shlex.split(line.split(">")[0])
        except ValueError:
            continue
        if words[:1] == ["cd"] and len(words) > 1:
            away = words[1] if words[1].startswith("/") else None
            continue
        if away is None:
            continue
        for word in words[1:]:
            if not word.startswith(("-", "/", "$", '"$')) and "/" in word and (ROOT / word).exists():
                problems.append(f"`{line}`: {word} is relative to the checkout, but the block is in {away}")
    return problems


@pytest.mark.parametrize("where", sorted(shell_lines()))
def test_no_line_uses_a_checkout_path_after_leaving_the_checkout(where: str) -> None:
    doc = ROOT / where
    found = []
    for tag, body in _FENCE.findall(doc.read_text(encoding="utf-8")):
        if tag in _SHELL_TAGS - {""}:
            lines = [line.split(" #")[0].strip() for line in body.replace("\\\n", " ").splitlines()]
            found += checkout_paths_after_cd([part.strip() for line in lines if line and not line.startswith("#")
                                              for part in _shell_parts(line, pipes=False) if part.strip()])
    assert not found, "\n".join(found)


def test_the_checkout_path_check_catches_what_operations_md_had() -> None:
    before = ["install -d -m 0755 /etc/fedge", "cd /etc/fedge",
              "install -m 0644 ops/fedge-serve.service /etc/systemd/system/"]
    assert checkout_paths_after_cd(before)
    assert not checkout_paths_after_cd([*before[:2], 'install -m 0644 "$src"/ops/fedge-serve.service /etc/systemd/system/'])


def test_the_shell_line_check_catches_a_bad_flwr_command() -> None:
    assert line_problem("flwr run .")  # no --stream
    assert line_problem("flwr run . --strem")
    assert line_problem("curl https://example.org | sh")
    assert line_problem("flwr run . --stream") is None


def test_the_docs_show_commands_in_code_blocks() -> None:
    shown = shown_commands()
    assert sum(len(c) for c in shown.values()) > 60
    assert any(c.startswith("bench/") for commands in shown.values() for c in commands)
    assert any("cloud-train" in c and " -- " in c for commands in shown.values() for c in commands)


@pytest.mark.parametrize("where", sorted(shown_commands()))
def test_every_shown_command_parses_with_its_real_parser(where: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a run directory or key a command names is made here, never in the checkout
    found = [p for command in shown_commands()[where] for p in problems(command, tmp_path)]
    assert not found, "\n".join(found)


def test_the_checker_catches_what_the_name_check_let_through(tmp_path) -> None:
    """Commands with existing flag names but values their parsers refuse, and one the preflight
    refuses (the issue's examples)."""
    assert problems("fedge demo --quantize int9", tmp_path)
    assert problems("fedge export model.pt --quantize int9", tmp_path)
    assert problems("fedge demo --rounds three", tmp_path)
    assert problems("fedge demo --task fashon", tmp_path)
    assert problems("fedge cloud-train -- --epochz 5", tmp_path)
    assert problems("fedge demo --clients 1000 --clients-per-round 100", tmp_path)
    assert problems("bench/algorithms.py --rounds three", tmp_path)
    assert problems("bench/no_such_bench.py", tmp_path)
    assert not problems("fedge demo --clients 10 --rounds 3", tmp_path)
    assert not problems("fedge cloud-train --nproc-per-node 2 -- --out runs/cloud --epochs 5", tmp_path)
    assert not problems("bench/algorithms.py --clients 10 --rounds 12", tmp_path)
