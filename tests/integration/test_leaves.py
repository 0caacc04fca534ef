"""Beyond one SuperLink on Flower's own processes: a root SuperLink whose two nodes are bridges,
each to a leaf (a SuperLink of its own, two device SuperNodes, a leaf coordinator's run), all on
127.0.0.1, over TLS with every node authenticated; the root's rounds train the leaves' devices, a
killed root resumes, a killed leaf does not block the root and rejoins, and every process stops at
the end."""

from __future__ import annotations

import json

import pytest
import torch

from fedge.deploy.model_file import load_model_file
from fedge.server.local import launch
from fedge.server.run.initial_model import initial_params
from fedge.server.run.checkpoint import CheckpointStore
from fedge.server.settings import RunSettings
from fedge.tasks.parameters import flatten_state
from fedge.tasks import make_task
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


@pytest.mark.timeout(1000)  # the two launches may take 360 + 540 s
def test_a_killed_root_resumes_and_a_killed_leaf_rejoins_each_from_its_checkpoint(tmp_path, assert_no_leftovers) -> None:
    """The root's rounds train the leaves' devices over TLS, and a crash loses nothing.

    - TLS: the root's and each leaf's SuperLink serve TLS with node authentication on (a device or
      bridge whose key is not registered could not join, and the rounds would not run); a restarted
      leaf registers its devices again with its new SuperLink.

    - The root: every process of it is SIGKILLed after its round 2 and the leaves are stopped.
      Started again on the same run directory, the root resumes from its checkpoint and the leaves
      from theirs (a round a leaf had already answered before the crash is answered from its spool,
      not stepped again).
    - A leaf: after root round 3 every process of leaf 1 is SIGKILLed. Root round 4 completes with
      leaf 0 alone (leaf 1's bridge answers with an error once the leaf's heartbeat has been silent
      10 s, or at the latest after its wait); leaf 1 is started again, resumes from its checkpoint
      and is in root round 5.

    The root's rows are rounds 1-5 once each; each leaf stepped once per root round it answered,
    never twice for one. Every process stops at the end."""
    # A restarted leaf has its bridge's wait (0.8 x round-timeout = 120 s) to be up and answer root
    # round 5: about 30 s alone on a 2-core Xeon, over 36 s beside two other test workers, and more than
    # 72 s once when the machine also ran a second suite (the bound costs nothing when the leaf is on time).
    settings = RunSettings(rounds=5, clients_per_round=2, local_epochs=1, run_dir=str(tmp_path / "run"),
                           wait_for_nodes=120.0, round_timeout=150.0)
    crashed = launch(settings, engine="deployment", num_supernodes=4, leaves=2, stop_after_round=2, timeout=360,
                     tls=True)
    assert crashed.summary is None
    saved = CheckpointStore(crashed.run_dir / "checkpoint").load()
    assert saved is not None and saved.round in (1, 2, 3)
    resumed = launch(settings, engine="deployment", num_supernodes=4, leaves=2, kill_leaf=(1, 3), timeout=540,
                     tls=True)
    assert [r["round"] for r in resumed.rows] == [1, 2, 3, 4, 5]
    assert resumed.summary is not None and resumed.summary["resumed_from_round"] == saved.round
    used = {r["round"]: r["clients_used"] for r in resumed.rows}
    assert used == {1: 2, 2: 2, 3: 2, 4: 1, 5: 2}, resumed.rows  # round 4 without leaf 1; round 5 with it again
    (missing,) = resumed.rows[3]["rejected"]
    assert "did not answer round 4" in missing["reason"], missing
    assert all(not r["rejected"] for r in resumed.rows if r["round"] != 4), resumed.rows
    assert resumed.summary["final_accuracy"] > resumed.summary["initial_accuracy"]
    for leaf, steps in (("leaf-0", [1, 2, 3, 4, 5]), ("leaf-1", [1, 2, 3, 4])):
        rows = [json.loads(line) for line in (tmp_path / "run" / leaf / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == steps, rows  # each step once, in order, across both crashes
        assert all(r["clients_used"] == 2 for r in rows)
    for logs in ("logs", "leaf-0/logs", "leaf-1/logs"):  # every SuperLink of the tree served TLS only
        superlink = (resumed.run_dir / logs / "superlink.log").read_text()
        assert "running on https://127.0.0.1:" in superlink, superlink[-2000:]
    for home in ("flwr-home", "leaf-0/flwr-home", "leaf-1/flwr-home"):
        assert_no_leftovers(resumed.run_dir / home)


@pytest.mark.timeout(640)
def test_simulated_leaves_train_the_same_devices_as_one_flat_federation(tmp_path, assert_no_leftovers) -> None:
    """Leaves whose devices run under Flower's Simulation Engine (a SuperLink in ``--simulation``
    mode and a Ray instance per leaf) under a deployed root: each simulated node trains as the
    device of the same partition a deployed leaf gives its SuperNode (``leaf-devices``), so the
    tree's model equals, to 1e-6 per coordinate, the flat FedAvg over the same five devices, run
    here on the engine's in-process grid (leaf 0 holds partitions 0, 2 and 4, leaf 1 partitions 1
    and 3; a node trained on Flower's own numbering would train partition 0 and 1 of 2 instead).

    The leaves are of unequal size and the weight cap is the default (``median:factor=5``: every
    device weighs 1 in a run's first step): the root weighs each leaf by the capped weights of its
    devices, 3:2, as the flat run weighs the five devices. It weighed them 1:1 before 2026-12-07 (the
    root capped its leaves' sums as if each were one device's claim)."""
    common = dict(rounds=2, local_epochs=1, codec="none", partitioning="iid", seed=3)
    # a leaf's step starts a Ray instance and its simulated devices: under the whole suite on 2 cores
    # that took more than 0.8 x 120 s once (the root then counted no leaf), and a leaf's node took more
    # than 60 s to reach the root once (round 1 then ran on one leaf), so the bounds are generous; the
    # root stops waiting as soon as both leaves are there
    settings = RunSettings(**common, clients_per_round=2, run_dir=str(tmp_path / "run"), wait_for_nodes=240.0,
                           round_timeout=200.0)
    result = launch(settings, engine="deployment", num_supernodes=5, leaves=2, leaf_engine="simulation", timeout=560)
    used = [r["clients_used"] for r in result.rows]
    assert used == [2, 2] and not any(r["rejected"] for r in result.rows), _why(result.run_dir, result.rows)
    flat = build_engine({**common, "clients_per_round": 5, "round_timeout": 5.0, "wait_for_nodes": 1.0,
                         "run_dir": str(tmp_path / "flat")})
    start = initial_params(make_task("digits"), 3)
    flat.run(InProcessGrid(5), start)
    tree = flatten_state(load_model_file(result.run_dir / "model.pt").state_dict)
    torch.testing.assert_close(tree, flat.algorithm.final_model(), rtol=0, atol=1e-6)
    assert not torch.equal(tree, start)
    for leaf in ("leaf-0", "leaf-1"):
        rows = [json.loads(line) for line in (result.run_dir / leaf / "metrics.jsonl").read_text().splitlines()]
        devices = 3 if leaf == "leaf-0" else 2
        assert [(r["round"], r["clients_used"]) for r in rows] == [(1, devices), (2, devices)], rows
        assert not list((result.run_dir / leaf / "logs").glob("supernode*")), "a simulated leaf starts no SuperNode"
        assert_no_leftovers(result.run_dir / leaf / "flwr-home")
    assert_no_leftovers(result.run_dir / "flwr-home")


def _why(run_dir, rows: list[dict]) -> str:
    """What a failed tree run left to read: the root's rows (what each leaf's bridge answered) and the
    end of every leaf's logs (a leaf's Ray head or SuperLink that did not start says so there)."""
    tails = []
    for log in sorted(run_dir.glob("leaf-*/logs/*.log")):
        text = log.read_text(errors="replace")
        tails.append(f"--- {log.relative_to(run_dir)}:\n{text[-1500:]}")
    return json.dumps([{k: r.get(k) for k in ("round", "clients_used", "rejected")} for r in rows]) + "\n" + \
        "\n".join(tails)


def test_a_leaf_that_fails_to_start_takes_the_started_leaves_down_with_it(tmp_path, assert_no_leftovers,
                                                                         monkeypatch) -> None:
    """The second leaf fails as it starts, after its SuperLink is up (here its devices' registration
    raises, as for a key Flower refuses): the launch raises that error, and neither that SuperLink
    nor the first leaf's processes (its SuperLink, device and coordinator's run) outlive it. Both
    did before 2026-12-06 (the leaves' groups were kept only once every leaf had started)."""
    import fedge.server.local as local
    from fedge.launcher.federation import RegistrationError

    real, calls = local._registered, []

    def refused_on_the_second_leaf(flower, security, indices):  # type: ignore[no-untyped-def]
        calls.append(list(indices))
        if len(calls) == 2:
            raise RegistrationError("flwr supernode register node-1.pub failed: refused (test)")
        return real(flower, security, indices)

    monkeypatch.setattr(local, "_registered", refused_on_the_second_leaf)
    settings = RunSettings(rounds=1, clients_per_round=2, local_epochs=1, run_dir=str(tmp_path / "run"))
    with pytest.raises(RegistrationError, match="refused \\(test\\)"):
        launch(settings, engine="deployment", num_supernodes=4, leaves=2, timeout=120)
    assert [len(c) for c in calls] == [2, 2]  # each leaf's devices; the first leaf was up when the second failed
    assert (tmp_path / "run" / "leaf-0" / "logs" / "superlink.log").is_file()
    assert (tmp_path / "run" / "leaf-1" / "logs" / "superlink.log").is_file()
    assert_no_leftovers(tmp_path / "run")  # every FLWR_HOME of the tree: the root's and each leaf's
