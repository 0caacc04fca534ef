"""The ConfigRecord of a train message, typed: what every algorithm's client reads.

The coordinator builds it with :func:`round_config`; the client parses it with
:class:`RoundConfig.from_record`, which checks every key's presence, type and range before anything
trains. Algorithm-specific keys (EASGD's ``alpha``, gossip's ``gamma`` and mixing weights) ride in
the same record and are read with :meth:`RoundConfig.number` / :meth:`RoundConfig.text`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ConfigRecord

from fedge.protocol.records import ProtocolError

__all__ = ["RoundConfig", "typed_value"]

# key -> (type, minimum); minimum None = no bound
_COMMON: dict[str, tuple[type, float | None]] = {
    "round": (int, 1),
    "task": (str, None),
    "partitioning": (str, None),
    "codec": (str, None),
    "error-feedback": (bool, None),
    "local-epochs": (int, 1),
    "batch-size": (int, 1),
    "lr": (float, 0.0),
    "momentum": (float, 0.0),
    "seed": (int, 0),
    "holdout": (float, 0.0),
}


@dataclass(frozen=True)
class RoundConfig:
    round: int
    task: str
    partitioning: str
    codec: str
    error_feedback: bool
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    seed: int
    #: fraction of a device's data set aside for federated evaluation (0: the run evaluates centrally)
    holdout: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> ConfigRecord:
        values: dict[str, Any] = {key: getattr(self, key.replace("-", "_")) for key in _COMMON}
        clash = set(values) & set(self.extra)
        if clash:
            raise ProtocolError(f"algorithm keys {sorted(clash)} clash with common config keys")
        return ConfigRecord({**values, **self.extra})

    @classmethod
    def from_record(cls, record: ConfigRecord) -> RoundConfig:
        values: dict[str, Any] = {}
        for key, (kind, low) in _COMMON.items():
            if key not in record:
                raise ProtocolError(f"config record lacks {key!r}")
            values[key.replace("-", "_")] = typed_value(key, record[key], kind, low)
        if values["holdout"] >= 1.0:
            raise ProtocolError(f"config holdout={values['holdout']} must be below 1")
        extra = {k: v for k, v in record.items() if k not in _COMMON}
        return cls(**values, extra=extra)

    def number(self, key: str, low: float | None = None, high: float | None = None) -> float:
        """An algorithm's numeric key, present, finite and within [low, high]."""
        value = typed_value(key, self.extra.get(key), float, low)
        if high is not None and value > high:
            raise ProtocolError(f"config {key}={value} is above {high}")
        return value

    def integer(self, key: str, low: int | None = None) -> int:
        return int(typed_value(key, self.extra.get(key), int, low))

    def text(self, key: str) -> str:
        return str(typed_value(key, self.extra.get(key), str, None))

    def flag(self, key: str, default: bool = False) -> bool:
        if key not in self.extra:
            return default
        return bool(typed_value(key, self.extra[key], bool, None))


def typed_value(key: str, value: Any, kind: type, low: float | None = None) -> Any:
    """A config value of ``kind`` (bool, a non-empty str, or a finite number at least ``low``), or
    a :class:`ProtocolError` that names ``key``: how every config key a device reads is checked."""
    if value is None:
        raise ProtocolError(f"config record lacks {key!r}")
    if kind is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"config {key}={value!r} is not a boolean")
        return value
    if kind is str:
        if not isinstance(value, str) or not value or len(value) > 4096:
            raise ProtocolError(f"config {key}={value!r} is not a non-empty string")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"config {key}={value!r} is not a number")
    if kind is int and not (isinstance(value, int) or float(value).is_integer()):
        raise ProtocolError(f"config {key}={value!r} is not an integer")
    if not math.isfinite(value):
        raise ProtocolError(f"config {key}={value!r} is not finite")
    if low is not None and value < low:
        raise ProtocolError(f"config {key}={value!r} is below {low}")
    return int(value) if kind is int else float(value)
