"""Docs and CLI cannot drift: every ``fedge …`` / ``fedge-edge …`` command in the README, ``docs/``,
SECURITY.md, CHANGELOG.md, the examples' and the templates' READMEs, the systemd units and the CLI's
own epilog (fenced shell blocks, inline code, unit files) names subcommands and flags the real
parsers have, and every spec-string value it passes to a run setting parses (``--codec``,
``--algorithm``, ...; placeholders in capitals are skipped). Everything after a bare ``--`` belongs
to another program (``fedge cloud-train -- ...``). Setting names written in prose (``the `x`
setting``), in TOML examples and in the daemon's example configuration must be settings; links
resolve, anchors included. The run-settings table in docs/operations.md is compared with the
settings themselves.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from fedge.deploy.certs import IDENTITY_NODE_CONFIG
from fedge.edge_client.edge_cli import build_parser as edge_parser
from fedge.server.cli.main import build_parser as fedge_parser
from fedge.server.settings import OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "SECURITY.md", ROOT / "CHANGELOG.md",
        *sorted((ROOT / "examples").rglob("README.md")),
        *sorted((ROOT / "server" / "cli" / "templates").glob("*/README.md"))]
#: files that are not Markdown but show commands: systemd units (comments and ExecStart lines)
UNITS = sorted((ROOT / "ops").glob("*.service"))
_SHELL = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
_INLINE = re.compile(r"(?<!`)`((?:\S*/)?fedge(?:-edge)? [^`]+)`(?!`)")


def _commands(text: str) -> list[str]:
    """The fedge / fedge-edge invocations a document shows."""
    found = []
    for block in _SHELL.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            found += _segments(line.split(" #")[0].strip().removeprefix("$ "))
    for span in _INLINE.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        found += _segments(span)
    return found


def _unit_commands(text: str) -> list[str]:
    """The fedge / fedge-edge invocations of a systemd unit: its commented install lines and its
    ``Exec*`` lines (continuation lines joined)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.lstrip("# ").split("=", 1)[1] if re.match(r"Exec\w*=", line) else line.lstrip("#").strip()
        found += _segments(line)
    return found


def _epilog_commands() -> list[str]:
    found = []
    for parser in (fedge_parser(), edge_parser()):
        for line in (parser.epilog or "").splitlines():
            found += _segments(line.split(" #")[0].strip())
    return found


def _segments(line: str) -> list[str]:
    """The ``fedge``/``fedge-edge`` invocations in one shell line (``a && b``, ``a; b``, ``a | b``)."""
    out = []
    for part in _shell_parts(line):
        words = part.strip().split()
        for i, word in enumerate(words):
            if word.split("/")[-1] in ("fedge", "fedge-edge"):
                out.append(" ".join([word.split("/")[-1], *words[i + 1:]]))
                break
            if word not in ("sudo", "time", "exec", "$") and not re.fullmatch(r"[A-Z_]+=\S*", word):
                break  # the program is another one (``useradd ... fedge`` names a user)
    return out


def _shell_parts(line: str, pipes: bool = True) -> list[str]:
    """``line``'s commands: split at ``&&``, ``;`` and (``pipes``) ``|`` outside quotes, so
    ``--tracking 'tensorboard;mlflow'`` stays one argument."""
    parts, current, quote, i = [], [], "", 0
    while i < len(line):
        char = line[i]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == ";" or (pipes and char == "|") or line.startswith("&&", i):
            parts.append("".join(current))
            current, i = [], i + (2 if line.startswith("&&", i) else 1)
            continue
        current.append(char)
        i += 1
    return [*parts, "".join(current)]


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


def _spec_checkers() -> dict[str, object]:
    """Run-setting flag -> a function that raises on a value that does not parse (the parsers the
    CLI's preflight uses)."""
    from fedge.aggregation import make_server_optimizer
    from fedge.aggregation.broadcast import parse_downlink
    from fedge.aggregation.model_average import parse_model_average
    from fedge.aggregation.robust import make_aggregator
    from fedge.aggregation.update_bounds import make_norm_bound, make_weight_cap
    from fedge.compression import make_codec
    from fedge.privacy.dp_spec import parse_differential_privacy
    from fedge.privacy.spec import parse_secure_aggregation
    from fedge.protocol.faulty_clients import parse_faulty_clients
    from fedge.protocol.stragglers import parse_stragglers
    from fedge.server.algorithms.registry import algorithm_class
    from fedge.tasks.partition import validate_partitioning

    return {
        "--codec": make_codec, "--downlink-codec": parse_downlink, "--server-opt": make_server_optimizer,
        "--aggregator": lambda v: make_aggregator(v, 10, 4), "--update-norm": make_norm_bound,
        "--weight-cap": make_weight_cap, "--secure-aggregation": parse_secure_aggregation,
        "--differential-privacy": parse_differential_privacy, "--model-average": parse_model_average,
        "--partitioning": validate_partitioning, "--faulty-clients": parse_faulty_clients,
        "--stragglers": parse_stragglers, "--algorithm": algorithm_class,
    }


def check_values(command: str) -> list[str]:
    """Spec strings passed to run settings in one documented command, each parsed for real."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        return []
    checkers = _spec_checkers()
    if "--plugins" in tokens:  # a plugin's codecs, aggregators and algorithms exist once it is loaded
        import sys

        from fedge.protocol.plugins import PluginError, load_plugins

        sys.path.insert(0, str(ROOT / "examples" / "plugins"))
        try:
            load_plugins(tokens[tokens.index("--plugins") + 1])
        except PluginError:  # a user's own module, named for illustration (my_codecs): not ours to check
            return []
        finally:
            sys.path.remove(str(ROOT / "examples" / "plugins"))
    problems = []
    for flag, value in zip(tokens, tokens[1:]):
        flag, _, inline = flag.partition("=")
        value = inline or value
        if flag not in checkers or value.startswith("-") or re.search(r"[A-Z]{2}|<|\.\.\.|…", value):
            continue  # a placeholder (SPEC, <codec>, ...) is not a value
        try:
            checkers[flag](value)  # type: ignore[operator]
        except Exception as err:  # noqa: BLE001 - any refusal is a wrong document
            problems.append(f"`{command}`: {flag} {value!r} does not parse: {err}")
    return problems


def _all_commands() -> dict[str, list[str]]:
    found = {doc.relative_to(ROOT).as_posix(): _commands(doc.read_text(encoding="utf-8")) for doc in DOCS}
    found.update({unit.relative_to(ROOT).as_posix(): _unit_commands(unit.read_text(encoding="utf-8")) for unit in UNITS})
    found["fedge --help (epilog)"] = _epilog_commands()
    return found


def test_docs_mention_commands_at_all() -> None:
    commands = _all_commands()
    assert len([c for doc in DOCS for c in _commands(doc.read_text(encoding="utf-8"))]) > 30
    assert all(commands[unit.relative_to(ROOT).as_posix()] for unit in UNITS)
    assert len(commands["fedge --help (epilog)"]) >= 8


@pytest.mark.parametrize("where", sorted(_all_commands()))
def test_every_documented_command_exists_and_its_specs_parse(where: str) -> None:
    problems = [p for command in _all_commands()[where] for p in check(command) + check_values(command)]
    assert not problems, "\n".join(problems)


def test_the_value_checker_catches_a_wrong_spec() -> None:
    assert check_values("fedge demo --codec qsgd:bitz=4")
    assert check_values("fedge demo --algorithm gosip")
    assert not check_values("fedge demo --codec SPEC --algorithm gossip:topology=exponential,gamma=0.5")


_SETTING_PROSE = re.compile(r"`([a-z][a-z0-9]*(?:-[a-z0-9]+)+)` (?:run )?settings?\b|\bsettings? `([a-z][a-z0-9]*(?:-[a-z0-9]+)+)`")


def test_setting_names_in_prose_and_examples_are_settings() -> None:
    """``the `client-eval-every` setting`` when no such setting exists (any more) fails here, as do
    keys of a TOML example's ``[run]`` table and of the daemon's example configuration."""
    keys = {opt.key for opt in OPTIONS}
    problems = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in _SETTING_PROSE.finditer(text):
            name = match.group(1) or match.group(2)
            if name not in keys:
                problems.append(f"{doc.name}: `{name}` is not a setting")
        for block in re.findall(r"```toml\n(.*?)```", text, flags=re.S):
            problems += [f"{doc.name}: {p}" for p in _run_table_problems(block, keys)]
    example = ROOT / "server" / "daemon" / "fedge.example.toml"
    problems += [f"{example.name}: {p}" for p in _run_table_problems(example.read_text(encoding="utf-8"), keys)]
    assert not problems, "\n".join(problems)


#: hyphenated words the docs may show in backticks that are not run settings: programs, packages,
#: the daemon's [service] keys (added below), spec parameters and values, metric and message names
_OTHER_WORDS = {
    "leaf-alive", "leaf-timeout",  # a leaf's heartbeat file and its bridge's node config key
    "fedge-edge", "flower-superlink", "flower-supernode", "flwr-clientapp", "flwr-serverapp", "flwr-simulation",
    "local-cluster", "client-resources-num-gpus",
    "flwr-datasets", "dataset-fashion-mnist", "dp-accounting",
    "clip-lr", "control-bits", "simple-cnn", "max-staleness", "reset-momentum", "sparse-mean", "trimmed-mean", "dynamic-int8", "ef21-pp",
    "bidirectional-full", "num-examples", "train-loss", "local-steps", "pull-messages",
    "weight-cap", "dp-clip", "dp-fitted", "prox-mu", "downlink-codec",
    "train-seconds",  # a reply's metric
    "min-share", "max-share",  # parameters of selection=oort
    "require-secure-aggregation", "min-participants", "min-threshold", "dp-min-noise", "dp-max-clip",  # a device's node config
    "device-code", "client-app", "allowed-modules", "no-default-policy",  # a device's node config (pinned code)
    *IDENTITY_NODE_CONFIG,  # a device's issued identity, in its node config
    "leaf-count", "leaf-connected",  # a bridge's metrics
    "warm-device",  # bench/clientapp_cpu.py --isolation: warm execution as a device install runs it
    "fedge-uplink-bytes", "fedge-downlink-bytes", "fedge-refused", "fedge-dropped-stale", "fedge-secagg-survivors",  # metrics fedge.flower adds to a Flower strategy's round
}


def test_hyphenated_names_in_the_docs_are_settings_or_known_words() -> None:
    """A renamed setting leaves its old name in prose (``client-eval-every``): every hyphenated word
    in backticks is a run setting, a daemon key, or a word of another vocabulary listed above.
    CHANGELOG.md is history and may name what was removed."""
    from fedge.server.daemon.service_config import _SERVICE_KEYS

    from fedge.protocol.failures import FailureKind

    known = {opt.key for opt in OPTIONS} | set(_SERVICE_KEYS) | _OTHER_WORDS | {kind.value for kind in FailureKind}
    problems = [f"{doc.name}: `{word}`" for doc in DOCS if doc.name != "CHANGELOG.md"
                for word in re.findall(r"`([a-z][a-z0-9]*(?:-[a-z0-9]+)+)`", doc.read_text(encoding="utf-8"))
                if word not in known]
    assert not problems, "not a setting (nor a known word):\n" + "\n".join(sorted(set(problems)))


def _run_table_problems(toml: str, keys: set[str]) -> list[str]:
    problems, table = [], ""
    for line in toml.splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("["):
            table = line.strip("[] ")
        elif "=" in line and table in ("run", "tool.flwr.app.config"):
            key = line.split("=")[0].strip()
            if key not in keys:
                problems.append(f"[{table}] {key} is not a setting")
    return problems


def test_the_docs_way_to_make_a_data_file_runs_as_written(tmp_path) -> None:
    """The one-liner that makes ``own.npz`` and ``x.npy`` (edge.md, extending.md, operations.md),
    and the device's data check that uses it, exactly as the docs show them."""
    import subprocess
    import sys

    lines = {line.split("   #")[0].strip() for doc in DOCS for block in _SHELL.findall(doc.read_text(encoding="utf-8"))
             for line in block.splitlines() if line.startswith('python -c "from sklearn.datasets import load_digits')}
    (line,) = lines  # one way, shown the same everywhere
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, check=True, timeout=120)
    assert (tmp_path / "own.npz").is_file() and (tmp_path / "x.npy").is_file()
    done = subprocess.run(["bash", "-c", "fedge-edge join --superlink 127.0.0.1:9093 --insecure --data own.npz --check"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


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


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_short_and_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    problems = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", doc.read_text(encoding="utf-8")):
            if target.startswith("http"):
                continue
            path = (doc.parent / target) if target else doc
            if not path.exists():
                problems.append(f"{doc.name} links to missing {target}")
            elif anchor and path.suffix == ".md":
                headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)}
                if anchor not in headings:
                    problems.append(f"{doc.name} links to {target}#{anchor}, which has no such heading")
    assert not problems, "\n".join(problems)


def _section(text: str, anchor: str) -> str:
    """The part of a Markdown text under the heading with ``anchor``, up to the next heading of
    the same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^(#+) (.+)$", line)
        if match and _anchor(match.group(2)) == anchor:
            level, out = len(match.group(1)), []
            for rest in lines[i + 1:]:
                heading = re.match(r"^(#+) ", rest)
                if heading and len(heading.group(1)) <= level:
                    break
                out.append(rest)
            return "\n".join(out)
    raise AssertionError(f"no heading for #{anchor}")


def test_the_readmes_headline_figures_are_the_ones_results_md_holds() -> None:
    """One figure, one place: every number of the README's first table (what Fedge adds to Flower)
    appears, as written, in the results.md section its row links to; a figure updated there and
    not in the README (or the other way round) fails here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    table = readme.split("**What Fedge adds to a Flower federation**", 1)[1].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "results.md#" in line]
    assert len(rows) >= 5, table
    problems = []
    for row in rows:
        anchor = re.search(r"results\.md#([^)]+)\)", row).group(1)
        section = _section(results, anchor)
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?x?", row.split("](")[0]):
            if number not in section:
                problems.append(f"{number!r} ({row.split('|')[1].strip()}) is not in results.md#{anchor}")
    assert not problems, "\n".join(problems)


def test_every_number_of_the_readmes_results_is_in_results_md() -> None:
    """The README's Results section quotes results.md: a number there that results.md does not hold
    (a figure changed on one page only) fails here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    numbers = set(re.findall(r"\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?(?:x|%)?", section))
    assert len(numbers) > 50
    missing = sorted(n for n in numbers if n not in results)
    assert not missing, f"in the README's Results, not in docs/results.md: {missing}"


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



#: A measured figure: a number with the unit of a measurement (ratio, percent, bytes, time, points).
_FIGURE = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?(?:[-–]\d[\d,]*(?:\.\d+)?)?"
                     r"(?: ?(?:x|%|MiB|GiB|KiB|MB|GB|kB|KB|ms|µs|s|points|bytes|B))(?![\w])")
#: A section that is its figures' source says when they were measured and how to measure them again.
_DATE = re.compile(r"20\d\d-\d\d-\d\d")
_REPRODUCE = re.compile(r"bench/\S+\.py|make \w|tests/\S+\.py|`fedge \w|pip install")
#: Numbers with a unit that are not measurements, in one place: (page, figure) -> why.
NOT_MEASURED: dict[tuple[str, str], str] = {
    ("README.md", "1-2%"): "DGC's usual ratios, a setting",
    ("algorithms.md", "153 KB"): "arithmetic: 4 bytes x 38,282 parameters",
    ("algorithms.md", "4 bytes"): "the size of a float32",
    ("operations.md", "4 bytes"): "the size of a float32",
    ("algorithms.md", "0-3 s"): "Flower's SuperNode polling interval, a constant of its source",
    ("algorithms.md", "5x"): "the scenario a unit test sets up (a quarter of the devices 5x slower)",
    ("architecture.md", "20%"): "the held-out split's size, a setting",
    ("capacity.md", "24 GiB"): "this machine's memory",
    ("results.md", "24 GiB"): "this machine's memory",
    ("cloud.md", "5%"): "the compile check's threshold, a constant",
    ("codecs.md", "3%"): "a lattice ratio, a setting",
    ("codecs.md", "1%"): "a sparsifier's ratio, a setting",
    ("codecs.md", "0.1%"): "a sparsifier's ratio, a setting",
    ("codecs.md", "2%"): "a sparsifier's ratio, a setting",
    ("codecs.md", "5%"): "a sparsifier's ratio, a setting",
    ("edge.md", "2.2 points"): "arithmetic: one sample of 45 is 100/45 points",
    ("edge.md", "1000x"): "the scale of the bad calibration data a test feeds, a test input",
    ("edge.md", "16 MiB"): "the envelope's size limit, a constant",
    ("flower.md", "10%"): "the tolerance a test asserts",
    ("privacy.md", "20%"): "the share of devices a test crashes, a test input",
}


def _sections(text: str) -> list[str]:
    """A page cut at every heading outside code blocks; each piece is one section's own text."""
    sections, current, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#+ ", line) and current:
            sections.append("\n".join(current))
            current = []
        current.append(line)
    sections.append("\n".join(current))
    return sections


def _paragraphs(section: str) -> list[str]:
    """A section's paragraphs outside code blocks: blank-line blocks, with each table row and list
    item on its own (a row quotes its own figures)."""
    text = re.sub(r"```.*?```", "", section, flags=re.S)
    return [p for p in re.split(r"\n\s*\n|\n(?=\|)|\n(?=\s*[-*] |\s*\d+\. )", text) if p.strip()]


def _sentences(paragraph: str) -> list[str]:
    return re.split(r"(?<=[.;:])\s+(?=[A-Z(`*])", paragraph)


def figure_problems(pages: dict[str, str]) -> list[str]:
    """Each measured figure on a page is quoted with a link to its source in the same sentence (and
    the linked section holds it, as written), or stands in a section that gives a date and a
    reproduce command (the page is its source), or is listed in ``NOT_MEASURED`` with why."""
    problems = []
    for name, text in pages.items():
        for section in _sections(text):
            own = bool(_DATE.search(section) and _REPRODUCE.search(section))
            for sentence in (s for p in _paragraphs(section) for s in _sentences(p)):
                figures = [f for f in _FIGURE.findall(sentence) if (Path(name).name, f) not in NOT_MEASURED]
                if not figures:
                    continue
                links = re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", sentence)
                if not links:
                    if not own:
                        problems.append(f"{name}: {figures} with no source (no link to one, and the "
                                        f"section gives no date and command): {sentence.strip()[:100]!r}")
                    continue
                held = ""
                for target, anchor in links:
                    path = ((ROOT / name).parent / target).resolve() if target else ROOT / name
                    key = path.relative_to(ROOT).as_posix()
                    held += _section(pages[key] if key in pages else path.read_text(encoding="utf-8"), anchor)
                differ = [f for f in figures if f not in held]
                if differ:
                    problems.append(f"{name}: {differ} are not in the section it links "
                                    f"({', '.join(a for _, a in links)}): {sentence.strip()[:100]!r}")
    return problems


def _figure_pages() -> dict[str, str]:
    """The pages to check, by path from the checkout: docs/ (results.md too: its headline table quotes
    its own sections), and the README without its first table and its Results section (the two
    tests above hold those to results.md, number by number)."""
    pages = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("**What Fedge adds to a Flower federation**", 1)[1].split("\n\n")[1]
    results = "\n## Results\n" + readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    pages["README.md"] = readme.replace(table, "").replace(results, "\n")
    return pages


def test_every_figure_in_the_docs_is_measured_there_or_quoted_from_its_source() -> None:
    """One figure, one place: a figure in docs/ either stands in a section that says when and how it
    was measured, or links the section it comes from and matches it as written."""
    problems = figure_problems(_figure_pages())
    assert not problems, "\n".join(problems)


def test_the_figure_check_catches_a_quote_that_drifted_and_a_figure_without_source() -> None:
    """The check above, on pages made for it: a quote that differs from the section it links, and a
    figure with neither a link nor a dated, reproducible section, are both named; a measured
    section and an exact quote pass."""
    pages = {
        "docs/a.md": "# A\n\nThe demo's uplink is 7.92x smaller ([demo](results.md#the-demo)).\n",
        "docs/b.md": "# B\n\nIt trains 3.1x faster than before.\n",
        "docs/c.md": ("# C\n\nMeasured 2026-11-28 with `.venv/bin/python bench/edge.py`: 14.3 µs per sample.\n\n"
                      "The demo's uplink is 7.91x smaller ([demo](results.md#the-demo)).\n"),
    }
    problems = figure_problems(pages)
    assert len(problems) == 2, problems
    assert "docs/a.md: ['7.92x'] are not in the section it links (the-demo)" in problems[0]
    assert "docs/b.md: ['3.1x'] with no source" in problems[1]


def test_results_md_is_a_short_page_with_its_headline_table_first() -> None:
    """docs/results.md is the current figures, not a notebook: at most 300 lines, and the first
    section under its title is the headline table (how each figure was reached lives beside the
    benchmarks' output, in bench/results/)."""
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    assert sections[0] == "Headline figures", sections[:3]
    table = _section(text, _anchor("Headline figures"))
    assert table.count("\n| ") >= 10 and "| figure | compared with | date | section |" in table
