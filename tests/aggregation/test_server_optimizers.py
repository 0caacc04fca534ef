import pytest
import torch

from fedge.aggregation import available_server_optimizers, make_server_optimizer


def test_fedavg_applies_the_mean_delta() -> None:
    x, d = torch.randn(10), torch.randn(10)
    assert torch.allclose(make_server_optimizer("fedavg").step(x, d), x + d)
    assert torch.allclose(make_server_optimizer("fedavg:lr=0.5").step(x, d), x + 0.5 * d)


def test_fedavgm_accumulates_momentum() -> None:
    opt = make_server_optimizer("fedavgm:lr=1.0,momentum=0.5")
    x, d = torch.zeros(3), torch.ones(3)
    x = opt.step(x, d)  # m = 1
    x = opt.step(x, d)  # m = 1.5
    assert torch.allclose(x, torch.full((3,), 2.5))


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad"])
def test_fedopt_matches_reddi_et_al(name: str) -> None:
    opt = make_server_optimizer(name)
    b1, b2, lr, tau = opt.b1, opt.b2, opt.lr, opt.tau  # type: ignore[attr-defined]
    x = torch.randn(5)
    m = torch.zeros(5)
    v = torch.zeros(5)
    for step in range(4):
        d = torch.randn(5, generator=torch.Generator().manual_seed(step))
        m = b1 * m + (1 - b1) * d
        if name == "fedadam":
            v = b2 * v + (1 - b2) * d * d
        elif name == "fedyogi":
            v = v - (1 - b2) * d * d * torch.sign(v - d * d)
        else:
            v = v + d * d
        expected = x + lr * m / (v.sqrt() + tau)
        x = opt.step(x, d)
        assert torch.allclose(x, expected, atol=1e-6)


def test_state_round_trip_resumes_identically() -> None:
    a = make_server_optimizer("fedadam:lr=0.05")
    x = torch.zeros(4)
    for _ in range(3):
        x = a.step(x, torch.randn(4))
    b = make_server_optimizer("fedadam:lr=0.05")
    b.load_state_dict(a.state_dict())
    d = torch.randn(4)
    assert torch.equal(a.step(x, d), b.step(x, d))


def test_registry_and_validation() -> None:
    assert set(available_server_optimizers()) == {"fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"}
    for bad in ["sgd", "fedavg:lr=0", "fedavgm:momentum=1.5", "fedadam:b1=-0.1", "fedavg:gamma=2"]:
        with pytest.raises(ValueError):
            make_server_optimizer(bad)
