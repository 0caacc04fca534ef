"""Secure aggregation on the device: the protocol's exchanges (:func:`query`, which
``edge_client.secure_mod`` answers them with) and the masked update; one device side for Fedge's coordinator and ``fedge.flower.secure`` alike.

The device keeps a long-lived Ed25519 identity key. Given an identity issued by the operator (node
config ``secagg-auth-key``, ``secagg-endorsement`` and ``secagg-issuer``, which ``fedge-edge join``
sets from ``--auth-key``, its ``.endorsement`` and ``--root-cert``), it binds that identity to its
node-authentication key, checks every peer's credential against the operator's CA, runs the
consistency round, and refuses any round that would trust identities on first use. Without one,
it pins the identity keys it has seen for its peers (trust on first use: a coordinator that later
swaps a peer's identity is refused). Both live
in ``context.state`` and, on a real device (node config ``state-dir``, which ``fedge-edge join``
sets), in ``secagg-identity.key`` and ``secagg-pins.json`` there, written atomically with mode
0600: a restarted device is the same device to its peers and keeps its pins. It keeps one round's
secrets (its X25519 keys, self-mask seed, the shares it holds) between the stages' messages. The round's
secrets are dropped when it unmasks, and overwritten by the next round's advertisement.

What the device reveals about itself: its masked upload (uniform in the ring), its signed public
keys, and, per neighbour, one share. Its metrics reply carries no example count or loss (both are
about its data): ``num-examples`` is 1, the weight travels inside the masked sum.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedge.deploy.atomic import atomic_write_bytes, atomic_write_text
from fedge.deploy.certs import IDENTITY_NODE_CONFIG
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.privacy_policy import check_secure_plan
from fedge.edge_client.resources import timed
from fedge.privacy.credentials import (
    Credential,
    Issuer,
    bind_identity,
    check_distinct,
    load_issuer,
    load_node_key,
    verify_credential,
)
from fedge.privacy.distributed_dp import encode
from fedge.privacy.errors import AdvertisementError, ProtocolError
from fedge.privacy.keys import KeyAdvertisement
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.secagg_device import SecAggDevice, export_state, restore_state, state_round
from fedge.protocol.secagg import SECAGG_RECORD, pack_blobs, plan_from_record, unpack_blobs, unpack_ids

__all__ = ["identity_of", "masked_update", "query"]

log = logging.getLogger(__name__)

_IDENTITY = "fedge-identity"
_PINS = "fedge-secagg-pins"
_IDENTITY_FILE = "secagg-identity.key"
_PINS_FILE = "secagg-pins.json"
_ROUND = "fedge-secagg-round"
_SERIAL = "fedge-revocation-serial"  # the highest revocation-list serial seen (without a state directory)
_SERIAL_FILE = "revocation-serial"
_STAGES = "fedge-secagg-stages"  # the node's state: the stages answered (without a state directory)
_STAGES_DIR = "secagg-stages"  # the state directory: one marker file per answered stage
#: seconds a stage marker is kept once its round's state is gone (a day: far longer than any round)
_MARKER_AGE = 86_400.0
_RAW = serialization.Encoding.Raw
_NODE_KEY, _ENDORSEMENT, _ISSUER = IDENTITY_NODE_CONFIG


def _saved(context: Context, name: str) -> Path | None:
    """``name`` in the device's state directory, when it has one."""
    directory = context.node_config.get("state-dir")
    return Path(str(directory)) / name if directory else None


def identity_of(context: Context) -> Ed25519PrivateKey:
    """This device's identity key: from its state, else from its state directory, else made now
    (and saved there, 0600)."""
    record = context.state.config_records.get(_IDENTITY)
    if record is not None and "key" in record:
        return Ed25519PrivateKey.from_private_bytes(bytes(record["key"]))
    path = _saved(context, _IDENTITY_FILE)
    if path is not None and path.exists():
        raw = path.read_bytes()
        key = Ed25519PrivateKey.from_private_bytes(raw)  # ValueError on a damaged file: never replaced silently
    else:
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        if path is not None:
            atomic_write_bytes(path, raw, mode=0o600)
    context.state[_IDENTITY] = ConfigRecord({"key": raw})
    return key


def _claim(context: Context, plan: SecAggPlan, stage: str) -> None:
    """Answer ``stage`` of this round once. Flower starts a task per pulled message and the warm
    executor forks each, all from one saved state: a coordinator that sends two consistency (or two
    unmask) messages at once could otherwise get two survivor sets signed, or, trusting on first
    use, both kinds of a device's shares (privacy audit 2, N10). The claim is an ``O_EXCL`` marker in
    the state directory, taken before signing or revealing; a node without one keeps the markers in
    its state. Raises :class:`ProtocolError` for a stage already answered.

    Called only once the plan matched the round's saved state (:func:`_load`), so every marker names
    a round this device really took part in; markers only age out (:data:`_MARKER_AGE`), and never
    while the device holds that round's state. Pruning by round number let a message of another run
    id, or of round + 4, erase the real round's marker before its plan was checked (privacy audit 3,
    F3)."""
    run, number = plan.context.run_id.hex(), plan.context.round
    name = f"{run}-{number}-{stage}"
    refused = ProtocolError(f"stage {stage} of round {number} was answered already: a second message for it is "
                            "refused")
    now, held = time.time(), _held_round(context)
    directory = _saved(context, _STAGES_DIR)
    if directory is None:
        record = context.state.config_records.get(_STAGES, ConfigRecord())
        if name in record:
            raise refused
        kept = {k: v for k, v in record.items() if _keep(k, float(v), now, held)}  # type: ignore[arg-type]
        context.state[_STAGES] = ConfigRecord({**kept, name: now})
        return
    directory.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        raise refused from None
    for old in directory.iterdir():
        try:
            if old.name != name and not _keep(old.name, old.stat().st_mtime, now, held):
                old.unlink(missing_ok=True)
        except OSError:  # another task pruned it first
            continue


def _held_round(context: Context) -> str | None:
    """``<run id hex>-<round>`` of the secure round whose state this device holds, if any."""
    state = context.state.config_records.get(_ROUND)
    held = None if state is None else state_round(dict(state))
    return None if held is None else f"{held[0].hex()}-{held[1]}"


def _keep(marker: str, made: float, now: float, held: str | None) -> bool:
    """Whether a stage marker stays: its round's state is still held, or it is younger than
    :data:`_MARKER_AGE`."""
    return (held is not None and marker.startswith(held + "-")) or now - made < _MARKER_AGE


def _public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)


def _node_id(msg: Message, context: Context) -> int:
    return int(msg.metadata.dst_node_id) if msg.metadata.dst_node_id else int(context.node_id)


def _checked_identities(context: Context, delivered: dict[int, bytes]) -> dict[int, Ed25519PublicKey]:
    """Peers' identity keys as delivered, checked against (and added to) this device's pins."""
    pins = context.state.config_records.get(_PINS)
    path = _saved(context, _PINS_FILE)
    if pins is None and path is not None and path.exists():
        pins = ConfigRecord({node: bytes.fromhex(raw) for node, raw in json.loads(path.read_text()).items()})
    pins = pins if pins is not None else ConfigRecord()
    out = {}
    for node, raw in delivered.items():
        pinned = pins.get(str(node))
        if pinned is not None and bytes(pinned) != raw:
            raise AdvertisementError(f"device {node}'s identity key differs from the one pinned when it was "
                                     "first seen: refused (a coordinator substituting keys, or a re-installed device)")
        out[node] = _identity_key(node, raw)
        pins[str(node)] = raw
    context.state[_PINS] = pins
    if path is not None:
        atomic_write_text(path, json.dumps({node: bytes(raw).hex() for node, raw in pins.items()}), mode=0o600)
    return out


def _identity_key(node: int, raw: bytes) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as error:
        raise AdvertisementError(f"device {node}'s identity key is malformed: {error}") from None


def _issuer(context: Context) -> Issuer | None:
    """The operator's CA key when the operator issued this device its identity (node config
    ``secagg-auth-key``, ``secagg-endorsement``, ``secagg-issuer``); None: trust on first use."""
    if not all(context.node_config.get(k) for k in IDENTITY_NODE_CONFIG):
        return None
    # the highest revocation-list serial this device has seen: an older list, or none, is refused
    path = _saved(context, _SERIAL_FILE)
    record = context.state.config_records.get(_SERIAL)
    seen = int(record["serial"]) if record is not None else 0
    if path is not None and path.exists():
        try:
            seen = max(seen, int(path.read_text(encoding="utf-8").strip() or 0))
        except ValueError:
            raise ProtocolError(f"{path} is not a revocation serial: refused rather than forgotten") from None
    issuer = load_issuer(str(context.node_config[_ISSUER]), seen)
    if issuer.serial > seen:
        context.state[_SERIAL] = ConfigRecord({"serial": issuer.serial})
        if path is not None:
            atomic_write_text(path, f"{issuer.serial}\n", mode=0o600)
    return issuer


def _credential(context: Context, identity: Ed25519PrivateKey) -> bytes:
    """This device's credential: its identity bound to its node key, with the CA's endorsement
    (made once per round, at the advertisement: the node key signs)."""
    endorsement = str(context.node_config[_ENDORSEMENT])
    try:
        raw = Path(endorsement).read_bytes()
    except OSError as error:
        raise AdvertisementError(f"the identity endorsement {endorsement}: {error}") from None
    return bind_identity(load_node_key(str(context.node_config[_NODE_KEY])), raw, _public(identity))


def _check_mode(plan: SecAggPlan, issuer: Issuer | None) -> None:
    """A device issued an identity never trusts on first use; one without cannot check issued peers."""
    if plan.consistency and issuer is None:
        raise ProtocolError("this round trusts only identities issued by the operator, and this device has "
                            "none (start it with --auth-key, its .endorsement next to it, and --root-cert)")
    if not plan.consistency and issuer is not None:
        raise ProtocolError("this device's identity is issued by the operator; it does not take part in a "
                            "secure round that trusts identities on first use (the coordinator's "
                            "secure-aggregation needs issuer=<ca.crt>)")


def _credentialed(delivered: dict[int, bytes], credentials: dict[int, bytes], issuer,  # type: ignore[no-untyped-def]
                  own: Credential | None = None) -> dict[int, Ed25519PublicKey]:
    """Peers' identity keys, each checked against its credential from the operator's CA, and no two
    (nor one and this device's own) carrying one endorsed node key or name (audit 2, N2)."""
    out, verified = {}, {}
    for node, raw in delivered.items():
        if node not in credentials:
            raise AdvertisementError(f"device {node}'s identity comes without a credential")
        verified[node] = verify_credential(credentials[node], raw, issuer)
        out[node] = _identity_key(node, raw)
    if own is not None:
        verified[-1] = own
    check_distinct(verified)
    return out


def _save(context: Context, device: SecAggDevice) -> None:
    context.state[_ROUND] = ConfigRecord(export_state(device))  # type: ignore[arg-type]


def _load(context: Context, plan: SecAggPlan, node: int) -> SecAggDevice:
    state = context.state.config_records.get(_ROUND)
    if state is None:
        raise ProtocolError(f"device {node} has no secure-aggregation state for round {plan.context.round}")
    return restore_state(plan, node, identity_of(context), dict(state))


def query(msg: Message, context: Context) -> Message:
    """The protocol's exchanges: ``advertise``, ``share``, ``consistency``, ``unmask``."""
    record = msg.content.config_records.get(SECAGG_RECORD)
    if record is None:
        raise ProtocolError("a secure-aggregation stage without its secagg record")
    plan, stage = plan_from_record(record)
    check_secure_plan(plan, context)
    node = _node_id(msg, context)
    identity = identity_of(context)
    issuer = _issuer(context)
    _check_mode(plan, issuer)
    if stage == "advertise":
        device = SecAggDevice(plan, node, identity)
        ad = device.advertise()
        _save(context, device)
        reply = ConfigRecord({"ad": ad.to_bytes(), "identity": _public(identity),
                              **({"credential": _credential(context, identity)} if issuer else {})})
    elif stage == "share":
        device = _load(context, plan, node)
        ads = {n: KeyAdvertisement.from_bytes(b) for n, b in unpack_blobs(record["ad-from"], record["ads"]).items()}
        delivered = unpack_blobs(record["ad-from"], record["identities"])
        if issuer:
            own = verify_credential(_credential(context, identity), _public(identity), issuer)
            identities = _credentialed(delivered, unpack_blobs(record["ad-from"], record["credentials"]), issuer,
                                       own=own)
        else:
            identities = _checked_identities(context, delivered)
        sealed = device.share_keys(ads, identities)
        _save(context, device)
        ids, blobs = pack_blobs(sealed)
        reply = ConfigRecord({"sealed-to": ids, "sealed": blobs})
    elif stage == "consistency":
        device = _load(context, plan, node)  # the plan must match the saved round before anything is claimed
        _claim(context, plan, stage)
        signature = device.consistency(unpack_ids(record["survivors"]))
        _save(context, device)
        reply = ConfigRecord({"signature": signature})
    elif stage == "unmask":
        device = _load(context, plan, node)  # the plan must match the saved round before anything is claimed
        _claim(context, plan, stage)
        del context.state[_ROUND]  # whatever happens now, this round's secrets are never used again
        signatures, identities = None, None
        if plan.consistency:
            assert issuer is not None
            signatures = unpack_blobs(record["signers"], record["signatures"])
            identities = _credentialed(unpack_blobs(record["signers"], record["identities"]),
                                       unpack_blobs(record["signers"], record["credentials"]), issuer)
        reveals = device.unmask(unpack_ids(record["survivors"]), signatures, identities)
        reply = ConfigRecord({"reveals": reveals})
    else:
        raise ProtocolError(f"unknown secure-aggregation stage {stage!r}")
    return Message(RecordDict({SECAGG_RECORD: reply}), reply_to=msg)


@timed("encode")
def masked_update(msg: Message, context: Context, delta: torch.Tensor, examples: int, memory: NodeStore,
                  generator: torch.Generator, *, error_feedback: bool = True) -> tuple[bytes, float]:
    """The masked upload of ``delta`` (weighted by ``examples``) and the error-feedback residual's norm.

    The device quantizes its weighted update on the round's shared grid; what rounding and clipping
    lost stays in its residual and is added to the next round's update (error feedback, as with the
    other codecs), so clipping delays information instead of dropping it.
    """
    record = msg.content.config_records[SECAGG_RECORD]
    node = _node_id(msg, context)
    plan, _ = plan_from_record(record)
    check_secure_plan(plan, context)
    device = _load(context, plan, node)
    if (plan.model_size or plan.dimension) != delta.numel():
        raise ProtocolError(f"the plan's model size {plan.model_size or plan.dimension} is not the model's {delta.numel()}")
    if plan.noise is not None:  # distributed DP: clip, scale, round, add Skellam noise; no residual
        # the noise must be unpredictable to the coordinator: a generator seeded from the OS CSPRNG,
        # never from the run's seed
        rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        values = encode(delta.double().numpy(), plan.noise, plan.bits, rng)
        sealed = unpack_blobs(record["shares-from"], record["shares"])
        payload = device.masked_input(sealed, values)
        _save(context, device)
        return payload, 0.0
    residual = memory.get_tensor("secagg-residual") if error_feedback else None
    corrected = delta + residual if residual is not None and residual.shape == delta.shape else delta.clone()
    support = plan.support  # random-k with a shared support: only these coordinates are sent
    chosen = corrected if support is None else corrected[torch.from_numpy(support)]
    grid = plan.grid
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator).item()))
    levels = grid.quantize(chosen.numpy(), examples, rng)
    scale = min(max(examples, 0), grid.weight_cap) / grid.weight_cap
    values = torch.from_numpy(levels[: plan.dimension].astype(np.float64) * (2 * grid.clip / grid.top) - grid.clip)
    sent = torch.zeros_like(corrected)
    if support is None:
        sent += (values / scale).to(torch.float32) if scale > 0 else 0.0
    elif scale > 0:
        sent[torch.from_numpy(support)] = (values / scale).to(torch.float32)
    new_residual = corrected - sent
    sealed = unpack_blobs(record["shares-from"], record["shares"])
    payload = device.masked_input(sealed, levels)
    _save(context, device)
    if error_feedback:  # only once the upload exists: a refused round leaves the residual as it was
        memory.put_tensor("secagg-residual", new_residual)
    log.debug("secure aggregation: node %d sent %d masked bytes", node, len(payload))
    return payload, float(new_residual.norm())
