"""The keys a train message's config record carries beyond the common ones (``round_config``),
defined once for both sides: the coordinator writes them, the device reads them.

Grouped by who owns them: the engine's layers (differential privacy, the downlink), the algorithms
(FedProx, EASGD, gossip), the run (plugins, memory storage, a plugin algorithm's handler), and a
Flower app's train message (``fedge.flower``'s uplink and lattice keys). The downlink's keys are one
vocabulary for both coordinators.
"""

from __future__ import annotations

__all__ = [
    "CODEC_KEY",
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
    "LAYOUT_KEY",
    "LAYOUT_SPEC_KEY",
    "MEMORY_STORAGE",
    "PLUGIN_HANDLER",
    "PLUGINS",
    "PROX_MU",
    "ROOT_LEAF",
    "ROOT_ROUND",
    "ROUND_KEY",
    "SCAFFOLD_CONTROL_CODEC",
    "SEED_KEY",
    "START_KEY",
    "WEIGHT_KEY",
]

# -- layers -------------------------------------------------------------------------------------
#: differential privacy: the L2 bound the device clips its update to this round
DP_CLIP = "dp-clip"
#: differential privacy, adaptive clipping: the device's metric, 1.0 when its update fitted under the bound
DP_FITTED = "dp-fitted"
#: the downlink codec of the message (``none`` or absent: the model rides in full in ``arrays``)
DOWNLINK_CODEC = "fedge.downlink"
#: lattice downlink: the version the message brings, its digest, and the digest of the lattice base
DOWNLINK_VERSION = "fedge.downlink-version"
DOWNLINK_DIGEST = "fedge.downlink-digest"
DOWNLINK_BASE_DIGEST = "fedge.base-digest"

#: beyond one SuperLink: the root round a leaf's step serves (``<root run id>/<round>``) and the leaf
#: (its bridge's index); a device takes part in a root round through one leaf only
ROOT_ROUND = "fedge.root-round"
ROOT_LEAF = "fedge.root-leaf"

# -- algorithms ---------------------------------------------------------------------------------
#: FedAvg / FedBuff / FedAsync: FedProx's proximal weight on the device
PROX_MU = "prox-mu"
#: EASGD: the elastic coupling alpha
EASGD_ALPHA = "alpha"
#: SCAFFOLD: the codec spec the server's control variate (``CONTROL_RECORD``) is encoded with
SCAFFOLD_CONTROL_CODEC = "scaffold-control-codec"
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
#: the devices' SGD weight decay (none when absent)
WEIGHT_DECAY = "weight-decay"
#: a plugin algorithm's messages: the name of the device handler its plugin registered
PLUGIN_HANDLER = "handler"

# -- a Flower app's train message (``fedge.flower``: namespaced, beside the user's own keys) -------
#: the uplink codec the server asks for, the model layout's digest (the downlink checks it too), the
#: round (or version) and the seed the codec derives its round's randomness from
CODEC_KEY = "fedge.uplink"
LAYOUT_KEY = "fedge.layout"
ROUND_KEY = "fedge.round"
SEED_KEY = "fedge.seed"
#: with a snapshot: the model's names, shapes and dtypes (JSON), so a node builds the zero base
LAYOUT_SPEC_KEY = "fedge.layout-spec"
#: the start model a node builds itself (``module:callable@seed``), when the server named one
START_KEY = "fedge.start"
#: a secure round's train config: the metric of the reply that weighs the update (the wrapped
#: strategy's ``weighted_by_key``; empty: every update weighs the same); the device masks it into the sum
WEIGHT_KEY = "fedge.weight-key"
