"""A benchmark killed with SIGTERM unwinds as on Ctrl-C, so that ``launch()`` (and the helpers that
start Flower's processes) stop every process they started: no SuperLink is left behind."""

from __future__ import annotations

import signal

__all__ = ["stop_on_sigterm"]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
