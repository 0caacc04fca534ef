"""FedNova (``algorithm = "fednova"``: FedAvg with ``fedge.coordinator.fednova_layer``): the step norm
against torch's own momentum SGD, the coordinator's update against the paper's rule, FedAvg when
every device takes the same steps, and refusals; then a few rounds on the engine's in-process grid
with the real device handler. The same layer in a Flower app: ``tests/flower/test_fednova_layer.py``."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict
from hypothesis import given
from hypothesis import strategies as st

from fedge.aggregation.fednova import FedNovaError, step_norm
from fedge.server.algorithms.registry import make_algorithm
from fedge.server.engine.algorithm import Rejected, Update
from fedge.server.engine.layers import build_layers
from fedge.server.engine.loop import make_context
from fedge.server.run.initial_model import initial_params
from fedge.server.settings import RunSettings, SettingsError
from fedge.tasks import make_task
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid


@given(st.integers(1, 60), st.sampled_from([0.0, 0.5, 0.9]), st.floats(0.01, 0.5))
def test_the_step_norm_is_how_far_torchs_momentum_sgd_moves_per_unit_gradient(steps, momentum, lr) -> None:
    """A constant gradient g: ``steps`` steps of torch.optim.SGD (buffer fresh, as each round's
    optimizer is) move the parameter by lr * a * g, with a the step norm."""
    x = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([x], lr=lr, momentum=momentum)
    for _ in range(steps):
        optimizer.zero_grad()
        (2.0 * x).sum().backward()  # gradient 2 everywhere
        optimizer.step()
    assert float(-x.detach()) == pytest.approx(lr * step_norm(steps, momentum) * 2.0, rel=1e-4)


def test_bad_step_counts_and_momenta_are_refused() -> None:
    for bad in (0, -3, 1.5, float("nan"), True, "7", 10**9):
        with pytest.raises(FedNovaError):
            step_norm(bad)  # type: ignore[arg-type]
    with pytest.raises(FedNovaError, match="momentum"):
        step_norm(3, 1.0)


def _algorithm(tmp_path, **settings):  # type: ignore[no-untyped-def]
    run = RunSettings(algorithm="fednova", codec="none", run_dir=str(tmp_path), **settings)
    return make_algorithm("fednova", make_context(run, make_task("digits")))


def _close(algorithm, params, updates, layer=None):  # type: ignore[no-untyped-def]
    """One step of ``algorithm`` over ``updates`` (node, vector, weight, steps), through ``layer`` as
    the engine passes them (each update, then the step's aggregate); FedNova's is built from the run."""
    layer = layer if layer is not None else next(iter(algorithm.layers()), None)
    algorithm.start(params)
    step = algorithm.open_step(1, [u[0] for u in updates])
    for node, vector, weight, steps in updates:
        update = Update(node, vector, weight, {"local-steps": steps, "train-loss": 0.5}, b"", RecordDict())
        algorithm.absorb(step, layer.update(step, update) if layer is not None else update)
    if layer is not None:
        step.released = layer.release(step, step.aggregate.partial())
    return algorithm.close(step).model


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_round_is_the_papers_rule(tmp_path, momentum) -> None:
    """x + tau_eff * sum_i p_i d_i / a_i, p_i = n_i / n, tau_eff = sum_i p_i a_i (Wang et al. 2020, eq. 6)."""
    algorithm = _algorithm(tmp_path, momentum=momentum)
    numel, g = algorithm.ctx.numel, torch.Generator().manual_seed(0)
    params = torch.randn(numel, generator=g)
    updates = [(n, torch.randn(numel, generator=g) * 0.01, float(w), s)
               for n, w, s in ((1, 40, 5), (2, 100, 30), (3, 10, 2))]
    got = _close(algorithm, params, updates)
    n = sum(u[2] for u in updates)
    norms = [step_norm(u[3], momentum) for u in updates]
    tau_eff = sum(u[2] / n * a for u, a in zip(updates, norms))
    want = params + tau_eff * sum(u[2] / n * u[1] / a for u, a in zip(updates, norms))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_with_equal_steps_it_is_fedavg(tmp_path) -> None:
    numel = _algorithm(tmp_path).ctx.numel
    g = torch.Generator().manual_seed(1)
    params = torch.randn(numel, generator=g)
    updates = [(n, torch.randn(numel, generator=g) * 0.01, float(w), 12) for n, w in ((1, 30), (2, 70), (3, 50))]
    nova = _close(_algorithm(tmp_path / "nova"), params, updates)
    fedavg = make_algorithm("fedavg", make_context(RunSettings(codec="none", run_dir=str(tmp_path / "avg")),
                                                    make_task("digits")))
    assert fedavg.layers() == []  # the layer is FedNova's alone
    avg = _close(fedavg, params, updates)
    torch.testing.assert_close(nova, avg, rtol=1e-5, atol=1e-7)


def test_a_reply_without_its_steps_is_rejected_and_sum_only_layers_are_refused(tmp_path) -> None:
    algorithm = _algorithm(tmp_path)
    layer = algorithm.layers()[0]
    step = algorithm.open_step(1, [1])
    with pytest.raises(Rejected, match="local-steps"):
        layer.update(step, Update(1, torch.zeros(algorithm.ctx.numel), 1.0, {"train-loss": 0.1}, b"", RecordDict()))
    for setting in ({"aggregator": "median"}, {"secure_aggregation": "secagg"},
                    {"differential_privacy": "gaussian:noise=1.0"}):
        with pytest.raises(SettingsError, match="fednova"):
            build_layers(_algorithm(tmp_path / "x", **setting))
    with pytest.raises(SettingsError, match="prox-mu"):
        _algorithm(tmp_path / "y", prox_mu=0.1)


def test_devices_that_train_unequally_long_still_train_the_model(tmp_path) -> None:
    """The engine, the devices' own FedAvg handler (which reports its steps) and 4-bit updates:
    a quantity-skewed split (unequal step counts) over three rounds."""
    engine = build_engine({"algorithm": "fednova", "rounds": 3, "clients_per_round": 4, "local_epochs": 3,
                           "partitioning": "quantity:beta=1", "momentum": 0.5, "round_timeout": 5.0,
                           "wait_for_nodes": 1.0, "run_dir": str(tmp_path / "run")})
    start = initial_params(make_task("digits"), 42)
    result = engine.run(InProcessGrid(4), start)
    assert [r.round for r in result.rows] == [1, 2, 3] and all(r.clients_used == 4 for r in result.rows)
    assert result.rows[-1].accuracy > result.rows[0].accuracy and result.rows[-1].accuracy > 0.5
