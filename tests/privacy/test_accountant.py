"""The privacy ledger against an independent dp-accounting computation, and its checkpoint state."""

from __future__ import annotations

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from fedge.privacy.accountant import PrivacyLedger
from fedge.privacy.dp_spec import parse_differential_privacy


def _independent(q: float, z: float, rounds: int, delta: float) -> tuple[float, float]:
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    r, p = rdp.RdpAccountant(), pld.PLDAccountant()  # dp-accounting's default grid, 10x finer than the ledger's
    r.compose(event)
    p.compose(event)
    return r.get_epsilon(delta), p.get_epsilon(delta)


@pytest.mark.parametrize("q, z, rounds, delta", [(0.1, 1.0, 200, 1e-5), (100 / 3400, 1.0, 300, 1.3e-4), (1.0, 5.0, 100, 1e-5)])
def test_epsilon_matches_an_independent_dp_accounting_computation(q, z, rounds, delta) -> None:
    ledger = PrivacyLedger(delta, [(q, z)] * rounds)
    expected_rdp, expected_pld = _independent(q, z, rounds, delta)
    assert ledger.epsilon_rdp() == pytest.approx(expected_rdp, rel=1e-9)
    # the ledger's coarser grid rounds pessimistically: never below the fine grid's figure, and close to it
    assert expected_pld <= ledger.epsilon_pld() <= expected_pld * (1 + 1e-4)
    assert ledger.epsilon_pld() <= ledger.epsilon_rdp()  # PLD is the tighter one


def test_the_field_notes_anchor() -> None:
    """PRIVACY.md's computed figure: N = 1,000, 100 per round, z = 1, 200 rounds, delta = 1e-5."""
    ledger = PrivacyLedger(1e-5, [(0.1, 1.0)] * 200)
    assert round(ledger.epsilon_rdp(), 1) == 11.1 and round(ledger.epsilon_pld(), 2) == 9.97


def test_budgeting_and_state() -> None:
    ledger = PrivacyLedger(1e-5, [(0.1, 1.0)] * 10)
    spent = ledger.epsilon_rdp()
    assert ledger.would_exceed(spent * 0.99, 0.1, 1.0) and not ledger.would_exceed(spent * 2, 0.1, 1.0)
    assert not ledger.would_exceed(0.0, 0.1, 1.0)  # 0: no budget
    again = PrivacyLedger.from_state(ledger.state_dict())
    assert again.rounds == ledger.rounds and again.epsilon_pld() == ledger.epsilon_pld()
    with pytest.raises(ValueError, match="malformed"):
        PrivacyLedger.from_state({"delta": 1e-5, "rounds": [[0.1]]})
    with pytest.raises(ValueError):
        ledger.record(0.0, 1.0)


def test_the_setting_is_checked() -> None:
    assert parse_differential_privacy("none") is None
    spec = parse_differential_privacy("gaussian:noise=0.8,clip=0.5,budget=8")
    assert (spec.noise, spec.clip, spec.delta, spec.budget) == (0.8, 0.5, 1e-5, 8.0)
    for bad in ("laplace", "gaussian:noise=0", "gaussian:noise=0.01", "gaussian:delta=1", "gaussian:sigma=1",
                "gaussian:clip=x", "gaussian:adaptive=maybe", "gaussian:quantile=1.5"):
        with pytest.raises(ValueError):
            parse_differential_privacy(bad)
