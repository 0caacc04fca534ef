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

Fault injection (``--node-config "fault='bitflip'"``) is a Flower mod around every handler.
"""

from __future__ import annotations

from flwr.clientapp import ClientApp

from edge_client import easgd, fedavg, gossip
from edge_client.faults import fault_injection_mod
from edge_client.slowdown import slowdown_mod

__all__ = ["app"]

app = ClientApp(mods=[slowdown_mod, fault_injection_mod])
app.train()(fedavg.train)
app.evaluate()(fedavg.evaluate_global)
app.train("easgd")(easgd.train)
app.train("gossip")(gossip.train)
