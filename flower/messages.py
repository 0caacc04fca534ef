"""The records the drivers of ``fedge.flower`` copy, count or merge on a message's way to and from
the user's strategy (how a reply is read is ``fedge.protocol.app_reply``'s, what a message asks for
``fedge.protocol.uplink_request``'s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedge.protocol.app_reply import REFUSED
from fedge.protocol.dispatcher import Missing
from fedge.protocol.door import door
from fedge.protocol.failures import Failure
from fedge.protocol.resources import RESOURCES_RECORD
from fedge.protocol.step import Reply
from fedge.protocol.tally import Tally

__all__ = ["own_config", "parsed", "through_door", "with_extra", "with_raw"]

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


def through_door(number: int, item: Message | Missing, consume: Callable[[Reply], None], tally: Tally,
                 **door_args: object) -> Failure | None:
    """A Flower-app driver's door (``fedge.protocol.door``, with the errors that refuse an app's
    reply): a reply that arrived is first counted in its step's ``tally`` (its bytes, its device's
    resource report, ``fedge.protocol.tally``) and the report taken out of it, since Flower's
    strategies aggregate replies that hold exactly one MetricRecord and ``resource_mod`` adds one."""
    if isinstance(item, Message):
        tally.replied(item)
        if not item.has_error():
            item.content.pop(RESOURCES_RECORD, None)
    return door(number, item, consume, refuses=REFUSED, **door_args)  # type: ignore[arg-type]


def with_extra(metrics: MetricRecord | None, extra: dict[str, object]) -> MetricRecord | None:
    """The strategy's metrics plus the layers' numbers (nested dicts flattened, ``a.b.c``)."""
    flat: dict[str, float] = {}

    def add(name: str, value: object) -> None:
        if isinstance(value, dict):
            for sub, item in value.items():
                add(f"{name}.{sub}", item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value

    for name, value in extra.items():
        add(name, value)
    if not flat:
        return metrics
    out = MetricRecord(dict(metrics or {}))
    out.update(flat)
    return out
