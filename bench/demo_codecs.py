"""Side-by-side federated runs of the demo configuration with different uplink codecs.

Same seed, same data split, same clients, same rounds; only the codec (and error feedback) changes.
Prints a markdown table and writes bench/results/demo_codecs.json with the command that produced it.

    .venv/bin/python bench/demo_codecs.py [--rounds 30] [--clients 10]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.engines import launch  # noqa: E402
from server.settings import RunSettings  # noqa: E402

CONFIGS = [
    ("none", True),
    ("fp16", True),
    ("qsgd:bits=8,bucket=512,norm=max", True),
    ("qsgd:bits=4,bucket=512,norm=max", True),
    ("qsgd:bits=4,bucket=512,norm=l2", True),
    ("qsgd:bits=4,bucket=512,norm=l2", False),
    ("qsgd:bits=2,bucket=512,norm=max", True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "demo_codecs.json"))
    args = parser.parse_args()
    command = " ".join([Path(sys.executable).name, *sys.argv])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (codec, ef) in enumerate(CONFIGS):
            settings = RunSettings(codec=codec, error_feedback=ef, rounds=args.rounds,
                                   clients_per_round=args.clients, run_dir=f"{tmp}/run{i}")
            result = launch(settings, engine="simulation", num_supernodes=args.clients, timeout=1800)
            s = result.summary
            rows.append({
                "codec": codec, "error_feedback": ef, "final_accuracy": s["final_accuracy"],
                "final_loss": s["final_loss"],
                "uplink_bytes": s["uplink_bytes"], "uplink_fp32_bytes": s["uplink_fp32_bytes"],
                "compression_ratio": s["compression_ratio"], "seconds": round(result.seconds, 1),
            })
            print(f"{codec} ef={ef}: {100 * s['final_accuracy']:.2f}%", file=sys.stderr)
    print(f"\nMeasured {time.strftime('%Y-%m-%d')} on {platform.machine()} ({platform.processor() or 'cpu'}), "
          f"{args.clients} clients, {args.rounds} rounds, digits, Dirichlet(0.5), seed 42. Command: `{command}`\n")
    print("| codec | error feedback | held-out accuracy | held-out loss | uplink bytes | fp32-equivalent bytes "
          "| ratio | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['codec']}` | {'yes' if r['error_feedback'] else 'no'} | {100 * r['final_accuracy']:.2f}% | "
              f"{r['final_loss']:.4f} | "
              f"{r['uplink_bytes']:,} | {r['uplink_fp32_bytes']:,} | {r['compression_ratio']:.2f}x | {r['seconds']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"),
                               "machine": platform.platform(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
