"""Rich progress display and end-of-run summary for the CLI."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedge.server.run.metrics_row import RoundRow

__all__ = ["RoundProgress", "print_summary"]


class RoundProgress:
    """One progress bar over rounds; each finished round also prints a compact line."""

    def __init__(self, console: Console, rounds: int) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("[bold blue]rounds"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
        )
        self.task = self.progress.add_task("rounds", total=rounds, status="starting engine...")
        self.uplink = 0
        self.fp32 = 0

    def __enter__(self) -> RoundProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, raw: dict[str, Any] | RoundRow) -> None:
        row = raw if isinstance(raw, RoundRow) else RoundRow.from_json(raw)
        self.uplink += row.uplink_bytes
        self.fp32 += row.uplink_fp32_bytes
        status = (
            f"{_metric(row.metric, row.score)}  loss {_number(row.loss)}  "
            f"clients {row.clients_used}/{row.clients_sampled}  "
            f"uplink {self.uplink / 1e6:.2f} MB (fp32 {self.fp32 / 1e6:.2f} MB)"
        )
        self.progress.update(self.task, completed=row.round, status=status)
        step = "version" if "version" in row.extra else "round"
        self.progress.console.print(f"{step} {row.round:>3}: {status}  ({row.seconds:.1f} s, "
                                    f"{row.wall_seconds:.0f} s in all)")


def _percent(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}%"


def _metric(name: str, value: float) -> str:
    """``acc 97.2%`` for accuracy, ``mse 0.123`` for anything else."""
    return f"acc {_percent(value)}" if name == "accuracy" else f"{name} {_number(value)}"


def _number(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def print_summary(console: Console, result: Any) -> None:
    rows = [RoundRow.from_json(r) if isinstance(r, dict) else r for r in result.rows]
    summary = result.summary or {}
    table = Table(title="fedge run summary", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    if rows:
        last = rows[-1]
        table.add_row("algorithm", summary.get("algorithm", last.algorithm))
        table.add_row("rounds", str(last.round))
        where = "held-out" if last.evaluation == "central" else "federated (devices' held-out)"
        final = summary.get("final_metrics") or last.metrics
        for name in [last.metric, *sorted(k for k in final if k != last.metric)]:
            value = float(final.get(name, math.nan))
            table.add_row(f"{where} {name}", _percent(value) if name == "accuracy" else _number(value))
        up = sum(r.uplink_bytes for r in rows)
        fp32 = sum(r.uplink_fp32_bytes for r in rows)
        table.add_row("uplink bytes (real payloads)", f"{up:,}")
        table.add_row("uplink bytes if fp32", f"{fp32:,}")
        table.add_row("uplink compression", f"{fp32 / up:.2f}x" if up else "-")
        table.add_row("downlink bytes", f"{sum(r.downlink_bytes for r in rows):,}")
        measured = sum(r.measurement_bytes for r in rows)
        if measured:
            table.add_row("measurement uploads (not training traffic)", f"{measured:,}")
        table.add_row("failed client replies", str(sum(r.clients_failed for r in rows)))
    if summary.get("resumed_from_round"):
        table.add_row("resumed after round", str(summary["resumed_from_round"]))
    bundle = summary.get("bundle")
    if bundle and bundle.get("path"):
        metric = bundle.get("metric", "accuracy")
        value = bundle.get(metric)
        shown = "-" if value is None else (f"{100 * value:.2f}%" if metric == "accuracy" else f"{metric} {value:.4g}")
        table.add_row("edge bundle (int8, signed)", f"{bundle['bytes']:,} B, {shown}")
    elif bundle:
        table.add_row("edge bundle", f"refused: {bundle['error']}")
    if summary.get("dp_private") is False:
        table.add_row("differential privacy", "[bold red]NOT PRIVATE[/bold red]: noise from the seed (dp-seeded-noise)")
    if summary.get("model_digest"):
        table.add_row("seed · model digest", f"{summary.get('seed')} · {summary['model_digest']}")
    table.add_row("wall time", f"{result.seconds:.1f} s")
    console.print(table)
    console.print(f"run directory: [bold]{result.run_dir}[/bold]  (metrics.jsonl, plot.png, model.pt)")
    if bundle and bundle.get("path") and bundle.get("public_key"):
        console.print(f"verify on a device: fedge-edge verify {bundle['path']} --trusted-key {bundle['public_key']}")
