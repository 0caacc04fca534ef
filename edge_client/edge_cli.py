"""``fedge-edge``: the device-side command line.

    fedge-edge join   --superlink HOST:PORT --root-cert ca.crt --auth-key device-1 --data own.npz
    fedge-edge verify bundle/ --trusted-key signing-key.pub.pem
    fedge-edge infer  bundle/ --trusted-key signing-key.pub.pem --input x.npy [--output y.npy]
    fedge-edge status [--state-dir DIR] [--day YYYY-MM-DD]

``verify`` and ``infer`` import no torch (onnxruntime and cryptography only); ``join`` trains, so it
needs ``fedge[device]``; ``status`` sums the device's resource ledger for a day. ``join`` exits 2 on a bad data file, key or certificate (before it
connects); a key the SuperLink refuses (not registered yet) is logged and retried.

A rejected bundle exits with status 3 and names the failed check (SignatureError, IntegrityError,
ExpiredError, RollbackError, ...); a bad input file exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np

from fedge.deploy.bundle import BundleError
from fedge.deploy.keys import KeyFileError
from fedge.edge_client.inference import EdgeModel, default_state_path

__all__ = ["main"]

EXIT_REJECTED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedge-edge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: info)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    join = sub.add_parser("join", help="join a federation with this device's own data (runs Flower's SuperNode)",
                          description="Validates --data against the task, then runs flower-supernode with the "
                          "Fedge ClientApp and supervises it (restarts it when it loses the SuperLink).")
    join.add_argument("--superlink", required=True, help="HOST:PORT of the federation's SuperLink")
    join.add_argument("--data", required=True,
                      help=".npz with x (float32, (N, *input shape), finite) and y (int labels in 0..classes-1)")
    join.add_argument("--task", default="digits", help="the federation's task (default: digits: x of shape (N, 1, 8, 8))")
    join.add_argument("--root-cert", default=None, help="the federation's CA certificate (TLS)")
    join.add_argument("--auth-key", default=None, help="this node's private key (`fedge certs node`), registered on the SuperLink")
    join.add_argument("--insecure", action="store_true", help="plaintext (test federations on a trusted network only)")
    join.add_argument("--threads", type=int, default=1, help="CPU threads for training (default: 1)")
    join.add_argument("--device", default="auto", help="where training runs: auto (the GPU where CUDA is, else the "
                      "CPU), cpu, cuda or cuda:N (default: auto)")
    join.add_argument("--state-dir", default=None, help="error-feedback memory, logs, Flower's app cache "
                      "(default: $XDG_STATE_HOME/fedge-edge)")
    join.add_argument("--port", type=int, default=0, help="local port of the SuperNode's ClientApp API (default: any free)")
    join.add_argument("--max-restarts", type=int, default=-1, help="give up after this many SuperNode restarts (default: never)")
    join.add_argument("--isolation", choices=("warm", "subprocess"), default="warm",
                      help="run each message in a child forked from one warm process with torch, Flower and "
                      "Fedge imported (default), or in a new flwr-clientapp process (Flower's subprocess isolation)")
    join.add_argument("--when", default="", help="train only when all hold: charging, unmetered, idle "
                      "(comma-separated; what each means on Linux: docs/operations.md, What a device spends)")
    join.add_argument("--max-rounds-per-day", type=int, default=0, help="refuse training beyond this many rounds a day")
    join.add_argument("--max-mb-per-day", type=float, default=0.0, help="refuse messages beyond this many MB a day (down + up)")
    join.add_argument("--require-secure-aggregation", action="store_true",
                      help="refuse any round without secure aggregation (the update would leave in clear) and "
                      "federated evaluation (metrics in clear), whatever the coordinator asks (docs/privacy.md)")
    join.add_argument("--min-participants", type=int, default=0,
                      help="take part only in secure rounds of at least this many devices (0: any)")
    join.add_argument("--min-threshold", type=float, default=0.0,
                      help="take part only in secure rounds whose share threshold is above this fraction of a "
                      "device's neighbours (0.67 against a coordinator that may lie; 0: any)")
    join.add_argument("--dp-min-noise", type=float, default=0.0,
                      help="take part only in secure rounds with distributed DP of at least this noise multiplier")
    join.add_argument("--dp-max-clip", type=float, default=0.0,
                      help="take part only in secure rounds with distributed DP that clip updates to at most this")
    join.add_argument("--no-default-policy", action="store_true",
                      help="with an identity issued by the operator's CA the device requires secure aggregation, "
                      "at least 3 participants and a share threshold above 2/3 of its neighbours unless this is "
                      "given (the device then logs at every message that its default policy is off)")
    join.add_argument("--app", default="fedge.edge_client.app:app", dest="client_app", metavar="MODULE:ATTRIBUTE",
                      help="the ClientApp this device runs, from its own installation (default: Fedge's); a run "
                      "whose app names another is refused, and nothing the run ships is imported")
    join.add_argument("--allow-module", action="append", default=[], metavar="MODULE",
                      help="an installed module a run's plugins or task may name (repeatable; default: none)")
    join.add_argument("--unpinned", action="store_true",
                      help="run the ClientApp the run's FAB ships, as Flower does (the coordinator's code: only "
                      "for a coordinator you trust, or with --trusted-entities)")
    join.add_argument("--trusted-entities", default=None, metavar="YAML",
                      help="Flower's FAB signature check: only FABs signed by these keys are run "
                      "(passed to flower-supernode)")
    join.add_argument("--check", action="store_true", help="validate everything, print the data summary, do not connect")
    status = sub.add_parser("status", help="what this device spent today: rounds, CPU-seconds, megabytes",
                            description="Sums the device's resource ledger (<state-dir>/resources.jsonl, one line "
                            "per message) for one day.")
    status.add_argument("--state-dir", default=None, help="the state directory `join` used (default: "
                        "$XDG_STATE_HOME/fedge-edge)")
    status.add_argument("--day", default=None, help="YYYY-MM-DD (default: today, local time)")
    for name, text in (("verify", "verify a bundle and accept its round (anti-rollback)"),
                       ("infer", "verify a bundle, then run it on an input .npy file")):
        command = sub.add_parser(name, help=text, description=text)
        command.add_argument("bundle", help="bundle directory (model.onnx + bundle.dsse.json)")
        command.add_argument("--trusted-key", action="append", required=True,
                             help="public key to trust (repeatable)")
        command.add_argument("--state", default=None,
                             help=f"anti-rollback store (default: {default_state_path()})")
        command.add_argument("--threads", type=int, default=1, help="intra-op threads (default: 1)")
        if name == "verify":
            command.add_argument("--install", default=None, metavar="ROOT",
                                 help="then make it the active model: ROOT/<name> -> ROOT/versions/... (atomic)")
        if name == "infer":
            command.add_argument("--input", required=True, help=".npy file, float32, shape as the manifest says")
            command.add_argument("--output", default=None, help="write the outputs here as .npy")
            command.add_argument("--runs", type=int, default=20, help="timed runs for the latency report (default: 20)")
    return parser


def _load_input(path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise SystemExit(f"fedge-edge: cannot read {path} as a .npy array: {err}") from err


def _join(args: argparse.Namespace) -> int:
    import threading

    from fedge.edge_client.join import JoinError, JoinOptions, check_join, default_state_dir, install_stop_signals, join

    options = JoinOptions(
        superlink=args.superlink, data=Path(args.data), task=args.task,
        root_cert=Path(args.root_cert) if args.root_cert else None,
        auth_key=Path(args.auth_key) if args.auth_key else None, insecure=args.insecure,
        threads=args.threads, device=args.device, state_dir=Path(args.state_dir) if args.state_dir else default_state_dir(),
        port=args.port, max_restarts=args.max_restarts, isolation=args.isolation, when=args.when,
        max_rounds_per_day=args.max_rounds_per_day, max_mb_per_day=args.max_mb_per_day,
        require_secure_aggregation=args.require_secure_aggregation, min_participants=args.min_participants,
        min_threshold=args.min_threshold,
        dp_min_noise=args.dp_min_noise, dp_max_clip=args.dp_max_clip,
        client_app=args.client_app, allowed_modules=tuple(args.allow_module), unpinned=args.unpinned,
        trusted_entities=Path(args.trusted_entities) if args.trusted_entities else None,
        no_default_policy=args.no_default_policy,
    )
    try:
        summary = check_join(options)
    except JoinError as err:
        print(f"fedge-edge: {err}", file=sys.stderr)
        return 2
    print(f"fedge-edge: data ok: {summary}", file=sys.stderr)
    if args.check:
        return 0
    stop = threading.Event()
    install_stop_signals(stop)
    return join(options, stop)


def _status(args: argparse.Namespace) -> int:
    import datetime

    from fedge.edge_client.join import default_state_dir
    from fedge.edge_client.resources import day_totals

    try:
        day = datetime.date.fromisoformat(args.day) if args.day else None
    except ValueError:
        print(f"fedge-edge: --day must be YYYY-MM-DD, got {args.day!r}", file=sys.stderr)
        return 2
    totals = day_totals(Path(args.state_dir) if args.state_dir else default_state_dir(), day)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "join" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "join":
        if os.getcwd() not in sys.path:  # a task given by import path imports from here, as in `fedge`
            sys.path.append(os.getcwd())
        return _join(args)
    if args.command == "status":
        return _status(args)
    try:
        model = EdgeModel.load(args.bundle, args.trusted_key, state=args.state, threads=args.threads)
    except KeyFileError as err:
        print(f"fedge-edge: {err}", file=sys.stderr)
        return 2
    except BundleError as err:
        print(f"fedge-edge: bundle rejected: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_REJECTED
    meta = model.metadata
    summary = {"verified": True, "name": meta["name"], "round": meta["round"], "task": meta["task"],
               "quantization": (meta.get("quantization") or {}).get("mode"),
               **_quality(meta),
               "expires": meta["expires"], "key_id": model.bundle.key_id,
               "verify_ms": round(model.bundle.seconds * 1e3, 2)}
    if args.command == "verify" and args.install:
        summary["installed"] = str(model.install(args.install))
    if args.command == "infer":
        x = _load_input(args.input)
        try:
            outputs = model.predict(x)
            report = model.latency(x, runs=max(1, args.runs))
        except BundleError as err:
            print(f"fedge-edge: {type(err).__name__}: {err}", file=sys.stderr)
            return 2
        if args.output:
            np.save(Path(args.output), outputs)
        # a classifier's outputs are logits: its predictions are the classes; anything else (a
        # regression, a sequence model) predicts its outputs themselves
        classifier = (meta.get("quality") or {}).get("metric") == "accuracy"
        predictions = outputs.argmax(axis=-1) if classifier else outputs
        summary |= {"batch": int(x.shape[0]), "predictions": np.round(predictions, 6).tolist(),
                    "latency_p50_ms": round(report.p50_ms, 4), "samples_per_s": round(report.samples_per_s, 1)}
    print(json.dumps(summary, indent=2))
    return 0


def _quality(meta: dict) -> dict:
    """The bundle's signed quality figure, e.g. ``{"accuracy": 0.97}`` or ``{"mse": 0.41}``."""
    quality = meta.get("quality") or {}
    return {quality["metric"]: quality.get("bundle")} if "metric" in quality else {}


if __name__ == "__main__":
    sys.exit(main())
