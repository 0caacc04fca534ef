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
is the other's update (audit N2), so a device can require more company before it takes part. One check serves both coordinators: the Fedge ClientApp runs
it as :func:`privacy_policy_mod`, and ``fedge.flower.secure_mod`` calls :func:`check_privacy_policy`
for a user's ClientApp.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.privacy.plan import SecAggPlan
from fedge.protocol.refusals import PolicyRefusal
from fedge.protocol.secagg import SECAGG_RECORD

__all__ = ["MIN_PARTICIPANTS", "REQUIRE_SECURE_AGGREGATION", "check_privacy_policy", "check_secure_plan",
           "privacy_policy_mod", "requires_secure_aggregation"]

#: the node config keys (``fedge-edge join --require-secure-aggregation --min-participants N``)
REQUIRE_SECURE_AGGREGATION = "require-secure-aggregation"
MIN_PARTICIPANTS = "min-participants"

_TRUE = {"1", "true", "yes", "on"}


def requires_secure_aggregation(context: Context) -> bool:
    """Whether the device's operator pinned secure aggregation (a bool, or its text)."""
    value = dict(context.node_config).get(REQUIRE_SECURE_AGGREGATION, False)
    return value is True or str(value).strip().lower() in _TRUE


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
    device's ``min-participants`` (checked at every stage the device answers)."""
    value = dict(context.node_config).get(MIN_PARTICIPANTS, 0)
    try:
        least = int(value or 0)
    except (TypeError, ValueError):
        raise PolicyRefusal(f"node config {MIN_PARTICIPANTS} must be a whole number, got {value!r}") from None
    if len(plan.participants) < least:
        raise PolicyRefusal(f"the round plans {len(plan.participants)} participants; this device takes part in "
                            f"rounds of at least {least} (node config {MIN_PARTICIPANTS})")


def privacy_policy_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """:func:`check_privacy_policy` in front of every handler (inside ``refusal_mod``, which turns
    the refusal into a typed record)."""
    check_privacy_policy(msg, context)
    return call_next(msg, context)
