"""Seeded runs' fingerprints: what the engine sends and receives, byte for byte, for each algorithm
and cross-cutting feature, on the in-process Grid stand-in (real ClientApp handlers).

``tests/server/test_behaviour.py`` checks today's engine against ``behaviour.json``, which this
module wrote before the engine's layers were refactored ("One door"): a refactor that changes one
uplink byte, one downlink byte or the trained model fails it. Regenerate only for a deliberate
change of behaviour, and say so in the commit:

    .venv/bin/python -m tests.server.behaviour --write

Recorded anew since, each for a deliberate change: ``dp-adaptive`` (2026-11-25, Privacy II H1: the
adaptive clipping count sums centred bits; noise 0.4 instead of 0.1, whose PLD accounting alone
took 25 s); ``dp`` and ``dp-adaptive`` (2026-11-25, Privacy II L6: the Poisson sample comes from
the OS CSPRNG directly, and rows under DP carry no training loss).

Training is bit-reproducible for one torch build and CPU kind only: torch, oneDNN and MKL pick their
kernels by the CPU's vendor and instruction set, and each rounds differently (the same commit gives
other digests on an AVX-512 Intel Xeon, and on an AVX2 AMD EPYC, than on the AMD EPYC these were
first recorded on; no ``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA``/``MKL_CBWR`` setting
reproduces the other's). So
``behaviour.json`` holds one set of fingerprints per platform (:func:`platform`: torch's version,
the CPU's vendor and torch's CPU capability), each with the commit it was recorded at; the test
checks the set of the platform it runs on and skips, saying so, on one that has none. ``--write``
adds or replaces this platform's set and leaves the others. Secure aggregation's masks come
from fresh X25519 keys, so its uploads differ every run; its fingerprint is the unmasked model and
the upload sizes. Central DP draws its noise and its sample from the OS; the fingerprint run
stands a fixed source in for both.

2026-12-06: every set recorded anew on this project's machine (AMD, AVX-512) for a deliberate
change of every digest: the coordinator's sums became exact (the same bits in any order of replies)
and a device's dropout and other layer randomness come from its seeded generator. The sets of the
other platforms were dropped with it (they recorded the old arithmetic); those platforms skip until
someone records theirs with ``--write``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from fedge.protocol import UPDATE_RECORD
from fedge.server.run.initial_model import initial_params
from fedge.tasks import make_task
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid

__all__ = ["CASES", "FINGERPRINTS", "fingerprint", "platform", "recorded_for", "recorded_here"]

FINGERPRINTS = Path(__file__).with_name("behaviour.json")

_BASE: dict[str, Any] = dict(rounds=3, clients_per_round=4, local_epochs=1, round_timeout=5.0, wait_for_nodes=1.0,
                             codec="qsgd:bits=4", seed=42)

#: name -> (run settings, in-process grid arguments, whether uploads are reproducible bytes)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], bool]] = {
    "fedavg": ({}, {"num_nodes": 6}, True),
    "fedavg-prox-adam": ({"prox_mu": 0.1, "server_opt": "fedadam:lr=0.01"}, {"num_nodes": 6}, True),
    "fedavg-lattice-ema": ({"downlink_codec": "lattice:ratio=0.05", "codec": "dgc:ratio=0.05",
                            "model_average": "ema:decay=0.8"}, {"num_nodes": 6}, True),
    "fedavg-median": ({"aggregator": "median"}, {"num_nodes": 5}, True),
    "easgd": ({"algorithm": "easgd", "downlink_codec": "lattice:ratio=0.05"}, {"num_nodes": 4}, True),
    "gossip": ({"algorithm": "gossip:topology=ring"}, {"num_nodes": 4}, True),
    "fedbuff": ({"algorithm": "fedbuff:concurrency=3,buffer=2", "rounds": 4}, {"num_nodes": 4, "lag": {2: 3}}, True),
    "fedasync": ({"algorithm": "fedasync:concurrency=3", "rounds": 4}, {"num_nodes": 4, "lag": {1: 2}}, True),
    "federated-eval": ({"evaluate": "federated", "holdout": 0.2}, {"num_nodes": 5}, True),
    "dp": ({"differential_privacy": "gaussian:noise=1.0,clip=1.0,delta=1e-5"}, {"num_nodes": 6}, True),
    "dp-adaptive": ({"differential_privacy": "gaussian:noise=0.4,clip=1.0,delta=1e-5,adaptive=true,quantile=0.5",
                     "clients_per_round": 6}, {"num_nodes": 8}, True),
    "secure": ({"secure_aggregation": "secagg:bits=8,clip=0.2,weight-cap=256", "clients_per_round": 5},
               {"num_nodes": 5}, False),
    "secure-easgd": ({"algorithm": "easgd", "secure_aggregation": "secagg:bits=8,clip=0.2,weight-cap=256",
                      "clients_per_round": 5}, {"num_nodes": 5}, False),
}


def platform() -> dict[str, str]:
    """What decides the float results of training: torch's build, the CPU vendor, the kernels' ISA."""
    vendor = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"torch": torch.__version__, "cpu_vendor": vendor, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def recorded_for(recorded: dict[str, Any], here: dict[str, str]) -> dict[str, Any] | None:
    """This platform's recorded set, or None. A set recorded before platforms were named carries
    only its vendor: it stands for that vendor's CPUs that have no set of their own (an AVX2 AMD
    EPYC trains to other digests than the one it was recorded on, and has its own)."""
    matches = [e for e in recorded["platforms"] if all(e["platform"].get(k, here[k]) == here[k] for k in here)]
    return max(matches, key=lambda e: len(e["platform"]), default=None)


def recorded_here() -> dict[str, Any]:
    """This platform's recorded cases; skips the calling test, saying how to record them, when this
    platform has none (a test module's fingerprint checks call it)."""
    import pytest

    here = platform()
    entry = recorded_for(json.loads(FINGERPRINTS.read_text()), here)
    if entry is None:
        pytest.skip(f"no fingerprints recorded for this platform ({here}): training rounds differently on each; "
                    "record them at a commit whose behaviour is known with "
                    "`.venv/bin/python -m tests.server.behaviour --write`")
    return entry["cases"]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class _FixedEntropy:
    """A stand-in for the OS's randomness: a deterministic stream, a new value each call."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, size: int) -> bytes:
        self.calls += 1
        return hashlib.shake_256(b"fedge-behaviour/%d" % self.calls).digest(size)


def fingerprint(name: str, run_dir: Path) -> dict[str, Any]:
    """One case's fingerprint: per step the bytes moved and the digest of every upload, then the
    delivered model's digest."""
    values, grid_args, exact = CASES[name]
    settings = {**_BASE, **values, "run_dir": str(run_dir)}
    uploads: list[list[str]] = []
    fixed = contextlib.ExitStack()
    if "differential_privacy" in values:  # the noise's seed and the Poisson sample, from a fixed "OS"
        import random

        dp = "fedge.coordinator.dp_mechanisms"
        fixed.enter_context(mock.patch(f"{dp}._os_entropy", _FixedEntropy()))
        fixed.enter_context(mock.patch(f"{dp}._system_random", lambda: random.Random(20261125)))
    with fixed:
        engine = build_engine(settings)
        grid = InProcessGrid(**grid_args)
        seen: list[str] = []
        pull = grid.pull_messages

        def recording_pull(ids: list[str]) -> list:  # type: ignore[type-arg]
            replies = pull(ids)
            for reply in replies:
                if not reply.has_error() and UPDATE_RECORD in reply.content.array_records:
                    payload = b"".join(bytes(a.data) for a in reply.content.array_records[UPDATE_RECORD].values())
                    seen.append(f"{reply.metadata.src_node_id}:{len(payload)}:{_digest(payload) if exact else '-'}")
            return replies

        grid.pull_messages = recording_pull  # type: ignore[method-assign]
        previous = 0

        def on_row(row: Any) -> None:
            nonlocal previous
            uploads.append(sorted(seen[previous:]))
            previous = len(seen)

        engine.on_row = on_row
        result = engine.run(grid, initial_params(make_task(settings.get("task", "digits")), settings["seed"]))
    rows = []
    for row, ups in zip(result.rows, uploads):
        rows.append({"round": row.round, "uplink_bytes": row.uplink_bytes if exact else None,
                     "downlink_bytes": row.downlink_bytes if exact else None,
                     "measurement_bytes": row.measurement_bytes, "clients_used": row.clients_used,
                     "clients_failed": row.clients_failed, "score": round(row.score, 6), "uploads": ups})
    model = result.model.contiguous().numpy().tobytes()
    return {"rows": rows, "model": _digest(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {FINGERPRINTS.name}")
    parser.add_argument("--case", action="append", help="only these cases (default: all)")
    args = parser.parse_args()

    import subprocess
    import tempfile

    torch.set_num_threads(1)
    here = platform()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=FINGERPRINTS.parent).stdout.strip()
    out: dict[str, Any] = {"platform": here, "commit": commit, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.case or CASES:
            out["cases"][name] = fingerprint(name, Path(tmp) / name)
            print(name, out["cases"][name]["model"], flush=True)
    if args.write:
        recorded = json.loads(FINGERPRINTS.read_text()) if FINGERPRINTS.exists() else {"platforms": []}
        old = next((e for e in recorded["platforms"] if e["platform"] == here), None)  # this platform's own
        if old is not None and args.case:  # only some cases: the others stay as recorded
            out["cases"] = {**old["cases"], **out["cases"]}
        recorded["platforms"] = [e for e in recorded["platforms"] if e is not old] + [out]
        FINGERPRINTS.write_text(json.dumps(recorded, indent=1) + "\n")
    else:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    main()
