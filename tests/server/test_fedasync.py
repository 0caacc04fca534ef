"""FedAsync: the mixing rule against its definition on hand-made updates, and through the engine's
asynchronous loop on the in-process Grid stand-in (real ClientApp handlers)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import MetricRecord, RecordDict

from fedge.compression import make_codec
from fedge.protocol import METRICS_RECORD, UPDATE_RECORD, payload_record
from fedge.server.engine.algorithm import Rejected, Reply
from fedge.server.algorithms.registry import check_algorithm_settings
from fedge.server.settings import RunSettings, SettingsError
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import _engine, _start


def _reply(engine, node: int, update: torch.Tensor, started: int) -> Reply:
    codec = make_codec("none").for_round(started + 1, engine.settings.seed)
    content = RecordDict({UPDATE_RECORD: payload_record(codec.encode(update)),
                          METRICS_RECORD: MetricRecord({"num-examples": 10, "train-loss": 1.0})})
    return Reply(node, content, started=started)


def test_mixing_rule_with_stale_updates_matches_the_definition(tmp_path) -> None:
    """x ← (1 − α_t)x + α_t(x_v + Δ), α_t = α(1+τ)^−a, x_v the version the client started from."""
    engine = _engine(tmp_path, codec="none", algorithm="fedasync:alpha=0.5,concurrency=2,a=0.5")
    alg = engine.algorithm
    x0 = torch.linspace(-1, 1, engine.ctx.numel)
    alg.start(x0.clone())
    step = alg.open_step(1, [])
    alg.configure(step, [1, 2])  # both start from version 0
    d1, d2 = torch.full_like(x0, 0.2), torch.full_like(x0, -0.4)

    engine.absorb_reply(step, _reply(engine, 1, d1, started=0))  # fresh: τ = 0
    assert alg.ready(step)
    out = alg.close(step)
    x1 = 0.5 * x0 + 0.5 * (x0 + d1)
    torch.testing.assert_close(out.model, x1)
    assert out.extra["alpha_t"] == 0.5 and out.extra["staleness_max"] == 0

    step = alg.open_step(2, [])
    alg.configure(step, [1])  # node 1 starts again, from version 1
    engine.absorb_reply(step, _reply(engine, 2, d2, started=0))  # node 2 answers one version late: τ = 1
    out = alg.close(step)
    alpha_t = 0.5 * 2 ** -0.5
    torch.testing.assert_close(out.model, (1 - alpha_t) * x1 + alpha_t * (x0 + d2))
    assert out.extra["alpha_t"] == pytest.approx(alpha_t) and out.extra["staleness_max"] == 1
    # version 0 is no longer anyone's start: only version 1 (node 1's) is held
    assert out.extra["versions_held"] == 1 and set(alg.versions.models) == {1}


def test_replies_to_unknown_versions_and_too_stale_ones_are_rejected(tmp_path) -> None:
    engine = _engine(tmp_path, codec="none", algorithm="fedasync:concurrency=2,max-staleness=0")
    alg = engine.algorithm
    alg.start(torch.zeros(engine.ctx.numel))
    step = alg.open_step(1, [])
    alg.configure(step, [1, 2])
    engine.absorb_reply(step, _reply(engine, 1, torch.ones(engine.ctx.numel), started=0))
    alg.close(step)
    step = alg.open_step(2, [])
    with pytest.raises(Rejected, match="max-staleness 0"):
        engine.absorb_reply(step, _reply(engine, 2, torch.ones(engine.ctx.numel), started=0))
    with pytest.raises(Rejected, match="never sent"):
        engine.absorb_reply(step, _reply(engine, 3, torch.ones(engine.ctx.numel), started=1))


def test_fedasync_with_one_client_at_a_time_is_fedbuff_with_buffer_one_and_server_lr_alpha(tmp_path) -> None:
    """With no staleness, x + α(x + Δ − x) = x + αΔ: FedBuff(K = 1) with a server learning rate α.

    fp32 updates: the two sides round differently in the last bit ((1 − α)x + α(x + Δ) against
    x + αΔ), and a stochastic quantizer turns such a difference into a whole quantization step
    wherever it flips a rounding (seen on an AVX-512 host: 0.002 on 1% of the weights)."""
    mixed = _engine(tmp_path / "a", rounds=4, codec="none",
                    algorithm="fedasync:alpha=0.6,concurrency=1,staleness=constant")
    got = mixed.run(InProcessGrid(3), _start(mixed))
    stepped = _engine(tmp_path / "b", rounds=4, codec="none",
                      algorithm="fedbuff:concurrency=1,buffer=1,staleness=constant", server_opt="fedavg:lr=0.6")
    expected = stepped.run(InProcessGrid(3), _start(stepped))
    assert [r.round for r in got.rows] == [1, 2, 3, 4]
    torch.testing.assert_close(got.model, expected.model, rtol=0, atol=1e-6)
    assert got.rows[-1].accuracy > got.rows[0].accuracy - 0.05


def test_a_straggler_is_mixed_in_with_its_true_staleness(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=6, algorithm="fedasync:concurrency=3")
    rows = engine.run(InProcessGrid(3, lag={2: 3}), _start(engine)).rows
    assert [r.round for r in rows] == list(range(1, 7))
    assert all(r.extra["updates_applied"] == 1 for r in rows)
    stale = [r for r in rows if r.extra["staleness_max"]]
    assert stale and all(r.extra["alpha_t"] < 0.6 for r in stale)
    assert max(r.extra["versions_held"] for r in rows) <= 3  # at most one per client in flight


def test_resume_continues_from_the_checkpointed_version(tmp_path) -> None:
    spec = "fedasync:concurrency=2"
    first = _engine(tmp_path, rounds=2, algorithm=spec)
    first.run(InProcessGrid(3), _start(first))
    more = _engine(tmp_path, rounds=4, algorithm=spec)
    result = more.run(InProcessGrid(3), _start(more))
    assert result.resumed_from == 2 and [r.round for r in result.rows] == [1, 2, 3, 4]


def test_fedasync_settings() -> None:
    check_algorithm_settings(RunSettings(algorithm="fedasync:alpha=0.9", prox_mu=0.01))  # the paper's proximal term
    for key, value in (("server_opt", "fedadam"), ("aggregator", "median")):
        with pytest.raises(SettingsError):
            check_algorithm_settings(RunSettings(algorithm="fedasync", **{key: value}))
    from fedge.server.preflight import preflight

    with pytest.raises(ValueError, match="alpha must be in"):
        preflight(RunSettings(algorithm="fedasync:alpha=1.5"))
