"""The run's picture: the primary metric (held-out accuracy, or the task's own: MSE, ...) and
cumulative uplink megabytes per round, and the metric against wall time.

The fp32-equivalent uplink (what the same clients would have sent uncompressed) is drawn dashed
beside the real bytes so the compression is visible at a glance. The right panel puts synchronous
and asynchronous runs on one axis (an asynchronous run's steps are model versions, far more and
far shorter than rounds): time to an accuracy is what a straggler costs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import accumulate

from fedge.server.run.metrics_row import RoundRow

__all__ = ["plot_run"]


def plot_run(rows: Sequence[RoundRow], path: str | os.PathLike[str], title: str = "", maximize: bool = True) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    from fedge.deploy.atomic import atomic_write_bytes

    measured = [r for r in rows if r.score == r.score]  # federated evaluation may skip steps
    metric = rows[0].metric if rows else "accuracy"
    percent = metric == "accuracy"
    where = "held-out" if not rows or rows[0].evaluation == "central" else "federated"
    label = f"{where} {metric}" + (" (%)" if percent else "") + ("" if maximize else " (lower is better)")
    scores = [100 * r.score if percent else r.score for r in measured]
    rounds = [r.round for r in rows]
    uplink = [mb / 1e6 for mb in accumulate(r.uplink_bytes for r in rows)]
    fp32 = [mb / 1e6 for mb in accumulate(r.uplink_fp32_bytes for r in rows)]

    fig, (left, timed) = plt.subplots(1, 2, figsize=(11, 4), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    left.plot([r.round for r in measured], scores, color="tab:blue", marker="o", markersize=3, label=label)
    left.set_xlabel("model version" if rows and "version" in rows[0].extra else "round")
    left.set_ylabel(label, color="tab:blue")
    if percent:
        left.set_ylim(0, 100)
    left.grid(alpha=0.3)
    right = left.twinx()
    right.plot(rounds, uplink, color="tab:orange", label="uplink MB (sent)")
    right.plot(rounds, fp32, color="tab:orange", linestyle="--", alpha=0.6, label="uplink MB (fp32 equivalent)")
    right.set_ylabel("cumulative uplink (MB)", color="tab:orange")
    timed.plot([r.wall_seconds for r in measured], scores, color="tab:blue", marker="o", markersize=3)
    timed.set(xlabel="wall seconds since the first message", ylabel=label, title=f"{metric} against wall time")
    if percent:
        timed.set_ylim(0, 100)
    timed.title.set_fontsize(9)
    timed.grid(alpha=0.3)
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
