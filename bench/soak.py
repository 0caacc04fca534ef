"""Soak: ``fedge serve`` for many rounds while SuperNodes leave and join; is coordinator memory flat?

One daemon (real SuperLink with its database, the Fedge ServerApp, /metrics) and ``--nodes``
``flower-supernode`` processes on 127.0.0.1. Every ``--churn-every`` rounds one SuperNode leaves
(SIGTERM) and a fresh process joins with the same partition (a device coming back). After every
round the resident memory (RSS, from /proc) of each coordinator process (SuperLink, its SuperExec,
the ServerApp, ``flwr run``, the daemon) is recorded; /metrics is scraped every 2 s and parsed with
prometheus_client's parser. Reported: the least-squares slope of coordinator memory over rounds
(after a warm-up of 10 rounds), per process, and the number of scrapes that failed to parse.

    .venv/bin/python bench/soak.py                 # 50 rounds, 4 SuperNodes, churn every 5 rounds
    .venv/bin/python bench/soak.py --rounds 20 --nodes 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from fedge.launcher.environment import flower_environment, supernode_home  # noqa: E402
from fedge.launcher.federation import supernode_argv  # noqa: E402
from fedge.launcher.processes import ProcessGroup, free_port, processes_with_env  # noqa: E402

BIN = Path(sys.executable).parent


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    for part in argv:
        base = os.path.basename(part.decode(errors="replace"))
        if base.startswith(("flower-", "flwr")):
            return base if base != "flwr" else "flwr run"
    return "fedge serve" if any(b"serve" == a for a in argv) else os.path.basename(argv[0].decode())


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--churn-every", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    from prometheus_client.parser import text_string_to_metric_families

    with tempfile.TemporaryDirectory(prefix="fedge-soak-") as tmp:
        directory = Path(tmp)
        port, metrics_port = free_port(), free_port()
        (directory / "fedge.toml").write_text(f"""[service]
address = "127.0.0.1:{port}"
state-dir = "state"
metrics-address = "127.0.0.1:{metrics_port}"
page-address = ""
node-poll-seconds = 10

[run]
rounds = {args.rounds}
clients-per-round = {args.nodes}
min-replies = 1
local-epochs = 1
round-timeout = 60
wait-for-nodes = 20
partitioning = "iid"
""")
        state = directory / "state"
        flwr_home = str(state / "flwr-home")
        env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
        log = open(directory / "serve.log", "ab")  # noqa: SIM115 - closed below
        daemon = subprocess.Popen([str(BIN / "fedge"), "serve", "--config", str(directory / "fedge.toml")],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        group = ProcessGroup(directory / "node-logs", env=flower_environment(directory / "nodes-home"))

        def start_node(i: int, generation: int):
            return group.start(f"supernode-{i}-{generation}", supernode_argv(
                f"127.0.0.1:{port}", free_port(),
                f'partition-id={i} num-partitions={args.nodes} cache-dir="{directory / "cache"}"'),
                env={"FLWR_HOME": str(supernode_home(directory / "nodes-home", i))})

        memory: list[dict] = []
        scrapes, failures, churn_events = 0, [], []
        started = time.monotonic()
        try:
            nodes = {i: start_node(i, 0) for i in range(args.nodes)}
            seen, last_scrape, generation = 0, 0.0, 0
            rows_path = state / "run" / "metrics.jsonl"
            while daemon.poll() is None:
                if time.monotonic() - last_scrape > 2:
                    last_scrape = time.monotonic()
                    try:
                        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
                        list(text_string_to_metric_families(text.decode()))
                        scrapes += 1
                    except OSError:
                        pass
                    except ValueError as err:
                        failures.append(str(err))
                done = len(rows_path.read_text().splitlines()) if rows_path.exists() else 0
                if done > seen:
                    seen = done
                    pids = [p for p in processes_with_env("FLWR_HOME", flwr_home)] + [daemon.pid]
                    per = {}
                    for pid in pids:
                        per[_name(pid)] = per.get(_name(pid), 0.0) + _rss_mb(pid)
                    memory.append({"round": done, "total_mb": sum(per.values()), "per_process_mb": per})
                    print(f"round {done}: coordinator RSS {sum(per.values()):.0f} MB "
                          + " ".join(f"{k} {v:.0f}" for k, v in sorted(per.items())), flush=True)
                    if args.churn_every and done % args.churn_every == 0 and done < args.rounds:
                        generation += 1
                        leaving = generation % args.nodes
                        nodes[leaving].popen.send_signal(signal.SIGTERM)
                        nodes[leaving].popen.wait(timeout=60)
                        nodes[leaving] = start_node(leaving, generation)
                        churn_events.append({"round": done, "node": leaving})
                time.sleep(0.5)
        finally:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                daemon.wait(timeout=120)
            group.stop()
            log.close()
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
        steady = [m for m in memory if m["round"] > args.warmup]
        slope = _slope([m["round"] for m in steady], [m["total_mb"] for m in steady])
        per_slope = {name: _slope([m["round"] for m in steady], [m["per_process_mb"].get(name, 0.0) for m in steady])
                     for name in (steady[-1]["per_process_mb"] if steady else {})}
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs",
            "command": "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rounds": [r["round"] for r in rows], "daemon_exit": daemon.returncode,
            "seconds": time.monotonic() - started, "churn": churn_events,
            "memory_slope_mb_per_round": slope, "memory_slope_per_process": per_slope,
            "memory_first_mb": steady[0]["total_mb"] if steady else None,
            "memory_last_mb": steady[-1]["total_mb"] if steady else None,
            "scrapes": scrapes, "scrape_failures": failures, "memory": memory,
            "final_accuracy": rows[-1]["accuracy"] if rows else None,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ok = result["rounds"] == list(range(1, args.rounds + 1)) and not failures and daemon.returncode == 0
    print(f"soak: {args.rounds} rounds, {len(churn_events)} leave/join events, daemon exit {daemon.returncode}; "
          f"coordinator RSS {result['memory_first_mb']:.0f} -> {result['memory_last_mb']:.0f} MB after round "
          f"{args.warmup}, slope {slope:+.3f} MB/round "
          f"({', '.join(f'{k} {v:+.3f}' for k, v in sorted(per_slope.items()))}); "
          f"{scrapes} scrapes parsed, {len(failures)} failed; accuracy {result['final_accuracy']:.4f}")
    print(f"reproduce: {result['command']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
