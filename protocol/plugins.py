"""Plugins: code outside Fedge that every process of a run loads before it builds anything.

A plugin is a Python module that registers extensions when it is imported:
``fedge.compression.register_codec(name, factory, codec_id=N)`` (a codec, with a wire id from the
reserved range), ``fedge.aggregation.register_aggregator(name, factory)`` (a robust rule),
``fedge.server.algorithms.registry.register_algorithm(cls, train)`` (a round
algorithm: its server class and its device handler in one call), ``fedge.tasks.register_task``.

Two ways in, both loaded by :func:`load_plugins` in the CLI, the ServerApp, every ClientApp
message (before its handler runs) and ``fedge-edge join``:

* the ``plugins`` run setting: comma-separated module names (``plugins = "my_codecs,my_algos"``).
  Fedge stages their top-level modules into the app bundle, so the coordinator and the devices run
  the same code;
* installed distributions that declare an entry point in the ``fedge.plugins`` group
  (``[project.entry-points."fedge.plugins"] mine = "my_pkg.fedge_plugin"``): loaded everywhere
  they are installed.

The device handlers of plugin algorithms live here, in the protocol both sides import, because a
device must never import the coordinator's code: the ClientApp looks the handler up by name.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["DEVICE_LAYERS_ATTRIBUTE", "ENTRY_POINT_GROUP", "PLUGIN_ACTION", "PluginError", "device_handler", "load_plugins", "plugin_modules",
           "register_device_handler"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fedge.plugins"
#: the Flower action of every plugin algorithm's messages (``train.plugin``); the config record's
#: ``handler`` key names the device handler
PLUGIN_ACTION = "plugin"
#: set on a device handler whose updates leave through the device's layers (clipping, masking,
#: encoding: ``fedge.edge_client.layers.uses_device_layers``); the coordinator reads it when the
#: handler is registered, so a plugin that bypasses them is refused secure aggregation and DP
DEVICE_LAYERS_ATTRIBUTE = "fedge_device_layers"

_loaded: set[str] = set()
_entry_points_loaded = False
_HANDLERS: dict[str, Callable[..., Any]] = {}


class PluginError(ImportError):
    """A plugin module cannot be imported or registers something inconsistent."""


def plugin_modules(setting: str) -> list[str]:
    """The module names of a ``plugins`` setting (``"a, b.c"`` -> ``["a", "b.c"]``)."""
    names = [name.strip() for name in setting.split(",") if name.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise PluginError(f"plugins: {name!r} is not a module name")
    return names


def load_plugins(setting: str = "") -> None:
    """Import the installed plugins (entry points, once per process) and the modules ``setting``
    names (each once). Raises :class:`PluginError` naming the module that failed."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                entry.load()
            except Exception as err:
                raise PluginError(f"installed plugin {entry.name!r} ({entry.value}) failed to load: "
                                  f"{type(err).__name__}: {err}") from None
    for name in plugin_modules(setting):
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise PluginError(f"plugin module {name!r} cannot be imported ({err}); it must be importable in every "
                              "process: in the app directory, the working directory, or installed") from None
        _loaded.add(name)
        log.info("plugin %s loaded", name)


def register_device_handler(name: str, train: Callable[..., Any]) -> None:
    """The device side of a plugin algorithm: ``train(msg, context) -> Message`` for its train
    messages (``fedge.edge_client.local`` has the helpers Fedge's own handlers use). Evaluation needs
    no handler of its own: federated evaluation is the same for every algorithm."""
    known = _HANDLERS.get(name)
    if known is not None and known is not train:
        raise PluginError(f"a device handler named {name!r} is registered already ({known!r})")
    _HANDLERS[name] = train


def device_handler(name: str) -> Callable[..., Any]:
    if name not in _HANDLERS:
        raise PluginError(f"no device handler {name!r} is registered on this device (registered: "
                          f"{', '.join(sorted(_HANDLERS)) or 'none'}); the run's plugins did not register it")
    return _HANDLERS[name]
