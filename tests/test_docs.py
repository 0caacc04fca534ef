"""Docs and CLI cannot drift: every ``fedge …`` / ``fedge-edge …`` command in the README and in
``docs/`` (fenced shell blocks and inline code) names subcommands and flags the real parsers have.

Values are not checked (docs use placeholders such as ``DIR``), only the command path and each
``--flag``; everything after a bare ``--`` belongs to another program (``fedge cloud-train -- ...``).
The run-settings table in docs/operations.md is compared with the settings themselves.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from fedge.edge_client.edge_cli import build_parser as edge_parser
from fedge.server.cli.main import build_parser as fedge_parser
from fedge.server.settings import OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_SHELL = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
_INLINE = re.compile(r"(?<!`)`((?:\S*/)?fedge(?:-edge)? [^`]+)`(?!`)")


def _commands(text: str) -> list[str]:
    found = []
    for block in _SHELL.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            found += _segments(line.split(" #")[0].strip().removeprefix("$ "))
    for span in _INLINE.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        found += _segments(span)
    return found


def _segments(line: str) -> list[str]:
    """The ``fedge``/``fedge-edge`` invocations in one shell line (``a && b``, ``a; b``, ``a | b``)."""
    out = []
    for part in re.split(r"&&|;|\|", line):
        words = part.strip().split()
        for i, word in enumerate(words):
            if word.split("/")[-1] in ("fedge", "fedge-edge"):
                out.append(" ".join([word.split("/")[-1], *words[i + 1:]]))
                break
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check(command: str) -> list[str]:
    """Problems with one documented command (empty if its path and flags exist)."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        tokens = command.split()
    parser = fedge_parser() if tokens[0] == "fedge" else edge_parser()
    path = [tokens[0]]
    problems = []
    for token in tokens[1:]:
        token = token.strip("[]()|,.")
        if token == "--" or not token:
            if token == "--":
                break
            continue
        subs = _subparsers(parser)
        if token.startswith("-") and not re.fullmatch(r"-[0-9.]+", token):  # -1 is a value
            flag = token.split("=")[0]
            if flag not in parser._option_string_actions:
                problems.append(f"`{command}`: {' '.join(path)} has no {flag}")
        elif subs:  # a parser with subcommands: its first positional names one
            if token.isupper() or token in ("…", "..."):  # a placeholder: `fedge COMMAND --help`, `fedge …`
                break
            if token not in subs:
                problems.append(f"`{command}`: {' '.join(path)} has no subcommand {token!r} "
                                f"(has {', '.join(sorted(subs))})")
                break
            parser = subs[token]
            path.append(token)
    return problems


def test_docs_mention_commands_at_all() -> None:
    assert len([c for doc in DOCS for c in _commands(doc.read_text(encoding="utf-8"))]) > 30


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_documented_command_exists(doc: Path) -> None:
    problems = [p for command in _commands(doc.read_text(encoding="utf-8")) for p in check(command)]
    assert not problems, "\n".join(problems)


def test_the_checker_catches_what_drifted_before() -> None:
    """The mismatches found on 2026-11-24 would each fail now."""
    assert check("fedge certs register certs/x.pub --dir certs")  # register had no --dir
    assert check("fedge frobnicate --rounds 3")
    assert check("fedge-edge verify bundle --threadz 2")
    assert not check("fedge local-cluster --supernodes 2 --rounds 2 --tls")
    assert not check("fedge cloud-train --nproc-per-node 2 -- --out runs/cloud --epochs 5")


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    subs = _subparsers(parser)
    if not subs:
        yield path, parser
    for name, sub in subs.items():
        yield from _leaves(sub, (*path, name))


def _documented_flags() -> dict[tuple[str, ...], set[str]]:
    seen: dict[tuple[str, ...], set[str]] = {}
    for doc in DOCS:
        for command in _commands(doc.read_text(encoding="utf-8")):
            tokens = command.split()
            parser = fedge_parser() if tokens[0] == "fedge" else edge_parser()
            path = [tokens[0]]
            for token in tokens[1:]:
                token = token.strip("[]()|,.")
                subs = _subparsers(parser)
                if token == "--":
                    break
                if token.startswith("--"):
                    seen.setdefault(tuple(path), set()).add(token.split("=")[0])
                elif subs and token in subs:
                    parser = subs[token]
                    path.append(token)
    return seen


def test_every_flag_is_documented() -> None:
    """The other direction: a flag nobody can find in the docs is as bad as a documented one that
    does not exist. The run settings are documented by the settings table."""
    seen = _documented_flags()
    settings = {f"--{opt.key}" for opt in OPTIONS} | {f"--no-{opt.key}" for opt in OPTIONS if opt.type is bool}
    missing = []
    for root in (fedge_parser(), edge_parser()):
        for path, parser in _leaves(root, (root.prog,)):
            flags = {flag for action in parser._actions for flag in action.option_strings
                     if flag.startswith("--") and flag != "--help"} - settings
            missing += [f"{' '.join(path)} {flag}" for flag in sorted(flags - seen.get(path, set()))]
    assert not missing, "undocumented flags:\n" + "\n".join(missing)


def test_readme_is_short_and_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text(encoding="utf-8")):
            if not target.startswith("http"):
                assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def settings_table() -> str:
    """The run-settings table of docs/operations.md, as it must read (from the settings themselves)."""
    from fedge.launcher.environment import toml_value

    rows = ["| setting (`--flag`, run-config key) | default | meaning |", "|---|---|---|"]
    for opt in OPTIONS:
        default = toml_value(opt.default) if isinstance(opt.default, (bool, str)) else repr(opt.default)
        rows.append(f"| `--{opt.key}` | `{default}` | {opt.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


def test_the_settings_table_is_the_settings() -> None:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert settings_table() in text, "regenerate: python -c 'from tests.test_docs import settings_table; print(settings_table())'"


def test_every_security_claim_names_a_test_that_exists() -> None:
    """SECURITY.md backs each claim with a test: every file and test function it names exists."""
    import re

    text = (ROOT / "SECURITY.md").read_text(encoding="utf-8")
    protected = text.split("## Not protected")[0]
    current: Path | None = None
    named = 0
    for match in re.finditer(r"`(tests/[\w/]+(?:\.py)?/?)?((?:::\w+)?)`", protected):
        path, test = match.group(1), match.group(2)
        if path:
            current = ROOT / path
            assert current.exists(), f"SECURITY.md names {path}, which does not exist"
        if test:
            assert current is not None and current.is_file(), f"SECURITY.md names {test} without its file"
            assert f"def {test[2:]}(" in current.read_text(encoding="utf-8"), f"{current.name} has no {test[2:]}"
        named += bool(path or test)
    assert named >= 15
