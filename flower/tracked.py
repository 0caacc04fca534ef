"""``tracked(strategy, "tensorboard:DIR;mlflow")``: a Flower app's rounds, logged where researchers look.

The same sinks as Fedge's own runs (``fedge.tracking``), around any strategy: Flower's own, a Fedge
wrapper (``compressed``, ``secure``, ...) or Fedge's ``FedBuff``/``FedAsync``. Each round (each
version) logs what the strategy returned: the aggregated train metrics as ``train/NAME``, the
federated evaluation as ``evaluate/NAME`` and the ServerApp's own evaluation (``evaluate_fn``) as
``server/NAME``; Fedge's wrappers put their real bytes each way, refusals and staleness among the
train metrics. This replaces what Flower's examples write by hand around ``wandb.log`` in a
``Strategy.start`` override.

    strategy = tracked(compressed(FedAvg(), uplink="qsgd:bits=4"), "tensorboard:runs/tb;mlflow",
                       run_dir="runs/my-run")
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedge.tracking import Tracker, check_tracking

__all__ = ["TrackedStrategy", "tracked"]


class TrackedStrategy(Strategy):
    """``strategy``, its rounds logged to the sinks ``tracking`` names (``fedge.tracking``'s grammar).

    ``run_dir`` is where the default sinks keep their files (``<run_dir>/tensorboard``, an MLflow
    SQLite store) and what names the run; ``params`` are logged as the run's parameters (the app's
    run config, say). The sinks open when the run starts and close when it ends.
    """

    def __init__(self, strategy: Strategy | Any, tracking: str, run_dir: str | Path | None = None,
                 params: dict[str, Any] | None = None) -> None:
        check_tracking(tracking)  # a missing library is refused here, with its install command
        self.strategy, self.tracking = strategy, tracking
        self.run_dir = Path(run_dir) if run_dir is not None else Path("runs") / f"flower-{time.strftime('%Y%m%d-%H%M%S')}"
        self.params = dict(params or {})
        self.tracker = Tracker([])  # the sinks open when the run starts (a ServerApp builds this first)

    # -- the run --------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None, **kwargs: Any) -> Result:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tracker = Tracker.open(self.tracking, self.run_dir,
                                    tags={"fedge.role": "flower-app", "fedge.strategy": type(self.strategy).__name__})
        self.tracker.start({"strategy": _describe(self.strategy), **self.params})
        server = None if evaluate_fn is None else self._server_evaluation(evaluate_fn)
        finished = False
        try:
            if type(self.strategy).start is not Strategy.start or not isinstance(self.strategy, Strategy):
                # a strategy with its own loop (FedBuff, FedAsync): it reports each version it publishes
                self.strategy.on_version = lambda version, metrics: self._log(version, "train", metrics)
                result = self.strategy.start(grid, initial_arrays, *args, evaluate_fn=server, **kwargs)
            else:  # Flower's round loop, through this wrapper's methods
                result = Strategy.start(self, grid, initial_arrays, *args, evaluate_fn=server, **kwargs)
            finished = True
            return result
        finally:
            self.tracker.close(finished=finished)

    def _server_evaluation(self, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None]
                           ) -> Callable[[int, ArrayRecord], MetricRecord | None]:
        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            metrics = evaluate_fn(server_round, arrays)
            self._log(server_round, "server", metrics)
            return metrics

        return evaluate

    def _log(self, server_round: int, prefix: str, metrics: MetricRecord | dict | None) -> None:
        if metrics is not None:
            self.tracker.row({"round": server_round, prefix: dict(metrics)})

    # -- Flower's round, delegated ----------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        self._log(server_round, "train", metrics)
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        self._log(server_round, "evaluate", metrics)
        return metrics

    def summary(self) -> None:
        self.strategy.summary()

    def __getattr__(self, name: str) -> object:
        if name == "strategy":  # not set yet (inside __init__): no recursion
            raise AttributeError(name)
        return getattr(self.strategy, name)


def _describe(strategy: Any) -> str:
    describe = getattr(strategy, "describe", None)
    return f"{type(strategy).__name__} ({describe()})" if callable(describe) else type(strategy).__name__


def tracked(strategy: Strategy | Any, tracking: str, run_dir: str | Path | None = None,
            params: dict[str, Any] | None = None) -> TrackedStrategy:
    """Wrap ``strategy`` so each round's metrics go to the sinks ``tracking`` names; see the module docstring."""
    return TrackedStrategy(strategy, tracking, run_dir, params)
