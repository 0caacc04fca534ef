"""What a root's bridge node and its leaf coordinator agree on: one leaf step, asked and answered.

A leaf coordinator (``fedge.server.leaf``) runs Fedge's engine over its own devices on its own
SuperLink. The root sees it as one node: a bridge SuperNode whose ClientApp (``fedge.edge_client.bridge``)
hands each root train message's model to the leaf through a :class:`LeafChannel` and sends the
root what comes back as a device sends its update. What comes back is the change of the leaf's
model over its step (its devices' weighted mean update, for FedAvg), the weight of that step (the
examples behind it) and how many devices' updates are in it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedge.protocol.records import ProtocolError

__all__ = ["DOWN_AFTER", "HEARTBEAT", "HEARTBEAT_EVERY", "LEAF_CONNECTED", "LEAF_SPOOL", "LEAF_STOP", "LEAF_TIMEOUT", "LeafChannel", "LeafResult", "LeafSpoolError", "RootOrigin",
           "decode_request", "decode_result", "encode_request", "encode_result", "request_name", "result_name"]

#: at most this many devices behind one leaf step (a larger count is a corrupt file)
MAX_COUNT = 1 << 31


@dataclass(frozen=True)
class LeafResult:
    """One leaf step, as the bridge reports it to the root."""

    #: the change of the leaf's model over its step(s) from the model the root sent (flat, float32;
    #: after one plain FedAvg step, the mean it applied, which the difference equals up to rounding)
    delta: torch.Tensor
    #: the step's total weight (its devices' example counts; 0 when no update was used)
    weight: float
    #: devices whose updates are in it
    count: int
    #: the devices' mean training loss, when they reported one
    train_loss: float | None = None
    #: devices connected to the leaf when its (last) step opened: under DP the root divides by the
    #: sampling rate times these (``fedge.coordinator.dp_mechanisms``)
    connected: int = 0
    #: central DP (tier=leaf): the leaf's Poisson draw picked no device this round. Its sum is empty
    #: but valid: the bridge sends it, so that the root still counts the leaf's connected devices
    #: (the draw's denominator), where a leaf whose devices failed has no answer
    empty_sample: bool = False


@dataclass(frozen=True)
class RootOrigin:
    """Whose root round a leaf step serves: the root's run (its Flower run id) and the leaf (its
    bridge's index among the root's nodes). The leaf stamps both, with the round, on its devices'
    train messages, so that a device that moved to another leaf during a root round takes part in
    that root round once (``fedge.edge_client.counted_once``)."""

    run: int
    leaf: int


class LeafChannel(Protocol):
    """How a bridge asks its leaf for a step: in one process a leaf coordinator itself; across
    processes a channel on the leaf's host."""

    def step(self, root_round: int, model: torch.Tensor, origin: RootOrigin | None = None) -> LeafResult: ...


# -- across processes: the spool on the leaf's host ------------------------------------------------
# The bridge's ClientApp and the leaf's ServerApp run in different processes on the leaf's host
# (Flower lets no process be both a root ClientApp and a leaf ServerApp). They meet in a directory
# both can write: the bridge writes ``request-<round>.pt`` (the root's model), the leaf answers with
# ``result-<round>.pt``; each is written atomically, and each is read back checked in full.


class LeafSpoolError(ProtocolError):
    """A spool file that is not what the other side writes: says what is wrong with it."""


#: the file that ends a leaf's service (its root's run is over)
LEAF_STOP = "stop"
#: the node config key that makes a SuperNode a leaf's bridge: the leaf's spool directory
LEAF_SPOOL = "leaf-spool"
#: the node config key of how long a bridge waits for its leaf's step at the most (seconds; the
#: launcher gives 0.8 x the root's round timeout, so a leaf that never answers does not hold the
#: root's round; one whose heartbeat stops is given up sooner)
LEAF_TIMEOUT = "leaf-timeout"
#: the file a serving leaf touches every :data:`HEARTBEAT_EVERY` seconds, from a process of its own
#: (so a long step, or an interpreter held by a native call, does not silence it): a bridge that saw
#: it fresh during its wait and then sees it go :data:`DOWN_AFTER` seconds without a beat answers at
#: once that its leaf is down, instead of holding the root's round for the whole ``leaf-timeout``
HEARTBEAT = "leaf-alive"
HEARTBEAT_EVERY = 1.0
DOWN_AFTER = 10.0
#: the metric a bridge reports beside its leaf's change: the devices connected to the leaf (what
#: central DP's divisor counts at the root)
LEAF_CONNECTED = "leaf-connected"


def request_name(root_round: int) -> str:
    return f"request-{int(root_round):09d}.pt"


def result_name(root_round: int) -> str:
    return f"result-{int(root_round):09d}.pt"


def _save(obj: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _load(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for a truncated or foreign file
        raise LeafSpoolError(f"{what} is not a leaf spool file: {type(err).__name__}: {err}") from None
    if not isinstance(obj, dict):
        raise LeafSpoolError(f"{what} holds a {type(obj).__name__}, not a record")
    return obj


def _flat(value: object, what: str, numel: int | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.dim() != 1:
        raise LeafSpoolError(f"{what} must be a flat float32 tensor")
    if numel is not None and value.numel() != numel:
        raise LeafSpoolError(f"{what} has {value.numel()} values, the model {numel}")
    if not bool(torch.isfinite(value).all()):
        raise LeafSpoolError(f"{what} holds NaN or infinite values")
    return value


def _round(obj: dict[str, Any], root_round: int | None, what: str) -> int:
    value = obj.get("round")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LeafSpoolError(f"{what}: round must be a whole number >= 1, got {value!r}")
    if root_round is not None and value != root_round:
        raise LeafSpoolError(f"{what}: for round {value}, expected {root_round}")
    return value


def encode_request(root_round: int, model: torch.Tensor, origin: RootOrigin | None = None) -> bytes:
    return _save({"round": int(root_round), "model": model.detach().to(torch.float32).flatten().contiguous(),
                  **({"run": int(origin.run), "leaf": int(origin.leaf)} if origin is not None else {})})


def decode_request(data: bytes, numel: int | None = None) -> tuple[int, torch.Tensor, RootOrigin | None]:
    """(root round, the root's flat model, its origin when the bridge named one), checked."""
    obj = _load(data, "a leaf request")
    root_round = _round(obj, None, "a leaf request")
    model = _flat(obj.get("model"), "a leaf request's model", numel)
    run, leaf = obj.get("run"), obj.get("leaf")
    if run is None and leaf is None:
        return root_round, model, None
    for name, value in (("run", run), ("leaf", leaf)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
            raise LeafSpoolError(f"a leaf request's {name} must be a whole number >= 0, got {value!r}")
    return root_round, model, RootOrigin(run=run, leaf=leaf)  # type: ignore[arg-type]


def encode_result(root_round: int, result: LeafResult) -> bytes:
    return _save({"round": int(root_round), "delta": result.delta.detach().to(torch.float32).flatten().contiguous(),
                  "weight": float(result.weight), "count": int(result.count), "connected": int(result.connected),
                  "train_loss": None if result.train_loss is None else float(result.train_loss),
                  "empty_sample": bool(result.empty_sample)})


def decode_result(data: bytes, root_round: int, numel: int) -> LeafResult:
    """The leaf's answer for ``root_round`` over a model of ``numel`` values, checked."""
    obj = _load(data, "a leaf result")
    _round(obj, root_round, "a leaf result")
    delta = _flat(obj.get("delta"), "a leaf result's change", numel)
    weight, count, loss, connected = obj.get("weight"), obj.get("count"), obj.get("train_loss"), obj.get("connected", 0)
    if not isinstance(weight, float) or not math.isfinite(weight) or weight < 0:
        raise LeafSpoolError(f"a leaf result's weight must be a finite number >= 0, got {weight!r}")
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_COUNT:
        raise LeafSpoolError(f"a leaf result's count must be a whole number >= 0, got {count!r}")
    if loss is not None and (not isinstance(loss, float) or not math.isfinite(loss)):
        raise LeafSpoolError(f"a leaf result's train loss must be finite, got {loss!r}")
    if not isinstance(connected, int) or isinstance(connected, bool) or not 0 <= connected <= MAX_COUNT:
        raise LeafSpoolError(f"a leaf result's connected devices must be a whole number >= 0, got {connected!r}")
    empty = obj.get("empty_sample", False)
    if not isinstance(empty, bool) or (empty and count):
        raise LeafSpoolError(f"a leaf result's empty_sample must be true (with no device counted) or false, "
                             f"got {empty!r} with count {count!r}")
    return LeafResult(delta=delta, weight=weight, count=count, train_loss=loss, connected=connected,
                      empty_sample=empty)
