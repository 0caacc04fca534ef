"""Secure aggregation: what it costs and what it does to accuracy, measured side by side.

``--part cost`` (the protocol alone, in one process, real cryptography): ``--devices`` devices each
with a ``--dimension``-coordinate update on a ``--bits``-bit grid; ``--drop`` of them vanish after
dealing their shares (their masks are recovered). Reports upload bytes per coordinate (the masked
upload, and everything a device sends), one device's seconds per round (its four stages, median over
devices) and the coordinator's seconds per round (routing, checks, unmasking); then the same round
through Flower's own SecAgg+ (``bench/flower_secaggplus.py``: its legacy workflow and client mod, the
same number of clients, neighbours and threshold, the same dropouts), side by side.

``--part accuracy`` (real Flower simulation runs on digits): the same shared-grid quantizer sent in
clear (codec ``grid``) against secure aggregation, each without and with a fifth of the devices
crashing in training (under secure aggregation: after dealing their shares), and fp32 for reference;
final held-out accuracy and total uplink.

    .venv/bin/python bench/secure_aggregation.py --part cost --devices 100 --dimension 1000000
    .venv/bin/python bench/secure_aggregation.py --part cost --devices 100 --dimension 100000 --no-flower --issued
    .venv/bin/python bench/secure_aggregation.py --part accuracy --clients 10 --rounds 20
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.privacy.keys import RoundContext
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.secagg_device import SecAggDevice
from fedge.privacy.secagg_server import SecAggServer
from fedge.privacy.shared_grid import SharedGrid


def cost(devices: int, dimension: int, bits: int, drop: int, neighbours: int, issued: bool = False) -> dict:
    """One round's cost. ``issued``: a coordinator that may lie (``issuer=``): every identity comes
    with a credential from an operator CA that each device checks for its neighbours and for every
    signer, and the consistency round runs before the unmask (the devices' extra bytes and seconds
    are counted; building the CA and node keys is not)."""
    plan = SecAggPlan(RoundContext(b"bench", 1), tuple(range(1, devices + 1)), SharedGrid(bits, 1.0, 1), dimension,
                      graph_seed=3, neighbours=neighbours, consistency=issued)
    keys = {n: Ed25519PrivateKey.generate() for n in plan.participants}
    credentials: dict[int, bytes] = {}
    if issued:
        from cryptography.hazmat.primitives.asymmetric import ec

        from fedge.privacy.credentials import bind_identity, endorse, verify_credential

        ca = ec.generate_private_key(ec.SECP384R1())
        for n, key in keys.items():
            node_key = ec.generate_private_key(ec.SECP384R1())
            credentials[n] = bind_identity(node_key, endorse(ca, f"node-{n}", node_key.public_key()),
                                           key.public_key().public_bytes_raw())

        def check(holder: int, peers) -> None:  # type: ignore[no-untyped-def]
            for peer in peers:
                verify_credential(credentials[peer], keys[peer].public_key().public_bytes_raw(), ca.public_key())
    rng = np.random.default_rng(0)
    levels = {n: rng.integers(0, plan.grid.top + 1, plan.length).astype(np.uint32) for n in plan.participants}
    device_s = {n: 0.0 for n in plan.participants}
    sent = {n: 0 for n in plan.participants}
    server_s = 0.0

    def on_device(node, work):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        out = work()
        device_s[node] += time.perf_counter() - started
        return out

    def on_server(work):  # type: ignore[no-untyped-def]
        nonlocal server_s
        started = time.perf_counter()
        out = work()
        server_s += time.perf_counter() - started
        return out

    dev = {n: SecAggDevice(plan, n, keys[n]) for n in plan.participants}
    server = SecAggServer(plan, {n: k.public_key() for n, k in keys.items()})
    ads = {n: on_device(n, lambda n=n: dev[n].advertise().to_bytes()) for n in plan.participants}
    for n, blob in ads.items():
        sent[n] += len(blob)
    routed = on_server(lambda: server.receive_advertisements(ads))
    if issued:  # each device checks its neighbours' credentials before dealing shares
        for n in plan.participants:
            on_device(n, lambda n=n: check(n, routed[n]))
            sent[n] += len(credentials[n])
    sealed = {n: on_device(n, lambda n=n: dev[n].share_keys(routed[n], server._identities)) for n in plan.participants}
    for n, blobs in sealed.items():
        sent[n] += sum(len(b) for b in blobs.values())
    inbox = on_server(lambda: server.route_shares(sealed))
    dropped = set(plan.participants[:drop])
    uploads = {n: on_device(n, lambda n=n: dev[n].masked_input(inbox[n], levels[n]))
               for n in plan.participants if n not in dropped}
    for n, blob in uploads.items():
        sent[n] += len(blob)
    masked_bytes = statistics.median(len(b) for b in uploads.values())
    survivors = on_server(lambda: server.receive_masked(uploads))
    if issued:
        signatures = {n: on_device(n, lambda n=n: dev[n].consistency(survivors)) for n in survivors}
        for n, blob in signatures.items():
            sent[n] += len(blob)
        signed = on_server(lambda: server.receive_consistency(signatures))
        public = {n: keys[n].public_key() for n in signed}

        def unmask(n: int) -> bytes:
            check(n, signed)  # every signer's credential, then the quorum of signatures
            return dev[n].unmask(survivors, signed, public)
        reveals = {n: on_device(n, lambda n=n: unmask(n)) for n in survivors}
    else:
        reveals = {n: on_device(n, lambda n=n: dev[n].unmask(survivors)) for n in survivors}
    for n, blob in reveals.items():
        sent[n] += len(blob)
    total, count = on_server(lambda: server.unmask(reveals))
    exact = np.sum([levels[n].astype(np.int64) for n in survivors], axis=0)
    assert np.array_equal(total.astype(np.int64), exact), "the unmasked sum is wrong"
    alive = [n for n in plan.participants if n not in dropped]
    return {
        "devices": devices, "dimension": dimension, "bits": bits, "ring_bits": plan.bits, "neighbours": plan.degree,
        "threshold": plan.reconstruction_threshold, "dropped_after_sharing": drop, "issued": issued,
        "masked_upload_bytes_per_coordinate": masked_bytes / dimension,
        "all_sent_bytes_per_coordinate": statistics.median(sent[n] for n in alive) / dimension,
        "device_seconds_median": statistics.median(device_s[n] for n in alive),
        "device_seconds_max": max(device_s[n] for n in alive),
        "coordinator_seconds": server_s, "sum_exact": True,
    }


def accuracy(clients: int, rounds: int, bits: int, clip: float, seed: int) -> list[dict]:
    from fedge.server.local import launch
    from fedge.server.settings import RunSettings

    configs = [
        ("fp32", {"codec": "none"}),
        (f"grid:bits={bits},clip={clip:g} (clear)", {"codec": f"grid:bits={bits},clip={clip:g}"}),
        (f"secagg:bits={bits},clip={clip:g}", {"secure_aggregation": f"secagg:bits={bits},clip={clip:g},weight-cap=512"}),
        (f"grid:bits={bits},clip={clip:g} (clear), 20% crash", {"codec": f"grid:bits={bits},clip={clip:g}",
                                                               "faulty_clients": "fraction=0.2,fault=crash"}),
        (f"secagg:bits={bits},clip={clip:g}, 20% crash after sharing",
         {"secure_aggregation": f"secagg:bits={bits},clip={clip:g},weight-cap=512",
          "faulty_clients": "fraction=0.2,fault=crash"}),
    ]
    out = []
    for label, overrides in configs:
        with tempfile.TemporaryDirectory() as tmp:
            settings = RunSettings(rounds=rounds, clients_per_round=clients, seed=seed, run_dir=str(Path(tmp) / "run"),
                                   **overrides)
            started = time.perf_counter()
            result = launch(settings, engine="simulation", num_supernodes=clients, timeout=3600)
            rows = result.rows
            out.append({"config": label, "final_accuracy": rows[-1]["accuracy"], "best_accuracy": max(r["accuracy"] for r in rows),
                        "uplink_mb": sum(r["uplink_bytes"] for r in rows) / 1e6,
                        "clients_used_last": rows[-1]["clients_used"], "wall_seconds": time.perf_counter() - started})
        print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("cost", "accuracy", "both"), default="both")
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--dimension", type=int, default=1_000_000)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--drop", type=int, default=-1, help="devices that vanish after sharing (default: 20%%)")
    parser.add_argument("--neighbours", type=int, default=0, help="graph degree (0: the default for the size)")
    parser.add_argument("--no-flower", action="store_true", help="skip Flower's SecAgg+ side by side")
    parser.add_argument("--issued", action="store_true",
                        help="also the same round with issued identities and the consistency round, side by side")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=Path("bench/results/secure-aggregation.json"))
    args = parser.parse_args(argv)
    report = {"command": " ".join([".venv/bin/python", "bench/secure_aggregation.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform()}
    if args.part in ("cost", "both"):
        drop = args.devices // 5 if args.drop < 0 else args.drop
        report["cost"] = cost(args.devices, args.dimension, args.bits, drop, args.neighbours)
        c = report["cost"]
        if not args.no_flower:  # the same round through Flower's SecAgg+ (its legacy workflow), same graph size
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from flower_secaggplus import measure

            report["flower"] = measure(args.devices, args.dimension, drop, c["neighbours"] + 1, c["threshold"])
        print(f"{c['devices']} devices x {c['dimension']:,} coordinates, {c['bits']}-bit grid, ring {c['ring_bits']} bits, "
              f"{c['neighbours']} neighbours (threshold {c['threshold']}), {c['dropped_after_sharing']} dropped after sharing")
        print(f"  masked upload {c['masked_upload_bytes_per_coordinate']:.3f} B/coordinate; everything a device sends "
              f"{c['all_sent_bytes_per_coordinate']:.3f} B/coordinate (Flower SecAgg+: 8 B int64)")
        print(f"  device {c['device_seconds_median']:.2f} s per round (max {c['device_seconds_max']:.2f}); "
              f"coordinator {c['coordinator_seconds']:.2f} s; unmasked sum exact")
        if args.issued:  # the same round, the coordinator untrusted: credentials and the consistency round
            report["issued"] = i = cost(args.devices, args.dimension, args.bits, drop, args.neighbours, issued=True)
            print("| | trust on first use | issued identities + consistency round |")
            print("|---|---|---|")
            print(f"| everything a device sends, bytes | {c['all_sent_bytes_per_coordinate'] * c['dimension']:,.0f} | "
                  f"{i['all_sent_bytes_per_coordinate'] * i['dimension']:,.0f} |")
            print(f"| device seconds per round (median / max) | {c['device_seconds_median']:.3f} / "
                  f"{c['device_seconds_max']:.3f} | {i['device_seconds_median']:.3f} / {i['device_seconds_max']:.3f} |")
            print(f"| coordinator seconds per round | {c['coordinator_seconds']:.3f} | {i['coordinator_seconds']:.3f} |")
        if "flower" in report:
            f = report["flower"]
            print("| | Fedge | Flower SecAgg+ (legacy workflow) |")
            print("|---|---|---|")
            print(f"| masked upload, bytes per coordinate | {c['masked_upload_bytes_per_coordinate']:.3f} | - |")
            print(f"| everything a device sends, bytes per coordinate | {c['all_sent_bytes_per_coordinate']:.3f} | "
                  f"{f['all_sent_bytes_per_coordinate']:.3f} |")
            print(f"| device seconds per round (median / max) | {c['device_seconds_median']:.2f} / "
                  f"{c['device_seconds_max']:.2f} | {f['client_seconds_median']:.2f} / {f['client_seconds_max']:.2f} |")
            print(f"| coordinator seconds per round | {c['coordinator_seconds']:.2f} | {f['coordinator_seconds']:.2f} |")
    if args.part in ("accuracy", "both"):
        report["accuracy"] = accuracy(args.clients, args.rounds, args.bits, args.clip, args.seed)
        print("| configuration | final accuracy | best | uplink MB | clients used (last round) |")
        print("|---|---|---|---|---|")
        for r in report["accuracy"]:
            print(f"| {r['config']} | {r['final_accuracy']:.2%} | {r['best_accuracy']:.2%} | {r['uplink_mb']:.3f} | {r['clients_used_last']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}; reproduce: {report['command']}")


if __name__ == "__main__":
    main()
