"""Pinned device code (privacy audit 3, F1): a pinned device runs its owner's installed ClientApp,
refuses a run whose app names another, and imports no module its owner did not allow. Real
processes: ``tests/integration/test_device_trust.py``."""

from __future__ import annotations

import pytest
from flwr.app import Context, Message, RecordDict

from fedge.edge_client.device_code import DEFAULT_CLIENT_APP, DeviceCode, check_modules, pinned_app
from fedge.protocol.refusals import PolicyRefusal, read_refusal

PINNED = {"device-code": "pinned"}


def _context(config: dict) -> Context:
    return Context(run_id=1, node_id=7, node_config=config, state=RecordDict(), run_config={})


def _message() -> Message:
    return Message(RecordDict(), dst_node_id=7, message_type="query.roster")


def test_a_pinned_device_refuses_a_fab_that_names_another_client_app() -> None:
    loaded = []
    code = DeviceCode("evil.client_app:app", lambda: loaded.append(1))
    reply = code(_message(), _context(PINNED))
    kind, reason = read_refusal(reply.content)
    assert kind.value == "policy" and "'evil.client_app:app'" in reason and DEFAULT_CLIENT_APP in reason
    assert not loaded  # Flower's loader (the FAB's directory on the import path) never ran


def test_a_pinned_device_runs_its_installed_app_and_an_unpinned_one_the_fabs() -> None:
    code = DeviceCode(DEFAULT_CLIENT_APP, lambda: pytest.fail("the FAB's app was loaded on a pinned device"))
    reply = code(_message(), _context({**PINNED, "partition-id": 3, "num-partitions": 5}))
    assert "fedge.roster" in reply.content  # Fedge's own installed app answered the roll call
    ran = []

    def fab_app(message, context):  # type: ignore[no-untyped-def]
        ran.append(context.node_id)
        return Message(RecordDict(), reply_to=message)

    DeviceCode("evil.client_app:app", lambda: fab_app)(_message(), _context({}))
    assert ran == [7]  # unpinned (the simulation, local-cluster): Flower's behaviour
    assert pinned_app({}) is None and pinned_app({"device-code": "fab"}) is None
    assert pinned_app({**PINNED, "client-app": "mine.app:app"}) == "mine.app:app"
    with pytest.raises(PolicyRefusal):
        pinned_app({"device-code": "sometimes"})


def test_a_pinned_device_imports_only_modules_its_owner_allowed() -> None:
    with pytest.raises(PolicyRefusal, match="plugin module 'planted'"):
        check_modules(PINNED, "planted", "digits")
    with pytest.raises(PolicyRefusal, match="task module 'theirs'"):
        check_modules(PINNED, "", "theirs.tasks:Task")
    check_modules({**PINNED, "allowed-modules": "mycodec,theirs"}, "mycodec.v2", "theirs.tasks:Task")
    check_modules(PINNED, "", "digits")  # a built-in task, no plugin
    check_modules({}, "planted", "theirs.tasks:Task")  # unpinned: as before



@pytest.mark.parametrize(("key", "value", "what"), [("plugins", "planted", "plugin"),
                                                   ("task", "theirs.tasks:Task", "task"),
                                                   ("fedge.start", "theirs.models:Net@0", "start model")])
def test_a_message_naming_a_module_is_refused_before_any_app_runs(key, value, what) -> None:
    """The warm executor's check, for Fedge's app and a user's alike: a plugin, an import-path task
    or a start model whose module the owner did not allow gets a refusal, and no app runs; the
    pinned app's own package needs no allowing."""
    from flwr.app import ConfigRecord

    message = _message()
    message.content = RecordDict({"config": ConfigRecord({key: value})})
    code = DeviceCode("mine.client_app:app", lambda: pytest.fail("the FAB's app was loaded"))
    config = {**PINNED, "client-app": "mine.client_app:app"}
    kind, reason = read_refusal(code(message, _context(config)).content)
    assert kind.value == "policy" and f"{what} module" in reason
    check_modules(config, "", "", "mine.task:Net@0")  # its own package
