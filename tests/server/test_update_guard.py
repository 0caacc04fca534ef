"""Hostile but well-formed clients against the norm bound, the weight cap and the robust
aggregators, through the engine on the in-process Grid stand-in (real ClientApp handlers and the
fault mod's ``signflip`` and ``inflate``)."""

from __future__ import annotations

import pytest
import torch

from fedge.compression import SpecError
from fedge.server.preflight import preflight
from fedge.server.settings import RunSettings, SettingsError
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import _engine, _start


@pytest.mark.parametrize("algorithm", ["fedavg", "easgd", "gossip"])
def test_reject_bound_refuses_a_sign_flipped_update_in_every_algorithm(tmp_path, algorithm: str) -> None:
    engine = _engine(tmp_path, rounds=2, algorithm=algorithm, update_norm="reject:factor=5")
    grid = InProcessGrid(3, node_config={2: {"fault": "signflip"}})
    first, second = engine.run(grid, _start(engine)).rows
    assert first.extra["update_norm_limit"] is None  # no reference norm before the first step closes
    assert second.extra["update_norm_limit"] > 0
    assert second.clients_used == 2
    (rejected,) = second.rejected
    assert rejected["node"] == grid.node_id(2) and "exceeds the bound" in rejected["reason"]
    if algorithm == "fedavg":  # the refused update's bytes were sent: three payloads of one size each round
        assert second.uplink_bytes == first.uplink_bytes and first.clients_used == 3


def test_clip_bound_names_the_clipped_client(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=2, update_norm="clip:factor=2")
    grid = InProcessGrid(3, node_config={0: {"fault": "signflip"}})
    _, second = engine.run(grid, _start(engine)).rows
    assert second.clients_used == 3 and not second.rejected
    assert second.extra["clipped"] == 1
    (clipped,) = second.extra["clipped_nodes"]
    assert clipped["node"] == grid.node_id(0) and clipped["reason"].startswith("clipped norm")


def test_inflated_example_count_is_capped_and_counted(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=2)  # default weight-cap median:factor=5
    grid = InProcessGrid(3, node_config={1: {"fault": "inflate"}})
    first, second = engine.run(grid, _start(engine)).rows
    assert first.extra["weight_capped"] == 0  # first step: equal weights, nothing to cap against
    assert second.extra["weight_capped"] == 1
    (capped,) = second.extra["weight_capped_nodes"]
    assert capped["node"] == grid.node_id(1) and "claimed 1e+09" in capped["reason"]


def _final_accuracy(path, rule: str, hostile: bool) -> float:
    # IID and a few rounds: enough for the clean run to learn (~80%) in seconds.
    engine = _engine(path, rounds=5, clients_per_round=5, local_epochs=3, partitioning="iid", aggregator=rule)
    config = {3: {"fault": "signflip"}} if hostile else {}
    return engine.run(InProcessGrid(5, node_config=config), _start(engine)).rows[-1].accuracy


@pytest.fixture(scope="module")
def baselines(tmp_path_factory) -> dict[str, float]:
    root = tmp_path_factory.mktemp("baselines")
    return {"clean": _final_accuracy(root / "clean", "mean", hostile=False),
            "attacked-mean": _final_accuracy(root / "mean", "mean", hostile=True)}


@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean:beta=0.2", "krum:f=1", "trimmed-mean:beta=0.2,nnm=1",
                                        "krum:f=1,nnm=1"])
def test_robust_aggregators_hold_while_the_mean_follows_a_byzantine_client(tmp_path, baselines,
                                                                          aggregator: str) -> None:
    """One client in five (20%) sends its update negated and 10x (well-formed): the mean collapses,
    the robust rules stay near the clean run (measured: clean 81%, mean 10%, median 75%, trimmed
    mean 81%, Krum 71%; Krum keeps one client's update, so it learns from less data). With
    nearest-neighbour mixing first (``nnm=1``), the rule the README recommends for skewed data."""
    clean = baselines["clean"]
    assert clean > 0.6
    assert baselines["attacked-mean"] < clean - 0.3
    assert _final_accuracy(tmp_path, aggregator, hostile=True) > clean - 0.15


def test_robust_aggregator_metrics_state_the_memory_held(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=1, aggregator="multikrum:f=0,m=2")
    grid = InProcessGrid(3)
    (row,) = engine.run(grid, _start(engine)).rows
    assert row.extra["aggregator"] == "multikrum:f=0,m=2"
    # three updates, one spare row (the canonical order) and the chosen ones' exact mean (12 B)
    assert row.extra["aggregator_bytes"] == 4 * engine.ctx.numel * (3 + 1 + 3) + 8 * 9
    assert len(row.extra["chosen_nodes"]) == 2 and set(row.extra["chosen_nodes"]) <= set(grid.get_node_ids())


def test_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(SettingsError, match=r"applies to algorithm fedavg and (.* and )?fedbuff only, not easgd"):
        preflight(RunSettings(algorithm="easgd", aggregator="median"))
    with pytest.raises(ValueError, match="cannot apply to gossip"):
        preflight(RunSettings(algorithm="gossip", update_norm="clip:max=1", clients_per_round=4))
    with pytest.raises(ValueError, match="over the limit"):
        preflight(RunSettings(aggregator="median", clients_per_round=100, aggregator_memory_mb=1))
    with pytest.raises(ValueError, match="n >= 2f"):
        preflight(RunSettings(aggregator="krum:f=4", clients_per_round=10))
    with pytest.raises(SpecError, match="unknown weight-cap"):
        preflight(RunSettings(weight_cap="mean"))
    with pytest.raises(ValueError, match="needs max"):
        preflight(RunSettings(update_norm="clip"))


def test_sparse_mean_through_the_engine_undoes_the_dilution_of_sparse_updates(tmp_path) -> None:
    """The same first round (same clients, same top-5% updates) aggregated by ``mean`` and by
    ``sparse-mean``: every coordinate moves the same way, and by the full weight of the devices
    that sent it rather than of all of them (so never less, and more where not every device sent)."""
    changes = {}
    for rule in ("mean", "sparse-mean"):
        engine = _engine(tmp_path / rule, rounds=1, clients_per_round=3, codec="topk:ratio=0.05", aggregator=rule)
        start = _start(engine)
        result = engine.run(InProcessGrid(3), start.clone())
        assert result.rows[0].extra["aggregator"] == rule and result.rows[0].clients_used == 3
        changes[rule] = result.model - start
    plain, sparse = changes["mean"], changes["sparse-mean"]
    assert torch.equal(plain != 0, sparse != 0) and torch.all(torch.sign(plain) == torch.sign(sparse))
    assert torch.all(sparse.abs() >= plain.abs() - 1e-7)
    assert float(sparse.norm()) > 1.5 * float(plain.norm())  # 3 devices, mostly different top 5%


def test_a_tcs_uplink_needs_the_lattice_downlink_and_a_fedavg_device() -> None:
    """``tcs`` sends on the coordinates the device's last downlink change moved: without a lattice
    downlink there is no change, and EASGD's and gossip's devices do not send an update from the
    model the change brought. Both are refused before the run, with the reason."""
    with pytest.raises(SettingsError, match="needs a lattice downlink"):
        preflight(RunSettings(codec="tcs:extra=0.01+qsgd:bits=4"))
    with pytest.raises(SettingsError, match="easgd's devices"):
        preflight(RunSettings(codec="tcs:extra=0.01+qsgd:bits=4", algorithm="easgd",
                              downlink_codec="lattice:ratio=0.05"))
    preflight(RunSettings(codec="tcs:extra=0.01+qsgd:bits=4", downlink_codec="lattice:ratio=0.05"))
