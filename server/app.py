"""The Fedge ServerApp: the coordinator that the simulation and deployment engines both run.

It reads the run config (one vocabulary, see ``fedge.server.settings``), prepares or resumes the run
directory, builds the round algorithm the ``algorithm`` key names (``fedge.server.algorithms``), runs it
on the round engine (``fedge.server.engine``) and writes the final artifacts: ``model.pt``, ``plot.png``
and ``summary.json``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedge.deploy.model_file import ModelFile, save_model_file
from fedge.protocol.flower_release import check_flower
from fedge.protocol.leaf import LEAF_STOP
from fedge.protocol.plugins import load_plugins
from fedge.server.algorithms.registry import make_algorithm
from fedge.server.engine.loop import Engine, make_context
from fedge.server.leaf import LeafCoordinator
from fedge.server.run.initial_model import initial_params
from fedge.server.run.plot import plot_run
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings
from fedge.tasks import make_task, unflatten_state
from fedge.tasks.parameters import model_digest
from fedge.tracking import Tracker

__all__ = ["app", "configure_logging"]

log = logging.getLogger(__name__)

check_flower()  # another Flower release: a clear error here, not a failure mid-run
app = ServerApp()


def configure_logging() -> None:
    """Send Fedge's INFO logs to stderr once (Flower configures only its own ``flwr`` logger)."""
    logger = logging.getLogger("fedge")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def _export_bundle(settings: RunSettings, run_dir: RunDirectory, round_: int) -> dict[str, Any]:
    """Sign the final model as an edge bundle. A refused export is logged; the model.pt stays."""
    from fedge.deploy.exporter import EXPORT_REFUSALS, ExportOptions, bundle_facts, export_bundle
    from fedge.deploy.keys import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keypair, load_private_key

    if settings.export_bundle == "auto":
        key_path = run_dir.path / "keys" / PRIVATE_KEY_FILE
        if not key_path.exists():  # a resumed run keeps its key
            generate_keypair(key_path.parent)
    else:
        key_path = Path(settings.export_bundle)
    out = run_dir.path / "bundle"
    try:
        statement = export_bundle(run_dir.model_path, out, load_private_key(key_path),
                                  ExportOptions(prune=settings.export_prune, round=round_))
    except (*EXPORT_REFUSALS, ValueError) as err:
        log.error("bundle export refused: %s", err)
        return {"path": None, "error": str(err)}
    except Exception as err:  # model.pt is saved: an export bug is logged, it must not fail the run
        log.exception("bundle export failed")
        return {"path": None, "error": f"{type(err).__name__}: {err}"}
    facts = bundle_facts(statement)
    log.info("signed bundle %s (round %d, %d bytes, %s %.4g)", out, round_, facts["bytes"], facts["metric"],
             facts[facts["metric"]])
    public = key_path.parent / PUBLIC_KEY_FILE  # next to the private key, as `fedge keys generate` writes it
    return {"path": str(out), "public_key": str(public) if public.is_file() else None, **facts}


@app.main()
def main(grid: Grid, context: Context) -> None:
    configure_logging()
    settings = RunSettings.from_run_config(context.run_config)
    load_plugins(settings.plugins)  # codecs, aggregators, algorithms from outside Fedge
    run_dir = RunDirectory(settings.run_dir or Path("runs") / f"run-{context.run_id}")
    # the threads its decode, sums and evaluation use: a local launch gives every core to a client
    # (``fedge.server.local.SERVER_THREADS``), a coordinator of its own keeps torch's default
    run_dir.start(settings, extra={"flower_run_id": context.run_id, "started_at": time.time(),
                                   "torch_threads": torch.get_num_threads()})
    log.info("run directory: %s", run_dir.path)

    task = make_task(settings.task)
    algorithm = make_algorithm(settings.algorithm, make_context(settings, task))
    # the run's tracking sinks see every row as it is written (after metrics.jsonl has it)
    tracker = Tracker.open(settings.tracking, run_dir.path,
                           tags={"fedge.role": "leaf" if settings.leaf_spool else "coordinator",
                                 "fedge.algorithm": algorithm.spec, "fedge.task": task.spec})
    tracker.start(settings.to_run_config())
    engine = Engine(algorithm, run_dir, on_row=lambda row: tracker.row(row.to_json()))
    finished = False
    try:
        finished = _serve_or_run(settings, run_dir, task, algorithm, engine, grid, tracker)
    finally:  # a failed run leaves its MLflow run open (RUNNING): a restart resumes it
        tracker.close(finished=finished)


def _serve_or_run(settings: RunSettings, run_dir: RunDirectory, task: Any, algorithm: Any, engine: Engine,
                  grid: Grid, tracker: Tracker) -> bool:
    """The run itself; True when it finished (not stopped to be resumed)."""
    if settings.leaf_spool:  # a leaf: its root sets the model of every step (fedge.server.leaf)
        spool = Path(settings.leaf_spool)
        answered = LeafCoordinator(engine, grid).serve(spool, stop=lambda: (spool / LEAF_STOP).exists()
                                                       or run_dir.stop_requested())
        log.info("leaf done: %d root rounds answered", answered)
        return not run_dir.stop_requested()
    start_params = initial_params(task, settings.seed, settings.init)
    first = engine.evaluate(start_params)
    result = engine.run(grid, start_params)
    if result.stopped:  # the checkpoint holds the state; no final model or summary for a paused run
        log.info("run stopped at the operator's request after round %d", result.rows[-1].round if result.rows else 0)
        return False

    rows = result.rows
    final_round = rows[-1].round if rows else 0
    # the final model's figures: central ones where there is central data, else the last
    # federated evaluation (the devices measured that very model when the last step closed)
    final = engine.evaluate(result.model) if rows and engine.ctx.evaluation != "federated" else (
        dict(rows[-1].metrics) if rows else first)
    metric = task.primary_metric
    save_model_file(
        run_dir.model_path,
        ModelFile(
            task=task.spec,
            state_dict=unflatten_state(result.model, task.build_model().state_dict()),
            metadata={"round": final_round, "metric": metric, metric: final.get(metric), "codec": settings.codec,
                      "algorithm": algorithm.spec, "evaluation": rows[-1].evaluation if rows else "central",
                      "seed": settings.seed, "model_digest": model_digest(result.model)},
        ),
    )
    bundle = _export_bundle(settings, run_dir, final_round) if settings.export_bundle else None
    if rows:
        plot_run(rows, run_dir.plot_path, maximize=task.maximize,
                 title=f"{task.spec} · {algorithm.spec} · {settings.codec} · {settings.partitioning}")
    uplink = sum(r.uplink_bytes for r in rows)
    fp32 = sum(r.uplink_fp32_bytes for r in rows)
    run_dir.write_summary(
        {
            "rounds": final_round,
            "algorithm": algorithm.spec,
            "metric": metric,
            "evaluation": rows[-1].evaluation if rows else engine.ctx.evaluation,
            "initial_metrics": first,
            "final_metrics": final,
            # the flat spellings scripts read (`jq .final_accuracy`), one per metric
            **{f"initial_{name}": value for name, value in first.items()},
            **{f"final_{name}": value for name, value in final.items()},
            "uplink_bytes": uplink,
            "uplink_fp32_bytes": fp32,
            "compression_ratio": fp32 / uplink if uplink else None,
            "downlink_bytes": sum(r.downlink_bytes for r in rows),
            "measurement_bytes": sum(r.measurement_bytes for r in rows),
            "seconds": sum(r.seconds for r in rows),
            "resumed_from_round": result.resumed_from,
            "stopped_at": (settings.stop_at or f"accuracy>={settings.stop_accuracy}") if result.reached_target else None,
            "privacy_budget_spent": result.budget_spent,
            "dp_epsilon": rows[-1].extra.get("dp_epsilon") if rows else None,
            # false: dp-seeded-noise drew the noise from the seed (a benchmark's run, not private)
            "dp_private": rows[-1].extra.get("dp_private") if rows else None,
            "codec": settings.codec,
            "seed": settings.seed,
            # model.pt's weights: two runs of one seed and one setting give the same digest
            "model_digest": model_digest(result.model),
            "bundle": bundle,
        }
    )
    log.info("done: %s %.4f after %d rounds; model %s", metric, final.get(metric, float("nan")), final_round,
             run_dir.model_path)
    tracker.artifacts([run_dir.model_path, run_dir.plot_path, run_dir.summary_path,
                       Path(bundle["path"]) if bundle and bundle.get("path") else None])
    return True
