"""What every wrapper of ``fedge.flower`` passes through to the strategy it wraps, and the records it
copies or merges (how a reply is read is ``fedge.protocol.app_reply``'s, what a message asks for
``fedge.protocol.uplink_request``'s)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

__all__ = ["Wrapper", "own_config", "parsed", "with_extra", "with_raw"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def parsed(parse: Callable[[str], T | None], text: str, name: str) -> T:
    """``parse(text)``, its error (a ValueError) or a ``none`` named after the argument ``name``."""
    try:
        value = parse(text)
    except ValueError as err:
        raise ValueError(f"{name} {text!r}: {err}") from None
    if value is None:
        raise ValueError(f"{name} {text!r}: a spec is needed here, not 'none'")
    return value


class Wrapper(Strategy):
    """A strategy around ``self.strategy``: evaluation, ``summary`` after the wrapper's own line, and
    every attribute the wrapper lacks (``fraction_train``, ``weighted_by_key``, ...) are the
    wrapped strategy's."""

    strategy: Strategy

    def describe(self) -> str:
        return type(self).__name__

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        log.info("%s (fedge.flower), wrapping:", self.describe())
        self.strategy.summary()

    def __getattr__(self, name: str) -> object:
        if name == "strategy":  # not set yet (inside __init__): no recursion
            raise AttributeError(name)
        return getattr(self.strategy, name)


def own_config(message: Message) -> ConfigRecord:
    """The message's ``config`` record as its own copy, in its own RecordDict: Flower's strategies
    give every message of a round one RecordDict (and the caller's one ConfigRecord), and what is
    written for one node must not reach another."""
    content = RecordDict(dict(message.content.items()))
    config = content["config"] = ConfigRecord(dict(content.config_records.get("config", ConfigRecord())))
    message.content = content
    return config


def with_raw(like: ArrayRecord, raw: ArrayRecord) -> ArrayRecord:
    """``like`` with the arrays ``raw`` has (the integer buffers a node sends as they are)."""
    return ArrayRecord({name: raw[name] if name in raw else like[name] for name in like})


def with_extra(metrics: MetricRecord | None, extra: dict[str, object]) -> MetricRecord | None:
    """The strategy's metrics plus the layers' numbers (one level of dicts flattened)."""
    flat: dict[str, float] = {}
    for name, value in extra.items():
        items = value.items() if isinstance(value, dict) else [("", value)]
        for sub, number in items:
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                flat[f"{name}.{sub}" if sub else name] = number
    if not flat:
        return metrics
    out = MetricRecord(dict(metrics or {}))
    out.update(flat)
    return out
