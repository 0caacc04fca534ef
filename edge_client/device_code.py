"""Pinned device code: a device runs the ClientApp its owner installed, never code the run ships.

Flower's ClientApp runtime installs the run's FAB and loads the ClientApp the FAB names, with the
FAB's directory first on the import path; ``fedge demo`` and ``fedge serve`` put Fedge itself, a task
given by import path and the run's ``plugins`` into that FAB. So a coordinator that may lie could
ship any code to a device and every check the device makes (its privacy policy, its budget) would
be the coordinator's to replace (privacy audit 3, F1). A device whose node config says
``device-code = "pinned"`` (``fedge-edge join``'s default) therefore:

* runs only the ClientApp its owner named (node config ``client-app``, default Fedge's own
  ``fedge.edge_client.app:app``), imported from what is installed on the device, with the FAB's
  directory never on its import path; a run whose FAB names another ClientApp gets a typed
  ``policy`` refusal with the reason, for every message, and nothing else;
* imports the run's ``plugins`` and a task given by import path only when their modules are in
  its owner's allowlist (node config ``allowed-modules``, ``fedge-edge join --allow-module``), and
  then from the installed packages: :func:`check_modules`, called by ``plugins_mod``. Plugins that
  installed distributions declare (entry points) are the owner's installation and load as before.

Owners who run apps they trust by signature pass Flower's own ``--trusted-entities`` through
``fedge-edge join``; that check is Flower's, before any of this. The simulation and ``fedge
local-cluster`` leave ``device-code`` unset: their operator is both sides, and they run the FAB's
code as Flower does. The warm executor (``fedge.edge_client.warm_executor``) loads every message's
app through :func:`load_client_app`; Flower's subprocess isolation cannot pin, and ``fedge-edge
join`` refuses it for a pinned device.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import Context, Message

from fedge.protocol import CONFIG_RECORD
from fedge.protocol.config_keys import PLUGINS, START_KEY
from fedge.protocol.plugins import plugin_modules
from fedge.protocol.failures import FailureKind
from fedge.protocol.refusals import PolicyRefusal, refusal_content

__all__ = ["ALLOWED_MODULES", "CLIENT_APP", "DEFAULT_CLIENT_APP", "DEVICE_CODE", "PINNED", "DeviceCode",
           "allowed_modules", "check_modules", "load_client_app", "pinned_app"]

log = logging.getLogger("fedge.edge.device_code")

#: node config keys (the owner's; ``fedge-edge join`` sets them)
DEVICE_CODE = "device-code"
CLIENT_APP = "client-app"
ALLOWED_MODULES = "allowed-modules"
PINNED = "pinned"
DEFAULT_CLIENT_APP = "fedge.edge_client.app:app"


def pinned_app(node_config: Mapping[str, Any]) -> str | None:
    """The ClientApp reference this device is pinned to, or None when it runs the FAB's app."""
    mode = str(node_config.get(DEVICE_CODE, "") or "").strip().lower()
    if mode in ("", "fab"):
        return None
    if mode != PINNED:
        raise PolicyRefusal(f"node config {DEVICE_CODE}={mode!r} is not {PINNED!r} or 'fab'")
    return str(node_config.get(CLIENT_APP, "") or DEFAULT_CLIENT_APP)


def allowed_modules(node_config: Mapping[str, Any]) -> frozenset[str]:
    """The owner's allowlist: top-level module names (``"mycodec, mytask"``)."""
    return frozenset(name.split(".")[0] for name in plugin_modules(str(node_config.get(ALLOWED_MODULES, "") or "")))


def check_modules(node_config: Mapping[str, Any], plugins: str, task: str, start: str = "") -> None:
    """Raise :class:`PolicyRefusal` when a pinned device would import a module its owner did not
    allow: a run's plugin, the module of a task given by import path, or of a start model the
    downlink names (``module:callable@seed``; the pinned app's own package needs no allowing).
    Unpinned devices return."""
    pinned = pinned_app(node_config)
    if pinned is None:
        return
    from fedge.tasks.task_spec import task_module

    allowed = allowed_modules(node_config) | {"fedge", pinned.partition(":")[0].split(".")[0]}
    wanted = [(name, "plugin") for name in plugin_modules(plugins)]
    module = task_module(task) if task else None
    if module is not None:
        wanted.append((module, "task"))
    if start:
        wanted.append((start.partition(":")[0], "start model"))
    for name, what in wanted:
        if name.split(".")[0] not in allowed:
            raise PolicyRefusal(f"the run names {what} module {name!r}; this device imports only the modules its "
                                f"owner allowed (node config {ALLOWED_MODULES}: "
                                f"{', '.join(sorted(allowed_modules(node_config))) or 'none'}; "
                                "fedge-edge join --allow-module)")


def _config_text(message: Message, key: str) -> str:
    """A text value of the message's config record, "" when absent; a value that is not text is
    left to the handlers' own checks (``fedge.edge_client.plugins``), which refuse it."""
    records = message.content.config_records if message.has_content() else {}
    value = records[CONFIG_RECORD].get(key, "") if CONFIG_RECORD in records else ""
    return value if isinstance(value, str) else ""


class DeviceCode:
    """What the warm executor runs for one message: the FAB's ClientApp as Flower loads it, or, on a
    pinned device, the owner's installed ClientApp when the FAB names the same one and a refusal
    when it names another. The node config (the owner's) decides, message by message."""

    def __init__(self, shipped: str, flower_load: Callable[[], Any]) -> None:
        self.shipped = shipped
        self._flower_load = flower_load

    def __call__(self, message: Message, context: Context) -> Message:
        try:
            pinned = pinned_app(context.node_config)
        except PolicyRefusal as refusal:
            return _refused(message, str(refusal))
        if pinned is None:
            return self._flower_load()(message=message, context=context)
        if self.shipped != pinned:
            return _refused(message, f"the run's app names ClientApp {self.shipped!r}; this device runs only the "
                                     f"ClientApp its owner installed ({pinned!r}, node config {CLIENT_APP})")
        try:  # before the app: whatever app it is, a message names no module the owner did not allow
            check_modules(context.node_config, _config_text(message, PLUGINS), _config_text(message, "task"),
                          _config_text(message, START_KEY))
        except PolicyRefusal as refusal:
            return _refused(message, str(refusal))
        return _installed(pinned)(message=message, context=context)


def _refused(message: Message, reason: str) -> Message:
    log.warning("refusing message %s: %s", message.metadata.message_id, reason)
    return Message(refusal_content(FailureKind.POLICY, reason), reply_to=message)


def _installed(reference: str) -> Any:
    """The ClientApp ``module:attribute`` from the installed packages: the import path is not
    touched (Flower's loader puts the FAB's directory first on it)."""
    module_name, _, attributes = reference.partition(":")
    if not module_name or not attributes:
        raise PolicyRefusal(f"node config {CLIENT_APP}={reference!r} is not MODULE:ATTRIBUTE")
    value: Any = importlib.import_module(module_name)
    for attribute in attributes.split("."):
        value = getattr(value, attribute)
    return value


def load_client_app(fab_id: str, fab_version: str, fab_hash: str) -> DeviceCode:
    """Flower's ``load_client_app_fn`` for the warm executor: read which ClientApp the installed FAB
    names, and leave loading it to :class:`DeviceCode`, which knows the node's config."""
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.config import get_project_config, get_project_dir

    config = get_project_config(get_project_dir(fab_id, fab_version, fab_hash))
    shipped = str(config["tool"]["flwr"]["app"]["components"]["clientapp"])

    def flower_load() -> Any:
        return get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(fab_id, fab_version, fab_hash)

    return DeviceCode(shipped, flower_load)
