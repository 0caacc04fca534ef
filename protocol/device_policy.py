"""The ``device-policy`` run setting: one privacy policy for every simulated device.

A device's privacy policy is its owner's, pinned in its node config (``fedge-edge join
--require-secure-aggregation --min-participants N ...``, ``fedge.edge_client.privacy_policy``).
Flower's simulation engine gives all its nodes one node config (partition id and count only), so a
simulation could not run its devices with a policy: ``device-policy`` stands for it there. It can
only add requirements: a device enforces the stricter of its node config and this setting, key by
key, so a coordinator that leaves it out, or sends a looser one, changes nothing a device's owner
pinned. Read by the coordinator (validation) and the devices.

Grammar: ``none``, or comma-separated items among ``require-secure-aggregation``,
``min-participants=N``, ``min-threshold=F`` (a fraction of the neighbours in [0, 1]),
``dp-min-noise=Z`` and ``dp-max-clip=C``.
"""

from __future__ import annotations

import math

__all__ = ["DP_MAX_CLIP", "DP_MIN_NOISE", "MIN_PARTICIPANTS", "MIN_THRESHOLD", "NO_DEFAULT_POLICY", "POLICY_KEYS", "PolicyError",
           "REQUIRE_SECURE_AGGREGATION", "parse_device_policy", "stricter"]

#: the node config keys a device policy sets (the names of ``fedge-edge join``'s flags)
REQUIRE_SECURE_AGGREGATION = "require-secure-aggregation"
#: node config: the owner of a device with an issued identity turned its default policy off
#: (``fedge-edge join --no-default-policy``); the device logs it at every message
NO_DEFAULT_POLICY = "no-default-policy"
MIN_PARTICIPANTS = "min-participants"
MIN_THRESHOLD = "min-threshold"
DP_MIN_NOISE = "dp-min-noise"
DP_MAX_CLIP = "dp-max-clip"
POLICY_KEYS = (REQUIRE_SECURE_AGGREGATION, MIN_PARTICIPANTS, MIN_THRESHOLD, DP_MIN_NOISE, DP_MAX_CLIP)


class PolicyError(ValueError):
    """A ``device-policy`` that does not parse, or a value out of its range."""


def parse_device_policy(spec: str) -> dict[str, float | bool]:
    """``none`` -> {}; ``require-secure-aggregation,min-participants=5`` ->
    ``{"require-secure-aggregation": True, "min-participants": 5.0}``."""
    policy: dict[str, float | bool] = {}
    text = (spec or "").strip()
    if not text or text.lower() == "none":
        return policy
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if key not in POLICY_KEYS:
            raise PolicyError(f"device-policy: unknown item {key!r}; known: {', '.join(POLICY_KEYS)}")
        if key in policy:
            raise PolicyError(f"device-policy: {key} given twice")
        if key == REQUIRE_SECURE_AGGREGATION:
            if sep and value.lower() not in ("true", "1", "yes", "on"):
                raise PolicyError(f"device-policy: require-secure-aggregation takes no value, got {value!r}")
            policy[key] = True
            continue
        try:
            number = float(value)
        except ValueError:
            raise PolicyError(f"device-policy: {key} needs a number, got {value!r}") from None
        if not (math.isfinite(number) and number >= 0):
            raise PolicyError(f"device-policy: {key} must be a number >= 0, got {value!r}")
        if key == MIN_THRESHOLD and number > 1:
            raise PolicyError(f"device-policy: min-threshold is a fraction of the neighbours in [0, 1], got {number:g}")
        if key == MIN_PARTICIPANTS and number != int(number):
            raise PolicyError(f"device-policy: min-participants must be a whole number, got {value!r}")
        policy[key] = number
    return policy


def stricter(key: str, own: float, run: float) -> float:
    """The stricter of a node config value and the run's (0 = no requirement): the larger floor,
    the smaller ceiling (``dp-max-clip``)."""
    if key == DP_MAX_CLIP:
        return min(v for v in (own, run) if v) if (own or run) else 0.0
    return max(own, run)
