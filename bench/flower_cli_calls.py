"""What one ``flwr`` call costs the coordinator: a new ``flwr`` process per call (as ``fedge serve``
polled until 2026-12-06) against one long-lived helper answering every call
(``fedge.launcher.flower_cli``), side by side against one real SuperLink on 127.0.0.1.

The calls are the daemon's own: ``flwr supernode ls`` (every ``node-poll-seconds``) and ``flwr ls
--run-id`` (every 5 s once a run's log stream ended), each with ``--format json``; the two ways
alternate call by call, so the host's speed drifts into both alike. CPU time is the calling
process's children's (a ``flwr`` process, reaped) or the helper's own (``/proc/<pid>/stat``); the
helper's first call, which pays Flower's imports once, is reported apart.

    .venv/bin/python bench/flower_cli_calls.py --calls 10 --out bench/results/flower-cli-calls.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sigterm import stop_on_sigterm

from fedge.launcher.environment import flower_environment
from fedge.launcher.flower_cli import FlowerCli, json_replies
from fedge.launcher.processes import ProcessGroup
from fedge.launcher.sequence import FlowerLaunch

CALLS = (["supernode", "ls", "fedge", "--format", "json"], ["ls", "fedge", "--run-id", "1", "--format", "json"])


def _cpu_of(pid: int) -> float:
    """utime + stime of process ``pid``, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _answered(text: str) -> bool:
    replies = json_replies(text)
    return len(replies) == 1 and isinstance(replies[0], dict)


def main() -> int:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10, help="calls of each kind, each way (default: 10)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedge-flwr-calls-"))
    home = work / "flwr-home"
    env = flower_environment(home)
    flwr_bin = str(Path(sys.executable).parent / "flwr")
    rows: dict[str, list[tuple[float, float]]] = {"process": [], "helper": []}
    with ProcessGroup(work / "logs", env=env) as group:
        FlowerLaunch(group, home).start_superlink(cwd=work)
        with FlowerCli(env, cwd=work) as helper:
            t0 = time.perf_counter()
            _, text = helper.call(list(CALLS[0]))
            assert helper.pid is not None and _answered(text), text
            first = (time.perf_counter() - t0, _cpu_of(helper.pid))
            for i in range(args.calls * len(CALLS)):
                call = CALLS[i % len(CALLS)]
                cpu0, t0 = _children_cpu(), time.perf_counter()
                done = subprocess.run([flwr_bin, *call], env=env, cwd=work, capture_output=True, text=True,
                                      timeout=120, check=False)
                rows["process"].append((time.perf_counter() - t0, _children_cpu() - cpu0))
                assert _answered(done.stdout), done.stdout + done.stderr
                cpu0, t0 = _cpu_of(helper.pid), time.perf_counter()
                _, text = helper.call(list(call))
                rows["helper"].append((time.perf_counter() - t0, _cpu_of(helper.pid) - cpu0))
                assert _answered(text), text
    figures = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{_cpu_model()}, {os.cpu_count()} CPUs",
        "calls_each_way": len(rows["helper"]), "command": "bench/flower_cli_calls.py " + " ".join(sys.argv[1:]),
        "helper_first_call": {"wall_s": round(first[0], 3), "cpu_s": round(first[1], 3)},
    }
    for way, values in rows.items():
        walls, cpus = [w for w, _ in values], [c for _, c in values]
        figures[way] = {"wall_s_median": round(statistics.median(walls), 4),
                        "cpu_s_median": round(statistics.median(cpus), 4), "cpu_s_mean": round(statistics.fmean(cpus), 4)}
    ratio = figures["helper"]["cpu_s_mean"] / figures["process"]["cpu_s_mean"]
    figures["cpu_ratio_helper_to_process"] = round(ratio, 4)
    print(f"{len(rows['helper'])} calls each way against one SuperLink ({figures['date']}, {figures['machine']}):")
    for way in rows:
        print(f"  {way:8s} median {figures[way]['wall_s_median']:.3f} s wall, {figures[way]['cpu_s_median']:.3f} CPU-s "
              f"per call (mean {figures[way]['cpu_s_mean']:.3f})")
    print(f"  helper's first call (Flower's imports, once): {first[0]:.2f} s wall, {first[1]:.2f} CPU-s")
    print(f"  CPU per call, helper / process: {figures['cpu_ratio_helper_to_process']:.3f}")
    print(f"reproduce: .venv/bin/python {figures['command']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
