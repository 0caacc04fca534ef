"""What the wrapper and the mod agree on: the config keys of a train message and the records of
its reply. Kept in one place so neither side writes the other's literals."""

from __future__ import annotations

__all__ = ["ARRAYS", "CODEC_KEY", "LAYOUT_KEY", "RAW_RECORD", "ROUND_KEY", "SEED_KEY", "UPDATE_RECORD"]

#: the ArrayRecord key Flower's strategies put the model under (``Strategy.configure_train``)
ARRAYS = "arrays"
#: train config: the uplink codec spec the server asks for, the model layout's digest, the round
#: and the seed the codec derives its round's randomness from
CODEC_KEY = "fedge.uplink"
LAYOUT_KEY = "fedge.layout"
ROUND_KEY = "fedge.round"
SEED_KEY = "fedge.seed"
#: reply: the encoded update (one payload array), and the arrays that are not compressed
UPDATE_RECORD = "fedge.update"
RAW_RECORD = "fedge.raw"
