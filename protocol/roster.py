"""The roll call: each device's stable name, so a seed means the same devices in every run.

Flower numbers nodes at random: every simulation, every restarted SuperNode gets new node ids. A
coordinator that samples "positions 3, 17 and 41 of the sorted node ids" therefore trains other
partitions in every run of one seed, and the runs part from round 1. Before it first chooses among
nodes, the coordinator asks each node it has not heard from for its name: one ``query.roster``
message, answered with the node config's ``partition-id`` (a simulated or local-cluster node's data
partition; a leaf's simulated node answers as the device it stands for). Seeded choices (sampling,
Oort, gossip positions) then order nodes by that name, and the same seed draws the same partitions.

A node without a partition id (a real device with its own data), or one that does not answer, keeps
its Flower number, after the named ones: a real federation's devices come and go, and no seed could
fix which of them take part.
"""

from __future__ import annotations

from flwr.app import MessageType, MetricRecord, RecordDict

__all__ = ["ROSTER_ACTION", "ROSTER_KEY", "ROSTER_MESSAGE_TYPE", "ROSTER_RECORD", "read_roster_answer",
           "roster_answer"]

ROSTER_ACTION = "roster"
ROSTER_MESSAGE_TYPE = f"{MessageType.QUERY}.{ROSTER_ACTION}"
#: the reply's record and the key of the device's stable name in it
ROSTER_RECORD = "fedge.roster"
ROSTER_KEY = "partition-id"


def roster_answer(node_config: dict[str, object]) -> RecordDict:
    """A device's answer: its partition id when its node config has one, else nothing."""
    value = node_config.get(ROSTER_KEY)
    named = value is not None and str(value).lstrip("-").isdigit()
    return RecordDict({ROSTER_RECORD: MetricRecord({ROSTER_KEY: int(value)}) if named else MetricRecord()})


def read_roster_answer(content: RecordDict) -> int | None:
    """The stable name in a device's answer; None when it gave none (or an answer of another shape)."""
    record = content.metric_records.get(ROSTER_RECORD)
    value = None if record is None else record.get(ROSTER_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
