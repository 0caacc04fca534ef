"""Test-wide setup: offline, telemetry off, deterministic hypothesis profile."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

for key, value in {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    # every test's settings are checked as it runs them; the remembered checks have tests of their
    # own (tests/server/test_preflight_memory.py), which turn them on
    "FEDGE_PREFLIGHT_CACHE": "off",
}.items():
    os.environ.setdefault(key, value)

settings.register_profile(
    "fedge", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("fedge")


@pytest.fixture
def flower_task_identity() -> Iterator[None]:
    """Flower builds a ``Message`` inside a task: its runtime sets the process's task identity first.

    Device-side and strategy tests (``tests/edge_client``, ``tests/flower``) build messages outside
    any runtime: their folders' conftest sets it for every test (and puts it back after), so that a
    test does not pass or fail by which other test ran before it in the same worker.
    """
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


# ---- shared model/key fixtures (deploy and edge tests), built once per session ---------------------


@pytest.fixture(scope="session")
def trained_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits CNN trained for a few epochs (about 97% held-out), saved as training round 5."""
    import torch

    from fedge.deploy.model_file import ModelFile, save_model_file
    from fedge.deploy.prune import fine_tune
    from fedge.tasks import make_task

    task = make_task("digits")
    torch.manual_seed(0)
    model = task.build_model()
    fine_tune(model, task.train_pool(), task, epochs=6, lr=0.05, seed=0)
    path = tmp_path_factory.mktemp("model") / "model.pt"
    save_model_file(path, ModelFile(task=task.spec, state_dict=model.state_dict(), metadata={"round": 5}))
    return path


@pytest.fixture(scope="session")
def keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from fedge.deploy.keys import generate_keypair

    return generate_keypair(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def rogue_keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from fedge.deploy.keys import generate_keypair

    return generate_keypair(tmp_path_factory.mktemp("rogue"))


#: the xdist group of the tests that run `flwr run .` on Flower's default local federation
DEFAULT_FEDERATION = "flwr-default-federation"


@pytest.fixture(autouse=True)
def _one_default_federation_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """The tests marked ``xdist_group("flwr-default-federation")`` run one at a time on this machine.

    They all use Flower's local SuperLink on its fixed ports, and ``flwr run`` reuses whatever
    SuperLink answers there (so one test's run could land in another's directory). The group mark
    alone does not keep them apart: pytest-xdist 3.8 under pytest 9 spread a group over workers
    (checked 2026-11-28 with a two-test file), so each takes a machine-wide file lock as well."""
    mark = request.node.get_closest_marker("xdist_group")
    if mark is None or DEFAULT_FEDERATION not in mark.args:
        yield
        return
    with open(Path(os.environ.get("TMPDIR", "/tmp")) / f"fedge-tests-{DEFAULT_FEDERATION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the test fails
        yield


#: the longest process tests (docs/testing.md), started first so none of them becomes the tail. Not
#: test_leaves.py: its two trees (a leaf's own Ray instance each, in the simulated one) started beside
#: these at the suite's start, and a leaf's Ray node timed out starting (2026-12-03 17:32)
_LONGEST_FIRST = ("test_serve.py", "test_packaging.py", "test_warm_execution.py", "test_algorithms.py",
                  "test_reproducibility.py", "test_plugin_examples.py", "test_ray_cluster.py",
                  "test_secure_aggregation.py", "test_bench_smoke.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start real processes first, the longest of them first, so that none of them
    starts late and forms a tail after the short in-process tests. The suite is CPU-bound on two
    cores either way (96-100% busy in every minute, 2026-12-03): what the order changes is the
    tail, not the work."""

    def order(item: pytest.Item) -> tuple[int, int]:
        if item.get_closest_marker("integration") is None:
            return (1, 0)
        name = Path(str(item.fspath)).name
        return (0, _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST))

    items.sort(key=order)
