"""The algorithm registry: spec string -> round algorithm, through the grammar codecs use.

``fedavg``; ``easgd[:alpha=0.3,beta=0.9]``; ``gossip[:topology=ring,gamma=1,degree=4,measure=1]``;
``fedbuff[:concurrency=C,buffer=K,staleness=poly,a=0.5,max-staleness=20]``;
``fedasync[:alpha=0.6,concurrency=C,staleness=poly,a=0.5,max-staleness=20]``.

Registered once: every module of this package is imported and each :class:`Algorithm` subclass
with a ``name`` defined there is an algorithm. Adding one is its server file here, its device
handler in ``fedge.edge_client.algorithms`` (unless it reuses one, as FedBuff reuses FedAvg's), and
its test. The algorithm-specific settings a class does not list in ``settings_used`` are refused
here, before any process starts, with the algorithms that do use them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from functools import cache
from typing import Any

from fedge.compression.errors import SpecError
from fedge.compression.spec import build_from_spec, parse_spec
from fedge.protocol.plugins import DEVICE_LAYERS_ATTRIBUTE, PLUGIN_ACTION, register_device_handler
from fedge.server.engine.algorithm import Algorithm, RunContext
from fedge.server.settings import ALGORITHM_KEYS, RunSettings, SettingsError

__all__ = ["algorithm_class", "algorithms", "available_algorithms", "check_algorithm_settings", "make_algorithm",
           "register_algorithm"]

#: algorithms registered by plugins (``fedge.protocol.plugins``), beside the package's own
_PLUGINS: dict[str, type[Algorithm]] = {}


def register_algorithm(cls: type[Algorithm], train: Callable[..., Any] | None = None) -> type[Algorithm]:
    """Register a round algorithm from outside Fedge: its server class and, in the same call, its
    device handler ``train(msg, context) -> Message`` (omit it to reuse a Fedge handler named by
    ``cls.device_handler``, e.g. ``"fedavg"``). The plugin module that calls this must be loaded
    by the coordinator and every device (the ``plugins`` setting, or an installed entry point).

    A handler built on the device's layers (``fedge.edge_client.algorithms.fedavg.make_train``, or
    any function marked with ``fedge.edge_client.layers.uses_device_layers``) sends its update
    through them, so every engine layer applies to the algorithm; any other handler sends what it
    likes, and the layers that need the device's part refuse the run before it starts."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise SettingsError(f"{cls!r} needs a class attribute name (an identifier), got {name!r}")
    if name in _discover() or (name in _PLUGINS and _PLUGINS[name] is not cls):
        raise SettingsError(f"an algorithm named {name!r} exists already")
    if train is not None:
        register_device_handler(name, train)
        cls.device_handler = PLUGIN_ACTION
        cls.plugin_handler = name
        cls.device_layers = bool(getattr(train, DEVICE_LAYERS_ATTRIBUTE, False))
    _PLUGINS[name] = cls
    return cls


@cache
def _discover() -> dict[str, type[Algorithm]]:
    import fedge.server.algorithms as package

    found: dict[str, type[Algorithm]] = {}
    for module_info in pkgutil.iter_modules(package.__path__):
        if module_info.name == "registry":
            continue
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, Algorithm) and value.__module__ == module.__name__
                    and "name" in vars(value)):
                if value.name in found:
                    raise RuntimeError(f"two algorithms named {value.name!r}: {found[value.name]} and {value}")
                found[value.name] = value
    return found


def algorithms() -> dict[str, type[Algorithm]]:
    """Every algorithm by name (the package's modules are imported once, on first use), plugins'
    included."""
    return {**_discover(), **_PLUGINS}


def available_algorithms() -> list[str]:
    return sorted(algorithms())


def algorithm_name(spec: str) -> str:
    return parse_spec(spec)[0]


def algorithm_class(spec: str) -> type[Algorithm]:
    """The class a spec names; :class:`SettingsError` naming the available ones otherwise."""
    try:
        name = algorithm_name(spec)
    except SpecError as err:
        raise SettingsError(f"algorithm: {err}") from None
    if name not in algorithms():
        raise SettingsError(f"unknown algorithm {name!r}; available: {', '.join(available_algorithms())}")
    return algorithms()[name]


def check_algorithm_settings(settings: RunSettings) -> type[Algorithm]:
    """Refuse an algorithm-specific setting (``server-opt``, ``prox-mu``, ...) changed from its
    default for an algorithm that does not use it: it would be silently ignored."""
    cls = algorithm_class(settings.algorithm)
    defaults = RunSettings()
    for key in ALGORITHM_KEYS:
        field = key.replace("-", "_")
        value = getattr(settings, field)
        if key not in cls.settings_used and value != getattr(defaults, field):
            users = sorted(name for name, other in algorithms().items() if key in other.settings_used)
            raise SettingsError(f"{key}={value!r} applies to algorithm {' and '.join(users)} only, not {cls.name}")
    return cls


def make_algorithm(spec: str, ctx: RunContext) -> Algorithm:
    """Build the algorithm ``spec`` names for the run ``ctx`` (parameters typed and validated)."""
    check_algorithm_settings(ctx.settings.replace(algorithm=spec))
    algorithm = build_from_spec(spec, algorithms(), family="algorithm", extra={"ctx": ctx})
    assert isinstance(algorithm, Algorithm)
    return algorithm
