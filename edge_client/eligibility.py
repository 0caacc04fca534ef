"""Participation that respects the device: its owner's conditions and daily budgets, as a Flower mod.

Node config (``fedge-edge join --when charging,unmetered,idle --max-rounds-per-day 20
--max-mb-per-day 50``):

* ``when``: conditions that must all hold for the device to train or evaluate, read on Linux:

  - ``charging``: on external power. A power supply of type ``Mains`` or ``USB`` that is
    ``online``, or a battery whose ``status`` is ``Charging`` or ``Full``
    (``/sys/class/power_supply``). A machine with no battery at all (a desktop, a server, a
    gateway) runs on mains and counts as charging.
  - ``unmetered``: Linux has no kernel flag for a metered network, so this is what can honestly be
    told: the interface of the default route (``/proc/net/route``) is not a cellular modem
    (``DEVTYPE=wwan`` in its ``uevent``, or a ``wwan*``/``rmnet*``/``ppp*``/``wwp*`` name), and
    where NetworkManager runs, it does not mark that device metered (``nmcli``'s
    ``GENERAL.METERED`` is not ``yes``/``yes (guessed)``). A tethered phone seen as Ethernet or a
    Wi-Fi hotspot NetworkManager has not flagged passes: the owner who knows better sets the
    connection metered in NetworkManager (``nmcli connection modify <c> connection.metered yes``).
  - ``idle``: the one-minute load average per core is below ``idle-load`` (default 0.5).

* ``max-rounds-per-day`` / ``max-mb-per-day``: today's trained rounds and megabytes (down + up)
  from the device's ledger (``<state-dir>/resources.jsonl``, ``fedge.edge_client.resources``), local
  time. A budget needs ``state-dir``; without one the device refuses with ``bad-config`` rather
  than ignore its owner's limit.

A device that may not train replies with a typed refusal (``not-eligible`` or ``over-budget``,
``fedge.protocol.refusals``), which the coordinator counts as declined, not as a failure. Checks
run on ``train`` and ``evaluate`` messages; the secure-aggregation key exchange (``query``) is
answered (a device that declined its train message has left the round already).

``FEDGE_POWER_SUPPLY_DIR`` and ``FEDGE_NET_DIR`` point the checks at another sysfs tree (containers
that mount the host's, tests).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.edge_client.resources import day_totals
from fedge.protocol.refusals import BadConfigRefusal, NotEligibleRefusal, OverBudgetRefusal
from fedge.protocol.secagg import secure_stage

__all__ = ["CONDITIONS", "Policy", "eligibility_mod", "is_charging", "is_idle", "is_unmetered"]

log = logging.getLogger(__name__)

CONDITIONS = ("charging", "unmetered", "idle")
_CHECKED_TYPES = ("train", "evaluate")
_CELLULAR_PREFIXES = ("wwan", "rmnet", "ppp", "wwp")


def _power_dir() -> Path:
    return Path(os.environ.get("FEDGE_POWER_SUPPLY_DIR", "/sys/class/power_supply"))


def _net_dir() -> Path:
    return Path(os.environ.get("FEDGE_NET_DIR", "/sys/class/net"))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def is_charging() -> tuple[bool, str]:
    """(on external power, why)."""
    supplies = sorted(_power_dir().glob("*")) if _power_dir().is_dir() else []
    batteries = []
    for supply in supplies:
        kind = _read(supply / "type")
        if kind in ("Mains", "USB", "USB_C", "USB_PD") and _read(supply / "online") == "1":
            return True, f"{supply.name} online"
        if kind == "Battery":
            batteries.append((supply.name, _read(supply / "status")))
    if not batteries:
        return True, "no battery (mains powered)"
    for name, status in batteries:
        if status in ("Charging", "Full"):
            return True, f"battery {name} {status.lower()}"
    return False, "on battery (" + ", ".join(f"{n} {s.lower() or 'unknown'}" for n, s in batteries) + ")"


def _default_route_interface() -> str | None:
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":
            return fields[0]
    return None


def is_unmetered() -> tuple[bool, str]:
    """(not on a metered network, as far as Linux can tell; why). See the module docstring."""
    iface = _default_route_interface()
    if iface is None:
        return False, "no default route"
    uevent = _read(_net_dir() / iface / "uevent")
    if "DEVTYPE=wwan" in uevent or iface.startswith(_CELLULAR_PREFIXES):
        return False, f"{iface} is a cellular modem"
    nmcli = shutil.which("nmcli")
    if nmcli:
        try:
            metered = subprocess.run([nmcli, "-t", "-g", "GENERAL.METERED", "device", "show", iface],
                                     capture_output=True, text=True, timeout=5, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            metered = ""
        if metered.startswith("yes"):
            return False, f"NetworkManager marks {iface} metered ({metered})"
    return True, f"{iface}"


def is_idle(threshold: float) -> tuple[bool, str]:
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return load < threshold, f"load {load:.2f} per core (idle below {threshold:g})"


@dataclass(frozen=True)
class Policy:
    """A device's participation policy, from its node config."""

    when: tuple[str, ...] = ()
    idle_load: float = 0.5
    max_rounds_per_day: int | None = None
    max_mb_per_day: float | None = None
    state_dir: Path | None = None

    @classmethod
    def from_node_config(cls, config: dict[str, object]) -> Policy:
        when = tuple(c.strip() for c in str(config.get("when", "") or "").split(",") if c.strip())
        unknown = sorted(set(when) - set(CONDITIONS))
        if unknown:
            raise BadConfigRefusal(f"node config when: unknown condition(s) {unknown}; known: {', '.join(CONDITIONS)}")

        def number(key: str, kind: type) -> float | None:
            value = config.get(key)
            if value in (None, "", 0, "0"):
                return None
            try:
                parsed = kind(value)
            except (TypeError, ValueError):
                raise BadConfigRefusal(f"node config {key} must be a positive number, got {value!r}") from None
            if parsed <= 0:
                raise BadConfigRefusal(f"node config {key} must be a positive number, got {value!r}")
            return parsed

        rounds, mb = number("max-rounds-per-day", int), number("max-mb-per-day", float)
        idle = number("idle-load", float)
        state_dir = Path(str(config["state-dir"])) if config.get("state-dir") else None
        if (rounds or mb) and state_dir is None:
            raise BadConfigRefusal("a daily budget needs state-dir (the device's ledger)")
        return cls(when=when, idle_load=idle or 0.5, max_rounds_per_day=int(rounds) if rounds else None,
                   max_mb_per_day=mb, state_dir=state_dir)

    def check(self) -> None:
        """Raise the refusal that applies now, if any."""
        for condition in self.when:
            ok, why = {"charging": is_charging, "unmetered": is_unmetered,
                       "idle": lambda: is_idle(self.idle_load)}[condition]()
            if not ok:
                raise NotEligibleRefusal(f"not {condition}: {why}")
        if self.state_dir is not None and (self.max_rounds_per_day or self.max_mb_per_day):
            today = day_totals(self.state_dir)
            if self.max_rounds_per_day and today["rounds"] >= self.max_rounds_per_day:
                raise OverBudgetRefusal(f"{today['rounds']} rounds today (at most {self.max_rounds_per_day})")
            spent = today["mb_down"] + today["mb_up"]
            if self.max_mb_per_day and spent >= self.max_mb_per_day:
                raise OverBudgetRefusal(f"{spent:.1f} MB today (at most {self.max_mb_per_day:g})")


def eligibility_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Refuse a train or evaluate message the device's owner does not allow now (typed refusal)."""
    if msg.metadata.message_type.split(".")[0] in _CHECKED_TYPES and secure_stage(msg) is None:
        Policy.from_node_config(dict(context.node_config)).check()
    return call_next(msg, context)
