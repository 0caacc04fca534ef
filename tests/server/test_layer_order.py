"""Layers compose by what they declare, never by a list's order: every registration order of the
layers gives the same run, and a combination that cannot work is refused, with its reason, by
``order_layers`` before the run."""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

import pytest
import torch

from fedge.aggregation.partial import Partial
from fedge.server.engine.algorithm import Step
from fedge.server.engine.layers import LAYERS, SAMPLE, SUM, Layer, LayerOrderError, build_layers, order_layers, register_layer
from tests.server.behaviour import CASES, fingerprint, recorded_here
from tests.server.test_engine import _engine

#: settings that turn on every layer a synchronous run can hold at once (the selection layer counts
#: the uniform sample; DP replaces it, so DP runs go without it)
COMBINATIONS: dict[str, dict[str, Any]] = {
    "secure-dp-lattice-average": {"secure_aggregation": "secagg:bits=16,clip=1.0", "clients_per_round": 3,
                                  "differential_privacy": "gaussian:noise=1.0,clip=1.0,delta=1e-5",
                                  "downlink_codec": "lattice:ratio=0.05", "model_average": "ema:decay=0.8",
                                  "weight_cap": "fixed:max=100"},
    "guard-dp": {"differential_privacy": "gaussian:noise=1.0,clip=1.0,delta=1e-5", "update_norm": "clip:max=5",
                 "model_average": "ema:decay=0.8"},
    "oort-secure-lattice": {"selection": "oort", "secure_aggregation": "secagg:bits=16,clip=1.0",
                            "clients_per_round": 3, "downlink_codec": "lattice:ratio=0.05"},
}


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_registration_order_gives_one_order(tmp_path, monkeypatch, name: str) -> None:
    engine = _engine(tmp_path, **COMBINATIONS[name])
    expected = [layer.key for layer in engine.layers]
    assert len(expected) >= 4, expected
    for order in itertools.permutations(list(LAYERS)):
        monkeypatch.setattr("fedge.server.engine.layers.LAYERS", list(order))
        assert [layer.key for layer in build_layers(engine.algorithm)] == expected, order
    keys = expected.index  # what the declarations imply, whatever the registration said
    if "dp" in expected:
        assert keys("dp") > keys("guard")  # DP clips the update the guard bounded and weighed
    if "secure-aggregation" in expected:
        # it keeps back the messages of the devices that dealt no shares, before any layer encodes or counts one
        assert keys("secure-aggregation") < keys("downlink")
        if "selection" in expected:
            assert keys("secure-aggregation") < keys("selection")
        if "dp" in expected:
            assert keys("dp") > keys("secure-aggregation")  # DP noises the unmasked sum


@pytest.mark.parametrize("case", ["dp", "secure", "fedavg-lattice-ema"])
def test_a_shuffled_registration_moves_the_same_bytes_and_trains_the_same_model(tmp_path, monkeypatch, case) -> None:
    """The recorded behaviour (``behaviour.json``) holds with the layers registered backwards."""
    expected = recorded_here()[case]
    assert case in CASES
    shuffled = list(reversed(LAYERS))
    random.Random(case).shuffle(shuffled)
    monkeypatch.setattr("fedge.server.engine.layers.LAYERS", shuffled)
    got = fingerprint(case, tmp_path / "run")
    assert got == expected


class _Chooser(Layer):
    key = "test-chooser"
    provides = frozenset({SAMPLE})

    @classmethod
    def build(cls, algorithm: Any, run_dir: Any = None) -> Layer:
        return cls()


class _NeedsSum(Layer):
    key = "test-needs-sum"
    provides = frozenset({"test-facet"})
    needs = frozenset({SUM})

    @classmethod
    def build(cls, algorithm: Any, run_dir: Any = None) -> Layer:
        return cls()


class _Circular(Layer):
    key = "test-circular"
    provides = frozenset({SUM})
    needs = frozenset({"test-facet"})

    @classmethod
    def build(cls, algorithm: Any, run_dir: Any = None) -> Layer:
        return cls()


def test_two_layers_providing_one_facet_are_refused_with_the_reason(tmp_path) -> None:
    engine = _engine(tmp_path, selection="oort")
    with pytest.raises(LayerOrderError, match="selection and test-chooser both provide the step's 'sample'"):
        order_layers([*engine.layers, _Chooser()])


def test_a_cycle_of_needs_is_refused_with_the_reason() -> None:
    with pytest.raises(LayerOrderError, match=re.escape("a cycle: test-circular needs ['test-needs-sum'], "
                                                      "test-needs-sum needs ['test-circular']")):
        order_layers([_NeedsSum(), _Circular()])


def test_a_need_nobody_provides_orders_nothing() -> None:
    """``needs`` orders a layer after the run's providers; a run without one is not refused."""
    assert [layer.key for layer in order_layers([_NeedsSum(), _Chooser()])] == ["test-chooser", "test-needs-sum"]


class _Halving(Layer):
    """A test layer that transforms the released aggregate: one class, one registration."""

    key = "test-halving"
    needs = frozenset({SUM})

    @classmethod
    def build(cls, algorithm: Any, run_dir: Any = None) -> Layer:
        return cls()

    def release(self, step: Step, partial: Partial) -> Partial:
        return partial if partial.is_empty else Partial.of_mean(partial.mean() / 2, partial.weight, partial.count,
                                                                members=partial.members)


def test_a_release_layer_added_in_tests_changes_what_the_algorithm_applies(tmp_path, monkeypatch) -> None:
    plain = _engine(tmp_path / "plain", rounds=1)
    from tests.server.in_process_grid import InProcessGrid
    from tests.server.test_engine import _start

    base = _start(plain)
    plain_model = plain.run(InProcessGrid(3), base).model
    monkeypatch.setattr("fedge.server.engine.layers.LAYERS", list(LAYERS))
    register_layer(_Halving)
    halved = _engine(tmp_path / "halved", rounds=1)
    assert "test-halving" in [layer.key for layer in halved.layers]
    halved_model = halved.run(InProcessGrid(3), base).model
    # FedAvg's plain server step moves the model by the mean update: the layer halved it
    torch.testing.assert_close(halved_model - base, (plain_model - base) / 2, rtol=1e-4, atol=1e-6)
