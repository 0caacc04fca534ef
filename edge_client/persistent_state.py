"""A device's Fedge state on its own disk, so that error-feedback memory (and EASGD / gossip local
models) survive a restart of the device's SuperNode, as a Flower mod.

Flower keeps ``context.state`` in the SuperNode process: restart the SuperNode and the compression
residuals are gone, so the next update silently drops everything the codec held back. With node
config ``state-dir=DIR`` (``fedge-edge join`` sets it) this mod writes the ``fedge/*`` records of
``context.state`` to ``DIR/node-state.npz`` after every message (atomically) and, when a message
finds them missing, restores them first. The file is tagged with the run's task, algorithm and
codec: state of another configuration is never restored (it is logged and ignored).
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.deploy.atomic import atomic_write_bytes

__all__ = ["load_state", "save_state", "state_persistence_mod"]

log = logging.getLogger(__name__)

_FILE = "node-state.npz"
_PREFIX = "fedge/"
_TAG_KEYS = ("task", "algorithm", "codec")


def _tag(context: Context) -> dict[str, str]:
    return {key: str(context.run_config.get(key, "")) for key in _TAG_KEYS}


def save_state(context: Context, path: Path) -> None:
    arrays: dict[str, np.ndarray] = {}
    configs: dict[str, dict] = {}
    for key, record in context.state.array_records.items():
        if key.startswith(_PREFIX):
            for name, array in record.items():
                slot = f"a{len(arrays)}"  # npz member names must be plain; the real names go in the meta
                arrays[slot] = array.numpy()
                configs.setdefault("__arrays__", {}).setdefault(key, []).append([name, slot])
    for key, record in context.state.config_records.items():
        if key.startswith(_PREFIX):
            values = dict(record)
            if any(isinstance(v, (bytes, list)) for v in values.values()):
                continue  # only scalar metadata is stored under fedge/ (NodeStore.put_meta)
            configs.setdefault("__configs__", {})[key] = values
    meta = {"tag": _tag(context), **configs}
    buffer = io.BytesIO()
    np.savez(buffer, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    atomic_write_bytes(path, buffer.getvalue())


def load_state(context: Context, path: Path) -> bool:
    """Restore ``fedge/*`` records from ``path`` into ``context.state``; False when nothing fits."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            meta = json.loads(bytes(archive["__meta__"]).decode())
            if meta.get("tag") != _tag(context):
                log.warning("saved node state belongs to another run configuration %s; not restored", meta.get("tag"))
                return False
            for key, entries in meta.get("__arrays__", {}).items():
                context.state[key] = ArrayRecord({name: Array(np.array(archive[slot])) for name, slot in entries})
            for key, values in meta.get("__configs__", {}).items():
                context.state[key] = ConfigRecord(values)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        log.warning("saved node state %s unreadable (%s); starting without it", path, err)
        return False
    return True


def state_persistence_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    directory = context.node_config.get("state-dir")
    if not directory:
        return call_next(msg, context)
    path = Path(str(directory)) / _FILE
    if path.exists() and not any(k.startswith(_PREFIX) for k in context.state):
        if load_state(context, path):
            log.info("restored this device's Fedge state from %s", path)
    reply = call_next(msg, context)
    if not reply.has_error():
        save_state(context, path)
    return reply
