"""Names under which Fedge messages carry their records (plain strings, no Flower import).

The coordinator and the edge client agree on these the way they agree on the wire format: changing
one is a protocol change. A train reply carries the encoded update as raw bytes in a uint8 ``Array``
(stype :data:`PAYLOAD_STYPE`, so no ``.npy`` header is added) inside the ``update`` ArrayRecord.
"""

__all__ = [
    "CONFIG_RECORD",
    "DOWNLINK_RECORD",
    "METRICS_RECORD",
    "MODEL_RECORD",
    "PAYLOAD_KEY",
    "PAYLOAD_STYPE",
    "UPDATE_RECORD",
]

MODEL_RECORD = "arrays"  # server -> client: the global model as an ArrayRecord (state dict)
DOWNLINK_RECORD = "downlink"  # server -> client: encoded change since the client's public copy
CONFIG_RECORD = "config"  # server -> client: round, codec spec, hyper-parameters
UPDATE_RECORD = "update"  # client -> server: ArrayRecord holding the payload
PAYLOAD_KEY = "payload"
PAYLOAD_STYPE = "fedge.payload/1"
METRICS_RECORD = "metrics"  # client -> server: num-examples, train-loss, payload-bytes
