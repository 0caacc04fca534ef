"""SCAFFOLD (``algorithm = "scaffold"``): the device's control update and corrected steps against
the paper's rules (Karimireddy et al. 2020, Algorithm 1), the coordinator's step against lines
16-17, refusals of replies and settings, then rounds on the engine's in-process grid with the real
device handler, its control variate kept across rounds and both directions compressed."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.aggregation.scaffold import ScaffoldError, control_step, device_control, server_control
from fedge.compression import make_codec
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.trainer import train_local
from fedge.protocol import CONTROL_RECORD, PAYLOAD_KEY, UPDATE_RECORD, payload_array
from fedge.protocol.config_keys import SCAFFOLD_CONTROL_CODEC
from fedge.coordinator.tally import Tally
from fedge.server.algorithms.registry import make_algorithm
from fedge.server.engine.algorithm import Rejected, Update
from fedge.coordinator.scaffold_layer import ControlVariates
from fedge.server.engine.layers import build_layers
from fedge.server.engine.loop import make_context
from fedge.server.run.initial_model import initial_params
from fedge.server.settings import RunSettings, SettingsError
from fedge.tasks import TensorData, make_task
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 20), st.floats(0.01, 0.3), st.integers(0, 2**16))
def test_option_ii_gives_the_mean_gradient_of_the_corrected_path(steps, lr, seed) -> None:
    """Plain corrected SGD on f(y) = 0.5 |A y - b|^2: x - y = lr * sum_k (g_k + c - c_i), so option II's
    c_i - c + (x - y) / (K lr) is the mean of the gradients the device met (the paper's remark)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    x, c, ci = (torch.randn(4, generator=g, dtype=torch.float64) for _ in range(3))
    y, seen = x.clone(), []
    for _ in range(steps):
        grad = a.T @ (a @ y - b)
        seen.append(grad)
        y = y - lr * (grad + c - ci)
    new = device_control(ci, c, y - x, steps, lr)
    torch.testing.assert_close(new, torch.stack(seen).mean(0), rtol=1e-9, atol=1e-9)
    new2, change = control_step(ci, c, y - x, steps, lr)
    torch.testing.assert_close(new2, new)
    torch.testing.assert_close(change, new - ci)


def test_the_trainer_applies_the_correction_after_each_momentum_step() -> None:
    """train_local with a correction equals torch's SGD followed by p -= lr * correction, step by
    step (NIID-Bench's SCAFFOLD: the correction outside the momentum buffer)."""
    task = make_task("digits")
    torch.manual_seed(0)
    model = task.build_model()
    reference = task.build_model()
    reference.load_state_dict(model.state_dict())
    data = TensorData(torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    correction = {name: torch.full_like(p, 0.01) for name, p in model.named_parameters()}
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    train_local(model, data, task, epochs=1, lr=0.05, batch_size=16, momentum=0.9, generator=g1,
                correction=correction)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    from fedge.compression import derive_seed
    from fedge.tasks import batches

    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(g2.initial_seed(), purpose="layers"))
        for xb, yb in batches(data, 16, shuffle=True, generator=g2):
            optimizer.zero_grad()
            task.loss(reference(xb), yb).backward()
            optimizer.step()
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    p.add_(correction[name], alpha=-0.05)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="does not have"):
        train_local(model, data, task, epochs=1, lr=0.05, batch_size=16, correction={"nope": torch.zeros(1)})


def test_bad_inputs_are_refused() -> None:
    z = torch.zeros(3)
    for steps in (0, -1, 1.5, True):
        with pytest.raises(ScaffoldError):
            device_control(z, z, z, steps, 0.1)  # type: ignore[arg-type]
    with pytest.raises(ScaffoldError):
        device_control(z, z, z, 3, 0.0)
    with pytest.raises(ScaffoldError, match="shape"):
        device_control(z, torch.zeros(4), z, 3, 0.1)
    with pytest.raises(ScaffoldError):
        server_control(z, z, 0)


def _algorithm(tmp_path, codec="none", spec="scaffold", **extra):  # type: ignore[no-untyped-def]
    run = RunSettings(algorithm="scaffold", codec=codec, run_dir=str(tmp_path), **extra)
    return make_algorithm(spec, make_context(run, make_task("digits")))


def _reply(layer, node, dy, dc, control=True):  # type: ignore[no-untyped-def]
    content = RecordDict({UPDATE_RECORD: ArrayRecord({PAYLOAD_KEY: payload_array(b"")})})
    if control:
        payload = layer.codec.encode(dc) if isinstance(dc, torch.Tensor) else dc
        content[CONTROL_RECORD] = ArrayRecord({PAYLOAD_KEY: payload_array(payload)})
    metrics = {"train-loss": 0.5, "local-steps": 10}
    return Update(node, dy, 50.0 * node, metrics, b"", content)


def _sent(outgoing, layer):  # type: ignore[no-untyped-def]
    """The control variate a message carries, decoded with the codec its config names."""
    spec = outgoing.content.config_records["config"][SCAFFOLD_CONTROL_CODEC]
    assert spec == layer.spec
    payload = outgoing.content.array_records[CONTROL_RECORD][PAYLOAD_KEY].data
    return make_codec(spec).decode(payload, layer.control.numel()), len(payload)


def test_one_round_is_lines_16_and_17(tmp_path) -> None:
    """x + mean_S(dy) (unweighted, as the paper and NIID-Bench) and c + (1/N) sum_S dc_i with N the
    devices connected when the round opened (5 here, 3 sampled)."""
    algorithm = _algorithm(tmp_path)
    layer = algorithm.layers()[0]
    assert layer.spec == "none"  # an fp32 run sends its control variates in fp32
    numel, g = algorithm.ctx.numel, torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    algorithm.start(x)
    step = algorithm.open_step(1, [1, 2, 3])
    step.connected = 5
    out = algorithm.configure(step, [1, 2, 3])
    layer.outgoing(step, out)
    assert torch.equal(_sent(out[0], layer)[0], torch.zeros(numel))  # c starts at 0
    dys = [torch.randn(numel, generator=g) * 0.01 for _ in range(3)]
    dcs = [-dy / (10 * 0.1) for dy in dys]  # option II with c = 0, 10 steps at the run's lr 0.1
    for node, (dy, dc) in enumerate(zip(dys, dcs), start=1):
        update = layer.update(step, _reply(layer, node, dy, dc))
        assert update.weight == 1.0
        algorithm.absorb(step, update)
    outcome = algorithm.close(step)
    layer.close(step, outcome, Tally(0.0))
    torch.testing.assert_close(outcome.model, x + sum(dys) / 3, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.control, sum(dcs) / 5, rtol=1e-5, atol=1e-6)
    assert outcome.extra["control_norm"] == pytest.approx(float(layer.control.norm()))
    step2 = algorithm.open_step(2, [1])  # the next round's messages carry the new c
    out2 = algorithm.configure(step2, [1])
    layer.outgoing(step2, out2)
    torch.testing.assert_close(_sent(out2[0], layer)[0], layer.control)
    again = ControlVariates(bits=0)  # and a checkpoint brings it back
    again.load_state_dict(layer.state_dict())
    assert torch.equal(again.control, layer.control)
    with pytest.raises(ValueError, match="finite"):
        again.load_state_dict({"control": torch.full((3,), float("nan")), "residual": torch.zeros(3)})


def test_a_reply_without_a_valid_control_change_is_refused_before_any_sum_takes_it(tmp_path) -> None:
    algorithm = _algorithm(tmp_path, codec="qsgd:bits=4")
    layer = algorithm.layers()[0]
    numel = algorithm.ctx.numel
    step = algorithm.open_step(1, [1])
    algorithm.start(torch.zeros(numel))
    layer.outgoing(step, algorithm.configure(step, [1]))  # the step's message: c = 0, sized by its model
    dy = torch.ones(numel) * 0.01
    with pytest.raises(Rejected, match="no 'fedge.control' record"):
        layer.update(step, _reply(layer, 1, dy, None, control=False))
    with pytest.raises(Rejected, match="control change"):
        layer.update(step, _reply(layer, 1, dy, b"\x00" * 17))
    with pytest.raises(Rejected, match="control change"):
        layer.update(step, _reply(layer, 1, dy, layer.codec.encode(torch.ones(numel - 1))))
    with pytest.raises(Rejected, match="control change"):
        layer.update(step, _reply(layer, 1, dy, make_codec("none").encode(torch.ones(numel))))  # another codec
    forged = layer.codec.encode(torch.full((numel,), 1e6))  # no local steps at lr 0.1 make this from dy
    with pytest.raises(Rejected, match="more than any local steps"):
        layer.update(step, _reply(layer, 1, dy, forged))
    assert "scaffold" not in step.layers or step.layers["scaffold"]["count"] == 0


def test_the_control_goes_down_quantized_through_server_error_feedback(tmp_path) -> None:
    """A 4-bit run sends c as an 8-bit QSGD snapshot; what the devices received, summed over rounds,
    tracks the true c's sum (the residual stays bounded)."""
    algorithm = _algorithm(tmp_path, codec="qsgd:bits=4")
    layer = algorithm.layers()[0]
    numel = algorithm.ctx.numel
    assert layer.spec.startswith("qsgd:bits=8")
    layer.load_state_dict({"control": torch.randn(numel, generator=torch.Generator().manual_seed(1)),
                           "residual": torch.zeros(numel)})
    received = torch.zeros(numel)
    for number in range(1, 6):
        step = algorithm.open_step(number, [1])
        out = algorithm.configure(step, [1])
        layer.outgoing(step, out)
        value, size = _sent(out[0], layer)
        assert size < 0.3 * 4 * numel  # about a byte a coordinate against fp32's four
        received += value
    residual = 5 * layer.control - received
    assert float(residual.norm()) < 0.05 * float(layer.control.norm())


def test_settings_that_cannot_work_with_it_are_refused(tmp_path) -> None:
    for setting, match in (({"secure_aggregation": "secagg"}, "scaffold"),
                           ({"differential_privacy": "gaussian:noise=1.0"}, "scaffold")):
        with pytest.raises(SettingsError, match=match):
            build_layers(_algorithm(tmp_path / "x", **setting))
    for setting, match in (({"aggregator": "median"}, "aggregator"), ({"prox_mu": 0.1}, "prox-mu")):
        with pytest.raises(SettingsError, match=match):
            _algorithm(tmp_path / "x", **setting)
    with pytest.raises(SettingsError, match="control-bits"):
        _algorithm(tmp_path, spec="scaffold:control-bits=0")
    assert _algorithm(tmp_path, codec="qsgd:bits=4", spec="scaffold:control-bits=4").layers()[0].bits == 4
    assert make_algorithm("fedavg", make_context(RunSettings(run_dir=str(tmp_path)), make_task("digits"))).layers() == []
    with pytest.raises(ValueError, match="bits"):
        ControlVariates(bits=17)


def test_devices_keep_their_control_variates_across_rounds_and_the_model_trains(tmp_path) -> None:
    """The engine and the devices' own SCAFFOLD handler, 4-bit updates and 4-bit control changes
    both ways, label-skewed devices: three rounds."""
    engine = build_engine({"algorithm": "scaffold", "rounds": 3, "clients_per_round": 4, "local_epochs": 3,
                           "partitioning": "dirichlet:alpha=0.5", "momentum": 0.5,
                           "round_timeout": 5.0, "wait_for_nodes": 1.0, "run_dir": str(tmp_path / "run")})
    start = initial_params(make_task("digits"), 42)
    grid = InProcessGrid(4)
    result = engine.run(grid, start)
    assert [r.round for r in result.rows] == [1, 2, 3] and all(r.clients_used == 4 for r in result.rows)
    assert result.rows[-1].accuracy > result.rows[0].accuracy and result.rows[-1].accuracy > 0.5
    assert all(r.extra["control_norm"] > 0 for r in result.rows)
    for node, context in grid.contexts.items():  # every device kept its c_i, and its upload memories
        state = NodeStore(context.state, "scaffold")
        control = state.get_tensor("control")
        assert control is not None and control.numel() == len(start) and float(control.norm()) > 0, node
        assert state.child("memory").get_meta("memory.meta")["round"] == 3  # dc_i's error feedback
