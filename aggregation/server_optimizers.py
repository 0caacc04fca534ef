"""Server optimizers: how the coordinator turns the mean client delta into a new global model.

The clients' weighted mean ``delta = sum_k (n_k/n)(x_k - x)`` is treated as a pseudo-gradient step:

* ``fedavg:lr=1.0`` - x <- x + lr * delta (McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629)
* ``fedavgm:lr=1.0,momentum=0.9`` - m <- momentum*m + delta; x <- x + lr*m
  (Hsu, Qi, Brown 2019, https://arxiv.org/abs/1909.06335)
* ``fedadam``, ``fedyogi``, ``fedadagrad`` - adaptive FedOpt (Reddi et al., ICLR 2021,
  https://arxiv.org/abs/2003.00295): m <- b1*m + (1-b1)*delta, then
  Adam v <- b2*v + (1-b2)*delta^2, Yogi v <- v - (1-b2)*delta^2*sign(v - delta^2), Adagrad v <- v + delta^2,
  and x <- x + lr * m / (sqrt(v) + tau). Defaults follow Flower's strategies of the same names.

State (momentum buffers) is exposed through ``state_dict`` so the coordinator's checkpoint restores
it exactly on resume.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from fedge.compression.spec import build_from_spec

__all__ = [
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedYogi",
    "ServerOptimizer",
    "available_server_optimizers",
    "make_server_optimizer",
]


class ServerOptimizer(ABC):
    """Apply a mean client delta to flat global parameters."""

    spec: str

    @abstractmethod
    def step(self, params: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Return the new flat parameters (``params`` is not modified)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{self.spec} keeps no state, got keys {sorted(state)}")


class FedAvg(ServerOptimizer):
    def __init__(self, lr: float = 1.0) -> None:
        _positive(lr=lr)
        self.lr = lr
        self.spec = f"fedavg:lr={lr}"

    def step(self, params: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return params + self.lr * delta


class _Stateful(ServerOptimizer):
    _keys: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._state: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        if key not in self._state:
            self._state[key] = torch.zeros_like(like)
        return self._state[key]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        unknown = set(state) - set(self._keys)
        if unknown:
            raise ValueError(f"{self.spec} does not know state keys {sorted(unknown)}")
        self._state = {k: v.clone().to(torch.float32) for k, v in state.items()}


class FedAvgM(_Stateful):
    _keys = ("momentum",)

    def __init__(self, lr: float = 1.0, momentum: float = 0.9) -> None:
        super().__init__()
        _positive(lr=lr)
        _unit(momentum=momentum)
        self.lr, self.momentum = lr, momentum
        self.spec = f"fedavgm:lr={lr},momentum={momentum}"

    def step(self, params: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        m = self._buffer("momentum", delta)
        m.mul_(self.momentum).add_(delta)
        return params + self.lr * m


class _FedOpt(_Stateful):
    _keys = ("m", "v")
    _name = ""

    def __init__(self, lr: float, b1: float, b2: float, tau: float) -> None:
        super().__init__()
        _positive(lr=lr, tau=tau)
        _unit(b1=b1, b2=b2)
        self.lr, self.b1, self.b2, self.tau = lr, b1, b2, tau
        self.spec = f"{self._name}:lr={lr},b1={b1},b2={b2},tau={tau}"

    @abstractmethod
    def _second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None: ...

    def step(self, params: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        m = self._buffer("m", delta)
        v = self._buffer("v", delta)
        m.mul_(self.b1).add_(delta, alpha=1 - self.b1)
        self._second_moment(v, delta * delta)
        return params + self.lr * m / (v.sqrt() + self.tau)


class FedAdam(_FedOpt):
    _name = "fedadam"

    def __init__(self, lr: float = 0.1, b1: float = 0.9, b2: float = 0.99, tau: float = 1e-9) -> None:
        super().__init__(lr, b1, b2, tau)

    def _second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.mul_(self.b2).add_(delta_sq, alpha=1 - self.b2)


class FedYogi(_FedOpt):
    _name = "fedyogi"

    def __init__(self, lr: float = 0.01, b1: float = 0.9, b2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__(lr, b1, b2, tau)

    def _second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.sub_((1 - self.b2) * delta_sq * torch.sign(v - delta_sq))


class FedAdagrad(_FedOpt):
    _name = "fedadagrad"

    def __init__(self, lr: float = 0.1, b1: float = 0.0, b2: float = 0.0, tau: float = 1e-9) -> None:
        super().__init__(lr, b1, b2, tau)

    def _second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.add_(delta_sq)


_REGISTRY: dict[str, Callable[..., ServerOptimizer]] = {
    "fedavg": FedAvg,
    "fedavgm": FedAvgM,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
}


def available_server_optimizers() -> list[str]:
    return sorted(_REGISTRY)


def make_server_optimizer(spec: str) -> ServerOptimizer:
    """Build a server optimizer from its spec, e.g. ``fedadam:lr=0.05``."""
    opt = build_from_spec(spec, _REGISTRY, family="server optimizer")
    assert isinstance(opt, ServerOptimizer)
    return opt


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _unit(**values: float) -> None:
    for name, value in values.items():
        if not 0 <= value < 1:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
