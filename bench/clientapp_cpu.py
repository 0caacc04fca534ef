"""What one deployment message costs a device, under Flower's subprocess isolation and Fedge's warm
execution, side by side in one invocation.

Flower 1.41's default (``--isolation subprocess``) starts a fresh ``flwr-clientapp`` process for
every message, so a device pays Python, Flower and torch imports on every round besides its
training. Fedge's default (``warm``, ``fedge.edge_client.warm_executor``) forks each message's
process from one pre-imported parent. This benchmark runs the product's own deployment path
(``fedge.server.local.launch``: a real SuperLink and N SuperNodes on 127.0.0.1) once per isolation
of ``--isolation`` and measures each message three ways:

* from outside. Subprocess: ``/proc`` sampled every ``--interval`` seconds for the run's
  ``flwr-clientapp`` processes (found by the run's ``FLWR_HOME``), CPU at the last sample, so a
  lower bound. Warm: the warm process's ledger, each child's exact CPU from ``wait4``, plus the
  parent's own CPU after its warm-up (its polling) shared over the messages.
* from inside: the device's resource report in every reply (``fedge.protocol.resources``):
  training, encoding and overhead apart; the rows' medians over rounds 2.. are shown.
* the whole run: the CPU of every process carrying the run's ``FLWR_HOME`` (SuperLink, ServerApp,
  SuperNodes, ClientApps, warm process, ``flwr run``), children it reaped included, when each
  metrics row lands; rounds 3.. minus round 2, per device message.

Memory: the SuperNode processes' and the warm process's peak RSS and PSS (``smaps_rollup``: shared
pages divided among the processes sharing them). A node's first message (it also loads and caches
its partition) is reported apart from the later ones.

    .venv/bin/python bench/clientapp_cpu.py          # 4 SuperNodes, 3 rounds: subprocess, warm, warm-device
    .venv/bin/python bench/clientapp_cpu.py --rounds 5 --local-epochs 1 --partitioning iid   # the whole-tree measure
    .venv/bin/python bench/clientapp_cpu.py --supernodes 16 --rounds 6 --algorithm fedbuff:concurrency=16,buffer=8 \
        --stragglers fraction=0.25,slowdown=5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Nothing here imports torch before the import ladders have run (``main``): a process that maps
# torch's libraries keeps the warm process from releasing their pages, as no process on a device does.
from fedge.launcher.processes import processes_with_env  # noqa: E402
from fedge.server.settings import RunSettings  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _clientapp(pid: str, home: bytes) -> tuple[float, int, int] | None:
    """(CPU-seconds, node index, start in clock ticks since boot) of a live ClientApp process of
    this run, else None."""
    try:
        if b"flwr-clientapp" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        node_home = next((e for e in environ if e.startswith(b"FLWR_HOME=" + home)), None)
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if node_home is None:
        return None
    node = node_home.rstrip(b"/").rsplit(b"/", 1)[-1]  # <run FLWR_HOME>/supernodes/<i>
    # after the ')' closing the command name, index 0 is field 3 (state): utime, stime, starttime
    # are fields 14, 15 and 22
    return (int(stat[11]) + int(stat[12])) / _TICK, int(node) if node.isdigit() else -1, int(stat[19])


def process_memory(pid: str) -> tuple[float, float]:
    """(RSS, PSS) in MiB of a process (PSS: its shared pages divided among their sharers, so a warm
    parent's pages its forked children share are counted once overall)."""
    rss = pss = 0.0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return rss, pss


def tree_cpu(home: Path) -> float:
    """CPU-seconds of the whole run so far: every process carrying the run's FLWR_HOME, its own
    user + system time plus that of its children it has reaped (``cutime``/``cstime``), so the
    ClientApp processes that have exited count too (as a cgroup's accounting would)."""
    return sum(process_cpu(pid) for pid in processes_with_env("FLWR_HOME", str(home), under=True))


def process_cpu(pid: int) -> float:
    """CPU-seconds of a process and of its children it has reaped (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in stat[11:15]) / _TICK  # utime stime cutime cstime


def _role(pid: str, home: bytes) -> str | None:
    """'supernode' or 'warm' for this run's SuperNode and warm processes, else None. A message's
    child of the warm process has the parent's command line: it is not the warm process (children
    are measured from the warm process's ledger, each one's own peak from ``wait4``)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"flower-supernode" not in cmdline and b"warm_executor" not in cmdline:
            return None
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"warm_executor" in cmdline:
            ppid = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1].decode()
            if b"warm_executor" in Path(f"/proc/{ppid}/cmdline").read_bytes():
                return None  # a forked message process
    except (OSError, IndexError):
        return None
    if not any(e.startswith(b"FLWR_HOME=" + home) for e in environ):
        return None
    return "warm" if b"warm_executor" in cmdline else "supernode"


class Sampler(threading.Thread):
    """Polls /proc for the run's ClientApp processes until stopped."""

    def __init__(self, flwr_home: Path, interval: float) -> None:
        super().__init__(daemon=True)
        self.home, self.interval = str(flwr_home).encode(), interval
        # (pid, start tick) -> node, first (its start), last (last seen), cpu; seconds since t0
        self.seen: dict[tuple[int, int], dict[str, Any]] = {}
        self.halt = threading.Event()
        self.t0 = _uptime()  # the clock /proc/<pid>/stat starttime counts on
        # peak (RSS, PSS) MiB per SuperNode / warm process seen
        self.memory: dict[str, dict[str, tuple[float, float]]] = {"supernode": {}, "warm": {}}

    def run(self) -> None:
        while not self.halt.is_set():
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                role = _role(pid, self.home)
                if role is not None:
                    rss, pss = process_memory(pid)
                    old = self.memory[role].get(pid, (0.0, 0.0))
                    self.memory[role][pid] = (max(old[0], rss), max(old[1], pss))
                    continue
                found = _clientapp(pid, self.home)
                if found is not None:
                    cpu, node, start = found
                    entry = self.seen.setdefault((int(pid), start), {"node": node, "first": start / _TICK - self.t0})
                    entry.update(last=_uptime() - self.t0, cpu=cpu)
            self.halt.wait(self.interval)


def summarize(seen: dict[tuple[int, int], dict[str, Any]], slow_nodes: int) -> dict[str, Any]:
    processes = sorted(seen.values(), key=lambda p: p["first"])
    firsts, later, done = [], [], set()
    for p in processes:
        (later if p["node"] in done else firsts).append(p)
        done.add(p["node"])
    span = (max(p["last"] for p in processes) - min(p["first"] for p in processes)) if processes else 0.0

    def med(items: list[dict[str, Any]], key: str) -> float | None:
        values = [p[key] if key == "cpu" else p["last"] - p["first"] for p in items]
        return statistics.median(values) if values else None

    total = sum(p["cpu"] for p in processes)
    slow = [p for p in later if p["node"] < slow_nodes]
    fast = [p for p in later if p["node"] >= slow_nodes]
    return {
        "processes": len(processes), "nodes": len(done),
        "first_cpu_median": med(firsts, "cpu"), "first_life_median": med(firsts, "life"),
        "later_cpu_median": med(later, "cpu"), "later_life_median": med(later, "life"),
        "later_cpu_min": min((p["cpu"] for p in later), default=None),
        "later_cpu_max": max((p["cpu"] for p in later), default=None),
        "cpu_total": total, "span_seconds": span, "busy_cores": total / span if span else None,
        "slow_later_life_median": med(slow, "life") if slow_nodes else None,
        "other_later_life_median": med(fast, "life") if slow_nodes else None,
    }


def _warm_figures(ledger: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-message CPU of a warm run from the warm process's ledger: each forked child's exact
    user + system CPU (``wait4``), its peak RSS, and the parent's own CPU beyond its warm-up (the
    polling) shared over the messages."""
    entries = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
    messages = sorted((e for e in entries if e.get("event") == "message"), key=lambda e: e["start"])
    ready = next((e for e in entries if e.get("event") == "ready"), None)
    stopped = next((e for e in entries if e.get("event") == "stopped"), None)
    firsts, later, seen = [], [], set()
    for e in messages:
        (later if e["node"] in seen else firsts).append(e)
        seen.add(e["node"])
    cpu = lambda e: e["cpu_user"] + e["cpu_system"]  # noqa: E731
    polling = (stopped["cpu"] - ready["cpu"]) / len(messages) if ready and stopped and messages else None
    return {
        "messages": len(messages), "nodes": len(seen), "ended_badly": sum(e["ended"] != "exit status 0" for e in messages),
        "first_cpu_median": statistics.median(cpu(e) for e in firsts) if firsts else None,
        "later_cpu_median": statistics.median(cpu(e) for e in later) if later else None,
        "later_cpu_min": min((cpu(e) for e in later), default=None),
        "later_cpu_max": max((cpu(e) for e in later), default=None),
        "later_life_median": statistics.median(e["end"] - e["start"] for e in later) if later else None,
        "child_peak_rss_mib_median": statistics.median(e["max_rss_kib"] / 1024 for e in later) if later else None,
        "parent_warmup_cpu": ready["cpu"] if ready else None,
        "parent_rss_mib": ready["max_rss_kib"] / 1024 if ready else None,
        "parent_cpu_per_message": polling,
    }


def _reported(rows: list[dict[str, Any]], field: str, skip_first: bool = True) -> float | None:
    """Median over rounds (after the first, whose messages also build each node's data cache) of
    the rows' median device report of ``field`` (``fedge.protocol.resources``)."""
    values = []
    for row in rows[1 if skip_first else 0:]:
        summary = (row.get("extra") or {}).get("device_resources") or row.get("device_resources")
        if summary and field in summary:
            values.append(summary[field]["median"])
    return statistics.median(values) if values else None


def _own_data(tmp: Path, settings: RunSettings, nodes: int) -> dict[int, dict[str, str]]:
    """Each node's partition as its own data file (``data=...npz``, as ``fedge-edge join --data``
    gives a device): the node then loads it and builds nothing."""
    from fedge.edge_client.node_data import save_npz
    from fedge.tasks import make_task

    task, out = make_task(settings.task), {}
    for i in range(nodes):
        path = tmp / f"node-{i}.npz"
        save_npz(path, task.partition(i, nodes, settings.partitioning))
        out[i] = {"data": str(path)}
    return out


def run_one(args: argparse.Namespace, isolation: str) -> dict[str, Any]:
    """One run. ``warm-device``: warm execution as a device installed with the ``device`` extra runs
    it: its own data file (no partition built, so no scikit-learn or datasets preloaded) and no numba
    (the extra does not install it; ``FEDGE_KERNELS=off``, the codecs' torch path)."""
    from fedge.server.local import launch

    device = isolation == "warm-device"
    with tempfile.TemporaryDirectory(prefix="fedge-bench-clientapp-") as tmp:
        run_dir = Path(tmp) / "run"
        settings = RunSettings(algorithm=args.algorithm, rounds=args.rounds, clients_per_round=args.supernodes,
                               local_epochs=args.local_epochs, stragglers=args.stragglers, run_dir=str(run_dir),
                               **({"partitioning": args.partitioning} if args.partitioning else {}))
        node_config = _own_data(Path(tmp), settings, args.supernodes) if device else None
        kernels = os.environ.get("FEDGE_KERNELS")
        if device:
            os.environ["FEDGE_KERNELS"] = "off"  # every process of the run inherits it
        sampler = Sampler((run_dir / "flwr-home").resolve(), args.interval)
        sampler.start()
        started = time.monotonic()
        home = (run_dir / "flwr-home").resolve()
        marks: list[tuple[int, float, int]] = []  # (round, whole-tree CPU when its row landed, messages)
        try:
            result = launch(settings, engine="deployment", num_supernodes=args.supernodes, timeout=3600,
                            isolation="warm" if device else isolation, node_config=node_config,
                            on_row=lambda row: marks.append(
                                (int(row["round"]), tree_cpu(home), int(row.get("clients_sampled", 0)))))
        finally:
            sampler.halt.set()
            sampler.join()
            if device:
                os.environ.pop("FEDGE_KERNELS", None)
                if kernels is not None:
                    os.environ["FEDGE_KERNELS"] = kernels
        if not result.summary:
            raise SystemExit(f"the {isolation} run did not finish; see its logs")
        out: dict[str, Any] = {"isolation": isolation, "seconds": time.monotonic() - started,
                               "round_seconds": [r.get("seconds") for r in result.rows],
                               "rounds_completed": len(result.rows)}
        # whole tree, rounds 3.. minus round 2 (round 1 also starts every process and builds caches)
        after = [m for m in marks if m[0] >= 3]
        base = next((m for m in marks if m[0] == 2), None)
        if base and after:
            messages = sum(m[2] for m in after)
            out["tree_cpu_per_message"] = (after[-1][1] - base[1]) / messages if messages else None
            out["tree_rounds"] = f"{base[0] + 1}-{after[-1][0]}"
        for role, seen in sampler.memory.items():
            if seen:
                out[f"{role}_peak_rss_mib_median"] = statistics.median(v[0] for v in seen.values())
                out[f"{role}_peak_pss_mib_median"] = statistics.median(v[1] for v in seen.values())
        ledger = run_dir / "logs" / "warm-messages.jsonl"
        if isolation.startswith("warm"):
            if not ledger.exists():
                raise SystemExit("warm run without a warm ledger: warm execution fell back (see the log)")
            out["measured"] = _warm_figures(ledger, result.rows)
        else:
            out["measured"] = summarize(sampler.seen, 0)
            if not out["measured"]["processes"]:
                raise SystemExit("no flwr-clientapp process of this run was seen: nothing measured")
        for field in ("cpu_seconds", "train_cpu_seconds", "encode_cpu_seconds", "overhead_cpu_seconds",
                      "startup_cpu_seconds", "peak_rss_mib"):
            out[f"reported_{field}"] = _reported(result.rows, field)
        trained = [r["client_train_seconds"] for r in result.rows if r.get("client_train_seconds")]
        out["train_seconds_median"] = statistics.median(trained) if trained else None
        return out


#: run in a fresh interpreter: the warm process's warm-up, its imports one at a time (each followed by
#: the release of its clean file pages, as the warm process does), with the process's resident memory
#: after each (``VmRSS``, its anonymous and file-backed parts, and the peak so far, ``VmHWM``)
_LADDER = """
import json
from fedge.edge_client.warm_executor import PRELOAD, WarmExecutor, WarmNode
def memory():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return [int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")]
rows = [("python and the warm executor's module", memory())]
WarmExecutor([WarmNode.parse("127.0.0.1:1")], preload=PRELOAD).warm_up(
    each=lambda name: rows.append(("import " + name, memory())))
rows.append(("warm-up (torch to one thread; codec kernels when numba is there)", memory()))
print(json.dumps(rows))
"""


def import_ladder(device: bool) -> list[tuple[str, list[float]]]:
    """What the warm process holds, step by step: a fresh interpreter imports what it preloads (the
    run's partitions are drawn before its nodes start, so no partitioners; as a device installs it
    with ``device``: no numba either) and warms up as it does, and reports its resident memory after
    each step (MiB: RSS, anonymous, file-backed)."""
    import subprocess

    env = {**os.environ, **({"FEDGE_KERNELS": "off"} if device else {})}
    done = subprocess.run([sys.executable, "-c", _LADDER], env=env,
                          capture_output=True, text=True, check=True, timeout=300)
    return [(step, values) for step, values in json.loads(done.stdout.strip().splitlines()[-1])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--supernodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--algorithm", default="fedavg")
    parser.add_argument("--partitioning", default=None, help="run setting (default: the product's)")
    parser.add_argument("--isolation", default="subprocess,warm,warm-device",
                        help="comma-separated, run one after the other in this invocation: subprocess, warm, "
                             "warm-device (warm, as a device installed with the device extra: its own data "
                             "file, no numba)")
    parser.add_argument("--stragglers", default="none", help="run setting: 'fraction=F,slowdown=S' slows the first "
                        "ceil(F x supernodes) nodes")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between /proc samples")
    parser.add_argument("--out", help="output path without suffix (default: bench/results/clientapp-cpu)")
    args = parser.parse_args()
    isolations = [i.strip() for i in args.isolation.split(",") if i.strip()]
    if args.supernodes < 1 or args.rounds < 2 or args.interval <= 0:
        parser.error("--supernodes must be >= 1, --rounds >= 2 (later messages are measured), --interval > 0")
    if not isolations or any(i not in ("subprocess", "warm", "warm-device") for i in isolations):
        parser.error("--isolation: subprocess, warm and/or warm-device")
    # What the warm process holds, measured first: a fresh interpreter alone with torch's pages, as a
    # device's warm process is (the supervisor imports no torch; here the ServerApp does).
    ladders = {isolation: import_ladder(isolation == "warm-device") for isolation in isolations
               if isolation.startswith("warm")}
    from fedge.protocol.stragglers import parse_stragglers

    try:
        parse_stragglers(args.stragglers)
    except ValueError as err:
        parser.error(str(err))
    command = shlex.join([".venv/bin/python", "bench/clientapp_cpu.py", *sys.argv[1:]])
    load_start = os.getloadavg()[0]
    runs = [run_one(args, isolation) for isolation in isolations]
    cores = os.cpu_count() or 1
    header = (f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}, {cores} logical CPUs "
              f"(load average {load_start:.2f} at start): {args.supernodes} SuperNodes on 127.0.0.1, "
              f"{args.algorithm}, {args.rounds} rounds of {args.local_epochs} local epochs, digits "
              f"({args.partitioning or 'default partitioning'}), "
              f"stragglers {args.stragglers}; `{command}`")
    fmt = lambda v, unit="s": "-" if v is None else f"{v:.2f} {unit}".strip()  # noqa: E731
    lines = ["| isolation | later message CPU, measured outside (min-max) | + warm parent's polling | "
             "reported by the device: CPU = train + encode + overhead | first message CPU | peak RSS per message "
             "process | whole run's CPU per device message | run wall time |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        m = run["measured"]
        lines.append(
            f"| {run['isolation']} | {fmt(m['later_cpu_median'])} ({fmt(m['later_cpu_min'])}-{fmt(m['later_cpu_max'])}) | "
            f"{fmt(m.get('parent_cpu_per_message'))} | {fmt(run['reported_cpu_seconds'])} = "
            f"{fmt(run['reported_train_cpu_seconds'])} + {fmt(run['reported_encode_cpu_seconds'])} + "
            f"{fmt(run['reported_overhead_cpu_seconds'])} | {fmt(m['first_cpu_median'])} | "
            f"{fmt(run['reported_peak_rss_mib'], 'MiB')} | {fmt(run.get('tree_cpu_per_message'))} "
            f"(rounds {run.get('tree_rounds', '-')}) | {fmt(run['seconds'])} |")
    table = "\n".join(lines)
    verdict = ""
    by = {run["isolation"]: run for run in runs}
    if "warm" in by and "subprocess" in by:
        warm, sub = by["warm"], by["subprocess"]
        warm_cpu = warm["measured"]["later_cpu_median"] + (warm["measured"]["parent_cpu_per_message"] or 0.0)
        sub_cpu = sub["measured"]["later_cpu_median"]
        budget = (warm["reported_train_cpu_seconds"] or 0.0) + (warm["reported_encode_cpu_seconds"] or 0.0) + 0.4
        verdict = (f"\n\nwarm: {warm_cpu:.2f} CPU-s per later message (child + parent's polling share) against "
                   f"subprocess {sub_cpu:.2f} (a lower bound: /proc sampled every {args.interval} s): "
                   f"{sub_cpu / warm_cpu:.1f}x less; budget training + encoding + 0.4 = {budget:.2f} CPU-s "
                   f"({'met' if warm_cpu <= budget else 'NOT met'}). Warm parent: {fmt(warm['measured']['parent_rss_mib'], 'MiB')} "
                   f"resident after its warm-up of {fmt(warm['measured']['parent_warmup_cpu'])} CPU.")
    for run in runs:
        if run.get("tree_cpu_per_message") is not None:
            verdict += (f"\n\n{run['isolation']}: the whole run (SuperLink, ServerApp, SuperNodes, ClientApps, "
                        f"`flwr run`) spent {run['tree_cpu_per_message']:.2f} CPU-s per device message over "
                        f"rounds {run['tree_rounds']}.")
        if run.get("supernode_peak_rss_mib_median") is not None:
            verdict += (f" SuperNode process: {run['supernode_peak_rss_mib_median']:.0f} MiB RSS "
                        f"({run['supernode_peak_pss_mib_median']:.0f} MiB PSS) median peak.")
        if run.get("warm_peak_rss_mib_median") is not None:
            verdict += (f" Warm process: {run['warm_peak_rss_mib_median']:.0f} MiB RSS, "
                        f"{run['warm_peak_pss_mib_median']:.0f} MiB PSS (shared with the children it forks).")
    for isolation in [i for i in isolations if i.startswith("warm")]:
        ladder = ladders[isolation]
        for run in runs:
            if run["isolation"] == isolation:
                run["import_ladder"] = ladder
        verdict += (f"\n\n{isolation}: what the warm process holds, step by step (a fresh interpreter doing what "
                    "it does, clean file pages released after each import; resident MiB after each step):\n\n"
                    "| step | RSS | anonymous | file-backed | RSS added | peak RSS so far |\n"
                    "|---|---|---|---|---|---|\n"
                    + "\n".join(
                        f"| {step} | {rss:.0f} | {anon:.0f} | {file:.0f} "
                        f"| {rss - (ladder[i - 1][1][0] if i else 0):+.0f} | {peak:.0f} |"
                        for i, (step, (rss, anon, file, peak)) in enumerate(ladder)))
        verdict += (f"\n\nAlone with torch's libraries, as on a device (whose supervisor and SuperNode import no "
                    f"torch), the warm process holds {ladder[-1][1][0]:.0f} MiB RSS once warm and "
                    f"{ladder[-1][1][3]:.0f} MiB at its peak. The run's figure above is its peak over the whole run; "
                    "there the ServerApp maps the same pages of torch, which the warm process drops from its own "
                    "page tables (``MADV_DONTNEED``) where ``MADV_PAGEOUT`` cannot release them.")
    print(header + "\n\n" + table + verdict)
    out = Path(args.out or ROOT / "bench" / "results" / "clientapp-cpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(header + "\n\n" + table + verdict + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_count": cores,
         "load_average_at_start": load_start, "args": vars(args), "runs": runs}, indent=2) + "\n")
    print(f"reproduce: {command}\nwrote {out}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
