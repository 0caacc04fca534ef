"""``fedge keys generate`` and ``fedge export``: the deploy side of the command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_deploy_parsers", "run_export", "run_keys"]


def add_deploy_parsers(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="signing keys for bundles (Ed25519)")
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    generate = keys_sub.add_parser(
        "generate", help="write signing-key.pem (private, 0600) and signing-key.pub.pem (give this to devices)"
    )
    generate.add_argument("--out", required=True, help="directory for the key pair")
    generate.add_argument("--force", action="store_true", help="replace an existing key pair")

    export = sub.add_parser(
        "export",
        help="prune, quantize, sign: turn a model.pt into a signed ONNX bundle for the edge",
        description="Loads an fp32 model file (model.pt of `fedge demo`/`cloud-train`, or their run "
        "directory), optionally prunes and fine-tunes it, exports ONNX, quantizes it to int8 with "
        "calibration, refuses the result if it is worse than fp32 by more than --max-accuracy-drop "
        "(accuracy points; for a task with another metric, percent of the fp32 value), and writes "
        "model.onnx plus a signed manifest (DSSE + in-toto) to --out.",
    )
    export.add_argument("checkpoint", help="model.pt, or a directory containing one")
    export.add_argument("--prune", default="", help="'unstructured:sparsity=0.8', 'channels:fraction=0.5', or both "
                        "joined with '+' (default: none)")
    export.add_argument("--quantize", default="int8", choices=["int8", "dynamic-int8", "none"],
                        help="int8: static QDQ, calibrated; dynamic-int8: weights only; none: fp32 (default: int8)")
    export.add_argument("--sign-key", required=True, help="private key from `fedge keys generate`")
    export.add_argument("--out", required=True, help="bundle directory to write")
    export.add_argument("--max-accuracy-drop", type=float, default=1.0,
                        help="accuracy points, or percent of the fp32 value for another metric such as MSE (default: 1.0)")
    export.add_argument("--min-quality", type=float, default=None,
                        help="the worst primary metric a bundle may have (default: for accuracy, better than "
                        "always answering the held-out set's most common class; no floor for other metrics)")
    export.add_argument("--fine-tune-epochs", type=int, default=3, help="after each pruning step (default: 3)")
    export.add_argument("--calibration-samples", type=int, default=256,
                        help="training samples that calibrate static int8 activations (default: 256)")
    export.add_argument("--valid-days", type=float, default=30.0, help="expiry, days from now (default: 30)")
    export.add_argument("--name", default="", help="model name devices track rollback under (default: task)")
    export.add_argument("--round", type=int, default=None, help="training round (default: from the model file)")


def run_keys(args: argparse.Namespace) -> int:
    from fedge.deploy.keys import generate_keypair

    private, public = generate_keypair(args.out, overwrite=args.force)
    print(f"private key: {private} (keep it secret)\npublic key:  {public} (give it to devices)")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fedge.deploy.exporter import EXPORT_REFUSALS, ExportOptions, bundle_facts, export_bundle
    from fedge.deploy.keys import load_private_key

    console = Console()
    options = ExportOptions(
        prune=args.prune, quantize=args.quantize, max_accuracy_drop=args.max_accuracy_drop,
        fine_tune_epochs=args.fine_tune_epochs, calibration_samples=args.calibration_samples,
        valid_days=args.valid_days, name=args.name, round=args.round, min_quality=args.min_quality,
    )
    key = load_private_key(args.sign_key)
    try:
        with console.status("pruning, exporting, quantizing, signing..."):
            statement = export_bundle(args.checkpoint, args.out, key, options)
    except EXPORT_REFUSALS as err:
        console.print(f"[red]export refused:[/red] {err}")
        return 1
    console.print(f"bundle written to {Path(args.out).resolve()}")
    facts = {key: round(value, 4) if isinstance(value, float) else value for key, value in bundle_facts(statement).items()}
    console.print(json.dumps(facts, indent=2))
    return 0
