"""Central DP checked by means that share nothing with the product (Privacy II, "tests that could
catch a wrong implementation"):

- epsilon from the closed-form RDP of the Poisson-subsampled Gaussian at integer orders (Mironov,
  Talwar and Zhang 2019, section 3.3), written here from the paper, against the product's ledger
  (which goes through ``dp-accounting``);
- the noise's standard deviation z C / (q N), the Poisson sampling rate and its independence,
  tested statistically with the false-alarm rate stated in each test;
- uniform weights, end to end: a device claiming 1,000 times more examples moves nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedge.privacy.accountant import PrivacyLedger
from fedge.privacy.dp_spec import parse_differential_privacy

#: every statistical test here rejects a correct implementation with probability at most this
FALSE_ALARM = 1e-6


def _log_binom(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def sampled_gaussian_rdp(q: float, z: float, alpha: int) -> float:
    """RDP of order ``alpha`` (an integer >= 2) of one Poisson-subsampled Gaussian with rate q and
    noise multiplier z: log(A_alpha) / (alpha - 1), with
    A_alpha = sum_k C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 z^2))
    (Mironov, Talwar, Zhang 2019, eq. for integer alpha), summed in log space."""
    if q == 1.0:
        return alpha / (2 * z * z)
    terms = [_log_binom(alpha, k) + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * z * z)
             for k in range(alpha + 1)]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)


def epsilon_from_rdp(rounds: int, q: float, z: float, delta: float, *, tight: bool) -> float:
    """(epsilon, delta) after ``rounds`` compositions, minimised over integer orders 2..512.
    ``tight``: the conversion of Canonne, Kamath and Steinke 2020 (Prop. 12), which dp-accounting
    uses; else Mironov 2017's original epsilon = rdp + log(1/delta) / (alpha - 1), which is looser."""
    best = math.inf
    for alpha in range(2, 513):
        rdp = rounds * sampled_gaussian_rdp(q, z, alpha)
        if tight:
            eps = rdp + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        else:
            eps = rdp - math.log(delta) / (alpha - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize("q, z, rounds, delta", [
    (0.1, 1.0, 200, 1e-5),      # docs/privacy.md's anchor: 1,000 devices, 100 per round
    (0.2, 0.8, 100, 1e-5),      # the audit's H1 example, at the multiplier the ledger records
    (0.5, 1.0, 3, 1e-5),        # the in-process tests' setting
    (0.01, 1.1, 5000, 1e-5),
    (1.0, 5.0, 100, 1e-5),      # no sampling: the plain Gaussian
])
def test_epsilon_matches_the_closed_form_rdp_of_the_sampled_gaussian(q, z, rounds, delta) -> None:
    """The product minimises over more orders (fractional ones too), so its epsilon may only be
    lower than the integer-order closed form under the same conversion, and not by much (3%); it
    is always below the looser classic conversion. A ledger that recorded the wrong q or z, or
    dropped rounds, misses these bounds by far more (checked below)."""
    product = PrivacyLedger(delta, [(q, z)] * rounds).epsilon_rdp()
    ours = epsilon_from_rdp(rounds, q, z, delta, tight=True)
    assert ours * 0.97 <= product <= ours * (1 + 1e-9), (product, ours)
    assert product < epsilon_from_rdp(rounds, q, z, delta, tight=False)
    # the closed form is sensitive enough to catch the audit's H1 (z 0.66 instead of 0.8)
    if (q, z, rounds) == (0.2, 0.8, 100):
        assert epsilon_from_rdp(rounds, q, 0.66, delta, tight=True) > 1.3 * product


def test_the_closed_form_reproduces_the_papers_limits() -> None:
    """Sanity of the test's own implementation: q = 1 is the Gaussian's alpha / (2 z^2) exactly,
    and for small q the order-2 RDP is log(1 + q^2 (e^(1/z^2) - 1)) (the k <= 2 terms)."""
    assert sampled_gaussian_rdp(1.0, 2.0, 8) == pytest.approx(8 / 8)
    assert sampled_gaussian_rdp(0.999999, 2.0, 8) == pytest.approx(1.0, rel=1e-4)
    q, z = 0.01, 1.5
    assert sampled_gaussian_rdp(q, z, 2) == pytest.approx(math.log1p(q * q * (math.exp(1 / z**2) - 1)), rel=1e-12)


def _central(spec: str = "gaussian:noise=1.3,clip=0.7,delta=1e-5"):  # type: ignore[no-untyped-def]
    from fedge.coordinator.dp_mechanisms import Central

    return Central(parse_differential_privacy(spec), clients_per_round=1)


def test_the_noise_standard_deviation_is_z_c_over_q_n() -> None:
    """The released mean of an all-zero sum is pure noise: its standard deviation must be
    z C / (q N). 400,000 draws; the chi-square interval for the variance is two-sided at
    FALSE_ALARM, so a correct implementation fails once in a million runs, while a factor of
    1/q N missing, or the clip left out, is off by far more than the interval's +-1.2%."""
    dp = _central()
    connected, per_round = 50, 10
    dp.sample_at(list(range(connected)), per_round / connected)  # q = 0.2
    n = 400_000
    released = dp.noisy_mean(torch.zeros(n), connected).double().numpy()
    sigma = 1.3 * 0.7 / (0.2 * connected)
    statistic = (n - 1) * released.var(ddof=1) / sigma**2
    low, high = stats.chi2.ppf([FALSE_ALARM / 2, 1 - FALSE_ALARM / 2], n - 1)
    assert low < statistic < high, (released.std(), sigma)
    # centred (two-sided z-test on the mean) and fresh on every call
    assert abs(released.mean()) < stats.norm.ppf(1 - FALSE_ALARM / 2) * sigma / math.sqrt(n)
    again = dp.noisy_mean(torch.zeros(n), connected).double().numpy()
    assert abs(np.corrcoef(released, again)[0, 1]) < stats.norm.ppf(1 - FALSE_ALARM / 2) / math.sqrt(n)


def test_poisson_sampling_has_the_accounted_rate_and_draws_each_device_independently() -> None:
    """1,000 devices, 100 per round (q = 0.1), 400 rounds. Poisson sampling, as the accountant
    assumes: the total number of inclusions is Binomial(400,000, 0.1); the round sizes vary with
    variance N q (1 - q) = 90 (a fixed-size sample would have none); every device is included
    equally often (chi-square over devices). Each check is two-sided at FALSE_ALARM."""
    dp = _central()
    nodes = list(range(1000))
    sizes, counts = [], np.zeros(1000)
    for _ in range(400):
        chosen = dp.sample_at(nodes, 100 / len(nodes))
        sizes.append(len(chosen))
        counts[chosen] += 1
    assert dp.rate == 0.1
    total = int(counts.sum())
    assert stats.binomtest(total, 400 * 1000, 0.1).pvalue > FALSE_ALARM
    variance_statistic = (len(sizes) - 1) * np.var(sizes, ddof=1) / 90.0
    low, high = stats.chi2.ppf([FALSE_ALARM / 2, 1 - FALSE_ALARM / 2], len(sizes) - 1)
    assert low < variance_statistic < high, np.var(sizes, ddof=1)
    # inclusion counts per device ~ Binomial(400, 0.1): dispersion test (sum of squared z-scores)
    dispersion = ((counts - 40.0) ** 2 / (400 * 0.1 * 0.9)).sum()
    low, high = stats.chi2.ppf([FALSE_ALARM / 2, 1 - FALSE_ALARM / 2], 1000 - 1)
    assert low < dispersion < high


def test_every_device_weighs_the_same_whatever_example_count_it_claims(tmp_path, monkeypatch) -> None:
    """End to end through the engine, with the noise set to zero and every device sampled (q = 1):
    a run where the devices claim wildly different example counts (1 and 1,000) releases the same
    model as one where they claim their real ones, since DP-FedAvg weighs each device 1. The same
    two runs without DP differ (the weighted mean), so the check can fail."""
    from flwr.app import Context, Message

    from fedge.edge_client.app import app as fedge_app
    from fedge.protocol import METRICS_RECORD
    from fedge.server.run.initial_model import initial_params
    from fedge.tasks import make_task
    from tests.server.engines import build_engine
    from tests.server.in_process_grid import InProcessGrid

    class Zeros:
        def normal(self, loc, scale, size=None):  # type: ignore[no-untyped-def]
            return np.zeros(size if size is not None else ())

    def claiming(msg: Message, context: Context) -> Message:
        reply = fedge_app(msg, context)
        record = reply.content.metric_records.get(METRICS_RECORD) if reply.has_content() else None
        if record is not None and "num-examples" in record:
            record["num-examples"] = 1000 if int(context.node_config["partition-id"]) % 2 else 1
        return reply

    def model(tmp, app, dp: bool) -> torch.Tensor:  # type: ignore[no-untyped-def]
        values = dict(rounds=1, clients_per_round=4, local_epochs=1, round_timeout=5.0, wait_for_nodes=1.0,
                      run_dir=str(tmp), seed=3, weight_cap="none")  # claims count in full without DP
        if dp:
            values["differential_privacy"] = "gaussian:noise=1.0,clip=10.0,delta=1e-5"
        engine = build_engine(values)
        if dp:
            engine.layer("dp").mechanism._rng = Zeros()
        return engine.run(InProcessGrid(4, app=app), initial_params(make_task("digits"), 42)).model

    honest = model(tmp_path / "a", fedge_app, True)
    lying = model(tmp_path / "b", claiming, True)
    assert torch.allclose(honest, lying, atol=1e-6)
    assert not torch.allclose(model(tmp_path / "c", fedge_app, False), model(tmp_path / "d", claiming, False), atol=1e-4)


def test_a_device_that_joins_does_not_move_anyones_sampling_rate(tmp_path) -> None:
    """Privacy audit 3, F5: q used to be clients-per-round over the devices connected each round,
    so a device that joined lowered every other device's inclusion probability, and epsilon was
    accounted at a q that depended on who was there. Now the run fixes q at its first private
    round (2 of 20: q = 0.1, z = 2) and keeps it when a 21st device joins: every round samples at
    0.1, and the reported epsilon is the closed form's at q = 0.1 for the rounds run, the worst
    case for any device whoever else joins (each is in with probability 0.1, independently)."""
    from flwr.app import Context, RecordDict

    from fedge.server.run.initial_model import initial_params
    from fedge.tasks import make_task
    from tests.server.engines import build_engine
    from tests.server.in_process_grid import InProcessGrid

    engine = build_engine(dict(rounds=3, clients_per_round=2, local_epochs=1, round_timeout=5.0, wait_for_nodes=1.0,
                               run_dir=str(tmp_path), seed=3, weight_cap="none",
                               differential_privacy="gaussian:noise=2.0,clip=1.0,delta=1e-5"))
    grid = InProcessGrid(20)
    publish = engine.publish

    def a_device_joins(grid_, closed, result):  # type: ignore[no-untyped-def]
        publish(grid_, closed, result)
        if len(grid.contexts) == 20:  # after the first round, a 21st device connects
            grid.contexts[2001] = Context(run_id=1, node_id=2001, node_config={"partition-id": 20,
                                                                                "num-partitions": 21},
                                          state=RecordDict(), run_config={})

    engine.publish = a_device_joins  # type: ignore[method-assign]
    rows = engine.run(grid, initial_params(make_task("digits"), 42)).rows
    assert len(grid.contexts) == 21
    assert [row.extra["dp_sampling_rate"] for row in rows] == [0.1, 0.1, 0.1]
    reported = rows[-1].extra["dp_epsilon_rdp"]
    ours = epsilon_from_rdp(3, 0.1, 2.0, 1e-5, tight=True)
    assert ours * 0.97 <= reported <= ours * (1 + 1e-9), (reported, ours)
