"""MLflow through ``mlflow-skinny``'s client: a local SQLite store in the run directory by default,
or any tracking URI (a server ``http://HOST:5000``, a database). One MLflow run per Fedge run: a
resumed Fedge run continues its MLflow run (the id is kept in the run directory)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from fedge.deploy.atomic import atomic_write_text

__all__ = ["EXPERIMENT", "MlflowSink", "default_uri"]

log = logging.getLogger(__name__)

#: the experiment runs go to unless ``MLFLOW_EXPERIMENT_NAME`` names another (MLflow's own variable)
EXPERIMENT = "fedge"
#: MLflow's limit on a parameter value
_PARAM_CHARS = 6000
#: metrics per ``log_batch`` call (MLflow's limit is 1,000)
_BATCH = 1000


def default_uri(run_dir: Path) -> str:
    """``sqlite:///<run dir>/mlflow.db``: MLflow 3 keeps its plain-file store in maintenance mode and
    refuses it by default; SQLite is its recommended local store and needs no server."""
    return f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"


class MlflowSink:
    name = "mlflow"

    def __init__(self, uri: str, run_dir: Path, run_name: str, tags: dict[str, str] | None = None) -> None:
        if uri.partition(":")[0] in ("file", uri):  # file:///PATH, or a bare path
            # a plain-file store named on purpose: MLflow 3 keeps it in maintenance mode and refuses it
            # unless told; naming it in `tracking` is that
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.run_dir = run_dir
        self._state = run_dir / "mlflow-run.json"  # which MLflow run this run directory's run is
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self._run(run_name, tags or {})
        log.info("tracking: MLflow run %s at %s", self.run_id, uri)

    def _experiment(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        local = self.uri.startswith("sqlite:") and self.uri.endswith(str(self.run_dir.resolve() / "mlflow.db"))
        # the default store keeps its artifacts beside it (a server chooses its own)
        location = (self.run_dir.resolve() / "mlartifacts").as_uri() if local else None
        return self.client.create_experiment(name, artifact_location=location)

    def _run(self, run_name: str, tags: dict[str, str]) -> str:
        if self._state.exists():
            saved = json.loads(self._state.read_text(encoding="utf-8"))
            if saved.get("uri") == self.uri:
                try:
                    run = self.client.get_run(saved["run_id"])
                    self.client.update_run(run.info.run_id, status="RUNNING")
                    return run.info.run_id
                except Exception as err:  # deleted on the server: start a new one
                    log.warning("tracking: MLflow run %s is gone (%s); starting a new one", saved["run_id"], err)
        run = self.client.create_run(self._experiment(), run_name=run_name, tags={"fedge.run_dir": str(self.run_dir),
                                                                                  **tags})
        atomic_write_text(self._state, json.dumps({"uri": self.uri, "run_id": run.info.run_id}) + "\n")
        return run.info.run_id

    def start(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        new = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in sorted(params.items()) if k not in have]
        for k, v in sorted(params.items()):  # a resumed run may change a resumable setting (rounds):
            if k in have and have[k] != str(v)[:_PARAM_CHARS]:  # MLflow params are immutable, so a tag says so
                self.client.set_tag(self.run_id, f"resumed.{k}", str(v)[:_PARAM_CHARS])
        for i in range(0, len(new), 100):  # MLflow's limit on params per batch
            self.client.log_batch(self.run_id, params=new[i:i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(_metric_name(k), v, stamp, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _BATCH])

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            elif path.is_file():
                self.client.log_artifact(self.run_id, str(path))

    def close(self, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.run_id, status="FINISHED")


def _metric_name(name: str) -> str:
    """MLflow allows letters, digits, ``_ - . / :`` and spaces in a metric name; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-./: " else "_" for c in name)
