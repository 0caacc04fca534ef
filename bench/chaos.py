"""Chaos: SuperNodes die mid-run and the whole coordinator loses power once; the run must finish.

One run of ``fedge serve`` (real SuperLink with its state database, the Fedge ServerApp, /metrics)
and N ``flower-supernode`` processes with the Fedge ClientApp on 127.0.0.1, then:

1. after round ``--kill-nodes-after``: SIGKILL ``round(0.3 N)`` SuperNodes (they never come back);
2. after round ``--kill-coordinator-after``: SIGKILL the daemon *and* every process it started
   (SuperLink, ServerApp, ``flwr run``), a power cut of the coordinator machine;
3. start ``fedge serve`` again with the same config: it resumes from the last checkpoint; the
   surviving SuperNodes reconnect by themselves (Flower's own retries).

Checked: every round 1..R exactly once in ``metrics.jsonl``, every line parses, the checkpoint
loads, every /metrics scrape parses (prometheus_client's parser), final accuracy against an
undisturbed run of the same configuration (``--baseline``, run first, side by side), and no process
left. The CI version is the chaos phase of ``tests/integration/test_serve.py`` (one device in three
and the coordinator SIGKILLed, both restarted).

    .venv/bin/python bench/chaos.py                          # 10 SuperNodes, 16 rounds, with baseline
    .venv/bin/python bench/chaos.py --nodes 3 --rounds 3 --kill-nodes-after 1 --kill-coordinator-after 2 --no-baseline
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

from fedge.server.run.checkpoint import CheckpointStore  # noqa: E402
from fedge.launcher.environment import flower_environment, supernode_home  # noqa: E402
from fedge.launcher.federation import supernode_argv  # noqa: E402
from fedge.launcher.processes import ProcessGroup, free_port, processes_with_env  # noqa: E402
from fedge.server.daemon.service_metrics import kind_label  # noqa: E402

BIN = Path(sys.executable).parent


@dataclass
class ChaosResult:
    rounds: list[int]
    accuracy: float
    seconds: float
    nodes_killed: int
    coordinator_killed_after: int | None
    resumed_from: int | None
    scrapes: int
    replies_used: int = 0
    #: replies refused, by reason (``timeout``: a node that did not answer within round-timeout)
    replies_rejected: dict[str, int] = field(default_factory=dict)
    scrape_errors: list[str] = field(default_factory=list)
    leftovers: list[int] = field(default_factory=list)
    log_dir: str = ""


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rejected(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        for item in row.get("rejected") or []:
            kind = kind_label(item)  # the typed kind, as the daemon's /metrics labels it
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _write_config(directory: Path, port: int, metrics_port: int, nodes: int, rounds: int, local_epochs: int,
                  round_timeout: float, wait_for_nodes: float) -> Path:
    path = directory / "fedge.toml"
    path.write_text(f"""[service]
address = "127.0.0.1:{port}"
state-dir = "state"
metrics-address = "127.0.0.1:{metrics_port}"
page-address = ""
node-poll-seconds = 10
stop-grace-seconds = 60

[run]
rounds = {rounds}
clients-per-round = {nodes}
min-replies = 1
local-epochs = {local_epochs}
round-timeout = {round_timeout}
wait-for-nodes = {wait_for_nodes}
partitioning = "iid"
""")
    return path


def _power_cut(daemon: subprocess.Popen, flwr_home: Path) -> None:
    """SIGKILL the daemon and everything it started (they all carry its FLWR_HOME)."""
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.wait()
    for pid in processes_with_env("FLWR_HOME", str(flwr_home)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_chaos(directory: Path, *, nodes: int = 10, rounds: int = 16, local_epochs: int = 5,
              kill_nodes_after: int | None = 2, kill_coordinator_after: int | None = 4,
              kill_fraction: float = 0.3, round_timeout: float | None = None, wait_for_nodes: float = 30.0,
              timeout: float | None = None) -> ChaosResult:
    """One run (see the module docstring). ``wait_for_nodes``: after the restart the coordinator
    waits this long for ``clients-per-round`` nodes (the killed ones never come), then goes on with
    the survivors. ``round_timeout``: default 15 s per SuperNode (at least 90): on 2 cores every
    ClientApp of a round competes for the same CPUs, so a round's time grows with the nodes."""
    round_timeout = round_timeout or max(90.0, 15.0 * nodes)
    timeout = timeout or 600.0 + 2 * rounds * round_timeout
    directory.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_port(), free_port()
    config = _write_config(directory, port, metrics_port, nodes, rounds, local_epochs, round_timeout, wait_for_nodes)
    state = directory / "state"
    run_dir, flwr_home = state / "run", state / "flwr-home"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    serve = [str(BIN / "fedge"), "serve", "--config", str(config)]
    node_home = directory / "nodes-home"
    doomed = set(range(max(1, round(kill_fraction * nodes)))) if kill_nodes_after else set()
    started = time.monotonic()
    deadline = started + timeout
    scrapes, errors = 0, []
    resumed_from = None
    daemon_log = open(directory / "serve.log", "ab")  # noqa: SIM115 - closed in finally
    daemon = subprocess.Popen(serve, stdout=daemon_log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    group = ProcessGroup(directory / "node-logs", env=flower_environment(node_home))
    try:
        supernodes = [
            group.start(f"supernode-{i}", supernode_argv(
                f"127.0.0.1:{port}", free_port(),
                f'partition-id={i} num-partitions={nodes} cache-dir="{directory / "node-cache"}"'),
                env={"FLWR_HOME": str(supernode_home(node_home, i))})
            for i in range(nodes)
        ]
        killed_nodes = killed_coordinator = False
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos run did not finish in {timeout:.0f} s; logs in {directory}")
            try:
                _scrape(metrics_port)
                scrapes += 1
            except OSError:
                pass  # not up yet, or between a power cut and the restart
            except ValueError as err:  # a scrape that does not parse is a finding
                errors.append(str(err))
            done = len(_rows(run_dir))
            if kill_nodes_after and not killed_nodes and done >= kill_nodes_after:
                for i in sorted(doomed):
                    os.killpg(supernodes[i].pid, signal.SIGKILL)
                killed_nodes = True
                print(f"chaos: killed SuperNodes {sorted(doomed)} after round {done}", flush=True)
            if kill_coordinator_after and not killed_coordinator and done >= kill_coordinator_after:
                _power_cut(daemon, flwr_home)
                killed_coordinator = True
                resumed_from = CheckpointStore(run_dir / "checkpoint").load().round  # must load after a power cut
                print(f"chaos: power cut of the coordinator after round {done} (checkpoint: round "
                      f"{resumed_from}); restarting it", flush=True)
                daemon = subprocess.Popen(serve, stdout=daemon_log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)
            if daemon.poll() is not None:
                if daemon.returncode != 0:
                    tail = (directory / "serve.log").read_text(errors="replace").splitlines()[-40:]
                    raise RuntimeError(f"fedge serve exited {daemon.returncode}; last lines of its log:\n"
                                       + "\n".join(tail))
                break
            time.sleep(1.0)
    finally:
        if daemon.poll() is None:
            _power_cut(daemon, flwr_home)
        group.stop()
        daemon_log.close()
    rows = _rows(run_dir)  # every line parses or this raises
    summary = json.loads((run_dir / "summary.json").read_text())
    CheckpointStore(run_dir / "checkpoint").load()
    leftovers = processes_with_env("FLWR_HOME", str(flwr_home)) + processes_with_env("FLWR_HOME", str(node_home), under=True)
    return ChaosResult(
        rounds=[r["round"] for r in rows], accuracy=summary["final_accuracy"],
        seconds=time.monotonic() - started, nodes_killed=len(doomed),
        coordinator_killed_after=kill_coordinator_after, resumed_from=resumed_from, scrapes=scrapes,
        replies_used=sum(int(r.get("clients_used") or 0) for r in rows), replies_rejected=_rejected(rows),
        scrape_errors=errors, leftovers=leftovers, log_dir=str(directory),
    )


def _portable(result: ChaosResult) -> dict[str, Any]:
    """A result for the results file: without the run's temporary directory (deleted after it)."""
    return {k: v for k, v in result.__dict__.items() if k != "log_dir"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--kill-nodes-after", type=int, default=2)
    parser.add_argument("--kill-coordinator-after", type=int, default=4)
    parser.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    parser.add_argument("--keep", metavar="DIR", help="run in DIR and keep every log (default: a temporary "
                        "directory, deleted afterwards)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    common = dict(nodes=args.nodes, rounds=args.rounds, local_epochs=args.local_epochs)
    results: dict[str, Any] = {}
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="fedge-chaos-")) as tmp:
        if not args.no_baseline:
            base = run_chaos(Path(tmp) / "baseline", kill_nodes_after=None, kill_coordinator_after=None, **common)
            results["undisturbed"] = _portable(base)
            print(f"undisturbed: accuracy {base.accuracy:.4f}, {base.seconds:.0f} s", flush=True)
        chaos = run_chaos(Path(tmp) / "chaos", kill_nodes_after=args.kill_nodes_after,
                          kill_coordinator_after=args.kill_coordinator_after, **common)
        results["chaos"] = _portable(chaos)
    ok = chaos.rounds == list(range(1, args.rounds + 1)) and not chaos.scrape_errors and not chaos.leftovers
    gap = None if args.no_baseline else 100 * (results["undisturbed"]["accuracy"] - chaos.accuracy)
    results.update({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs",
                    "command": "python bench/chaos.py " + " ".join(argv or sys.argv[1:]),
                    "rounds_exactly_once": ok, "accuracy_gap_points": gap})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"chaos: {args.nodes} SuperNodes, {chaos.nodes_killed} killed after round {args.kill_nodes_after}, "
          f"coordinator power cut after round {args.kill_coordinator_after} (resumed from {chaos.resumed_from})")
    print(f"  rounds {chaos.rounds} (each exactly once: {ok}); {chaos.scrapes} /metrics scrapes parsed, "
          f"{len(chaos.scrape_errors)} failed; leftover processes: {chaos.leftovers}")
    print(f"  accuracy {chaos.accuracy:.4f}" + (f" vs undisturbed {results['undisturbed']['accuracy']:.4f}: "
                                                f"{-gap:+.2f} points" if gap is not None else "") +
          f"; {chaos.seconds:.0f} s")
    print(f"reproduce: {results['command']}")
    return 0 if ok and (gap is None or gap <= 2.0) else 1


if __name__ == "__main__":
    sys.exit(main())
