"""The device's privacy policy: what its operator pins, whatever the coordinator asks.

A device believes the messages it gets: a coordinator that leaves secure aggregation out of a round
would otherwise receive every update in clear, with its example count and training metrics (privacy
audit 2, N1). With ``require-secure-aggregation`` in its node config (``fedge-edge join
--require-secure-aggregation``) a device refuses, before anything is trained, evaluated or read from
its data:

* a train message without a secure-aggregation plan (the ``secagg`` record): its update would leave
  in clear;
* an evaluate message: federated evaluation reports the device's loss, metrics and example count in
  clear.

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

import math

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.privacy.plan import SecAggPlan
from fedge.protocol.device_policy import (
    DP_MAX_CLIP,
    DP_MIN_NOISE,
    MIN_PARTICIPANTS,
    MIN_THRESHOLD,
    REQUIRE_SECURE_AGGREGATION,
    PolicyError,
    parse_device_policy,
    stricter,
)
from fedge.protocol.refusals import PolicyRefusal
from fedge.protocol.secagg import SECAGG_RECORD

__all__ = ["DP_MAX_CLIP", "DP_MIN_NOISE", "MIN_PARTICIPANTS", "MIN_THRESHOLD", "REQUIRE_SECURE_AGGREGATION", "check_privacy_policy",
           "check_secure_plan", "privacy_policy_mod", "requires_secure_aggregation"]

# the node config keys (``fedge-edge join --require-secure-aggregation --min-participants N``) are
# fedge.protocol.device_policy's, which the run setting device-policy shares

_TRUE = {"1", "true", "yes", "on"}


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
    forbids; return when it may go on."""
    if not requires_secure_aggregation(context):
        return
    kind = msg.metadata.message_type.split(".")[0]
    if kind == "evaluate":
        raise PolicyRefusal("this device requires secure aggregation (node config require-secure-aggregation): "
                            "federated evaluation would report its metrics and example count in clear")
    if kind == "train" and SECAGG_RECORD not in msg.content.config_records:
        raise PolicyRefusal("this device requires secure aggregation (node config require-secure-aggregation) "
                            "and the round has none: its update would leave in clear")


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
    check_privacy_policy(msg, context)
    return call_next(msg, context)
