"""The Fedge ServerApp: the coordinator that the simulation and deployment engines both run.

It reads the run config (one vocabulary, see ``server.settings``), prepares or resumes the run
directory, runs the round loop and writes the final artifacts: ``model.pt``, ``plot.png`` and
``summary.json``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from deploy.model_file import ModelFile, save_model_file
from server.fedavg import FedAvgLoop, initial_params
from server.plot import plot_run
from server.run_directory import RunDirectory
from server.settings import RunSettings
from tasks import make_task, unflatten_state

__all__ = ["app", "configure_logging"]

log = logging.getLogger("server")

app = ServerApp()


def configure_logging() -> None:
    """Send Fedge's INFO logs to stderr once (Flower configures only its own ``flwr`` logger)."""
    for name in ("server", "edge_client", "aggregation", "compression", "tasks", "deploy"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False


@app.main()
def main(grid: Grid, context: Context) -> None:
    configure_logging()
    settings = RunSettings.from_run_config(context.run_config)
    run_dir = RunDirectory(settings.run_dir or Path("runs") / f"run-{context.run_id}")
    run_dir.start(settings, extra={"flower_run_id": context.run_id, "started_at": time.time()})
    log.info("run directory: %s", run_dir.path)

    task = make_task(settings.task)
    loop = FedAvgLoop(settings, task, run_dir)
    start_params = initial_params(task, settings.seed, settings.init)
    first_loss, first_accuracy = loop.evaluate(start_params)
    result = loop.run(grid, start_params)

    rows = result.rows
    final = rows[-1] if rows else {"accuracy": first_accuracy, "loss": first_loss, "round": 0}
    save_model_file(
        run_dir.model_path,
        ModelFile(
            task=task.spec,
            state_dict=unflatten_state(result.params, task.build_model().state_dict()),
            metadata={"round": final["round"], "accuracy": final["accuracy"], "codec": settings.codec},
        ),
    )
    if rows:
        plot_run(rows, run_dir.plot_path, title=f"{task.spec} · {settings.codec} · {settings.partitioning}")
    uplink = sum(r["uplink_bytes"] for r in rows)
    fp32 = sum(r["uplink_fp32_bytes"] for r in rows)
    run_dir.write_summary(
        {
            "rounds": final["round"],
            "initial_accuracy": first_accuracy,
            "final_accuracy": final["accuracy"],
            "final_loss": final["loss"],
            "uplink_bytes": uplink,
            "uplink_fp32_bytes": fp32,
            "compression_ratio": fp32 / uplink if uplink else None,
            "downlink_bytes": sum(r["downlink_bytes"] for r in rows),
            "seconds": sum(r["seconds"] for r in rows),
            "resumed_from_round": result.resumed_from,
            "codec": settings.codec,
        }
    )
    log.info("done: accuracy %.4f after %d rounds; model %s", final["accuracy"], final["round"], run_dir.model_path)
