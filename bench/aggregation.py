"""Server cost of one round: Fedge's streaming decode-and-accumulate vs Flower's FedAvg aggregation.

100 clients, each with a 1M-parameter update (random, seeded: identical for both methods).

* ``flower``: every reply is held as a dense fp32 ``ArrayRecord`` (what ``send_and_receive`` returns to
  ``flwr.serverapp.strategy.FedAvg``), then ``aggregate_arrayrecords`` (the function its
  ``aggregate_train`` calls) averages them.
* ``streaming-<codec>``: each client's payload arrives, is validated, decoded, added to one exact
  accumulator (``aggregation.StreamingMean``: the same bits in any order of replies) and dropped.

Each method runs in its own process; peak memory is the growth of ru_maxrss over the process's
baseline after imports (and after the fused codec kernels are compiled, a one-time cost of the
process); seconds are the aggregation work (building the replies is not counted). The streaming
methods' clients encode in a process of their own and send their payloads over a pipe, so the
coordinator process holds only what it receives (one payload at a time) and what it aggregates.
Prints a markdown table and writes bench/results/aggregation.json with the command.

    .venv/bin/python bench/aggregation.py [--clients 100] [--params 1000000]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path


SHAPES = [(1000, 784), (1000,), (200, 1000), (8, 200)]  # sums to 1,000,000 + 1,000 + 1,600


def _update(client: int, numel: int):  # type: ignore[no-untyped-def]
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(client))


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_flower(clients: int, numel: int) -> dict:
    import numpy as np
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    base = _peak_mb()
    replies = []
    for c in range(clients):  # what send_and_receive hands to the strategy: all replies at once
        flat = _update(c, numel).numpy()
        arrays, offset = {}, 0
        for i, shape in enumerate(_shapes(numel)):
            size = int(np.prod(shape))
            arrays[f"p{i}"] = Array(flat[offset : offset + size].reshape(shape).copy())
            offset += size
        replies.append(RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": 10 + c})}))
    start = time.perf_counter()
    result = aggregate_arrayrecords(replies, "num-examples")
    seconds = time.perf_counter() - start
    checksum = float(sum(np.abs(a.numpy()).sum() for a in result.values()))
    return {"seconds": seconds, "peak_mb": _peak_mb() - base, "checksum": checksum}


def run_streaming(clients: int, numel: int, spec: str) -> dict:
    import struct

    from fedge.aggregation import StreamingMean
    from fedge.compression import make_codec

    codec = make_codec(spec)
    # Compile the fused kernels (a one-time cost of the process, like its imports) before the baseline.
    import torch

    warm = codec.encode(torch.randn(4096))
    codec.decode(warm, 4096)
    # The clients encode in a process of their own and send each payload over a pipe, as devices
    # would: the coordinator's memory is what it holds, not what encoding an update costs.
    clients_process = subprocess.Popen([sys.executable, __file__, "--clients", str(clients), "--params", str(numel),
                                        "--method", f"emit:{spec}"], stdout=subprocess.PIPE)
    assert clients_process.stdout is not None
    base = _peak_mb()
    mean = StreamingMean(numel)
    seconds = 0.0
    for c in range(clients):  # each payload arrives, is decoded, added to the exact sum, and dropped
        (size,) = struct.unpack("<Q", clients_process.stdout.read(8))
        payload = clients_process.stdout.read(size)
        start = time.perf_counter()
        decoded = codec.decode(payload, numel)  # what the coordinator's door does: validate in full, decode
        mean.add(decoded, 10 + c)
        seconds += time.perf_counter() - start
        del payload, decoded
    if clients_process.wait() != 0:
        raise RuntimeError("the clients' process failed")
    start = time.perf_counter()
    result = mean.mean()
    seconds += time.perf_counter() - start
    return {"seconds": seconds, "peak_mb": _peak_mb() - base, "checksum": float(result.abs().sum())}


def emit_payloads(clients: int, numel: int, spec: str) -> None:
    """The clients: each update encoded, written to stdout as an 8-byte length and the payload."""
    import struct

    from fedge.compression import make_codec

    codec = make_codec(spec)
    out = sys.stdout.buffer
    for c in range(clients):
        payload = codec.encode(_update(c, numel))
        out.write(struct.pack("<Q", len(payload)))
        out.write(payload)
    out.flush()


def _shapes(numel: int) -> list[tuple[int, ...]]:
    if numel == sum(int(__import__("math").prod(s)) for s in SHAPES):
        return SHAPES
    return [(numel,)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--params", type=int, default=sum(int(__import__("math").prod(s)) for s in SHAPES))
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fedge.aggregation.json"))
    args = parser.parse_args()
    if args.method:  # child process
        if args.method.startswith("emit:"):
            emit_payloads(args.clients, args.params, args.method.removeprefix("emit:"))
            return
        if args.method == "flower":
            out = run_flower(args.clients, args.params)
        else:
            out = run_streaming(args.clients, args.params, args.method.removeprefix("streaming:"))
        print(json.dumps(out))
        return
    command = " ".join([Path(sys.executable).name, *sys.argv])
    rows = []
    for method in ("flower", "streaming:none", "streaming:qsgd:bits=4"):
        child = subprocess.run(
            [sys.executable, __file__, "--clients", str(args.clients), "--params", str(args.params), "--method", method],
            capture_output=True, text=True, check=True,
        )
        rows.append({"method": method, **json.loads(child.stdout.strip().splitlines()[-1])})
        print(f"{method}: {rows[-1]}", file=sys.stderr)
    flower = rows[0]
    print(f"\nMeasured {time.strftime('%Y-%m-%d')} on {platform.machine()}: {args.clients} clients x "
          f"{args.params:,} parameters, one aggregation. Command: `{command}`\n")
    print("| method | seconds | peak memory MB | memory vs Flower | time vs Flower |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['seconds']:.2f} | {r['peak_mb']:.0f} | "
              f"{flower['peak_mb'] / max(r['peak_mb'], 1e-9):.1f}x less | {flower['seconds'] / r['seconds']:.2f}x faster |")
    if abs(rows[0]["checksum"] - rows[1]["checksum"]) > 1e-3 * rows[0]["checksum"]:
        print("WARNING: fp32 streaming and Flower disagree on the aggregate", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"),
                               "machine": platform.platform(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
