"""What the wrapper and the mod agree on: the config keys of a train message and the records of
its reply. Kept in one place so neither side writes the other's literals."""

from __future__ import annotations

__all__ = ["ARRAYS", "BASE_DIGEST_KEY", "BASE_RECORD", "CODEC_KEY", "DOWNLINK_DIGEST_KEY", "DOWNLINK_KEY",
           "DOWNLINK_RECORD", "DOWNLINK_VERSION_KEY", "LAYOUT_KEY", "LAYOUT_SPEC_KEY", "RAW_RECORD", "ROUND_KEY",
           "SEED_KEY", "START_KEY", "UPDATE_RECORD", "UPLINK_KEYS", "WEIGHT_KEY"]

#: the ArrayRecord key Flower's strategies put the model under (``Strategy.configure_train``)
ARRAYS = "arrays"
#: train config: the uplink codec spec the server asks for, the model layout's digest, the round
#: and the seed the codec derives its round's randomness from
CODEC_KEY = "fedge.uplink"
LAYOUT_KEY = "fedge.layout"
ROUND_KEY = "fedge.round"
SEED_KEY = "fedge.seed"
#: the uplink's own config keys (what secure aggregation removes: its masked ring is the uplink; the
#: layout digest stays, the downlink checks it too)
UPLINK_KEYS = (CODEC_KEY, ROUND_KEY, SEED_KEY)
#: reply: the encoded update (one payload array), and the arrays that are not compressed
UPDATE_RECORD = "fedge.update"
RAW_RECORD = "fedge.raw"
#: any message with a lattice downlink: its spec, the version it brings, that version's digest and
#: the base's digest (config); the lattice change or snapshot, and (to a node without it) the base
#: model as an ArrayRecord of the model's own arrays, which also tells the node the layout
DOWNLINK_KEY = "fedge.downlink"
DOWNLINK_VERSION_KEY = "fedge.downlink-version"
DOWNLINK_DIGEST_KEY = "fedge.downlink-digest"
BASE_DIGEST_KEY = "fedge.base-digest"
DOWNLINK_RECORD = "fedge.downlink"
#: with a snapshot: the model's names, shapes and dtypes (JSON), so a node builds the zero base
LAYOUT_SPEC_KEY = "fedge.layout-spec"
#: the start model a node builds itself (``module:callable@seed``), when the server named one
START_KEY = "fedge.start"
BASE_RECORD = "fedge.base"

#: a secure round's train config: the metric of the reply that weighs the update (the wrapped
#: strategy's ``weighted_by_key``; empty: every update weighs the same); the device masks it into the sum
WEIGHT_KEY = "fedge.weight-key"
