"""Every benchmark runs, at tiny sizes: a renamed function fails here, not in a headline.

``bench/aggregation.py``, the source of a README figure, called a method that had been removed, and
nothing noticed: no test ran it. Each ``bench/*.py`` is listed here with arguments that make it run
in seconds (or, for those that start Flower's engines, in the fewest rounds and devices it accepts),
writing into a temporary directory; the test runs it as the docs show (``.venv/bin/python
bench/X.py ...``, from the repository root) and checks that it exits cleanly and wrote its output.
A new benchmark without an entry fails :func:`test_every_benchmark_has_a_smoke_run`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: benchmark -> (arguments, a file it must write or None; "{out}" is a fresh temporary directory)
SMOKE: dict[str, tuple[list[str], str | None]] = {
    "aggregation.py": (["--clients", "3", "--params", "4000", "--out", "{out}/a.json"], "a.json"),
    "codecs.py": (["--n", "20000", "--repeat", "1", "--out", "{out}/c.json"], "c.json"),
    "fuzz.py": (["--per-codec", "20", "--out", "{out}/f.json"], "f.json"),
    "wire_details.py": (["--repeat", "1"], None),
    "dp_noise_multipliers.py": (["--rounds", "2", "--numel", "100", "--clients", "40"], None),
    "flower_secaggplus.py": (["--clients", "5", "--dimension", "100", "--drop", "1", "--num-shares", "4",
                              "--threshold", "3", "--out", "{out}/s.json"], "s.json"),
    "secure_aggregation.py": (["--part", "cost", "--devices", "5", "--dimension", "100", "--no-flower",
                               "--out", "{out}/sa.json"], "sa.json"),
    "flower_cli_calls.py": (["--calls", "1", "--out", "{out}/cli.json"], "cli.json"),
    "page_release.py": (["--pairs", "1", "--children", "2"], None),
    "allreduce.py": (["--max-mb", "1", "--hooks", "allreduce", "--out", "{out}/ar.json"], "ar.json"),
    "edge.py": (["--epochs", "1", "--runs", "5", "--out", "{out}/edge"], None),
    "partial_participation_screen.py": (["--clients", "4", "--per-round", "2", "--rounds", "1", "--local-epochs", "1",
                                         "--seeds", "1"], None),
    "live_page.py": (["--devices", "50", "--rounds", "5", "--requests", "3", "--idle", "0.5", "--out", "{out}/lp"],
                     "lp.json"),
    "leaf_scaling.py": (["--devices", "4", "--rounds", "1", "--no-flat", "--out", "{out}/ls.json"], "ls.json"),
}

#: benchmarks that start Flower's engines (or torchrun): the fewest rounds, devices and seeds they
#: take. The light ones run in the default suite; the heavy ones (``HEAVY``) in ``make test-slow``.
ENGINE_SMOKE: dict[str, tuple[list[str], str | None]] = {
    # FedNova here: the one real-engine run of it in the default suite (devices report their steps
    # from Ray actors); FedAvg runs on the real engines in many other tests
    "algorithms.py": (["--clients", "2", "--rounds", "1", "--local-epochs", "1", "--only", "--config",
                       "fednova;fednova;qsgd:bits=4", "--set", "clients-per-round=2", "--out", "{out}/alg"], None),
    "bidirectional.py": (["--clients", "2", "--per-round", "2", "--rounds", "1", "--local-epochs", "1", "--config",
                          "fp32;none;none", "--out", "{out}/bi"], "bi.json"),
    "communication.py": (["--preset", "demo", "--seeds", "1", "--rounds", "1", "--only", "none", "--out",
                          "{out}/comm"], None),
    "differential_privacy.py": (["--clients", "2", "--per-round", "2", "--rounds", "1", "--local-epochs", "1",
                                 "--noise", "1.0", "--out", "{out}/dp.json"], None),
    "distributed_dp.py": (["--clients", "3", "--per-round", "3", "--rounds", "1", "--local-epochs", "1",
                           "--seeds", "1", "--epsilon", "8", "--out", "{out}/ddp.json"], None),
    "flower_app.py": (["--clients", "2", "--rounds", "1", "--local-epochs", "1", "--repeats", "1", "--out",
                       "{out}/fa"], None),
    "flower_secure.py": (["--clients", "2", "--rounds", "1", "--local-epochs", "1", "--repeats", "1", "--out",
                          "{out}/fs"], None),
    "chaos.py": (["--nodes", "2", "--rounds", "2", "--local-epochs", "1", "--kill-nodes-after", "1",
                  "--kill-coordinator-after", "1", "--no-baseline", "--out", "{out}/chaos.json"], None),
    "clientapp_cpu.py": (["--supernodes", "2", "--rounds", "2", "--local-epochs", "1", "--isolation", "warm",
                          "--out", "{out}/cpu"], None),
    "deployment_rounds.py": (["--rounds", "2", "--supernodes", "2", "--local-epochs", "1", "--repeats", "1",
                              "--no-flower", "--fedge-codecs", "none", "--out", "{out}/dr.json"], None),
    "same_seed.py": (["--repeats", "2", "--rounds", "1", "--clients", "4", "--per-round", "2", "--no-load",
                      "--out", "{out}/ss"], "ss.json"),
    "scale.py": (["--task", "digits", "--clients", "4", "--per-round", "2", "--rounds", "1", "--local-epochs", "1",
                  "--out", "{out}/scale"], None),
    "leaf_simulation.py": (["--devices", "4", "--leaves", "2", "--per-round", "4", "--rounds", "2", "--local-epochs",
                            "1", "--out", "{out}/lsim.json"], "lsim.json"),
    "leaf_processes.py": (["--supernodes", "4", "--leaves", "2", "--rounds", "1", "--local-epochs", "1", "--seeds", "1",
                           "--out", "{out}/lp.json"], "lp.json"),
    "start_profile.py": (["--clients", "2", "--rounds", "1", "--repeats", "1", "--out", "{out}/sp.json"], None),
    "superlink_throughput.py": (["--supernodes", "2", "--rounds", "1", "--payload-bytes", "1000", "--out",
                                 "{out}/st.json"], None),
    "soak.py": (["--rounds", "2", "--nodes", "2", "--churn-every", "1", "--warmup", "1", "--out", "{out}/soak.json"],
                None),
    "niid_bench.py": (["run", "--smoke", "--cell", "scaffold-c2-dgc-s1", "--cell", "fedavg-c2-fp32-s1", "--out",
                       "{out}/niid"], "niid/niid-bench.md"),
    "niid_reference.py": (["--algorithm", "fednova", "--rounds", "2", "--epochs", "1", "--samples", "64", "--out",
                           "{out}/ref"], "ref/fednova-pathological-classes2-wd0-s1.jsonl"),
    "flower_stragglers.py": (["--clients", "2", "--rounds", "1", "--local-epochs", "1", "--target", "0.1",
                              "--stragglers", "none", "--timeout", "300", "--out", "{out}/fst"], None),
}
#: at their smallest, alone on this 2-core machine (2026-12-07, seconds): flower_secure 46,
#: deployment_rounds 20, differential_privacy 34, distributed_dp 32, clientapp_cpu 23, scale 18,
#: start_profile 40, leaf_simulation 45, edge 31, allreduce 33, superlink_throughput 23, same_seed 40,
#: flower_app 81, soak 68, leaf_processes 126, chaos 121, flower_stragglers 83: 864 s of engine runs, against a default
#: suite already at CI's 15 minutes. ``make test-slow`` runs them; the default suite checks every name
#: they take from Fedge and parses their ``--help`` (``tests/test_bench_names.py``)
HEAVY = {"differential_privacy.py", "distributed_dp.py", "flower_app.py", "flower_secure.py", "edge.py", "allreduce.py",
         "chaos.py", "clientapp_cpu.py", "deployment_rounds.py", "scale.py", "leaf_simulation.py", "leaf_processes.py",
         "start_profile.py", "soak.py", "same_seed.py", "superlink_throughput.py", "flower_stragglers.py",
         "niid_bench.py"}

#: benchmarks without a smoke run yet, and why
PENDING: dict[str, str] = {}

#: run by a test of its own (named), or not a benchmark
ELSEWHERE = {
    "at_commit.py": "tests/test_at_commit.py",
    "gpu_check.py": "tests/test_gpu_check.py (its rehearsal on the CPU)",
    "sigterm.py": "a helper the engine benchmarks import (stop_on_sigterm), not a benchmark",
}


def test_every_benchmark_has_a_smoke_run() -> None:
    benches = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    known = set(SMOKE) | set(ELSEWHERE) | set(ENGINE_SMOKE) | set(PENDING)
    missing = [b for b in benches if b not in known]
    assert not missing, f"benchmarks without a smoke run in tests/test_bench_smoke.py: {missing}"
    stale = sorted(known)
    assert set(stale) <= set(benches), f"smoke entries for benchmarks that are gone: {set(stale) - set(benches)}"


def _run(name: str, args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, f"bench/{name}", *(a.replace("{out}", str(tmp_path)) for a in args)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.integration  # a process (or an engine) each: ordered with the process tests (tests/conftest.py)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n
                                  for n in sorted({**SMOKE, **ENGINE_SMOKE})])
def test_benchmark_runs(name: str, tmp_path: Path) -> None:
    args, wrote = {**SMOKE, **ENGINE_SMOKE}[name]
    done = _run(name, args, tmp_path, timeout=400)
    assert done.returncode == 0, f"bench/{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    if wrote is not None:
        assert (tmp_path / wrote).exists(), f"bench/{name} wrote no {wrote}"
