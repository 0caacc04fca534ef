"""``compressed(strategy, uplink=...)``: any Message-API strategy, with compressed updates.

The wrapper adds the codec to every train message's config (with the model's layout digest, the
round and the seed of the codec's round randomness) and, before the wrapped strategy aggregates,
decodes each reply's payload into the update, adds it to the model it sent and hands the strategy
an ``ArrayRecord`` of the same arrays as ever. So ``FedAvg``, ``FedAdam``, ``FedMedian``, ``Krum``,
... aggregate exactly what they would aggregate from uncompressed clients whose models differ by
the compression error, and their own ``start``, ``evaluate_fn``, ``Result`` and logging work as
before (``start`` is Flower's, calling this object's methods).

With ``downlink="lattice:..."`` the model goes out as a versioned lattice change instead of fp32
arrays (``fedge.flower.downlink``); replies are then decoded against the copy the node holds.
The round's train metrics gain ``fedge-downlink-bytes`` (the records sent, as Flower serializes them).

A reply that does not carry a payload (a client without ``compression_mod``), or whose payload
does not decode (another codec, a corrupt or truncated body, another model size), is refused: it
is logged with the reason and left out of the round, never mis-decoded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedge.compression import PayloadError, SpecError, make_codec
from fedge.flower.downlink import ServerDownlink
from fedge.flower.layout import Layout, LayoutError
from fedge.flower.records import ARRAYS, CODEC_KEY, LAYOUT_KEY, RAW_RECORD, ROUND_KEY, SEED_KEY, UPDATE_RECORD
from fedge.protocol.records import ProtocolError, array_bytes, read_payload

__all__ = ["CompressedStrategy", "compressed"]

log = logging.getLogger(__name__)


class CompressedStrategy(Strategy):
    """``strategy`` with Fedge-compressed uplink updates (see the module docstring)."""

    def __init__(self, strategy: Strategy, uplink: str = "qsgd:bits=4", seed: int = 0, downlink: str = "none") -> None:
        try:
            make_codec(uplink)
        except (SpecError, ValueError) as err:
            raise ValueError(f"uplink codec {uplink!r}: {err}") from None
        self.strategy, self.uplink, self.seed = strategy, uplink, int(seed)
        self.downlink = ServerDownlink(downlink)
        self._sent: tuple[int, Layout, np.ndarray, ArrayRecord] | None = None
        self.refused: list[tuple[int, int, str]] = []  # (round, node, reason) of replies left out

    # -- train ----------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        layout = Layout(arrays)
        public = self.downlink.public(arrays)  # with a lattice downlink, nodes train from its copy
        self._sent = (server_round, layout, layout.flatten(arrays) if public is None else public, arrays)
        messages = self.downlink.attach(self.strategy.configure_train(server_round, arrays, config, grid), arrays)
        for message in messages:
            record = message.content.config_records.get("config")
            if record is None:
                record = message.content["config"] = ConfigRecord()
            record[CODEC_KEY], record[LAYOUT_KEY] = self.uplink, layout.digest
            record[ROUND_KEY], record[SEED_KEY] = int(server_round), self.seed
        return messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The wrapped strategy's aggregate of the decoded replies; its metrics gain
        ``fedge-uplink-bytes`` (the update records received this round, as Flower serializes their
        arrays: payload headers included; the same count as Fedge's own engine) and
        ``fedge-refused`` (replies left out), which Flower logs and keeps in ``Result``."""
        replies = list(replies)
        uplink = sum(array_bytes(r.content, (UPDATE_RECORD,)) for r in replies if not r.has_error())
        refused_before = len(self.refused)
        self.downlink.settle(replies)
        arrays, metrics = self.strategy.aggregate_train(server_round, self.decode_replies(server_round, replies))
        metrics = metrics if metrics is not None else MetricRecord()
        metrics["fedge-uplink-bytes"] = uplink
        metrics["fedge-downlink-bytes"], self.downlink.bytes = self.downlink.bytes, 0
        metrics["fedge-refused"] = len(self.refused) - refused_before
        return arrays, metrics

    def decode_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies as the wrapped strategy expects them: each payload decoded into the model the
        client sent; refused replies are left out (logged, and kept in :attr:`refused`)."""
        if self._sent is None or self._sent[0] != server_round:
            raise RuntimeError(f"round {server_round} was not configured through this wrapper")
        _, layout, sent_flat, sent = self._sent
        wire = make_codec(self.uplink).for_model(layout.sizes()).for_round(server_round, self.seed)
        out = []
        for reply in replies:
            if reply.has_error():
                out.append(reply)
                continue
            try:
                if UPDATE_RECORD not in reply.content.array_records:
                    raise LayoutError(f"no {UPDATE_RECORD!r} record: is compression_mod on the ClientApp?")
                delta = wire.decode(read_payload(reply.content, UPDATE_RECORD), layout.numel).numpy()
                raw = reply.content.array_records.get(RAW_RECORD, ArrayRecord())
                like = ArrayRecord({name: raw[name] if name in raw else sent[name] for name in sent})
                model = layout.rebuild(sent_flat + delta, like)
            except (PayloadError, ProtocolError, LayoutError, KeyError) as err:
                node = reply.metadata.src_node_id
                log.warning("round %d: refused the reply of node %d: %s", server_round, node, err)
                self.refused.append((server_round, node, str(err)))
                continue
            content = RecordDict({name: record for name, record in reply.content.items()
                                  if name not in (UPDATE_RECORD, RAW_RECORD)})
            content[ARRAYS] = model
            reply.content = content
            out.append(reply)
        return out

    # -- everything else is the wrapped strategy's ----------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        if messages:
            self.downlink.public(arrays)
        return self.downlink.attach(messages, arrays)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The wrapped strategy's; with messages sent, ``fedge-downlink-bytes`` of the evaluate round."""
        replies = list(replies)
        self.downlink.settle(replies)
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        if self.downlink.bytes:
            metrics = metrics if metrics is not None else MetricRecord()
            metrics["fedge-downlink-bytes"], self.downlink.bytes = self.downlink.bytes, 0
        return metrics

    def summary(self) -> None:
        log.info("compressed uplink: %s, downlink: %s (fedge.flower), wrapping:", self.uplink, self.downlink.spec)
        self.strategy.summary()

    def __getattr__(self, name: str) -> object:
        # the wrapped strategy's own attributes (fraction_train, weighted_by_key, ...) read through
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)


def compressed(strategy: Strategy, uplink: str = "qsgd:bits=4", seed: int = 0,
               downlink: str = "none") -> CompressedStrategy:
    """Wrap ``strategy`` so clients with :func:`fedge.flower.compression_mod` send compressed updates
    (``uplink``, a Fedge codec spec) and, with ``downlink="lattice[:ratio=...]"``, receive the model as
    a versioned lattice change (``fedge.flower.downlink``) instead of fp32 arrays."""
    return CompressedStrategy(strategy, uplink=uplink, seed=seed, downlink=downlink)
