"""Fedge inside any Flower app (docs/flower.md): strategy wrappers and ClientApp mods.

    # client_app.py
    app = ClientApp(mods=[compression_mod])
    # server_app.py
    strategy = compressed(FedAvg(fraction_train=0.5), uplink="qsgd:bits=4")

The strategies here drive the parts Fedge's own coordinator runs (``fedge.protocol``'s layers, door
and asynchronous loop); the mods are ``fedge.edge_client``'s, re-exported so an app imports both
sides from one place. Nothing here imports Fedge's coordinator (``fedge.server``).
"""

from fedge.protocol.flower_release import check_flower

check_flower()  # before anything reads Flower: another release gets a clear error, not a mid-run one

from fedge.edge_client.compression_mod import compression_mod  # noqa: E402
from fedge.edge_client.elastic_mod import elastic_mod  # noqa: E402
from fedge.edge_client.layers import refusal_mod  # noqa: E402
from fedge.edge_client.resources import resource_mod  # noqa: E402
from fedge.edge_client.scaffold_mod import scaffold_correction, scaffold_mod  # noqa: E402
from fedge.edge_client.secure_mod import secure_mod  # noqa: E402
from fedge.flower.fedbuff import FedAsync, FedBuff  # noqa: E402
from fedge.flower.layered import CompressedStrategy, LayeredStrategy, compressed, layered  # noqa: E402
from fedge.flower.secure import SecureStrategy, distributed_dp, secure  # noqa: E402
from fedge.flower.tracked import TrackedStrategy, tracked  # noqa: E402
from fedge.coordinator.elastic_layer import ElasticAveraging  # noqa: E402
from fedge.coordinator.fednova_layer import NormalizedAveraging  # noqa: E402
from fedge.coordinator.scaffold_layer import ControlVariates  # noqa: E402

__all__ = ["CompressedStrategy", "ControlVariates", "ElasticAveraging", "FedAsync", "FedBuff", "LayeredStrategy",
           "NormalizedAveraging", "SecureStrategy", "TrackedStrategy", "compressed", "compression_mod", "distributed_dp",
           "elastic_mod", "layered", "refusal_mod", "resource_mod", "scaffold_correction", "scaffold_mod", "secure",
           "secure_mod", "tracked"]
