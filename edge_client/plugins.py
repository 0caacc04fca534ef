"""Plugins on the device: load the run's plugins before every handler, and dispatch the messages
of plugin algorithms (``train.plugin``) to the device handler their config names.

Flower starts a fresh ClientApp process for every message on the deployment engine, so the run's
``plugins`` (carried in each message's config record) are imported at every message; the
simulation engine's long-lived workers import them once.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.edge_client.device_code import check_modules
from fedge.protocol import CONFIG_RECORD, ProtocolError
from fedge.protocol.config_keys import PLUGINS

TASK = "task"  # the round config's task spec (fedge.protocol.round_config)
from fedge.protocol.plugins import device_handler, load_plugins

__all__ = ["plugins_mod", "train"]


def _config_text(msg: Message, key: str) -> str:
    records = msg.content.config_records if msg.has_content() else {}
    value = records[CONFIG_RECORD].get(key, "") if CONFIG_RECORD in records else ""
    if not isinstance(value, str):
        raise ProtocolError(f"config {key}={value!r} is not a string")
    return value


def plugins_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Import the installed plugins and the run's ``plugins`` modules before the handler runs; on a
    device pinned to its installed code, only modules its owner allowed
    (:func:`fedge.edge_client.device_code.check_modules`: a typed ``policy`` refusal otherwise)."""
    plugins = _config_text(msg, PLUGINS)
    check_modules(context.node_config, plugins, _config_text(msg, TASK))
    load_plugins(plugins)
    return call_next(msg, context)


def train(msg: Message, context: Context) -> Message:
    """A plugin algorithm's train message: its registered device handler does the work."""
    name = _config_text(msg, "handler")
    if not name:
        raise ProtocolError("a train.plugin message needs the config key 'handler'")
    return device_handler(name)(msg, context)
