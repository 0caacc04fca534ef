"""``compressed(strategy, uplink=...)``: any Message-API strategy, with compressed updates.

The wrapper adds the codec to every train message's config (with the model's layout digest, the
round and the seed of the codec's round randomness) and, before the wrapped strategy aggregates,
decodes each reply's payload into the update, adds it to the model it sent and hands the strategy
an ``ArrayRecord`` of the same arrays as ever. So ``FedAvg``, ``FedAdam``, ``FedMedian``, ``Krum``,
... aggregate exactly what they would aggregate from uncompressed clients whose models differ by
the compression error, and their own ``start``, ``evaluate_fn``, ``Result`` and logging work as
before (``start`` is Flower's, calling this object's methods).

With ``downlink="lattice:..."`` the model goes out as a versioned lattice change instead of fp32
arrays (``fedge.flower.downlink``); a reply's update is from the copy the node holds, and moves the
strategy's exact model (what the copy lacks goes out in later versions).
The round's train metrics gain ``fedge-downlink-bytes`` (the records sent, as Flower serializes them).
A ``tcs`` uplink (``compression.shared_support``) needs that downlink: each node sends its values
on the coordinates its last change moved, and the wrapper decodes each reply on that node's.

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
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedge.aggregation.streaming_mean import StreamingMean
from fedge.compression import Codec, SpecError, make_codec
from fedge.flower.downlink import ServerDownlink
from fedge.protocol.layout import Layout
from fedge.flower.messages import REFUSED, Wrapper, reply_payload, reply_weight, with_raw, write_uplink
from fedge.protocol.records import MODEL_RECORD, RAW_RECORD, UPDATE_RECORD, array_bytes

__all__ = ["CompressedStrategy", "compressed"]

log = logging.getLogger(__name__)


class CompressedStrategy(Wrapper):
    """``strategy`` with Fedge-compressed uplink updates (see the module docstring)."""

    def __init__(self, strategy: Strategy, uplink: str = "qsgd:bits=4", seed: int = 0, downlink: str = "none",
                 streaming: bool = False, start: str | None = None) -> None:
        try:
            codec = make_codec(uplink)
        except (SpecError, ValueError) as err:
            raise ValueError(f"uplink codec {uplink!r}: {err}") from None
        if codec.shares_support and not downlink.startswith("lattice"):
            raise ValueError(f"uplink codec {uplink!r} sends on the coordinates the downlink's last change moved; "
                             "it needs a lattice downlink (downlink=\"lattice:...\")")
        if getattr(strategy, "masks_updates", False):
            raise ValueError("compressed(secure(...)) would decode masked uploads: secure aggregation is the uplink; "
                             "wrap the other way, secure(compressed(strategy, uplink=\"none\", downlink=...)), to "
                             "keep the lattice downlink")
        if streaming and not is_plain_mean(strategy):
            raise ValueError(f"streaming=True needs a strategy that aggregates by FedAvg's weighted mean; "
                             f"{type(strategy).__name__} has its own aggregate_train")
        self.strategy, self.uplink, self.seed, self.streaming = strategy, uplink, int(seed), streaming
        self.uplink_codec = codec
        self.downlink = ServerDownlink(downlink, start=start, track_supports=codec.shares_support)
        self._sent: tuple[int, Layout, np.ndarray, ArrayRecord] | None = None
        self._supports: dict[int, np.ndarray] = {}  # node -> the shared support of its round (tcs)
        self.refused: list[tuple[int, int, str]] = []  # (round, node, reason) of replies left out

    # -- train ----------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        layout = Layout(arrays)
        # With a lattice downlink the nodes train from its public copy, but their updates move the
        # strategy's exact model: what a version did not carry stays in (exact - public) and goes out
        # in a later one, error feedback on the server, as in Fedge's engine and FedBuff. (Decoding
        # against the public copy dropped that residual every round.)
        self.downlink.public(arrays, fresh=True)
        self._sent = (server_round, layout, layout.flatten(arrays), arrays)
        messages = self.downlink.attach(self.strategy.configure_train(server_round, arrays, config, grid), arrays)
        self._supports = dict(self.downlink.supports)
        for message in messages:  # each has its own config copy (attach)
            write_uplink(message.content.config_records["config"], self.uplink, layout.digest, server_round, self.seed)
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
        if self.streaming:
            arrays, metrics = self.streaming_mean(server_round, replies)
        else:
            arrays, metrics = self.strategy.aggregate_train(server_round, self.decode_replies(server_round, replies))
        metrics = metrics if metrics is not None else MetricRecord()
        metrics["fedge-uplink-bytes"] = uplink
        metrics["fedge-downlink-bytes"], self.downlink.bytes = self.downlink.bytes, 0
        metrics["fedge-refused"] = len(self.refused) - refused_before
        return arrays, metrics

    def aggregate_released(self, server_round: int, replies: list[Message],
                           released: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """An outer wrapper's round (``secure(compressed(...))``): the wrapped strategy aggregates
        ``released`` (what the outer wrapper made of the replies: secure aggregation's one reply)
        while this wrapper's downlink settles on the real ``replies``."""
        self.downlink.settle(replies)
        arrays, metrics = self.strategy.aggregate_train(server_round, released)
        metrics = MetricRecord(dict(metrics or {}))
        metrics["fedge-downlink-bytes"], self.downlink.bytes = self.downlink.bytes, 0
        return arrays, metrics

    def decode_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies as the wrapped strategy expects them: each payload decoded into the model the
        client sent; refused replies are left out (logged, and kept in :attr:`refused`)."""
        layout, sent_flat, sent, wire = self._round(server_round)
        out = []
        for reply in replies:
            if reply.has_error():
                out.append(reply)
                continue
            try:
                delta = self._bound(wire, reply).decode(reply_payload(reply), layout.numel).numpy()
                model = layout.rebuild(sent_flat + delta,
                                       with_raw(sent, reply.content.array_records.get(RAW_RECORD, ArrayRecord())))
            except REFUSED as err:
                self._refuse(server_round, reply, err)
                continue
            content = RecordDict({name: record for name, record in reply.content.items()
                                  if name not in (UPDATE_RECORD, RAW_RECORD)})
            content[MODEL_RECORD] = model
            reply.content = content
            out.append(reply)
        return out

    def streaming_mean(self, server_round: int,
                       replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg's weighted mean, each payload decoded straight into one running sum (Fedge's
        ``StreamingMean``): one model-sized accumulator and one decoded temporary, however many
        replies, instead of one decoded model per reply. Same refusals as :meth:`decode_replies`;
        metrics by the wrapped strategy's ``train_metrics_aggr_fn``."""
        layout, sent_flat, sent, wire = self._round(server_round)
        key = str(self.strategy.weighted_by_key)  # type: ignore[attr-defined]
        total, used = StreamingMean(layout.numel), []
        for reply in replies:
            if reply.has_error():
                continue
            try:
                weight, _ = reply_weight(reply, key)
                total.add_payload(reply_payload(reply), self._bound(wire, reply), weight)
            except REFUSED as err:
                self._refuse(server_round, reply, err)
                continue
            used.append(reply)
        if not used:
            return None, None
        raw_names = [name for name, _, _ in layout.entries if name not in {n for n, _, _ in layout.floats}]
        like = sent
        if raw_names:  # integer buffers: the weighted mean of the clients' own, as FedAvg takes it
            raws = [RecordDict({"raw": ArrayRecord({n: r.content.array_records.get(RAW_RECORD, sent)[n]
                                                    for n in raw_names}),
                                "metrics": next(iter(r.content.metric_records.values()))}) for r in used]
            like = with_raw(sent, aggregate_arrayrecords(raws, key))
        arrays = layout.rebuild(sent_flat + total.mean().numpy(), like)
        contents = [RecordDict(dict(r.content.metric_records.items())) for r in used]
        metrics = self.strategy.train_metrics_aggr_fn(contents, key)  # type: ignore[attr-defined]
        return arrays, metrics

    def _round(self, server_round: int) -> tuple[Layout, np.ndarray, ArrayRecord, Codec]:
        """What this wrapper sent in ``server_round`` (layout, the strategy's flat model the updates
        apply to, the arrays) and the codec of that round."""
        if self._sent is None or self._sent[0] != server_round:
            raise RuntimeError(f"round {server_round} was not configured through this wrapper")
        _, layout, sent_flat, sent = self._sent
        return layout, sent_flat, sent, make_codec(self.uplink).for_model(layout.sizes()).for_round(server_round,
                                                                                                      self.seed)

    def _bound(self, wire: Codec, reply: Message) -> Codec:
        """``wire`` bound to the support the reply's node sent on (a ``tcs`` uplink; others ignore it)."""
        return wire.with_support(self._supports.get(reply.metadata.src_node_id)) if wire.shares_support else wire

    def _refuse(self, server_round: int, reply: Message, err: Exception) -> None:
        node = reply.metadata.src_node_id
        log.warning("round %d: refused the reply of node %d: %s", server_round, node, err)
        self.refused.append((server_round, node, str(err)))

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

    def describe(self) -> str:
        return f"compressed uplink: {self.uplink}, downlink: {self.downlink.spec}"


def is_plain_mean(strategy: Strategy) -> bool:
    """Whether ``strategy`` aggregates train replies by FedAvg's weighted mean (FedAvg, FedProx, ...)."""
    return isinstance(strategy, FedAvg) and type(strategy).aggregate_train is FedAvg.aggregate_train


def compressed(strategy: Strategy, uplink: str = "qsgd:bits=4", seed: int = 0,
               downlink: str = "none", streaming: bool = False, start: str | None = None) -> CompressedStrategy:
    """Wrap ``strategy`` so clients with :func:`fedge.flower.compression_mod` send compressed updates
    (``uplink``, a Fedge codec spec) and, with ``downlink="lattice[:ratio=...]"``, receive the model as
    a versioned lattice change (``fedge.flower.downlink``) instead of fp32 arrays. ``streaming=True``
    (a plain weighted mean such as FedAvg or FedProx only) decodes each reply straight into one sum.
    ``start="pkg.task:Net@0"`` names the constructor and seed of ``initial_arrays``, so nodes build the
    start model themselves and the lattice downlink never sends it (``fedge.protocol.start_model``)."""
    return CompressedStrategy(strategy, uplink=uplink, seed=seed, downlink=downlink, streaming=streaming,
                              start=start)
