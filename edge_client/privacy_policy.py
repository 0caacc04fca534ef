"""The device's privacy policy: what its operator pins, whatever the coordinator asks.

A device believes the messages it gets: a coordinator that leaves secure aggregation out of a round
would otherwise receive every update in clear, with its example count and training metrics (privacy
audit 2, N1). With ``require-secure-aggregation`` in its node config
(``fedge-edge join --require-secure-aggregation``) the policy gates *actions*, not records: before
anything is trained, evaluated or read from its data, the device answers only

* a ``train`` message of an action whose upload goes through the masking layer (plain ``train``:
  the FedAvg family, FedBuff, FedAsync and EASGD; :data:`SECURE_TRAIN_ACTIONS`) that
  carries a secure-aggregation plan (the ``secagg`` record) which parses and meets the policy's
  floors below, and the secure stages of such a round;
* the roll call (``query.roster``), whose answer is the partition id its owner configured and
  nothing of its data or model.

Everything else is refused: a train message without a plan (its update would leave in clear), an
action whose handler does not mask (gossip sends its model to its neighbours; a plugin's handler is
not ours to vouch for) even when the coordinator adds a ``secagg`` record to it (privacy audit 3,
F2), federated evaluation (loss, metrics and example count in clear), any other query, and a
message kind this device does not know. SECURITY.md has the table, one test per row.

The refusal is typed (``policy``, ``fedge.protocol.failures``): the coordinator counts it as a
failure, and the reply carries only the refusal record. The secure-aggregation stages themselves
(key exchange, unmasking) are answered, unless the round is smaller than ``min-participants``
(``fedge-edge join --min-participants N``): the sum of a two-device round minus a colluder's input
is the other's update (audit N2), so a device can require more company before it takes part, and
with ``min-threshold F`` (``--min-threshold``) a share threshold of more than ``F`` of its
neighbours (0.67: Bonawitz et al.'s bound against a coordinator that may lie; the plan itself only
insists on a majority without issued identities, and the coordinator chooses it). With
``dp-min-noise`` (and optionally ``dp-max-clip``) the device refuses a secure round whose plan
carries no distributed-DP noise, or less than that noise multiplier over the planned devices, or a
larger clip (audit N5: the plan comes from the coordinator, which could set any noise, or none).

In a simulation, whose devices share one node config, the run setting ``device-policy``
(``fedge.protocol.device_policy``) stands for it; a device enforces the stricter of the two, key by
key, so the run's setting can add requirements and never remove one its owner pinned.

One check serves both coordinators: the Fedge ClientApp runs it as :func:`privacy_policy_mod`, and
``fedge.edge_client.secure_mod`` calls :func:`check_privacy_policy` for a user's ClientApp.
"""

from __future__ import annotations

import logging
import math

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.privacy.errors import SecAggError
from fedge.privacy.plan import SecAggPlan
from fedge.protocol.device_policy import (
    DP_MAX_CLIP,
    DP_MIN_NOISE,
    MIN_PARTICIPANTS,
    NO_DEFAULT_POLICY,
    MIN_THRESHOLD,
    REQUIRE_SECURE_AGGREGATION,
    PolicyError,
    parse_device_policy,
    stricter,
)
from fedge.protocol.refusals import PolicyRefusal
from fedge.protocol.roster import ROSTER_MESSAGE_TYPE
from fedge.protocol.secagg import SECAGG_RECORD, plan_from_record

__all__ = ["DP_MAX_CLIP", "DP_MIN_NOISE", "MIN_PARTICIPANTS", "MIN_THRESHOLD", "REQUIRE_SECURE_AGGREGATION",
           "SECURE_TRAIN_ACTIONS", "check_privacy_policy",
           "check_secure_plan", "privacy_policy_mod", "requires_secure_aggregation"]

# the node config keys (``fedge-edge join --require-secure-aggregation --min-participants N``) are
# fedge.protocol.device_policy's, which the run setting device-policy shares

_TRUE = {"1", "true", "yes", "on"}

log = logging.getLogger("fedge.edge.policy")

#: the train actions whose device handler uploads through the masking layer
#: (``fedge.edge_client.layers.upload``): "" is plain ``train`` (FedAvg and every rule over its
#: updates, FedBuff, FedAsync, EASGD, a Flower app's strategy). A test checks each handler of
#: ``fedge.edge_client.algorithms`` against this set.
SECURE_TRAIN_ACTIONS = frozenset({""})

_NEEDS = "this device requires secure aggregation (node config require-secure-aggregation)"


def requires_secure_aggregation(context: Context) -> bool:
    """Whether the device's operator pinned secure aggregation (a bool, or its text), or the run's
    ``device-policy`` asks for it."""
    value = dict(context.node_config).get(REQUIRE_SECURE_AGGREGATION, False)
    return value is True or str(value).strip().lower() in _TRUE or bool(_run_policy(context).get(
        REQUIRE_SECURE_AGGREGATION, False))


def _run_policy(context: Context) -> dict[str, float | bool]:
    """The run's ``device-policy`` (simulations); a malformed one is a refusal, never ignored."""
    try:
        return parse_device_policy(str(dict(context.run_config).get("device-policy", "none")))
    except PolicyError as err:
        raise PolicyRefusal(str(err)) from None


def check_privacy_policy(msg: Message, context: Context) -> None:
    """Raise :class:`PolicyRefusal` when ``msg`` would make this device send something its policy
    forbids; return when it may go on. Under ``require-secure-aggregation`` the message's action
    decides (the module's docstring), not which records the coordinator put in it."""
    if not requires_secure_aggregation(context):
        return
    message_type = msg.metadata.message_type
    if message_type == ROSTER_MESSAGE_TYPE:
        return  # the partition id its owner configured: nothing of its data or model
    kind, _, action = message_type.partition(".")
    if kind == "evaluate":
        raise PolicyRefusal(f"{_NEEDS}: federated evaluation would report its metrics and example count in clear")
    if kind != "train":
        raise PolicyRefusal(f"{_NEEDS}: a {message_type!r} message is answered in clear; this device answers "
                            "only secure rounds and the roll call")
    if action not in SECURE_TRAIN_ACTIONS:
        raise PolicyRefusal(f"{_NEEDS}: {message_type!r} does not run inside secure aggregation (its handler "
                            "sends in clear whatever records the message carries)")
    record = msg.content.config_records.get(SECAGG_RECORD) if msg.has_content() else None
    if record is None:
        raise PolicyRefusal(f"{_NEEDS} and the round has none: its update would leave in clear")
    try:
        plan, _ = plan_from_record(record)
    except SecAggError as err:
        raise PolicyRefusal(f"{_NEEDS}: the round's secure-aggregation plan is not valid ({err})") from None
    check_secure_plan(plan, context)


def check_secure_plan(plan: SecAggPlan, context: Context) -> None:
    """Raise :class:`PolicyRefusal` when a secure round's plan has fewer participants than the
    device's ``min-participants``, a share threshold not above its ``min-threshold`` fraction of
    the neighbours, or less noise than its DP floor (checked at every stage the device answers)."""
    config, run = dict(context.node_config), _run_policy(context)

    def setting(key: str) -> float:
        return stricter(key, _number(config, key), float(run.get(key, 0.0)))

    least = int(setting(MIN_PARTICIPANTS))
    if len(plan.participants) < least:
        raise PolicyRefusal(f"the round plans {len(plan.participants)} participants; this device takes part in "
                            f"rounds of at least {least} (node config or device-policy {MIN_PARTICIPANTS})")
    fraction = setting(MIN_THRESHOLD)
    if fraction > 1:
        raise PolicyRefusal(f"node config {MIN_THRESHOLD} is a fraction of the neighbours in [0, 1], got {fraction:g}")
    if fraction and plan.reconstruction_threshold <= fraction * plan.degree:
        raise PolicyRefusal(f"the round reconstructs from {plan.reconstruction_threshold} of {plan.degree} "
                            f"neighbours; this device requires more than {fraction:g} of them (node config or "
                            f"device-policy {MIN_THRESHOLD}: that many colluding neighbours and the coordinator could unmask it)")
    floor, ceiling = setting(DP_MIN_NOISE), setting(DP_MAX_CLIP)
    if not (floor or ceiling):
        return
    noise = plan.noise
    if noise is None:
        raise PolicyRefusal(f"the round carries no distributed-DP noise; this device requires it (node config or "
                            f"device-policy {DP_MIN_NOISE}/{DP_MAX_CLIP})")
    # the noise multiplier of the planned devices' noise together: their summed variance over the
    # rounded vectors' L2 bound, in integer units (what skellam_params sized it by)
    planned = math.sqrt(len(plan.participants) * noise.local_variance) / noise.l2_bound
    if floor and planned < floor * (1 - 1e-9):
        raise PolicyRefusal(f"the round's distributed-DP noise multiplier is {planned:.3g}; this device requires "
                            f"at least {floor:g} (node config or device-policy {DP_MIN_NOISE})")
    if ceiling and noise.clip > ceiling:
        raise PolicyRefusal(f"the round clips updates to {noise.clip:g}; this device allows at most {ceiling:g} "
                            f"(node config or device-policy {DP_MAX_CLIP})")


def _number(config: dict[str, object], key: str) -> float:
    """A node config number >= 0 (absent: 0, no requirement); a malformed one is a refusal."""
    value = config.get(key, 0) or 0
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise PolicyRefusal(f"node config {key} must be a number >= 0, got {value!r}") from None
    if not (math.isfinite(number) and number >= 0):
        raise PolicyRefusal(f"node config {key} must be a number >= 0, got {value!r}")
    return number


def privacy_policy_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """:func:`check_privacy_policy` in front of every handler (inside ``refusal_mod``, which turns
    the refusal into a typed record)."""
    if str(dict(context.node_config).get(NO_DEFAULT_POLICY, "")).lower() in _TRUE:
        log.warning("this device's owner turned its default policy off (fedge-edge join --no-default-policy): "
                    "it answers rounds without secure aggregation and rounds of any size")
    check_privacy_policy(msg, context)
    return call_next(msg, context)
