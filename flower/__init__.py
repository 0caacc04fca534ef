"""Fedge inside any Flower app: compressed updates as a ClientApp mod and a strategy wrapper.

    # client_app.py
    app = ClientApp(mods=[compression_mod])
    # server_app.py
    strategy = compressed(FedAvg(fraction_train=0.5), uplink="qsgd:bits=4")

The wrapper tells every train message which codec to use (its config); the mod trains with the
user's own ``@app.train()`` body unchanged, then sends the update (trained weights minus those
received) encoded with Fedge's codec and error feedback kept in the node's ``Context`` state; the
wrapper decodes each reply back into the ``ArrayRecord`` the wrapped strategy expects, so any
Message-API strategy (FedAvg, FedAdam, FedProx, FedMedian, Krum, ...) aggregates as it always does.
``FedBuff`` and ``FedAsync`` (``fedge.flower.fedbuff``) run asynchronous aggregation from the user's
ServerApp against its Grid. ``secure(strategy, ...)`` with ``secure_mod`` on the ClientApp runs the
round over Fedge's secure aggregation: the strategy aggregates only the survivors' sum
(``fedge.flower.secure``). ``layered(strategy, *layers)`` runs Fedge's engine layers (one class
each, ``fedge.protocol.layer``) around any strategy's rounds (``fedge.flower.layered``);
``layered(FedAvg(), ElasticAveraging())`` with ``elastic_mod`` runs EASGD. Nothing here imports
Fedge's coordinator (``fedge.server``).

This package holds the server side: the strategy wrappers. The ClientApp mods are the device's
and live with its other parts (``fedge.edge_client.compression_mod``, ``fedge.edge_client.secure_mod``,
``refusal_mod``, first on the ClientApp, sending a device's typed refusals as the engine's devices do,
the lattice copy in ``fedge.edge_client.downlink``; the server's is the engine's downlink layer,
``fedge.protocol.downlink_layer``); they are re-exported here, so an app imports
both sides from ``fedge.flower``. A model's layout and a named start model, which both sides read,
are ``fedge.protocol.layout`` and ``fedge.protocol.start_model``.
"""

from fedge.protocol.flower_release import check_flower

check_flower()  # before anything reads Flower: another release gets a clear error, not a mid-run one

from fedge.edge_client.compression_mod import compression_mod  # noqa: E402
from fedge.edge_client.elastic_mod import elastic_mod  # noqa: E402
from fedge.edge_client.layers import refusal_mod  # noqa: E402
from fedge.edge_client.secure_mod import secure_mod  # noqa: E402
from fedge.flower.fedbuff import FedAsync, FedBuff  # noqa: E402
from fedge.flower.layered import CompressedStrategy, LayeredStrategy, compressed, layered  # noqa: E402
from fedge.flower.secure import SecureStrategy, distributed_dp, secure  # noqa: E402
from fedge.protocol.elastic_layer import ElasticAveraging  # noqa: E402

__all__ = ["CompressedStrategy", "ElasticAveraging", "FedAsync", "FedBuff", "LayeredStrategy", "SecureStrategy",
           "compressed", "compression_mod", "distributed_dp", "elastic_mod", "layered", "refusal_mod", "secure",
           "secure_mod"]
