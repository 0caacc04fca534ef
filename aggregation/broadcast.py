"""Compressed, versioned downlink: every device's copy of the model, exact and cheap to bring up to date.

The coordinator keeps a *public copy* ``x_hat`` of its model: what devices hold. ``x_hat`` lives on a
fixed lattice, ``x_hat = base + step * n``, with ``base`` the run's seeded initial model (a device
rebuilds it from the task and seed; it is shipped only when that is impossible), ``step`` one
resolution per tensor fixed at the start, and ``n`` an integer vector. Each published version
moves ``n`` by a sparse integer change ``dn``: the top ``ratio`` coordinates of ``x - x_hat`` by
magnitude, rounded to the lattice and clamped to ``bits``-bit steps. What a version does not carry
stays in ``x - x_hat`` and goes out in a later one: error feedback on the coordinator, the
DoubleSqueeze / EF21-P family (Tang et al. 2019; Gruntkowska et al. 2023), with the devices'
copies carrying the compression error and the coordinator's model staying exact (Artemis' MCM).

Because ``n`` is integer, changes compose exactly:

* a device one version behind gets that version's change;
* a device k versions behind, k within the cache of the last ``cache`` changes, gets their sum,
  one sparse message over the union of their supports (STC's "caching and synchronizing" of
  returning clients, Sattler et al. 2019, made exact);
* a device past the cache, new, or whose copy is in doubt gets a snapshot: ``n`` itself, a few
  bits per coordinate with exact escapes for the rare outliers (or only its non-zero entries, while
  most of ``n`` is still zero: a device joining early), plus the per-tensor steps;
  whichever of catch-up and snapshot is smaller is sent.

Every message names the version it brings the device to and that version's digest (BLAKE2b of the
fp32 bytes of ``x_hat``); the device checks its copy against it before training and refuses to train
on a mismatch, so no copy diverges silently. The coordinator tracks the version each device holds
(O(clients) integers); a device that fails or does not reply is forgotten and gets a snapshot.
Devices compute ``base + (step * n)`` in two separate element-wise operations, as here (no fused
multiply-add), so both sides get the same bits.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedge.compression.lattice import (
    CHANGE,
    MAX_VALUE,
    SNAPSHOT,
    change_support,
    encode_lattice,
    lattice_model,
    model_digest,
)
from fedge.compression.spec import parse_setting, parse_spec

__all__ = ["DownlinkMessage", "DownlinkSpec", "VersionedBroadcast", "lattice_model", "model_digest", "parse_downlink"]


@dataclass(frozen=True)
class DownlinkSpec:
    """``lattice[:ratio=R,bits=B,cache=K,resolution=S,warmup=N,dense=D]``.

    ``ratio``: fraction of coordinates a version may change; ``bits``: a version moves a coordinate
    by at most 2^(bits-1) - 1 lattice steps; ``cache``: versions of changes kept for catch-up;
    ``resolution``: lattice steps per RMS of a tensor's initial values (finer: more precise, larger
    snapshots); ``warmup`` and ``dense``: versions 1..N may change a fraction D instead (the first
    rounds move the model most, and copies that lag them slow the whole run)."""

    ratio: float = 0.05
    bits: int = 16
    cache: int = 64
    resolution: float = 256.0
    warmup: int = 0
    dense: float = 0.0

    @property
    def spec(self) -> str:
        head = f"lattice:ratio={self.ratio:g},bits={self.bits},cache={self.cache},resolution={self.resolution:g}"
        return head + (f",warmup={self.warmup},dense={self.dense:g}" if self.warmup else "")

    def ratio_at(self, version: int) -> float:
        """The fraction of coordinates version ``version`` may change."""
        return self.dense if 1 <= version <= self.warmup else self.ratio


def parse_downlink(spec: str) -> DownlinkSpec | None:
    """The downlink spec, or None for ``none`` (full fp32 models). Raises ValueError with the reason."""
    if spec.strip().lower() != "none" and parse_spec(spec)[0] != "lattice":
        raise ValueError(f"downlink-codec must be 'none' or 'lattice[:ratio=R,bits=B,cache=K,resolution=S]', "
                         f"got {spec!r} (uplink codecs such as qsgd do not compose exactly across versions)")
    out = parse_setting(spec, DownlinkSpec, "lattice", "downlink-codec")
    if out is None:
        return None
    if not 0 < out.ratio <= 1:
        raise ValueError(f"downlink ratio must be in (0, 1], got {out.ratio}")
    if not 2 <= out.bits <= 16:
        raise ValueError(f"downlink bits must be in 2..16, got {out.bits}")
    if not 1 <= out.cache <= 10_000:
        raise ValueError(f"downlink cache must be in 1..10000 versions, got {out.cache}")
    if not (math.isfinite(out.resolution) and 1 <= out.resolution <= 2**20):
        raise ValueError(f"downlink resolution must be in 1..2^20, got {out.resolution}")
    if out.warmup < 0 or (out.warmup > 0) != (out.dense > 0) or not 0 <= out.dense <= 1:
        raise ValueError(f"downlink warmup=N and dense=D come together (N >= 1 versions, D in (0, 1]), got "
                         f"warmup={out.warmup}, dense={out.dense}")
    return out


def lattice_steps(base: torch.Tensor, sizes: list[int], resolution: float) -> torch.Tensor:
    """One step per tensor: its initial RMS / resolution (a tensor starting at zero, such as a bias,
    uses the whole model's RMS), as float32."""
    overall = float(base.pow(2).mean().sqrt()) if base.numel() else 1.0
    overall = overall if overall > 0 else 1.0
    steps = []
    for part in torch.split(base, sizes):
        rms = float(part.pow(2).mean().sqrt()) if part.numel() else 0.0
        steps.append((rms if rms > 0 else overall) / resolution)
    return torch.tensor(steps, dtype=torch.float32)


#: what a downlink message carries: a change one version up, a catch-up of k versions from the
#: cache, or a snapshot (no copy known, or too far behind)
SENT_CURRENT, SENT_CATCH_UP, SENT_SNAPSHOT = "current", "catch-up", "snapshot"


@dataclass(frozen=True)
class DownlinkMessage:
    """What one device gets: ``payload`` (a lattice change or snapshot) and, with a snapshot, the
    per-tensor ``steps``; ``base`` only for a device that cannot rebuild the initial model."""

    payload: bytes
    kind: str  # SENT_CURRENT, SENT_CATCH_UP or SENT_SNAPSHOT
    behind: int | None  # versions behind (None: no copy known)
    steps: torch.Tensor | None = None
    base: torch.Tensor | None = None


class VersionedBroadcast:
    """The coordinator's side: the public copy, its versions, the cache, and who holds what."""

    def __init__(self, spec: DownlinkSpec, base: torch.Tensor, sizes: list[int], *, seeded: bool = True,
                 start: torch.Tensor | None = None, track_supports: bool = False) -> None:
        self.spec = spec
        #: with ``track_supports`` (a ``tcs`` uplink sends on them): node -> the coordinates its latest
        #: message moved (none after a snapshot); one message in flight per node, so its reply is from it
        self.track_supports = track_supports
        self.supports: dict[int, np.ndarray] = {}
        self._moved: dict[bytes, np.ndarray] = {}  # a message's payload -> what it moved: decoded once
        self.sizes = list(sizes)
        self.base = base.detach().to(torch.float32).clone()
        self.seeded = seeded  # False: devices cannot rebuild the base (a model file started the run)
        # version 0 is the base itself, or ``start`` on the lattice around the base (a zero base that
        # every device builds, standing for a start model they cannot): steps from its per-tensor RMS
        reference = self.base if start is None else start.detach().to(torch.float32)
        self.tensor_steps = lattice_steps(reference, self.sizes, spec.resolution)
        self.steps = torch.repeat_interleave(self.tensor_steps, torch.tensor(self.sizes))
        self.n = torch.zeros(self.base.numel(), dtype=torch.int64)
        if start is not None:
            self.n = torch.round((reference - self.base) / self.steps).clamp_(-MAX_VALUE, MAX_VALUE).to(torch.int64)
        self.public = lattice_model(self.base, self.steps, self.n)
        self.base_digest = model_digest(self.base)
        self.version = 0
        self.digest = model_digest(self.public)
        self.changes: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # v -> change v-1 -> v
        self.held: dict[int, int] = {}  # node -> version it holds
        self.needs_base: set[int] = set()
        self.has_base: set[int] = set()  # unseeded base: the nodes that replied since it was shipped to them
        self._snapshot: tuple[int, bytes] | None = None
        #: after each version: the share of the model's distance from the base that the public copy
        #: still lacks (|x - x_hat| / |x - base|; 0 at a copy that keeps up, near 1 at one that
        #: cannot follow), and how many coordinates the ``bits`` limit clamped
        self.lag = 0.0
        self.clamped = 0

    @property
    def numel(self) -> int:
        return self.base.numel()

    def publish(self, params: torch.Tensor, version: int) -> None:
        """Move the public copy towards ``params`` by one change and call the result ``version``."""
        if version <= self.version:
            raise ValueError(f"version {version} is not after the current {self.version}")
        target = params.detach().to(torch.float32)
        residual = target - self.public
        k = max(1, math.ceil(self.spec.ratio_at(version) * self.numel))
        top = torch.topk(residual.abs(), min(k, self.numel), sorted=False).indices
        limit = 2 ** (self.spec.bits - 1) - 1
        dn = torch.round(residual[top] / self.steps[top])
        self.clamped = int((dn.abs() > limit).sum())
        dn = dn.clamp_(-limit, limit).to(torch.int64)
        keep = dn != 0
        order = torch.argsort(top[keep])
        idx, dn = top[keep][order], dn[keep][order]
        self.n[idx] += dn
        self.public[idx] = lattice_model(self.base[idx], self.steps[idx], self.n[idx])
        moved = float((target - self.base).norm())
        self.lag = float((target - self.public).norm()) / moved if moved > 0 else 0.0
        self.version = version
        self.digest = model_digest(self.public)
        self.changes[version] = (idx.numpy().astype(np.int64), dn.numpy().astype(np.int64))
        while len(self.changes) > self.spec.cache:
            self.changes.popitem(last=False)
        self._snapshot = None

    def owes(self, params: torch.Tensor) -> bool:
        """Whether a version published now towards ``params`` would move the public copy: some
        coordinate is at least half a lattice step away."""
        residual = params.detach().to(torch.float32) - self.public
        return bool((torch.round(residual / self.steps) != 0).any())

    def snapshot_payload(self) -> bytes:
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, encode_lattice(SNAPSHOT, self.numel, -1, self.version, self.n.numpy()))
        return self._snapshot[1]

    def catch_up(self, held: int) -> bytes | None:
        """The change from version ``held`` to the current one, or None if the cache does not reach."""
        if held == self.version:
            return encode_lattice(CHANGE, self.numel, held, self.version, np.zeros(0), np.zeros(0))
        needed = range(held + 1, self.version + 1)
        if held < 0 or held > self.version or any(v not in self.changes for v in needed):
            return None
        if len(needed) == 1:
            idx, dn = self.changes[self.version]
        else:
            parts = [self.changes[v] for v in needed]
            all_idx = np.concatenate([p[0] for p in parts])
            all_dn = np.concatenate([p[1] for p in parts])
            idx, inverse = np.unique(all_idx, return_inverse=True)
            dn = np.zeros(idx.size, dtype=np.int64)
            np.add.at(dn, inverse, all_dn)
            nonzero = dn != 0
            idx, dn = idx[nonzero], dn[nonzero]
        return encode_lattice(CHANGE, self.numel, held, self.version, dn, idx)

    def message_for(self, node: int) -> DownlinkMessage:
        """The smallest message that brings ``node`` to the current version (and, when tracking,
        the coordinates it moves, in :attr:`supports`)."""
        message = self._message_for(node)
        if self.track_supports:
            if message.payload not in self._moved:
                if len(self._moved) > 64:
                    self._moved.clear()
                self._moved[message.payload] = change_support(message.payload, self.numel)
            self.supports[node] = self._moved[message.payload]
        return message

    def _message_for(self, node: int) -> DownlinkMessage:
        held = self.held.get(node)
        shipped = node in self.needs_base or (not self.seeded and node not in self.has_base)
        base = self.base if shipped else None
        if held is not None and base is None:
            change = self.catch_up(held)
            if change is not None and len(change) <= len(self.snapshot_payload()):
                behind = self.version - held
                return DownlinkMessage(change, SENT_CURRENT if behind <= 1 else SENT_CATCH_UP, behind)
        behind = None if held is None else self.version - held
        return DownlinkMessage(self.snapshot_payload(), SENT_SNAPSHOT, behind, steps=self.tensor_steps, base=base)

    def confirm(self, node: int, version: int) -> None:
        """``node`` replied to a message of ``version``: it holds that version's copy."""
        self.held[node] = version
        self.needs_base.discard(node)
        self.has_base.add(node)  # it built that version's copy, on the base it holds

    def forget(self, node: int, *, base: bool = False) -> None:
        """``node`` failed or did not reply: its copy is unknown (``base``: it could not rebuild the base)."""
        self.held.pop(node, None)
        if base:
            self.needs_base.add(node)
            self.has_base.discard(node)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The lattice and version (the base and steps follow from the run's seed and settings, but
        are saved so a resumed run cannot drift). Which device holds what is not saved: after a
        restart every device is sent a snapshot once (a restart is a new Flower run, whose devices
        start with empty node state)."""
        return {"spec": self.spec.spec, "version": self.version, "n": self.n.clone(), "base": self.base.clone(),
                "steps": self.tensor_steps.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("spec") != self.spec.spec:
            raise ValueError(f"checkpoint downlink {state.get('spec')!r} differs from this run's {self.spec.spec!r}")
        n, base, steps = state.get("n"), state.get("base"), state.get("steps")
        version = state.get("version")
        if not (isinstance(n, torch.Tensor) and n.dtype == torch.int64 and n.numel() == self.numel):
            raise ValueError("checkpoint downlink lattice does not match the model")
        if not (isinstance(base, torch.Tensor) and base.numel() == self.numel and bool(torch.isfinite(base).all())):
            raise ValueError("checkpoint downlink base does not match the model")
        if not (isinstance(steps, torch.Tensor) and steps.shape == self.tensor_steps.shape
                and bool(torch.isfinite(steps).all()) and bool((steps > 0).all())):
            raise ValueError("checkpoint downlink steps do not match the model")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"checkpoint downlink version must be an integer >= 0, got {version!r}")
        self.base, self.tensor_steps, self.n, self.version = base.clone(), steps.clone(), n.clone(), version
        self.steps = torch.repeat_interleave(self.tensor_steps, torch.tensor(self.sizes))
        self.public = lattice_model(self.base, self.steps, self.n)
        self.base_digest = model_digest(self.base)
        self.digest = model_digest(self.public)
        self.changes.clear()
        self.held.clear()
        self.needs_base.clear()
        self._snapshot = None
