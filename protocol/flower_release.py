"""The Flower releases Fedge is tested with, and the check that refuses any other.

Fedge reads more of Flower than its public Message API: the local SuperLink's fixed ports, the
SuperNode's polling, ``flwr run``'s output, ``flwr ls`` JSON. Each release in :data:`SUPPORTED` has
passed the compatibility run (``make flower-compat``: the tests that touch Flower, in a fresh
environment per release; docs/testing.md), and ``pyproject.toml`` allows exactly these. A new
release is one line here, one in ``pyproject.toml`` and ``Makefile``'s ``FLOWER_RELEASES``, then
that run. On any other release ``fedge.flower`` (and Fedge's own ServerApp and ClientApp) refuse to
start with :class:`UnsupportedFlowerError`, naming the supported range; ``FEDGE_UNTESTED_FLOWER=1``
turns the refusal into a warning, to try a release before it is added.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version

__all__ = ["SUPPORTED", "UNTESTED_ENV", "UnsupportedFlowerError", "check_flower", "supported_range"]

log = logging.getLogger(__name__)

#: the minor releases the compatibility run passes on (any patch release of each)
SUPPORTED = ("1.41", "1.42")
#: set to 1 to run on a release outside :data:`SUPPORTED` anyway (a warning, not a refusal)
UNTESTED_ENV = "FEDGE_UNTESTED_FLOWER"


class UnsupportedFlowerError(ImportError):
    """The installed Flower is a release Fedge has not been tested with."""


def supported_range() -> str:
    """The pip specifier ``pyproject.toml`` pins flwr with: the oldest supported release up to, not
    including, the first untested one."""
    major, minor = SUPPORTED[-1].split(".")
    return f">={SUPPORTED[0]},<{major}.{int(minor) + 1}"


def check_flower(installed: str | None = None) -> str:
    """The installed Flower release, if :data:`SUPPORTED` holds it; else raises
    :class:`UnsupportedFlowerError` (a warning with ``FEDGE_UNTESTED_FLOWER=1``)."""
    if installed is None:
        try:
            installed = version("flwr")
        except PackageNotFoundError:
            raise UnsupportedFlowerError("Flower (flwr) is not installed; Fedge needs flwr" + supported_range()) from None
    if ".".join(installed.split(".")[:2]) in SUPPORTED:
        return installed
    message = (f"Flower {installed} is not a release Fedge is tested with (flwr{supported_range()}: "
               f"{', '.join(SUPPORTED)}); install one, e.g. pip install 'flwr{supported_range()}'")
    if os.environ.get(UNTESTED_ENV) == "1":
        log.warning("%s; %s=1: going on anyway", message, UNTESTED_ENV)
        return installed
    raise UnsupportedFlowerError(f"{message}, or set {UNTESTED_ENV}=1 to try it untested")
