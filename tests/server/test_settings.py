import sys

import pytest

from fedge.server.cli.main import build_parser
from fedge.server.settings import OPTIONS, RunSettings, SettingsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedge.server.flower_app import app_pyproject


def test_the_flower_apps_run_config_is_the_settings_vocabulary() -> None:
    app = tomllib.loads(app_pyproject())["tool"]["flwr"]["app"]
    assert app["config"] == {opt.key: opt.default for opt in OPTIONS}
    assert RunSettings.from_run_config(app["config"]) == RunSettings()
    assert app["components"] == {"serverapp": "fedge.server.app:app", "clientapp": "fedge.edge_client.app:app"}


def test_every_option_is_a_cli_flag_of_demo_and_local_cluster() -> None:
    parser = build_parser()
    for command in ("demo", "local-cluster"):
        args = parser.parse_args([command, "--codec", "fp16", "--no-error-feedback", "--rounds", "7"])
        assert args.codec == "fp16" and args.error_feedback is False and args.rounds == 7
        for option in OPTIONS:
            assert hasattr(args, option.field)


def test_values_are_validated() -> None:
    with pytest.raises(SettingsError, match="unknown setting"):
        RunSettings.from_run_config({"round": 3})
    with pytest.raises(SettingsError):
        RunSettings.from_run_config({"rounds": 2.5})
    with pytest.raises(SettingsError):
        RunSettings.from_run_config({"error-feedback": "maybe"})
    with pytest.raises(SettingsError):
        RunSettings(rounds=0)
    with pytest.raises(SettingsError):
        RunSettings(clients_per_round=2, min_replies=3)
    with pytest.raises(SettingsError, match="stop-accuracy"):
        RunSettings(stop_accuracy=1.5)
    with pytest.raises(SettingsError, match="stop-accuracy"):
        RunSettings(stop_accuracy=-0.1)
    assert RunSettings.from_run_config({"lr": 1, "error-feedback": "false"}).lr == 1.0


def test_advice_for_sparse_uplinks_at_partial_participation() -> None:
    """The CLI's advice: a sparsifier at one device in four or fewer per round without sparse-mean
    and a model average gets a note naming what is missing; dense codecs, full participation,
    gossip and the recommended settings get none."""
    from fedge.server.preflight import advise

    sparse = RunSettings(codec="dgc:ratio=0.01,sample=0.05+qsgd:bits=4", clients_per_round=10)
    [note] = advise(sparse, 100)
    assert "dgc at 10 of 100" in note and "--aggregator sparse-mean" in note and "--model-average" in note
    [note] = advise(sparse.replace(aggregator="sparse-mean"), 100)
    assert "sparse-mean" not in note and "model-average" in note
    assert advise(sparse.replace(aggregator="sparse-mean", model_average="ema:decay=0.8"), 100) == []
    assert advise(sparse, 20) == []  # half the clients every round
    assert advise(RunSettings(codec="qsgd:bits=4", clients_per_round=10), 100) == []
    assert advise(sparse.replace(algorithm="gossip"), 100) == []
    assert advise(RunSettings(codec="zstd:level=3+topk:ratio=0.01", clients_per_round=5), 50)
