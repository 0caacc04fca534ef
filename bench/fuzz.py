"""Decoder fuzzing at bench scale: 100,000 mutated payloads per codec (CI runs 10,000).

Byte flips, truncations, insertions and header edits, half of them with a repaired checksum so that
validation must catch them by looking at the fields. Any exception other than PayloadError, or a
decoded tensor of the wrong shape or with non-finite values, fails the run. Prints a table and
writes bench/results/fuzz.json with the command.

    .venv/bin/python bench/fuzz.py [--per-codec 100000]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


from tests.compression import test_payload_validation as validation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-codec", type=int, default=100_000)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fuzz.json"))
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "bench/fuzz.py", *sys.argv[1:]])
    rows = []
    for spec in validation.SPECS:
        started = time.perf_counter()
        validation.fuzz(spec, args.per_codec)  # raises on any finding
        rows.append({"codec": spec, "mutations": args.per_codec, "seconds": time.perf_counter() - started})
        print(f"{spec}: {args.per_codec:,} mutations, no finding", file=sys.stderr)
    print(f"\nMeasured {time.strftime('%Y-%m-%d')} on {platform.machine()}. Command: `{command}`\n")
    print("| codec | mutated payloads | seconds | findings |\n|---|---|---|---|")
    for r in rows:
        print(f"| `{r['codec']}` | {r['mutations']:,} | {r['seconds']:.1f} | 0 |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"),
                               "machine": platform.platform(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
