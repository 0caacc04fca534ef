"""The start model a node builds itself, so the lattice downlink need not send it.

Fedge's own devices rebuild the run's start model from the task and seed; a Flower app's nodes
know only the app's code. ``compressed(..., downlink="lattice:...", start="pkg.task:Net@0")`` names
the zero-argument constructor and the seed the ServerApp built its ``initial_arrays`` with
(``torch.manual_seed(0); Net()``): each node builds the same model from the app's own module and
checks it against the server's digest. It is the app's code, which Flower already ships to the
node in the app bundle, so naming it gives the server no new power over the node. A node whose
model differs (another torch build, another seed) answers with an error and is sent the start
model once, in fp32.
"""

from __future__ import annotations

import importlib
import re

import torch
from flwr.app import ArrayRecord

from fedge.protocol.layout import LayoutError

__all__ = ["build_start", "parse_start"]

_SPEC = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_]\w*)@(\d{1,18})$")


def parse_start(spec: str) -> tuple[str, str, int]:
    """``module:callable@seed`` -> (module, callable, seed); anything else raises ValueError."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise ValueError(f"start must be 'module:callable@seed' (e.g. 'digitsapp.task:Net@0'), got {spec!r}")
    return match.group(1), match.group(2), int(match.group(3))


def build_start(spec: str) -> ArrayRecord:
    """The start model ``spec`` names, built with its seed, as an ``ArrayRecord`` of its state dict."""
    module_name, name, seed = parse_start(spec)
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise LayoutError(f"start {spec!r}: {err}") from None
    torch.manual_seed(seed)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise LayoutError(f"start {spec!r} built a {type(model).__name__}, not a torch module")
    return ArrayRecord(model.state_dict())
