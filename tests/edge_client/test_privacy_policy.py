"""A device that requires secure aggregation refuses what would make it send in clear, whatever the
coordinator asks (privacy audit 2, N1): nothing about its data leaves it but the refusal."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedge.edge_client.privacy_policy import SECURE_TRAIN_ACTIONS
from fedge.protocol.records import UPDATE_RECORD
from fedge.protocol.refusals import read_refusal
from fedge.protocol.roster import ROSTER_RECORD
from fedge.protocol.secagg import MASKED_STAGE, SECAGG_RECORD
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import _engine, _start

POLICY = {"require-secure-aggregation": "true"}
SECURE = "secagg:bits=8,clip=0.2,weight-cap=256"


def _recording(grid: InProcessGrid) -> list[Message]:
    """Every reply the coordinator pulls from ``grid``."""
    seen: list[Message] = []
    pull = grid.pull_messages

    def recording_pull(ids: list[str]) -> list[Message]:
        replies = pull(ids)
        seen.extend(replies)
        return replies

    grid.pull_messages = recording_pull  # type: ignore[method-assign]
    return seen


def test_a_round_without_secure_aggregation_gets_only_refusals(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=2, clients_per_round=3)
    grid = InProcessGrid(3, node_config={i: POLICY for i in range(3)})
    seen = _recording(grid)
    start = _start(engine)
    result = engine.run(grid, start)
    for row in result.rows:
        assert row.clients_used == 0 and row.uplink_bytes == 0
        assert [entry["kind"] for entry in row.rejected] == ["policy"] * 3
        assert row.extra["failures"] == {"policy": 3}
    # refusals only; and the roll call's answers, which carry the node config's partition id alone
    assert seen and all(set(reply.content.keys()) <= {"refusal", "resources"}
                        or set(reply.content.keys()) <= {"fedge.roster", "resources"} for reply in seen)
    assert torch.equal(result.model, start)  # nothing was learnt from these devices


def test_the_same_devices_take_part_under_secure_aggregation(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=1, clients_per_round=3, secure_aggregation=SECURE)
    grid = InProcessGrid(3, node_config={i: POLICY for i in range(3)})
    seen = _recording(grid)
    row = engine.run(grid, _start(engine)).rows[-1]
    assert row.clients_used == 3 and not row.rejected
    masked = [reply for reply in seen if UPDATE_RECORD in reply.content]
    assert len(masked) == 3 and all(reply.content["metrics"]["num-examples"] == 1 for reply in masked)


def test_federated_evaluation_is_refused_under_the_policy(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=1, clients_per_round=3, secure_aggregation=SECURE, evaluate="both",
                     holdout=0.2)
    row = engine.run(InProcessGrid(3, node_config={i: POLICY for i in range(3)}), _start(engine)).rows[-1]
    assert row.clients_used == 3
    assert [entry["kind"] for entry in row.extra["federated_ignored"]] == ["policy"] * 3
    assert row.extra["federated_replies"] == 0


def test_a_device_refuses_a_secure_round_smaller_than_its_minimum(tmp_path) -> None:
    """Audit N2's two-device round: with ``min-participants`` 4, devices refuse a round of 3 at its
    first stage (the key advertisement: nothing of theirs is in it yet); the coordinator drops them
    with the reason and no update is used. A round of 4 runs."""
    small = _engine(tmp_path / "small", rounds=1, clients_per_round=3, secure_aggregation=SECURE)
    policy = {**POLICY, "min-participants": 4}
    row = small.run(InProcessGrid(3, node_config={i: policy for i in range(3)}), _start(small)).rows[-1]
    assert row.clients_used == 0
    assert {entry["kind"] for entry in row.rejected} == {"policy"}  # the device's typed refusal, kept
    assert all("takes part in rounds of at least 4" in entry["reason"] for entry in row.rejected)
    big = _engine(tmp_path / "big", rounds=1, clients_per_round=4, secure_aggregation=SECURE)
    row = big.run(InProcessGrid(4, node_config={i: policy for i in range(4)}), _start(big)).rows[-1]
    assert row.clients_used == 4 and not row.rejected


def test_a_device_refuses_a_round_below_its_noise_floor(tmp_path) -> None:
    """Audit N5: the plan's noise comes from the coordinator. A device with ``dp-min-noise`` 2 refuses
    a distributed-DP round planned at z = 1 (and a secure round without noise); at a floor of 1 it
    takes part."""
    dp = "gaussian:noise=1.0,clip=1.0,delta=1e-5"
    for floor, used in ((2.0, 0), (1.0, 3)):
        engine = _engine(tmp_path / f"dp-{floor}", rounds=1, clients_per_round=3, secure_aggregation=SECURE,
                         differential_privacy=dp)
        grid = InProcessGrid(3, node_config={i: {"dp-min-noise": floor} for i in range(3)})
        row = engine.run(grid, _start(engine)).rows[-1]
        assert row.clients_used == used, (floor, row.rejected)
        if not used:
            assert all("noise multiplier is 1; this device requires at least 2" in r["reason"] for r in row.rejected)
    engine = _engine(tmp_path / "no-dp", rounds=1, clients_per_round=3, secure_aggregation=SECURE)
    row = engine.run(InProcessGrid(3, node_config={i: {"dp-min-noise": 1.0} for i in range(3)}),
                     _start(engine)).rows[-1]
    assert row.clients_used == 0 and all("no distributed-DP noise" in r["reason"] for r in row.rejected)


def test_a_device_refuses_a_share_threshold_below_its_floor(tmp_path) -> None:
    """Audit N3 without issued identities: the plan only insists on a majority of the neighbours,
    and the coordinator picks it. With ``min-threshold`` 0.67, the majority of 4 of 6 neighbours
    is refused at the first stage (two colluders and the coordinator could gather 4 shares); a
    threshold of 5 takes part."""
    for threshold, used in ((4, 0), (5, 7)):
        engine = _engine(tmp_path / f"t{threshold}", rounds=1, clients_per_round=7,
                         secure_aggregation=f"{SECURE},neighbours=6,threshold={threshold}")
        grid = InProcessGrid(7, node_config={i: {"min-threshold": 0.67} for i in range(7)})
        row = engine.run(grid, _start(engine)).rows[-1]
        assert row.clients_used == used, (threshold, row.rejected)
        if not used:
            assert {entry["kind"] for entry in row.rejected} == {"policy"}
            assert all("reconstructs from 4 of 6 neighbours" in entry["reason"] for entry in row.rejected)


def test_an_honest_coordinators_run_is_the_same_run_with_the_whole_policy_on(tmp_path) -> None:
    """The policy only refuses: against an honest coordinator whose settings meet it, every sampled
    device takes part in every round and the ledger charges what it charges without one, so what
    distributed DP reaches without the policy it reaches with it. (The Poisson sample itself is
    drawn from secret randomness, so two runs differ in who is sampled, policy or not.)"""
    dp = "gaussian:noise=1.0,clip=1.0,delta=1e-5"
    policy = {**POLICY, "min-participants": 2, "min-threshold": 0.5, "dp-min-noise": 1.0, "dp-max-clip": 1.0}
    epsilons = {}
    for name, config in (("open", {}), ("policy", policy)):
        engine = _engine(tmp_path / name, rounds=3, clients_per_round=8, secure_aggregation=SECURE,
                         differential_privacy=dp)  # q = 0.8 of 10: a sample below 2 once in 10^5 rounds
        rows = engine.run(InProcessGrid(10, node_config={i: config for i in range(10)}), _start(engine)).rows
        assert all(r.clients_used == r.clients_sampled >= 2 and not r.rejected for r in rows), \
            [(r.clients_sampled, r.clients_used, r.rejected) for r in rows]
        epsilons[name] = [r.extra["dp_epsilon"] for r in rows]
    assert epsilons["open"] == epsilons["policy"]


def test_a_simulations_device_policy_adds_requirements_and_never_removes_one(tmp_path) -> None:
    """Flower's simulation gives every node one node config, so the run setting ``device-policy``
    stands for the devices' policy there: a device enforces the stricter of it and its own. The
    run's ``min-participants=4`` refuses a round of 3 as the node config's would; a looser run
    policy (``min-participants=2``) leaves a device's own floor of 4 in force; a malformed one is a
    refusal, not an open door."""
    cases = (({}, "require-secure-aggregation,min-participants=4", 0),
             ({"min-participants": 4}, "min-participants=2", 0),
             ({}, "min-participants=2,min-threshold=0.5", 3),
             ({}, "min-participants=two", 0))
    for i, (own, run, used) in enumerate(cases):
        engine = _engine(tmp_path / str(i), rounds=1, clients_per_round=3, secure_aggregation=SECURE)
        grid = InProcessGrid(3, node_config={n: own for n in range(3)}, run_config={"device-policy": run})
        row = engine.run(grid, _start(engine)).rows[-1]
        assert row.clients_used == used, (own, run, row.rejected)
        if not used:
            assert {entry["kind"] for entry in row.rejected} == {"policy"}, row.rejected
    engine = _engine(tmp_path / "clear", rounds=1, clients_per_round=3)  # no secure aggregation at all
    grid = InProcessGrid(3, run_config={"device-policy": "require-secure-aggregation"})
    row = engine.run(grid, _start(engine)).rows[-1]
    assert row.clients_used == 0 and row.extra["failures"] == {"policy": 3}


def _masked_message(tmp_path) -> tuple[InProcessGrid, Message]:
    """A real secure round's masked train message (its ``secagg`` record valid), and its grid."""
    engine = _engine(tmp_path, rounds=1, clients_per_round=3, secure_aggregation=SECURE)
    grid = InProcessGrid(3, node_config={i: POLICY for i in range(3)})
    engine.run(grid, _start(engine))
    masked = [m for m in grid.pushed if SECAGG_RECORD in m.content.config_records
              and m.content.config_records[SECAGG_RECORD]["stage"] == MASKED_STAGE]
    assert masked
    return grid, masked[0]


def _as(msg: Message, message_type: str, content: RecordDict | None = None) -> Message:
    """``msg``'s records (its secure-aggregation plan included) under another message type."""
    return Message(content if content is not None else msg.content, dst_node_id=msg.metadata.dst_node_id,
                   message_type=message_type)


def _refusal(grid: InProcessGrid, msg: Message) -> tuple[str, str] | None:
    reply = grid.app(msg, grid.contexts[msg.metadata.dst_node_id])
    assert reply.has_content()
    refused = read_refusal(reply.content)
    return None if refused is None else (refused[0].value, refused[1])


# privacy audit 3, F2: the record does not make a message secure; its action does (SECURITY.md's table)
@pytest.mark.parametrize("message_type", ["train.gossip", "train.plugin", "evaluate"])
def test_a_secagg_record_on_an_action_that_does_not_mask_is_refused(tmp_path, message_type) -> None:
    grid, masked = _masked_message(tmp_path)
    refused = _refusal(grid, _as(masked, message_type))
    assert refused is not None and refused[0] == "policy"
    assert "requires secure aggregation" in refused[1]
    # an action the device has no handler for: Flower's ClientApp raises before any mod or handler runs
    for unknown in ("train.someone_elses", "query", "query.metrics"):
        with pytest.raises(ValueError, match="No (train|query) function registered"):
            grid.app(_as(masked, unknown), grid.contexts[masked.metadata.dst_node_id])


def test_the_policy_refuses_other_kinds_in_a_users_app() -> None:
    """The same check guards a user's ClientApp (``secure_mod``), whose handlers may answer queries."""
    from flwr.app import Context

    from fedge.edge_client.privacy_policy import check_privacy_policy
    from fedge.protocol.refusals import PolicyRefusal

    context = Context(run_id=1, node_id=1, node_config=dict(POLICY), state=RecordDict(), run_config={})
    for message_type in ("query", "query.metrics", "evaluate", "train.gossip", "train"):
        with pytest.raises(PolicyRefusal, match="requires secure aggregation"):
            check_privacy_policy(Message(RecordDict(), dst_node_id=1, message_type=message_type), context)


def test_the_policy_answers_secure_actions_and_the_roll_call_only(tmp_path) -> None:
    grid, masked = _masked_message(tmp_path)
    for message_type in ("train",):  # SECURE_TRAIN_ACTIONS: past the policy (no policy refusal)
        try:  # replayed or incomplete: the handler fails on its own checks, after the policy let it through
            refused = _refusal(grid, _as(masked, message_type))
        except Exception as err:  # noqa: BLE001 (a policy refusal never gets here: refusal_mod answers it)
            refused = None
            assert "requires secure aggregation" not in str(err)
        assert refused is None or refused[0] != "policy", refused
    record = ConfigRecord(dict(masked.content.config_records[SECAGG_RECORD]))
    record["bits"] = "eight"  # a plan that does not parse
    bad = RecordDict({**{k: v for k, v in masked.content.items() if k != SECAGG_RECORD}, SECAGG_RECORD: record})
    refused = _refusal(grid, _as(masked, "train", bad))
    assert refused is not None and refused[0] == "policy" and "plan is not valid" in refused[1]
    assert grid.roll_calls and all(ROSTER_RECORD in grid.app(m, grid.contexts[m.metadata.dst_node_id]).content
                                   for m in grid.roll_calls)


def test_every_handler_that_masks_is_named_and_no_other() -> None:
    """SECURE_TRAIN_ACTIONS against the device's handlers: an action is in it exactly when its
    handler uploads through the masking layer (``fedge.edge_client.layers.upload``)."""
    import importlib
    import inspect
    import pkgutil

    from fedge.edge_client import algorithms
    from fedge.protocol.records import message_type_for

    masking = set()
    for info in pkgutil.iter_modules(algorithms.__path__):
        module = importlib.import_module(f"{algorithms.__name__}.{info.name}")
        if "upload(" in inspect.getsource(module):
            masking.add(message_type_for(info.name).partition(".")[2])
    # SCAFFOLD uploads through the masking layer too, but its control change (sent beside, in clear)
    # is a function of the update, so a policy that requires masking must refuse it
    assert "scaffold" in masking and "scaffold" not in SECURE_TRAIN_ACTIONS
    assert masking - {"scaffold"} == set(SECURE_TRAIN_ACTIONS)
