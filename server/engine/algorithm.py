"""The algorithm protocol: what a round algorithm (FedAvg, EASGD, gossip, ...) owns.

The engine (``fedge.server.engine``) owns everything every algorithm shares: waiting for nodes,
sampling, pushing messages and pulling replies, timeouts, screening, decoding and bounding each
update (``Engine.absorb_reply``: one door for every algorithm), byte accounting, held-out
evaluation, the metrics row, checkpoints and resume. An algorithm owns the policy, in the shape of
Flower's strategies (``configure_train`` / ``aggregate_train``) but streaming, and keeps a step's
accumulators in an explicit :class:`Step` object rather than on itself (the pattern of PyTorch's
DDP comm hooks: what persists lives in the algorithm and its ``state_dict``, what belongs to one
call lives in that call's object):

* :meth:`Algorithm.open_step` makes one step's :class:`Step` (a synchronous round, or the buffer of
  one asynchronous model version);
* :meth:`Algorithm.configure` builds messages for nodes (once per round; an asynchronous run calls
  it whenever it sends work to free nodes);
* :meth:`Algorithm.admit` may refuse a reply before anything is decoded (staleness, membership);
* :meth:`Algorithm.absorb` takes **one** decoded, bounded :class:`Update` into the step's
  accumulators, raising :class:`Rejected` with a reason for one it cannot use;
* :meth:`Algorithm.close` ends the step and returns the model the engine evaluates on held-out data;
* :meth:`Algorithm.state_dict` / :meth:`Algorithm.load_state_dict` hold everything a resumed run
  needs, validated on load (the checkpoint stores it).

An algorithm is one file in ``fedge.server.algorithms``; the registry finds it there by its
``name``, and its class attributes say which device handler its messages go to, which
algorithm-specific settings it uses and what it needs of a step's updates (``aggregate``: each
one, or only their mean or sum). Specs use the grammar codecs use, ``easgd:alpha=0.05,beta=0.9``.

An algorithm knows nothing of differential privacy, secure aggregation, the downlink codec, the
update guard or the model average: those are the engine's layers (``fedge.server.engine.layers``),
which wrap every algorithm's steps. A message that carries one model to many devices names it in
:attr:`Outgoing.model` and the downlink layer ships it; an algorithm that works from a sum adds its
updates to ``step.aggregate`` and closes from ``step.aggregated()``, the
:class:`~fedge.aggregation.partial.Partial` the layers released (noised, or the unmasked sum of
secure aggregation).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from flwr.app import ConfigRecord, RecordDict
from torch.utils.data import Dataset

from fedge.compression import Codec, make_codec, relative_error
from fedge.protocol import CONFIG_RECORD, METRICS_RECORD, message_type_for
from fedge.protocol.config_keys import MEMORY_STORAGE, PLUGIN_HANDLER, PLUGINS, WEIGHT_DECAY
from fedge.protocol.failures import Rejected
from fedge.protocol.round_config import RoundConfig
from fedge.coordinator.step import Outgoing, Reply, Step, StepOutcome, Update
from fedge.server.settings import RunSettings
from fedge.tasks import Task, tensor_sizes

if TYPE_CHECKING:
    from fedge.coordinator.layer import Layer

__all__ = [
    "Algorithm",
    "Outgoing",
    "Rejected",
    "Reply",
    "RunContext",
    "Step",
    "StepOutcome",
    "Update",
    "reply_metrics",
    "warn_if_not_contractive",
]


@dataclass(frozen=True)
class RunContext:
    """What the engine hands an algorithm: the run's settings, task and model layout."""

    settings: RunSettings
    task: Task
    template: dict[str, torch.Tensor]  # the model's state dict (shapes, dtypes, order)
    numel: int  # floating-point elements of the model: the length of every flat vector
    fp32_bytes: int  # one fp32 model as a Flower ArrayRecord: the baseline of compression ratios
    nodes_expected: int  # clients the run was configured for (clients-per-round)
    #: the coordinator's held-out data (the task's test split or the operator's eval-data), if any
    central_data: Dataset | None = None
    #: where step models are measured: ``central``, ``federated`` or ``both`` (``engine.evaluation``)
    evaluation: str = "central"

    @cached_property
    def codec(self) -> Codec:
        """The run's uplink codec, built once for the model's layout (a ``tcs`` codec is bound to each
        reply's support by the downlink layer, which also refuses it where no support is shared)."""
        return make_codec(self.settings.codec).for_model(tensor_sizes(self.template))

    @property
    def holdout(self) -> float:
        """The fraction of each device's data it keeps for federated evaluation (0: none)."""
        return self.settings.holdout if self.evaluation != "central" else 0.0

    @cached_property
    def _evaluation_model(self) -> torch.nn.Module:
        """Built once, on the GPU where CUDA is (the batches follow it, ``fedge.tasks.device``)."""
        from fedge.tasks.device import resolve_device

        return self.task.build_model().to(resolve_device("auto"))

    def evaluate(self, flat: torch.Tensor) -> dict[str, float]:
        """Loss and the task's metrics of a flat model on the coordinator's held-out data (empty
        when the run has none: it evaluates on the devices). The one evaluation path: the engine's
        step models and gossip's node models alike, in one model built once."""
        from fedge.tasks import evaluate, unflatten_state

        if self.central_data is None:
            return {}
        self._evaluation_model.load_state_dict(unflatten_state(flat, self.template))
        return evaluate(self._evaluation_model, self.central_data, self.task)

    def round_config(self, step: int, **extra: Any) -> RoundConfig:
        """The common part of every train message's config, plus an algorithm's own keys."""
        s = self.settings
        return RoundConfig(
            round=step, task=self.task.spec, partitioning=s.partitioning, codec=self.codec.spec,
            error_feedback=s.error_feedback, local_epochs=s.local_epochs, batch_size=s.batch_size,
            lr=s.lr, momentum=s.momentum, seed=s.seed, holdout=self.holdout,
            extra={**({PLUGINS: s.plugins} if s.plugins else {}),
                   **({MEMORY_STORAGE: s.memory_storage} if s.memory_storage != "fp32" else {}),
                   **({WEIGHT_DECAY: s.weight_decay} if s.weight_decay else {}), **extra},
        )


class Algorithm(ABC):
    """Base class of a round algorithm; subclasses are one file each in ``fedge.server.algorithms``."""

    #: name in spec strings and in the checkpoint
    name: ClassVar[str]
    #: the device handler its train messages go to (``fedge.edge_client.algorithms.<handler>``); empty:
    #: its own name. FedBuff's clients do FedAvg's work, so FedBuff says ``"fedavg"``.
    device_handler: ClassVar[str] = ""
    #: plugin algorithms (``register_algorithm``): the name of their device handler, which travels
    #: in the config record's ``handler`` key of their ``train.plugin`` messages (:meth:`round_config`)
    plugin_handler: ClassVar[str] = ""
    #: the algorithm-specific run settings (``settings.ALGORITHM_KEYS``) this algorithm uses; a run
    #: that sets another of them away from its default is refused before it starts
    settings_used: ClassVar[frozenset[str]] = frozenset()
    #: whether replies' example counts become (capped) aggregation weights
    weighted: ClassVar[bool] = True
    #: asynchronous algorithms (FedBuff) are driven by ``Engine`` one reply at a time: they answer
    #: :meth:`ready` and the engine closes a step whenever it is True
    asynchronous: ClassVar[bool] = False
    #: asynchronous algorithms: how many clients to keep training at once
    concurrency: int = 0
    #: what a step needs of its updates: ``each`` (gossip relays them; the default), ``mean``
    #: (their weighted mean, from ``step.aggregated().mean()``: FedAvg) or ``sum`` (their sum, from
    #: ``step.aggregated().sum()``: EASGD). Layers that hide or perturb individual updates (secure
    #: aggregation, differential privacy) run only where the mean or the sum is enough.
    aggregate: ClassVar[str] = "each"
    #: whether its device handler sends its update through the device's layers
    #: (``fedge.edge_client.layers.upload``: clipping, masking, encoding). Fedge's handlers do; a
    #: plugin's own handler does when it was declared so (``register_algorithm``).
    device_layers: ClassVar[bool] = True
    #: whether the algorithm runs over a fixed set of nodes (gossip's topology) instead of a
    #: sample per step: the engine then waits for its members instead of sampling what is there
    fixed_membership: ClassVar[bool] = False
    #: whether the algorithm forwards each accepted update's bytes as sent (gossip relays them to
    #: the node's peers): a layer that changes a decoded update (a clipping norm bound) cannot apply
    relays_updates: ClassVar[bool] = False

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.codec: Codec = ctx.codec
        self._wires: dict[int, Codec] = {}

    @property
    @abstractmethod
    def spec(self) -> str:
        """Canonical spec with every parameter spelled out (stored in the checkpoint)."""

    @property
    def message_type(self) -> str:
        """The Flower message type of this algorithm's train messages."""
        return message_type_for(self.device_handler or self.name)

    # -- lifecycle ------------------------------------------------------------------------------
    @abstractmethod
    def start(self, params: torch.Tensor) -> None:
        """A fresh run from the initial model ``params`` (flat float32)."""

    def nodes_needed(self) -> int:
        """Nodes the run waits for at start (sampling algorithms: clients-per-round)."""
        return self.ctx.settings.clients_per_round

    def select(self, step: int, nodes: list[int], sample: Callable[[list[int], int], list[int]]) -> list[int]:
        """The nodes that take part in ``step``; by default a seeded sample of the connected ones."""
        return sample(nodes, step)

    def open_step(self, number: int, nodes: list[int]) -> Step:
        """A new step's accumulators (override to return a :class:`Step` subclass)."""
        return Step(number, list(nodes))

    @abstractmethod
    def configure(self, step: Step, nodes: list[int]) -> list[Outgoing]:
        """Messages for ``nodes`` (synchronous: the step's nodes, once; asynchronous: free nodes)."""

    def round_config(self, step: int, **extra: Any) -> RoundConfig:
        """The run's config for a train message of ``step`` plus the algorithm's own keys; a plugin
        algorithm's (``register_algorithm``) names its device handler, which its ``train.plugin``
        messages are routed to."""
        handler = {PLUGIN_HANDLER: self.plugin_handler} if self.plugin_handler else {}
        return self.ctx.round_config(step, **handler, **extra)

    def model_messages(self, nodes: list[int], config: RoundConfig, model: torch.Tensor) -> list[Outgoing]:
        """One train message per node carrying ``config`` (its own record: layers add keys to it)
        and ``model``, which the engine's downlink layer ships (in full, or as a lattice change)."""
        record = config.to_record()
        return [Outgoing(n, RecordDict({CONFIG_RECORD: ConfigRecord(dict(record))}), self.message_type, model=model)
                for n in nodes]

    def admit(self, step: Step, reply: Reply) -> None:
        """Refuse a reply before it is decoded (raise :class:`Rejected`); by default every reply passes."""

    def reply_codec(self, step: Step, reply: Reply) -> Codec:
        """The codec the reply was encoded with: the run's codec for the step's round (its schedule
        and shared seeds); asynchronous algorithms name the round the reply's message carried."""
        return self.wire(step.number)

    def wire(self, round_: int) -> Codec:
        """The run's codec as clients derive it for ``round_`` (cached: a step decodes many replies)."""
        if round_ not in self._wires:
            if len(self._wires) > 32:
                self._wires.clear()
            self._wires[round_] = self.codec.for_round(round_, self.ctx.settings.seed)
        return self._wires[round_]

    @abstractmethod
    def absorb(self, step: Step, update: Update) -> None:
        """Use one decoded update (raise :class:`Rejected` with the reason if it cannot be used)."""

    def missed(self, step: Step, node: int, reason: str) -> None:
        """``node`` gave no usable reply this step (timeout, client error, or rejected)."""

    @abstractmethod
    def close(self, step: Step) -> StepOutcome:
        """End the step: apply what was absorbed."""

    def ready(self, step: Step) -> bool:
        """Asynchronous algorithms: whether enough was absorbed to close the step now."""
        return False

    @abstractmethod
    def final_model(self) -> torch.Tensor:
        """The run's model for ``model.pt`` and the edge bundle."""

    def layers(self) -> list[Layer]:
        """The layers this algorithm is made of beside the run's (FedNova's normalisation, SCAFFOLD's
        control variates, EASGD's center step: the layer a Flower app wraps its strategy in); what it
        cannot meet raises :class:`SettingsError` here, when the run's layers are built."""
        return []

    def describe(self) -> dict[str, Any]:
        """Facts worth keeping in the run directory (``algorithm.json``)."""
        return {"algorithm": self.spec}

    # -- state ----------------------------------------------------------------------------------
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: tensors, numbers, strings, lists and dicts of them."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; raise ``ValueError`` if it does not fit this run."""

    # -- helpers for subclasses -----------------------------------------------------------------
    def check_flat(self, tensor: Any, what: str) -> torch.Tensor:
        """A checkpointed flat model vector: right size, float32, finite."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.numel() != self.ctx.numel:
            raise ValueError(f"{what} is not a flat vector of {self.ctx.numel} elements")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what} holds NaN or infinite values")
        return tensor.to(torch.float32).clone()


def reply_metrics(content: RecordDict, require_examples: bool = True) -> dict[str, float]:
    """The reply's MetricRecord, with the fields every algorithm relies on checked:
    ``num-examples`` a positive integer, ``train-loss`` (if present) finite."""
    if METRICS_RECORD not in content.metric_records:
        raise Rejected(f"reply has no {METRICS_RECORD!r} MetricRecord")
    metrics = dict(content.metric_records[METRICS_RECORD])
    examples = metrics.get("num-examples")
    if require_examples and (not isinstance(examples, int) or isinstance(examples, bool) or examples <= 0):
        raise Rejected(f"num-examples must be a positive integer, got {examples!r}")
    loss = metrics.get("train-loss", 0.0)
    if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not torch.isfinite(torch.tensor(float(loss))):
        raise Rejected(f"train-loss must be a finite number, got {loss!r}")
    return metrics


def finite_or_previous(new: torch.Tensor, old: torch.Tensor, step: int) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Each reply was finite, but their aggregate can still overflow float32 (a client sent values
    near the float32 limit): keep the previous model rather than poison every later round."""
    if bool(torch.isfinite(new).all()):
        return new, []
    import logging

    logging.getLogger(__name__).error("round %d: the aggregated model is not finite; model unchanged", step)
    return old, [{"node": None, "reason": "aggregate not finite; round skipped"}]


def warn_if_not_contractive(codec: Codec, numel: int, error_feedback: bool) -> None:
    """Error feedback assumes a contractive compressor; warn when the codec is not one."""
    if not error_feedback:
        return
    noise = relative_error(codec, numel)
    if noise >= 1.0:
        import logging

        logging.getLogger(__name__).warning(
            "codec %s has relative squared error %.2f >= 1 (not contractive): error feedback "
            "can amplify its noise; prefer norm=max, more bits, or error-feedback=false", codec.spec, noise,
        )
