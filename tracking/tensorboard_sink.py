"""TensorBoard event files through tensorboardX (87 KB; its numpy, protobuf and packaging already
come with Flower): no torch, no TensorFlow, nothing that reads the files installed on the coordinator."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardSink"]

log = logging.getLogger(__name__)


class TensorBoardSink:
    """One run directory of event files. A resumed run purges the steps it runs again (tensorboardX's
    ``purge_step``: the first step this process logs), so TensorBoard shows each step once."""

    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._writer: Any = None
        self._params: dict[str, str] = {}

    def start(self, params: dict[str, str]) -> None:
        self._params = dict(params)  # written with the first step (the writer opens there, at its purge step)

    def _open(self, step: int) -> Any:
        from tensorboardX import SummaryWriter

        self.directory.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(logdir=str(self.directory), purge_step=step, flush_secs=10)
        if self._params:
            table = "\n".join(["| setting | value |", "|---|---|",
                               *(f"| {k} | `{v}` |" for k, v in sorted(self._params.items()))])
            writer.add_text("settings", table, global_step=step)
        log.info("tracking: TensorBoard event files in %s", self.directory)
        return writer

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self._writer is None:
            self._writer = self._open(step)
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a figure a person is watching for should not wait for the next flush

    def artifacts(self, paths: list[Path]) -> None:
        """Event files hold figures, not files; the run directory keeps the files."""

    def close(self, finished: bool) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
