"""``fedge-edge``: the device-side command line (verify and run signed bundles). Imports no torch.

    fedge-edge verify bundle/ --trusted-key signing-key.pub.pem
    fedge-edge infer  bundle/ --trusted-key signing-key.pub.pem --input x.npy [--output y.npy]

A rejected bundle exits with status 3 and names the failed check (SignatureError, IntegrityError,
ExpiredError, RollbackError, ...); a bad input file exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from deploy.bundle import BundleError
from deploy.keys import KeyFileError
from edge_client.inference import EdgeModel, default_state_path

__all__ = ["main"]

EXIT_REJECTED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedge-edge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
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
            command.add_argument("--runs", type=int, default=20, help="timed runs for the latency report")
    return parser


def _load_input(path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise SystemExit(f"fedge-edge: cannot read {path} as a .npy array: {err}") from err


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
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
               "accuracy": (meta.get("accuracy") or {}).get("bundle"),
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
        summary |= {"batch": int(x.shape[0]), "predictions": outputs.argmax(axis=-1).tolist(),
                    "latency_p50_ms": round(report.p50_ms, 4), "samples_per_s": round(report.samples_per_s, 1)}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
