"""The Fedge ClientApp: one handler per round algorithm, on Flower's own message-type routing.

Runs unchanged under Flower's simulation engine (Ray) and its deployment engine (a SuperNode per
device). The coordinator sends everything a round needs in the message's config record, so a client
never trusts a local copy of the run settings; the node's own config says which data is its own.

=================  ==================================  ===========================================
message type       handler                             what the node keeps in ``context.state``
=================  ==================================  ===========================================
``train``          ``edge_client.fedavg.train``        compression memory, downlink public copy
``evaluate``       ``edge_client.fedavg.evaluate_global``  -
``train.easgd``    ``edge_client.easgd.train``         its local model x_i, compression memory
``train.gossip``   ``edge_client.gossip.train``        its model, public copies of itself and its
                                                       peers, compression memory
=================  ==================================  ===========================================

Mods around every handler: ``threads_mod`` (node config ``threads=N``, default 1: torch's thread
per core oversubscribes a host that runs a ClientApp process per message), ``slowdown_mod``
(``slowdown=F``, stragglers on purpose) and ``fault_injection_mod`` (``fault='bitflip'``, chaos).
Data comes from the node config too (``edge_client/node_data.py``: ``data=own.npz`` or a cached
partition).
"""

from __future__ import annotations

from flwr.clientapp import ClientApp

from fedge.edge_client import easgd, fedavg, gossip
from fedge.edge_client.faults import fault_injection_mod
from fedge.edge_client.persistent_state import state_persistence_mod
from fedge.edge_client.slowdown import slowdown_mod
from fedge.edge_client.threads import threads_mod

__all__ = ["app"]

app = ClientApp(mods=[threads_mod, state_persistence_mod, slowdown_mod, fault_injection_mod])
app.train()(fedavg.train)
app.evaluate()(fedavg.evaluate_global)
app.train("easgd")(easgd.train)
app.train("gossip")(gossip.train)
