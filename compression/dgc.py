"""Deep Gradient Compression as a client-side memory around a sampled top-k codec.

Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training", ICLR 2018, https://arxiv.org/abs/1712.01887

Per round, with ``g`` the client's update (a step, here the local model delta)::

    g <- g * min(1, clip / |g|)          local clipping (clip = 0: off)
    u <- momentum * u + g                momentum correction
    v <- v + u                           accumulation
    send top-k of v (sampled threshold), values optionally quantized
    v <- v - sent;  u[sent != 0] <- 0    momentum factor masking (v keeps any quantization error)

The kept fraction warms up over the first ``warmup`` rounds as in the paper (75%, 93.75%, 98.4%,
99.6%, ... sparsity: ratio = max(final, 0.25^round)). With ``dense=R`` the warm-up rounds keep R
each instead: a flat, longer warm-up for runs whose first rounds carry most of the change (a few
tens of rounds of several local epochs each), where the paper's schedule is at the final ratio by
round 3. On the wire a DGC update *is* a top-k payload, so the coordinator decodes it with
:meth:`DGCCodec.for_round` and needs no DGC state.

Spec: ``dgc:ratio=0.001,sample=0.01,momentum=0.9,clip=0,warmup=4[,dense=0.1],absent=keep,scope=model[+qsgd:bits=4]``
(``scope=tensor``: the top ratio of each tensor, as the paper sparsifies layer by layer);
``absent`` is what a client that skipped rounds does with its memory (:meth:`DGCMemory.age`).
"""

from __future__ import annotations

import torch

from fedge.compression.codec import Codec, as_flat_float32
from fedge.compression.errors import SpecError
from fedge.compression.sparse import TopKCodec

__all__ = ["ABSENT_POLICIES", "DGCCodec", "DGCMemory"]

ABSENT_POLICIES = ("keep", "decay", "reset-momentum", "reset")


class DGCCodec(TopKCodec):
    """The DGC schedule and memory factory; encodes like (and as) a sampled top-k codec."""

    def __init__(self, ratio: float = 0.001, sample: float = 0.01, momentum: float = 0.9,
                 clip: float = 0.0, warmup: int = 4, absent: str = "keep", scope: str = "model",
                 values: Codec | None = None, sizes: tuple[int, ...] | None = None, dense: float = 0.0) -> None:
        super().__init__(ratio=ratio, sample=sample, scope=scope, values=values, sizes=sizes)
        if not 0 <= momentum < 1:
            raise SpecError(f"dgc momentum must be in [0, 1), got {momentum}")
        if clip < 0 or warmup < 0:
            raise SpecError("dgc clip and warmup must be >= 0")
        if absent not in ABSENT_POLICIES:
            raise SpecError(f"dgc absent must be one of {', '.join(ABSENT_POLICIES)}, got {absent!r}")
        if not 0 <= dense <= 1:
            raise SpecError(f"dgc dense must be in [0, 1] (0: the paper's warm-up), got {dense}")
        self.momentum, self.clip, self.warmup, self.absent = momentum, clip, warmup, absent
        self.dense = float(dense)

    @property
    def spec(self) -> str:
        head = (f"dgc:ratio={self.ratio:g},sample={self.sample:g},momentum={self.momentum:g},"
                f"clip={self.clip:g},warmup={self.warmup}" + (f",dense={self.dense:g}" if self.dense else "")
                + (f",absent={self.absent}" if self.absent != "keep" else "")
                + (",scope=tensor" if self.scope == "tensor" else ""))
        return self._spec_with_values(head)

    def ratio_at(self, server_round: int) -> float:
        if self.warmup and 1 <= server_round <= self.warmup:
            return max(self.ratio, self.dense or 0.25**server_round)
        return self.ratio

    def for_model(self, sizes: list[int] | tuple[int, ...]) -> Codec:
        if self.scope != "tensor":
            return self
        return DGCCodec(self.ratio, self.sample, self.momentum, self.clip, self.warmup, self.absent, self.scope,
                        self.values, tuple(int(n) for n in sizes), self.dense)

    def for_round(self, server_round: int, seed: int) -> Codec:
        return self._with(ratio=self.ratio_at(server_round))

    def make_memory(self, wire: Codec, numel: int, state: dict[str, torch.Tensor] | None) -> DGCMemory:
        return DGCMemory(wire, numel, self.momentum, self.clip, state, absent=self.absent)


class DGCMemory:
    """Momentum ``u`` and accumulation ``v`` of one client, persisted between rounds by the caller."""

    def __init__(self, wire: Codec, numel: int, momentum: float, clip: float,
                 state: dict[str, torch.Tensor] | None = None, absent: str = "keep") -> None:
        state = state or {}
        self.codec, self.numel, self.momentum, self.clip, self.absent = wire, numel, momentum, clip, absent
        self.u = as_flat_float32(state["u"]) if "u" in state else torch.zeros(numel)
        self.v = as_flat_float32(state["v"]) if "v" in state else torch.zeros(numel)
        if self.u.numel() != numel or self.v.numel() != numel:
            raise ValueError(f"DGC state does not have {numel} elements")

    @property
    def residual(self) -> torch.Tensor:
        """What has been accumulated but not sent (the analogue of the error-feedback residual)."""
        return self.v

    def age(self, rounds: int) -> None:
        """The client last sent ``rounds`` rounds ago (1: the previous round). Partial participation
        leaves a client's momentum and accumulation from a model many rounds old; the policy says
        what becomes of them: ``keep`` (the paper, all clients every step), ``decay`` (momentum as if
        the missed rounds had brought zero updates: u *= m^(rounds-1)), ``reset-momentum`` (u = 0
        after any absence) or ``reset`` (u = v = 0 after any absence)."""
        if rounds <= 1 or self.absent == "keep":
            return
        if self.absent == "decay":
            self.u.mul_(self.momentum ** (rounds - 1))
        else:
            self.u.zero_()
            if self.absent == "reset":
                self.v.zero_()

    def encode(self, update: torch.Tensor, generator: torch.Generator | None = None) -> bytes:
        g = as_flat_float32(update)
        if self.clip > 0:
            norm = float(g.norm())
            if norm > self.clip:
                g = g * (self.clip / norm)
        self.u.mul_(self.momentum).add_(g)
        self.v.add_(self.u)
        payload = self.codec.encode(self.v, generator)
        sent = self.codec.decode(payload, self.numel)
        self.v.sub_(sent)
        self.u[sent != 0] = 0.0
        return payload

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"u": self.u, "v": self.v}
