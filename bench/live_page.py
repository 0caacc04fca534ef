"""The live page at scale: response time at 1,000 devices, and what serving it costs the coordinator.

A run directory as a long run leaves it (``--rounds`` rows of ``metrics.jsonl``, a ``devices.json``
of ``--devices`` devices, each with refusals and a resource report) is served by
``fedge.server.live.LivePage`` in this process, and:

- a client fetches ``/api/federation`` (the whole snapshot; the run directory changes before each
  fetch, so every answer is rebuilt) and ``/`` ``--requests`` times each: median and p95 seconds;
- with nobody looking, the process's CPU over ``--idle`` seconds, as a share of one core;
- with one page open (a fetch every 2 s, answered 304 while nothing changes), the same.

Targets: under 100 ms at 1,000 devices; under 1% of a core while nobody is looking.

    .venv/bin/python bench/live_page.py [--devices 1000 --rounds 200 --requests 50 --idle 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedge.server.live.server import LivePage  # noqa: E402
from fedge.server.run.metrics_log import MetricsLog  # noqa: E402


def write_run(run: Path, devices: int, rounds: int) -> None:
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"settings": {"rounds": rounds, "clients-per-round": devices // 10}}))
    log = MetricsLog(run / "metrics.jsonl")
    for r in range(1, rounds + 1):
        log.append({"round": r, "metric": "accuracy", "accuracy": 0.9, "loss": 0.3, "uplink_bytes": 10_000_000,
                    "uplink_fp32_bytes": 80_000_000, "downlink_bytes": 40_000_000, "clients_sampled": 100,
                    "clients_used": 97, "clients_failed": 3, "seconds": 12.0,
                    "rejected": [{"node": n, "kind": "timeout", "reason": "no reply within the round"} for n in range(3)]})
    resources = {"cpu_seconds": 3.2, "train_cpu_seconds": 2.9, "encode_cpu_seconds": 0.1, "overhead_cpu_seconds": 0.2,
                 "startup_cpu_seconds": 0.0, "wall_seconds": 4.0, "peak_rss_mib": 310.0, "bytes_down": 4e5,
                 "bytes_up": 1e5}
    ledger = {str(n): {"node": n, "partition": n, "rounds": rounds // 10, "last_asked": rounds, "last_round": rounds,
                       "last_seen": time.time(), "refusals": {"timeout": 2}, "resources": resources}
              for n in range(1_000_000, 1_000_000 + devices)}
    (run / "devices.json").write_text(json.dumps({"step": rounds, "devices": ledger}))


def timed(url: str, headers: dict[str, str] | None = None) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
        size = len(response.read())
    return time.perf_counter() - started, size


def cpu_share(seconds: float) -> float:
    """This process's CPU over ``seconds`` of wall time, as a share of one core."""
    import resource

    before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    time.sleep(seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return used / (time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of each CPU measurement")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "live-page"))
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "bench/live_page.py", *(argv if argv is not None else sys.argv[1:])])
    with tempfile.TemporaryDirectory(prefix="fedge-live-page-") as tmp:
        run = Path(tmp) / "run"
        write_run(run, args.devices, args.rounds)
        with LivePage(run) as page:
            api, html, size = [], [], 0
            for i in range(args.requests):
                (run / "devices.json").touch()  # a changed run: the snapshot is built again
                seconds, size = timed(page.url + "api/federation")
                api.append(seconds)
                html.append(timed(page.url)[0])
            idle = cpu_share(args.idle)
            stop = threading.Event()

            def viewer() -> None:  # one open page: a fetch every 2 s, 304 while the run is unchanged
                etag = None
                while not stop.wait(2.0):
                    request = urllib.request.Request(page.url + "api/federation",
                                                     headers={"If-None-Match": etag} if etag else {})
                    try:
                        with urllib.request.urlopen(request, timeout=30) as response:
                            etag = response.headers["ETag"]
                            response.read()
                    except urllib.error.HTTPError as err:
                        if err.code != 304:
                            raise

            watcher = threading.Thread(target=viewer, daemon=True)
            watcher.start()
            watched = cpu_share(args.idle)
            stop.set()
            watcher.join()
    p95 = lambda xs: statistics.quantiles(xs, n=20)[-1] if len(xs) >= 2 else xs[0]  # noqa: E731
    result = {"devices": args.devices, "rounds": args.rounds, "snapshot_bytes": size,
              "api_median_ms": 1000 * statistics.median(api), "api_p95_ms": 1000 * p95(api),
              "page_median_ms": 1000 * statistics.median(html), "idle_core_percent": 100 * idle,
              "one_viewer_core_percent": 100 * watched}
    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()} ({platform.processor() or 'cpu'}): "
        f"{args.devices:,} devices, {args.rounds} rounds, {args.requests} requests each; `{command}`", "",
        "| what | figure | target |", "|---|---|---|",
        f"| /api/federation (snapshot rebuilt, {size / 1e6:.2f} MB) | median {result['api_median_ms']:.1f} ms, "
        f"p95 {result['api_p95_ms']:.1f} ms | < 100 ms |",
        f"| / (the page) | median {result['page_median_ms']:.1f} ms | < 100 ms |",
        f"| coordinator CPU, nobody looking ({args.idle:g} s) | {result['idle_core_percent']:.3f}% of a core | < 1% |",
        f"| coordinator CPU, one page open ({args.idle:g} s) | {result['one_viewer_core_percent']:.3f}% of a core | - |",
    ])
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": command, **result}, indent=2) + "\n")
    print(f"reproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
