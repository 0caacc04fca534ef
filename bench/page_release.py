"""What releasing the warm process's clean file pages costs its children (``fedge.edge_client.page_release``).

A device's warm process imports torch, Flower and Fedge, releases their clean file pages, then forks
a child per message. Linux's ``fork`` copies no page table entries of a read-only file mapping, so
every child faults in the code it runs whether or not the parent kept it resident; what release can
cost is reading a page back from storage (a major fault) when nothing else kept it cached. This runs
the warm process's warm-up (``FEDGE_KERNELS=off``, as on a device) in a fresh interpreter with
release on and off, alternating, and forks ``--children`` children one after the other, each doing
the same small torch training job; it prints the parent's resident memory and each child's CPU,
peak RSS and page faults (``wait4``). With ``--beside`` another interpreter that has imported the
same libraries (as a local cluster's ServerApp has) runs alongside the whole time: the pages it maps
are the ones ``MADV_PAGEOUT`` cannot release, and ``MADV_DONTNEED`` drops from the warm process.

    .venv/bin/python bench/page_release.py --pairs 2 --children 6
    .venv/bin/python bench/page_release.py --pairs 2 --children 6 --beside
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_PROCESS = """
import json, os
from fedge.edge_client.warm_executor import PRELOAD, WarmExecutor, WarmNode
WarmExecutor([WarmNode.parse("127.0.0.1:1")], preload=PRELOAD).warm_up()
import torch
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
parent = {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
children = []
for _ in range(int(os.environ["CHILDREN"])):
    pid = os.fork()
    if pid == 0:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                    torch.nn.Flatten(), torch.nn.Linear(72, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
        for _ in range(30):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        os._exit(0)
    _, _, usage = os.wait4(pid, 0)
    children.append({"cpu": usage.ru_utime + usage.ru_stime, "peak_rss_mib": usage.ru_maxrss / 1024,
                     "major_faults": usage.ru_majflt, "minor_faults": usage.ru_minflt})
print(json.dumps({"parent": parent, "children": children}))
"""


def run(release: bool, children: int) -> dict:
    env = {**os.environ, "FEDGE_KERNELS": "off", "FEDGE_PAGE_RELEASE": "on" if release else "off",
           "CHILDREN": str(children)}
    done = subprocess.run([sys.executable, "-c", _PROCESS], env=env, capture_output=True, text=True, check=True,
                          timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


#: the neighbour of ``--beside``: the warm process's imports, their pages resident, then it waits
_NEIGHBOUR = """
import sys
from fedge.edge_client.warm_executor import PRELOAD
import importlib
for name in PRELOAD:
    importlib.import_module(name)
print("ready", flush=True)
sys.stdin.read()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--children", type=int, default=6)
    parser.add_argument("--beside", action="store_true",
                        help="run another interpreter with the same imports alongside (as a ServerApp)")
    args = parser.parse_args()
    neighbour = None
    if args.beside:
        neighbour = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if neighbour.stdout is None or neighbour.stdout.readline().strip() != "ready":
            raise SystemExit("the neighbour process did not start")
    try:
        return _pairs(args)
    finally:
        if neighbour is not None:
            neighbour.communicate(timeout=60)


def _pairs(args: argparse.Namespace) -> int:
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} logical CPUs; "
          f"`.venv/bin/python bench/page_release.py --pairs {args.pairs} --children {args.children}"
          f"{' --beside' if args.beside else ''}`"
          f"{'; beside an interpreter with the same imports' if args.beside else ''}\n")
    print("| release | parent RSS (anonymous + file), MiB | parent peak | first child: CPU-s, major faults "
          "| later children: median CPU-s, major faults | children's peak RSS |")
    print("|---|---|---|---|---|---|")
    for _ in range(args.pairs):
        for release in (False, True):
            got = run(release, args.children)
            p, kids = got["parent"], got["children"]
            later = kids[1:]
            print(f"| {'on' if release else 'off'} | {p['VmRSS']:.0f} ({p['RssAnon']:.0f} + {p['RssFile']:.0f}) "
                  f"| {p['VmHWM']:.0f} | {kids[0]['cpu']:.2f}, {kids[0]['major_faults']} "
                  f"| {statistics.median(k['cpu'] for k in later):.2f}, {sum(k['major_faults'] for k in later)} "
                  f"| {max(k['peak_rss_mib'] for k in kids):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
