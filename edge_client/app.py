"""The Fedge ClientApp: one handler per round algorithm, on Flower's own message-type routing.

Runs unchanged under Flower's simulation engine (Ray) and its deployment engine (a SuperNode per
device). The coordinator sends everything a round needs in the message's config record, so a client
never trusts a local copy of the run settings; the node's own config says which data is its own.

Handlers live in ``fedge.edge_client.algorithms``, one module per algorithm, and are registered
here by discovery: ``fedavg.train`` for ``train`` (FedBuff and FedAsync send FedAvg's messages),
``fedavg.evaluate`` for ``evaluate`` (EASGD sends FedAvg's messages too, with ``elastic_mod``),
``scaffold.train`` for ``train.scaffold``, ``gossip.train`` for ``train.gossip``. What a node keeps between messages lives in ``context.state`` (compression memory,
the downlink public copy, EASGD's local model, gossip's copies of itself and its peers).

Mods around every handler: ``leaf_devices_mod`` (outermost: a simulated leaf's node becomes the
device it stands for, ``edge_client.leaf_devices``), ``resource_mod`` (what the message cost the device, reported in the reply
and kept in its ledger; ``edge_client.resources``), ``eligibility_mod`` (the owner's conditions and
daily budgets: a typed ``not-eligible`` / ``over-budget`` refusal; ``edge_client.eligibility``),
``refusal_mod`` (a handler's typed refusal, such as a copy out of sync,
leaves as a ``refusal`` record the coordinator counts by kind; ``edge_client.layers``), ``plugins_mod`` (the run's plugins imported first: codecs, algorithms
from outside Fedge), ``threads_mod`` (node config ``threads=N``, default 1: torch's thread
per core oversubscribes a host that runs a ClientApp process per message), ``counted_once_mod`` (beyond
one SuperLink: a device takes part in a root round through one leaf only, ``edge_client.counted_once``),
``slowdown_mod``
(``slowdown=F``, stragglers on purpose), ``fault_injection_mod`` (``fault='bitflip'``, chaos) and,
the update mods a Flower app lists (``UPDATE_MODS``: ``compression_mod``, which encodes the
update a handler hands over with the round's codec, and ``secure_mod``, which answers secure
aggregation's own exchanges and masks the update of a secure round; both clip it first under
differential privacy, ``edge_client.device_update``), ``elastic_mod`` (EASGD: the handler trains
the node's own model, the mod takes the elastic step, as in a Flower app) and, innermost,
``bridge_mod`` (a node whose
node config names a ``leaf-spool`` is a leaf's bridge: its train messages are answered by a leaf
step, ``edge_client.bridge``, whose update leaves through the same mods).
Data comes from the node config too (``edge_client/node_data.py``: ``data=own.npz`` or a cached
partition).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

from flwr.clientapp import ClientApp

import fedge.edge_client.algorithms as _handlers
from fedge.edge_client.counted_once import counted_once_mod
from fedge.edge_client.elastic_mod import elastic_mod
from fedge.edge_client.eligibility import eligibility_mod
from fedge.edge_client.faults import fault_injection_mod
from fedge.edge_client.layers import UPDATE_MODS, refusal_mod
from fedge.edge_client.leaf_devices import leaf_devices_mod
from fedge.edge_client.persistent_state import state_persistence_mod
from fedge.edge_client.plugins import plugins_mod
from fedge.edge_client.privacy_policy import privacy_policy_mod
from fedge.edge_client.plugins import train as plugin_train
from fedge.edge_client.bridge import bridge_mod
from fedge.edge_client.resources import resource_mod
from fedge.edge_client.roster import answer_roster
from fedge.edge_client.slowdown import slowdown_mod
from fedge.edge_client.threads import threads_mod
from fedge.protocol import message_type_for
from fedge.protocol.flower_release import check_flower
from fedge.protocol.plugins import PLUGIN_ACTION
from fedge.protocol.roster import ROSTER_ACTION

__all__ = ["app", "handled_algorithms"]

check_flower()  # another Flower release: a clear error here, not a failure mid-run
app = ClientApp(mods=[leaf_devices_mod, resource_mod, refusal_mod, privacy_policy_mod, eligibility_mod, plugins_mod, threads_mod,
                      state_persistence_mod, counted_once_mod, slowdown_mod, fault_injection_mod, *UPDATE_MODS,
                      elastic_mod, bridge_mod])


def _defined(module: ModuleType, name: str) -> Callable[..., Any] | None:
    """``module.name`` if the module defines it itself (not a function it imported)."""
    value = getattr(module, name, None)
    return value if callable(value) and getattr(value, "__module__", None) == module.__name__ else None


def _register(client_app: ClientApp) -> list[str]:
    """Register every handler module of ``fedge.edge_client.algorithms``; the algorithm names."""
    names = []
    for module_info in sorted(pkgutil.iter_modules(_handlers.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{_handlers.__name__}.{module_info.name}")
        train, evaluate = _defined(module, "train"), _defined(module, "evaluate")
        if train is None:
            continue
        action = message_type_for(module_info.name).partition(".")[2]  # "" for fedavg: plain "train"
        register = client_app.train(action) if action else client_app.train()
        register(train)
        if evaluate is not None:
            client_app.evaluate()(evaluate)
        names.append(module_info.name)
    return names


#: the algorithms this device can train for (``Algorithm.device_handler`` names one of these)
handled_algorithms = [*_register(app), PLUGIN_ACTION]
# every plugin algorithm's messages: the handler its plugin registered (fedge.protocol.plugins)
app.train(PLUGIN_ACTION)(plugin_train)
# the coordinator's roll call: this node's stable name (fedge.protocol.roster)
app.query(ROSTER_ACTION)(answer_roster)

