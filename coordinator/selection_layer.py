"""``selection``: which devices a step asks, as a layer. ``uniform`` (the default) is the engine's
seeded sample; ``oort`` prefers devices that are useful and fast, after Oort (Lai et al., OSDI
2021), with participation kept within bounds.

Per device the layer keeps what the coordinator has seen: how long its last replies took (an
exponential average; a device that timed out counts the whole wait), its statistical utility
(examples × training loss of its replies, Oort's ``|B|·sqrt(mean loss²)`` with the mean loss
standing in for the root mean square; 1 where replies carry no loss, as under secure aggregation)
and how often and when it was chosen.

A step of ``k`` devices is filled in this order:

1. **Owed devices**: every device chosen fewer times than ``min-share`` × its fair count (the sum
   over steps of ``k / connected``, rounded down) is chosen first, least chosen first, so no
   device is starved however slow it is.
2. **Exploration**: up to ``explore`` × k slots go to devices never tried yet (seeded random).
3. **Exploitation**: the rest by Oort's score, utility (normalised) × ``(T / duration)^alpha`` for a
   device slower than ``T`` (the duration of the k-th fastest known device: the round time a
   step of the k fastest would take), plus Oort's staleness bonus ``sqrt(0.1 ln(t) / last)``.
   Devices at ``max-share`` × their fair share are skipped while others remain.

**How long a reply took** is the device's own time, as far as the coordinator can check it. The
round trip (sending its message to its reply landing) also holds what the message spent outside
the device: the network and the engine's polling. On Flower's deployment engine that polling alone
is 0-3 s, because an idle SuperNode sleeps 3 s between asks. That is more than a 5x slow device's
extra time on a small task, so ranking by the round trip mixes fast devices with slow ones. So a
reply that carries a resource report (``fedge.protocol.resources``) counts as
``max(reported wall time, round trip - L)``. L is the 90th percentile of round trip minus reported
wall time over the last 64 reports, the time outside the devices.

- A device that reports nothing counts as ``round trip - L``.
- A device that understates its time still counts at least ``round trip - L``. Only the jitter
  within L is taken on its word, so it cannot look faster than the coordinator saw it by more than
  that. If more than a tenth of the replies understate, L grows with them. The ``max-share`` cap
  still bounds how often any device is asked.
- Before any report, every device counts its round trip.

In a user's Flower app (``fedge.flower.layered(strategy, SelectionLayer(Oort(), ...))``) the
strategy sees its replies only after the round's barrier, so the wrapper times each reply by the
messages' own timestamps (``Reply.seconds``: the reply's ``created_at`` minus its message's, which
Flower's TTL check reads too); a node that never answers costs the whole wait, as here.

A device that declined (``not-eligible``, ``over-budget``) is not asked again in the next step.
The row gets ``participation``: Jain's fairness index over every connected device's selection
count (1 = perfectly even), with the minimum and maximum count. Under ``uniform`` the layer only
counts the engine's seeded sample for that figure (not under DP, whose rows carry no node facts,
nor for gossip's fixed topology).

Refused with differential privacy (the accountant assumes Poisson sampling with a fixed rate;
choosing by speed and loss would break it) and with gossip (a fixed topology).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedge.compression import derive_seed
from fedge.compression.errors import SpecError
from fedge.compression.spec import build_from_spec
from fedge.protocol import METRICS_RECORD
from fedge.protocol.refusals import DECLINED
from fedge.protocol.resources import read_report
from fedge.coordinator.step import Outgoing, Reply, Step, StepOutcome
from fedge.coordinator.layer import MEMBERS, SAMPLE, Failure, Layer
from fedge.coordinator.tally import Tally

__all__ = ["Oort", "SelectionLayer", "jain_index"]

#: replies whose time outside the device sets L
_OUTSIDE_WINDOW = 64


def jain_index(counts: list[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one takes all."""
    total, squares = sum(counts), sum(c * c for c in counts)
    return 1.0 if squares == 0 else total * total / (len(counts) * squares)


@dataclass
class _Device:
    chosen: int = 0
    duration: float | None = None  # seconds, exponential average
    utility: float | None = None
    last: int = 0  # the step it was last chosen in
    rest_until: int = 0  # declined: not asked before this step


@dataclass(frozen=True)
class Oort:
    """Oort's rule with participation bounds; parameters as in the module docstring."""

    alpha: float = 2.0
    explore: float = 0.2
    min_share: float = 0.25
    max_share: float = 2.0
    smoothing: float = 0.5  # weight of the newest observation in the averages

    @classmethod
    def parse(cls, spec: str) -> Oort | None:
        try:  # the project's one spec reader: parameters typed by the dataclass's defaults
            rule = build_from_spec(spec, {"uniform": lambda: None, "oort": cls}, family="selection")
        except SpecError as err:
            raise ValueError(f"selection must be 'uniform' or 'oort[:alpha=A,explore=E,min-share=M,max-share=X]': "
                                f"{err}") from None
        if rule is None:
            return None
        if not (rule.alpha >= 0 and 0 <= rule.explore <= 1 and 0 <= rule.min_share <= 1 <= rule.max_share
                and 0 < rule.smoothing <= 1):
            raise ValueError("selection: oort needs alpha >= 0, 0 <= explore <= 1, 0 <= min-share <= 1 <= "
                                "max-share, 0 < smoothing <= 1")
        return rule


class SelectionLayer(Layer):
    key = "selection"
    needs = frozenset({MEMBERS})  # counts only the messages that go out

    def __init__(self, rule: Oort | None, seed: int, per_step: int, clock: Any = time.monotonic) -> None:
        self.rule, self.seed, self.per_step, self.clock = rule, seed, per_step, clock
        #: Oort chooses the step's devices; uniform selection only counts the engine's sample
        self.provides = frozenset({SAMPLE}) if rule is not None else frozenset()
        self.devices: dict[int, _Device] = {}
        self.steps = 0  # selections made (steps, or asynchronous dispatches)
        self.fair = 0.0  # the sum over selections of k / connected: each device's fair count so far
        self.sent: dict[int, float] = {}  # node -> when its message left
        self.outside: deque[float] = deque(maxlen=_OUTSIDE_WINDOW)  # round trip - reported wall, recent replies

    # -- choosing -----------------------------------------------------------------------------
    def select(self, nodes: list[int], count: int, key: int) -> list[int] | None:
        nodes = list(nodes)  # the run's canonical order (fedge.server.engine.roster)
        for node in nodes:  # every connected device counts in the fairness figure, chosen or not
            self.devices.setdefault(node, _Device())
        if self.rule is None:
            return None  # uniform: the engine's seeded sample, counted in outgoing()
        count = min(count, len(nodes))
        self.steps += 1
        self.fair += count / max(1, len(nodes))
        if count == 0:
            return []
        rng = np.random.default_rng(derive_seed(self.seed, key, purpose="selection"))
        resting = {n for n in nodes if self.devices[n].rest_until > self.steps}
        available = [n for n in nodes if n not in resting] or nodes
        picked: list[int] = []

        # owed: chosen fewer times than min-share of its fair count allows (whole selections: a
        # device is owed once the floor of its minimum reaches one more than it has had)
        floor = math.floor(self.rule.min_share * self.fair + 1e-9)
        tie = {n: float(t) for n, t in zip(available, rng.random(len(available)), strict=True)}
        owed = sorted((n for n in available if self.devices[n].chosen < floor),
                      key=lambda n: (self.devices[n].chosen, tie[n]))
        picked += owed[:count]

        fresh = [n for n in available if self.devices[n].duration is None and n not in picked]
        explore = min(len(fresh), count - len(picked), math.ceil(self.rule.explore * count))
        if explore > 0:
            picked += [fresh[int(i)] for i in rng.choice(len(fresh), size=explore, replace=False)]

        rest = [n for n in available if n not in picked]
        capped = [n for n in rest if self.devices[n].chosen < self.rule.max_share * self.fair]
        pool = capped if len(capped) >= count - len(picked) else rest
        scores = self._scores(pool, count, rng)
        picked += sorted(pool, key=lambda n: -scores[n])[: count - len(picked)]
        for node in picked:
            self.devices[node].chosen += 1
            self.devices[node].last = self.steps
        chosen = set(picked)
        return [n for n in nodes if n in chosen]

    def _scores(self, pool: list[int], count: int, rng: np.random.Generator) -> dict[int, float]:
        known = sorted(d.duration for d in self.devices.values() if d.duration is not None)
        target = known[min(count, len(known)) - 1] if known else None
        utilities = [d.utility for d in self.devices.values() if d.utility is not None]
        top = max(utilities) if utilities else 1.0
        scores = {}
        for node in pool:
            device = self.devices[node]
            utility = (device.utility / top if device.utility is not None and top > 0 else 1.0)
            if device.duration is not None and target is not None and device.duration > target:
                utility *= (target / device.duration) ** self.rule.alpha
            staleness = math.sqrt(0.1 * math.log(self.steps + 1) / max(1, device.last)) if device.last else 1.0
            scores[node] = utility + 0.1 * staleness + 1e-6 * float(rng.random())  # seeded tie-break
        return scores

    # -- what the layer learns ------------------------------------------------------------------
    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        now = self.clock()
        for o in outgoing:
            self.sent[o.node] = now
            if self.rule is None:  # the engine chose: count what it sent
                device = self.devices.setdefault(o.node, _Device())
                device.chosen, device.last = device.chosen + 1, step.number

    def _observe(self, node: int, seconds: float | None = None, utility: float | None = None) -> None:
        device = self.devices.setdefault(node, _Device())
        if self.rule is None:  # uniform learns nothing from speed or loss
            return
        w = self.rule.smoothing
        if seconds is not None:
            device.duration = seconds if device.duration is None else (1 - w) * device.duration + w * seconds
        if utility is not None:
            device.utility = utility if device.utility is None else (1 - w) * device.utility + w * utility

    def _outside(self) -> float:
        """L: the time recent replies spent outside their devices (90th percentile), 0 before any
        report."""
        return float(np.quantile(np.fromiter(self.outside, dtype=float), 0.9)) if self.outside else 0.0

    def _device_seconds(self, trip: float, reply: Reply) -> float:
        report = read_report(reply.content)
        if report is None:
            return max(0.0, trip - self._outside())
        if report.wall_seconds <= trip:  # a report longer than the round trip is not one to learn from
            self.outside.append(trip - report.wall_seconds)
        return max(report.wall_seconds, trip - self._outside())

    def arrived(self, step: Step, event: Reply | Failure) -> bool:
        if isinstance(event, Failure):
            self._missed(event)
            return False
        reply = event
        sent = self.sent.pop(reply.node, None)
        record = reply.content.metric_records.get(METRICS_RECORD)
        utility = None
        if record is not None:  # Fedge's devices report train-loss; Flower's quickstart apps train_loss
            loss, examples = record.get("train-loss", record.get("train_loss")), record.get("num-examples")
            if isinstance(loss, (int, float)) and isinstance(examples, (int, float)) and math.isfinite(loss) \
                    and loss >= 0 and examples > 0:
                utility = float(examples) * float(loss)
        trip = reply.seconds if reply.seconds is not None else None if sent is None else self.clock() - sent
        if self.rule is None or trip is None:  # uniform learns nothing from speed
            self._observe(reply.node, None, utility)
            return False
        self._observe(reply.node, self._device_seconds(max(0.0, trip), reply), utility)
        return False

    def _missed(self, failure: Failure) -> None:
        if failure.node is None:
            return
        sent = self.sent.pop(failure.node, None)
        device = self.devices.setdefault(failure.node, _Device())
        if failure.kind in DECLINED:
            device.rest_until = self.steps + 2  # not asked in the next selection
        elif sent is not None:
            self._observe(failure.node, max(0.0, self.clock() - sent))  # a timeout costs the whole wait

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        outcome.extra["participation"] = self.participation()

    def participation(self) -> dict[str, float]:
        counts = [d.chosen for d in self.devices.values()]
        return {"jain": round(jain_index([float(c) for c in counts]), 4), "min": min(counts, default=0),
                "max": max(counts, default=0), "devices": len(counts)}

    # -- the run ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        if self.rule is None:
            return {"selection": {"rule": "uniform"}}
        return {"selection": {"rule": "oort", "alpha": self.rule.alpha, "explore": self.rule.explore,
                              "min_share": self.rule.min_share, "max_share": self.rule.max_share}}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "fair": self.fair, "outside": list(self.outside),
                "devices": {str(n): [d.chosen, d.duration, d.utility, d.last, d.rest_until]
                            for n, d in self.devices.items()}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            if self.rule is None:  # a uniform run's checkpoint from before the counts were kept
                return
            raise ValueError("the checkpoint has no selection state: the run did not set selection=oort")
        self.steps, self.fair = int(state["steps"]), float(state["fair"])
        self.outside = deque((float(v) for v in state.get("outside", [])), maxlen=_OUTSIDE_WINDOW)
        self.devices = {int(n): _Device(int(c), d, u, int(last), int(rest))
                        for n, (c, d, u, last, rest) in state["devices"].items()}
