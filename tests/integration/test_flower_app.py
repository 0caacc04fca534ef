"""docs/flower.md, followed literally: a plain Flower app of the shape of Flower's quickstart
plus the four lines the page shows, and ``examples/flower-app``, each run with the page's own
command on Flower's default local federation (the simulation engine)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from fedge.launcher.environment import flower_environment
from tests.flower_home import run_flwr, stop_flower_home
from tests.test_packaging import readme_commands

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "flower-app"
#: a plain Flower app of the shape of Flower's quickstart-pytorch, no Fedge in it; its task.py (the
#: model and digits, nothing to download) is the example's, copied in when the test builds the app
QUICKSTART = Path(__file__).resolve().parent / "quickstart_app"
#: the example's Fedge lines and what Flower's own app has in their place (None: nothing)
EXAMPLE_LINES = {
    "digitsapp/server_app.py": [
        ("from fedge.flower import compressed", None),
        ('    strategy = compressed(FedAvg(fraction_train=float(context.run_config["fraction-train"]), '
         'fraction_evaluate=0.0), uplink=str(context.run_config["uplink"]), '
         'downlink=str(context.run_config["downlink"]), start=str(context.run_config["start"]) or None)',
         '    strategy = FedAvg(fraction_train=float(context.run_config["fraction-train"]), fraction_evaluate=0.0)'),
    ],
    "digitsapp/client_app.py": [("from fedge.flower import compression_mod", None),
                                ("app = ClientApp(mods=[compression_mod])", "app = ClientApp()")],
}


def plain_flower_app(fedge_app: Path, out: Path, package: str = "digitsapp") -> Path:
    """The example as Flower wrote it: its four Fedge lines taken back out (the benchmarks' baseline).
    ``package``: the app's package, for another app written with the same four lines
    (``bench/flower_fashion``)."""
    shutil.copytree(fedge_app, out, ignore=shutil.ignore_patterns("__pycache__"))
    for name, lines in EXAMPLE_LINES.items():
        name = name.replace("digitsapp/", f"{package}/", 1)
        text = (out / name).read_text()
        for fedge_line, flower_line in lines:
            assert text.count(fedge_line + "\n") == 1, f"{name}: {fedge_line!r} is not in the example once"
            text = text.replace(fedge_line + "\n", "" if flower_line is None else flower_line + "\n")
        (out / name).write_text(text)
    return out


def apply_docs_diff(app: Path) -> int:
    """docs/flower.md's diff applied to ``app`` exactly as the page shows it: a ``-`` line replaced
    by the ``+`` lines after it, a ``+`` line with no ``-`` before it (an import) added after the
    file's last top-level import. The lines changed."""
    diff = re.search(r"```diff\n(.*?)```", (ROOT / "docs" / "flower.md").read_text(), re.S).group(1)
    changed, target, removed = 0, None, None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            target, removed = app / line[4:].split(" ")[0], None
        elif line.startswith("--- "):
            continue
        elif line.startswith("-"):
            removed = line[1:]
        elif line.startswith("+") and target is not None:
            text = target.read_text()
            if removed is not None:
                assert text.count(removed + "\n") == 1, f"{target.name}: {removed!r} is not in the app once"
                text, removed = text.replace(removed + "\n", line[1:] + "\n"), None
            else:
                lines = text.splitlines(keepends=True)
                last = max(i for i, t in enumerate(lines) if t.startswith(("import ", "from ")))
                text = "".join(lines[:last + 1] + [line[1:] + "\n"] + lines[last + 1:])
            target.write_text(text)
            changed += 1
    assert removed is None
    return changed


def _flwr_run(app: Path, home: Path) -> str:
    """``flwr run . --stream`` in ``app`` as the page writes it; the log (every process stopped)."""
    try:
        done = run_flwr(["bash", "-c", "flwr run . --stream"], cwd=app, env=flower_environment(home), home=home,
                        timeout=500)
    finally:
        stop_flower_home(home)  # flwr leaves its SuperLink running on Flower's fixed ports
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return log


@pytest.mark.xdist_group("flwr-default-federation")  # `flwr run .` uses Flower's fixed local ports
def test_docs_flower_md_works_as_written_in_a_plain_flower_app(tmp_path: Path) -> None:
    """A plain quickstart-shaped app (not Fedge's example) plus exactly the page's four lines, run
    with the page's command: every round's train metrics carry the wrapper's bytes (4-bit QSGD, the
    default: about an eighth of the fp32 update), none refused."""
    commands = readme_commands((ROOT / "docs" / "flower.md").read_text())
    assert commands[1:] == ["flwr run . --stream", "cd examples/flower-app", "flwr run . --stream"], commands
    app = tmp_path / "app"
    shutil.copytree(QUICKSTART, app, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(APP / "digitsapp" / "task.py", app / "pytorchexample" / "task.py")
    assert "fedge" not in "".join(p.read_text() for p in app.rglob("*.py"))
    assert apply_docs_diff(app) == 4
    log = _flwr_run(app, tmp_path / "flwr-home")
    uplink = [float(v) for v in re.findall(r"'fedge-uplink-bytes': ([0-9.e+]+)", log)]
    refused = [float(v) for v in re.findall(r"'fedge-refused': ([0-9.e+]+)", log)]
    replied = [int(n) for n in re.findall(r"aggregate_train: Received (\d+) results", log)]
    assert len(uplink) == len(replied) == 3 and refused == [0.0] * 3, log[-4000:]
    # each reply: 38,282 values at 4 bits plus headers, under a sixth of its fp32 ArrayRecord (153 KB)
    assert all(0 < bytes_ < n * 153_128 / 6 for bytes_, n in zip(uplink, replied)), (uplink, replied)


@pytest.mark.xdist_group("flwr-default-federation")
# make test-slow: the default suite runs the page's diff on a plain app with the example's task
# (test_docs_flower_md_works_as_written_in_a_plain_flower_app), on the same fixed Flower ports, so the
# two ran one after the other (~50 s each); the example as shipped also runs in bench/flower_app.py
@pytest.mark.slow
def test_the_example_runs_as_docs_flower_md_says(tmp_path: Path) -> None:
    plain = plain_flower_app(APP, tmp_path / "plain")
    for name in ("server_app.py", "client_app.py"):
        assert "fedge" not in (plain / "digitsapp" / name).read_text()
    app = tmp_path / "flower-app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    log = _flwr_run(app, tmp_path / "flwr-home")
    # Flower's own summary of the run: every round's aggregated train metrics carry the wrapper's
    # byte count and no refused reply; the server's evaluate_fn ran after every round
    uplink = [float(v) for v in re.findall(r"'fedge-uplink-bytes': ([0-9.e+]+)", log)]
    refused = [float(v) for v in re.findall(r"'fedge-refused': ([0-9.e+]+)", log)]
    assert len(uplink) == 3 and all(v > 0 for v in uplink) and refused == [0.0] * 3, log[-4000:]
    assert len(re.findall(r"'accuracy': ", log)) >= 4, log[-4000:]
    # the example's lattice downlink with its start model named: the nodes build the start model
    # themselves and every round sends each of the 2 nodes a change of a few percent of the model
    # (its fp32 ArrayRecord is 153 KB: 38,282 coordinates)
    downlink = [float(v) for v in re.findall(r"'fedge-downlink-bytes': ([0-9.e+]+)", log)]
    assert len(downlink) == 3 and all(0 < d < 0.05 * 2 * 153_000 for d in downlink), log[-4000:]


@pytest.mark.slow
def test_fedbuff_from_the_apps_serverapp_with_the_lattice_downlink_on_the_simulation_engine(tmp_path: Path) -> None:
    """``fedge.flower.FedBuff`` called from a user's ServerApp on Flower's simulation engine (real
    SuperLink, Ray actors), a quarter of the clients slowed, the model sent as lattice changes:
    every version is published, the model learns, and the downlink is a fraction of fp32's."""
    import argparse
    import json

    from bench.flower_app import fp32_bytes
    from bench.flower_stragglers import bench_app, run_app

    args = argparse.Namespace(rounds=3, local_epochs=2, lr=0.05, alpha=0.5, codec="qsgd:bits=4", clients=4,
                              stragglers="fraction=0.25,slowdown=3", target=0.5, timeout=400)
    run = run_app(bench_app(tmp_path), args, "fedbuff", tmp_path, downlink="lattice:ratio=0.1")
    assert run["versions"] == 3 * 4 // 2
    # six versions of two updates learn (random is 0.1)
    assert run["best_accuracy"] > 0.3 and all(a == a for a in run["accuracy"])
    last = run["train_metrics"][str(run["versions"])]
    fp32 = fp32_bytes(APP)  # the app's model as Flower serializes it
    messages = run["versions"] * 2 + 4  # a buffer of 2 per version, plus the 4 first messages, at most
    assert 0 < last["fedge-downlink-bytes"] < 0.5 * messages * fp32, json.dumps(last)


@pytest.mark.slow
@pytest.mark.parametrize("dp", ["none", "gaussian:noise=0.3,clip=1.0,delta=1e-5"])
def test_secure_aggregation_from_the_apps_serverapp_on_the_simulation_engine(tmp_path: Path, dp: str) -> None:
    """``fedge.flower.secure(FedAvg(...))`` from a user's ServerApp and ``secure_mod`` on its
    ClientApp, on Flower's simulation engine (real SuperLink, Ray actors): the key exchange and the
    unmasking run as train messages on the user's grid, every round unmasks all three nodes' sum,
    and the model learns from it; with distributed DP (q = 1: three devices' noise at z = 0.3 is
    too much for three devices to learn through) every round reports its epsilon, growing."""
    import argparse

    from bench.flower_stragglers import bench_app, run_app

    args = argparse.Namespace(rounds=3, local_epochs=2, lr=0.05, alpha=0.5,
                              codec="secagg:bits=12,clip=0.5,weight-cap=64", clients=3, stragglers="none",
                              target=0.5, timeout=400)
    run = run_app(bench_app(tmp_path), args, "secure", tmp_path, dp=dp)
    assert run["versions"] == 3, run["accuracy"]
    for version in ("1", "2", "3"):
        metrics = run["train_metrics"][version]
        assert metrics["fedge-secagg-survivors"] == 3 and metrics["fedge-uplink-bytes"] > 0, metrics
    if dp == "none":
        assert run["best_accuracy"] > 0.3, run["accuracy"]  # random is 0.1
    else:
        epsilons = [run["train_metrics"][v]["dp_epsilon"] for v in ("1", "2", "3")]
        assert 0 < epsilons[0] < epsilons[1] < epsilons[2], epsilons


@pytest.mark.slow
def test_easgd_from_the_apps_serverapp_on_the_simulation_engine(tmp_path: Path) -> None:
    """``layered(compressed(FedAvg(...)), ElasticAveraging())`` from a user's ServerApp and
    ``elastic_mod`` on its ClientApp, on Flower's simulation engine (real SuperLink, Ray actors):
    each node trains its own model and sends its 4-bit elastic difference, the center learns, and
    every round reports how far the nodes' models stand from it."""
    import argparse

    from bench.flower_stragglers import bench_app, run_app

    args = argparse.Namespace(rounds=3, local_epochs=2, lr=0.05, alpha=0.5, codec="qsgd:bits=4", clients=3,
                              stragglers="none", target=0.5, timeout=400)
    run = run_app(bench_app(tmp_path), args, "easgd", tmp_path)
    assert run["versions"] == 3 and run["best_accuracy"] > 0.3, run["accuracy"]  # random is 0.1
    for version in ("1", "2", "3"):
        metrics = run["train_metrics"][version]
        assert metrics["center_distance"] > 0 and metrics["fedge-uplink-bytes"] > 0, metrics


@pytest.mark.slow
def test_scaffold_from_the_apps_serverapp_on_the_simulation_engine(tmp_path: Path) -> None:
    """``layered(compressed(FedAvg(...)), ControlVariates())`` from a user's ServerApp, ``scaffold_mod``
    on its ClientApp and the corrector in its loop, on Flower's simulation engine (real SuperLink, Ray
    actors): every reply carries its 8-bit control change beside its 4-bit update, none is refused,
    the server's control variate moves, and the model learns."""
    import argparse

    from bench.flower_stragglers import bench_app, run_app

    args = argparse.Namespace(rounds=3, local_epochs=2, lr=0.05, alpha=0.5, codec="qsgd:bits=4", clients=3,
                              stragglers="none", target=0.5, timeout=400)
    run = run_app(bench_app(tmp_path), args, "scaffold", tmp_path)
    assert run["versions"] == 3 and run["best_accuracy"] > 0.3, run["accuracy"]  # random is 0.1
    for version in ("1", "2", "3"):
        metrics = run["train_metrics"][version]
        assert metrics["control_norm"] > 0 and metrics["fedge-refused"] == 0, metrics
        assert metrics["fedge-uplink-bytes"] > 0, metrics
