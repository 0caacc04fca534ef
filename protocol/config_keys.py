"""The keys a train message's config record carries beyond the common ones (``round_config``),
defined once for both sides: the coordinator writes them, the device reads them.

Grouped by who owns them: the engine's layers (differential privacy, the downlink), the algorithms
(FedProx, EASGD, gossip), and the run (plugins, memory storage, a plugin algorithm's handler).
"""

from __future__ import annotations

__all__ = [
    "DOWNLINK_BASE_DIGEST",
    "DOWNLINK_CODEC",
    "DOWNLINK_DIGEST",
    "DOWNLINK_VERSION",
    "DP_CLIP",
    "DP_FITTED",
    "EASGD_ALPHA",
    "GOSSIP_GAMMA",
    "GOSSIP_MEASURE",
    "GOSSIP_MIX_PEERS",
    "GOSSIP_MIX_WEIGHTS",
    "GOSSIP_PEERS",
    "GOSSIP_POSITION",
    "GOSSIP_VERSION",
    "MEMORY_STORAGE",
    "PLUGIN_HANDLER",
    "PLUGINS",
    "PROX_MU",
]

# -- layers -------------------------------------------------------------------------------------
#: differential privacy: the L2 bound the device clips its update to this round
DP_CLIP = "dp-clip"
#: differential privacy, adaptive clipping: the device's metric, 1.0 when its update fitted under the bound
DP_FITTED = "dp-fitted"
#: the downlink codec of the message (``none``: the model rides in full in the ``arrays`` record)
DOWNLINK_CODEC = "downlink-codec"
#: lattice downlink: the version the message brings, its digest, and the digest of the lattice base
DOWNLINK_VERSION = "downlink-version"
DOWNLINK_DIGEST = "downlink-digest"
DOWNLINK_BASE_DIGEST = "downlink-base-digest"

# -- algorithms ---------------------------------------------------------------------------------
#: FedAvg / FedBuff / FedAsync: FedProx's proximal weight on the device
PROX_MU = "prox-mu"
#: EASGD: the elastic coupling alpha
EASGD_ALPHA = "alpha"
#: gossip: the node's position, the copies' version, gamma, whether to measure, peers and mixing row
GOSSIP_POSITION = "position"
GOSSIP_VERSION = "version"
GOSSIP_GAMMA = "gamma"
GOSSIP_MEASURE = "measure"
GOSSIP_PEERS = "peers"
GOSSIP_MIX_PEERS = "mix-peers"
GOSSIP_MIX_WEIGHTS = "mix-weights"

# -- the run ------------------------------------------------------------------------------------
#: the run's plugin modules, imported by the device before its handler runs
PLUGINS = "plugins"
#: how the device stores its compression memory (``fp32`` when absent)
MEMORY_STORAGE = "memory-storage"
#: a plugin algorithm's messages: the name of the device handler its plugin registered
PLUGIN_HANDLER = "handler"
