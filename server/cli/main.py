"""``fedge``: the command line of the coordinator side.

Every run option is generated from ``fedge.server.settings`` so a flag is spelled exactly like its
run-config key (``--clients-per-round`` <-> ``clients-per-round``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fedge.server.cli.certs_command import add_certs_parser, run_certs
from fedge.server.cli.deploy_commands import add_deploy_parsers, run_export, run_keys
from fedge.deploy.certs import CertificateError
from fedge.launcher.federation import RegistrationError
from fedge.protocol.plugins import PluginError
from fedge.server.settings import CLIENT_DEVICES, OPTIONS, RunSettings, SettingsError

__all__ = ["main"]

log = logging.getLogger(__name__)

_EPILOG = """
examples:
  fedge demo                                   # 10 simulated clients, 4-bit QSGD + error feedback
  fedge demo --codec none --rounds 10          # the fp32 baseline
  fedge demo --partitioning iid --server-opt fedadam
  fedge demo --algorithm easgd                 # elastic averaging: clients keep their own models
  fedge demo --algorithm gossip:topology=exponential --clients 16 --clients-per-round 16   # decentralized
  fedge local-cluster --supernodes 3 --rounds 3   # real SuperLink + 3 SuperNodes on 127.0.0.1
  fedge local-cluster --tls                    # the same with TLS and SuperNode authentication
  fedge cloud-train --nproc-per-node 2 -- --out runs/cloud --epochs 5   # torchrun DDP pretraining
  fedge demo --init runs/cloud/model.pt        # federated fine-tuning from the cloud model
  fedge flower-app --out app && flwr run app <connection> --run-config 'rounds=5'   # your own Flower setup
  fedge new myapp && cd myapp && flwr run . --stream    # your own model and data: edit myapp/task.py
  fedge demo --app myapp --clients 10          # the same app on Fedge's launcher

every run setting (`fedge settings`; the --options of `fedge demo --help`) is also a key of
[tool.flwr.app.config] and of `flwr run --run-config`.
"""


class _Given(argparse.Action):
    """Stores a run option and records that it was given (``--app``: the app's pyproject.toml
    supplies every setting the command line does not)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.__dict__.setdefault("given", set()).add(self.dest)


class _GivenFlag(argparse.BooleanOptionalAction):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        namespace.__dict__.setdefault("given", set()).add(self.dest)


def _add_run_options(parser: argparse.ArgumentParser, overrides: dict[str, Any]) -> None:
    parser.add_argument("--app", metavar="DIR", default=None,
                        help="run a Flower app project (`fedge new DIR`): its task.py travels in the app bundle "
                        "and its [tool.flwr.app.config] gives the settings the command line does not")
    group = parser.add_argument_group("run settings (same keys as the Flower run config)")
    for option in OPTIONS:
        default = overrides.get(option.key, option.default)
        kwargs: dict[str, Any] = {"dest": option.field, "default": default, "help": f"{option.help} (default: {default!r})"}
        if option.type is bool:
            kwargs["action"] = _GivenFlag
        else:
            kwargs["action"] = _Given
            kwargs["type"] = option.type
            kwargs["metavar"] = option.type.__name__.upper()
        group.add_argument(f"--{option.key}", **kwargs)


def _add_client_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--client-device", choices=CLIENT_DEVICES, default="auto",
                        help="where clients train: auto (default: the GPU where CUDA is, a share of it per "
                        "simulated client; the CPU elsewhere), cpu, or cuda (refused without a GPU)")


def _add_live(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--live", nargs="?", const="127.0.0.1:0", default=None, metavar="HOST:PORT",
                        help="serve the run's live page (settings, rounds, curves, devices, leaves) while it runs "
                        "and print its address (default 127.0.0.1 on a free port; read-only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedge",
        description="Fedge: compressed federated learning on Flower (coordinator side).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: info)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="run the embedded default task on Flower's simulation engine (Ray)",
        description="Federated training of the digits CNN with simulated clients (no downloads). "
        "Prints a progress line per round and a summary; writes metrics.jsonl, plot.png and model.pt "
        "to the run directory.",
    )
    demo.add_argument("--clients", type=int, default=10, help="simulated SuperNodes (default: 10)")
    demo.add_argument("--timeout", type=float, default=3600, help="seconds before giving up (default: 3600)")
    demo.add_argument("--ray-address", default="", metavar="HOST:PORT",
                      help="run the simulated clients on an existing Ray cluster (`ray start --head` here, "
                      "`ray start --address` on every other machine); default: a local Ray instance")
    _add_client_device(demo)
    _add_live(demo)
    _add_run_options(demo, {"export-bundle": "auto"})

    cluster = sub.add_parser(
        "local-cluster",
        help="run on the deployment engine: a real SuperLink and N SuperNodes on 127.0.0.1",
        description="Starts flower-superlink and N flower-supernode processes on loopback, runs the "
        "app on them with `flwr run`, and stops every process it started (also on Ctrl-C or failure). "
        "Each SuperNode runs its messages in a child forked from one warm process (Python, torch, "
        "Flower and Fedge imported once); --isolation subprocess is Flower's own (a new process per message).",
    )
    cluster.add_argument("--supernodes", type=int, default=2, help="SuperNodes to start (default: 2)")
    cluster.add_argument("--timeout", type=float, default=3600, help="seconds before giving up (default: 3600)")
    cluster.add_argument("--isolation", choices=("warm", "subprocess"), default="warm",
                         help="how SuperNodes run messages: 'warm' (default: a child forked from one "
                         "pre-imported process per message) or Flower's 'subprocess' (a new process each)")
    cluster.add_argument("--tls", action="store_true",
                         help="TLS and SuperNode authentication on: a CA, server certificate and node keys "
                         "are made in <run-dir>/tls and every node key is registered before it connects")
    cluster.add_argument("--leaves", type=int, default=0,
                         help="beyond one SuperLink: split the SuperNodes over this many leaves, each a SuperLink "
                         "with its devices and a leaf coordinator, under a root whose nodes are the leaves' bridges "
                         "(default: 0, one tier)")
    cluster.add_argument("--leaf-engine", choices=("deployment", "simulation"), default="deployment",
                         help="with --leaves: 'deployment' (default) gives each leaf a SuperNode per device; "
                         "'simulation' runs each leaf's devices under Flower's Simulation Engine (Ray), each "
                         "simulated node the device of the same partition, under the same deployed root")
    cluster.add_argument("--leaf-sample", type=int, default=0,
                         help="with --leaves: devices each leaf samples per root round (default: 0, all of them); "
                         "--clients-per-round is then the leaves per root round")
    _add_client_device(cluster)
    _add_live(cluster)
    _add_run_options(cluster, {"rounds": 3, "clients-per-round": 2})

    cloud = sub.add_parser(
        "cloud-train",
        help="cloud tier: data-parallel training with torchrun (DDP; gloo on CPU, NCCL on GPU)",
        description="Runs `torchrun ... -m fedge.deploy.train ...`, or prints it with --print. The final "
        "model.pt in --out is accepted by `fedge demo --init`. Multi-node: give the same "
        "--nnodes/--rdzv-endpoint on every node and a distinct --node-rank.",
    )
    cloud.add_argument("--nproc-per-node", type=int, default=2,
                       help="worker processes on this node: GPUs, or CPU processes for gloo (default: 2)")
    cloud.add_argument("--nnodes", type=int, default=1, help="machines taking part (default: 1)")
    cloud.add_argument("--node-rank", type=int, default=0, help="this machine's rank, 0 to nnodes-1 (default: 0)")
    cloud.add_argument("--rdzv-endpoint", default="127.0.0.1:29500", help="host:port of node 0 (default: 127.0.0.1:29500)")
    cloud.add_argument("--print", action="store_true", dest="print_only", help="print the command only")
    cloud.add_argument("train_args", nargs=argparse.REMAINDER,
                       help="arguments for fedge.deploy.train after a bare --, e.g. -- --out runs/cloud --epochs 5 --hook qsgd:bits=4")

    serve = sub.add_parser(
        "serve",
        help="the coordinator daemon: SuperLink (TLS, node authentication, state database) + the Fedge run, "
        "/metrics and /healthz, the live page, JSON logs",
        description="Runs the federation described by a fedge.toml ([service] + [run]; "
        "`fedge serve --example` prints a commented one). SIGTERM stops at the next round "
        "boundary and exits 0; starting it again resumes the run. The live page of the federation "
        "(settings, rounds, curves, devices, leaves) is at http://127.0.0.1:9101/ (page-address; "
        "beyond loopback over TLS, with page-token-file's token as ?token=); /metrics at "
        "http://127.0.0.1:9100/metrics (metrics-address).",
    )
    serve_what = serve.add_mutually_exclusive_group(required=True)
    serve_what.add_argument("--config", help="the fedge.toml file")
    serve_what.add_argument("--example", action="store_true", help="print a commented example fedge.toml and exit")
    serve.add_argument("--check-config", action="store_true", help="validate the file, print it resolved, exit")
    flower_app = sub.add_parser(
        "flower-app",
        help="write the Fedge app as a Flower app directory, for `flwr run DIR <connection>` on your own Flower setup",
        description="Writes pyproject.toml ([tool.flwr.app]: Fedge's ServerApp and ClientApp, every run setting "
        "with its default) and the installed fedge code to --out. Every machine that runs it needs fedge "
        "installed (fedge[device] on a device).",
    )
    flower_app.add_argument("--out", required=True, help="the directory to write (replaced if it exists)")
    sub.add_parser("settings", help="list every run setting with its default (the run-config keys)")
    new = sub.add_parser(
        "new",
        help="create a Flower app project around your own task.py (model, data, metrics)",
        description="Writes DIR/pyproject.toml (a Flower app whose ServerApp and ClientApp are Fedge's), "
        "DIR/task.py (the model, the data and its partitioning, the loss and the metrics: the one file you "
        "edit) and a README. Then: cd DIR && flwr run . --stream   or   fedge demo --app DIR",
    )
    new.add_argument("dir", metavar="DIR", help="the project directory (new, or empty)")
    from fedge.server.cli.new_project import TEMPLATES

    new.add_argument("--template", choices=sorted(TEMPLATES), default="classification",
                     help="classification (wine, accuracy) or regression (diabetes, MSE); both offline "
                     "(default: classification)")
    new.add_argument("--force", action="store_true", help="overwrite the template's files in a non-empty DIR")
    add_deploy_parsers(sub)
    add_certs_parser(sub)
    return parser


def _settings_from_args(args: argparse.Namespace) -> RunSettings:
    values = {opt.field: getattr(args, opt.field) for opt in OPTIONS}
    if getattr(args, "app", None):
        from fedge.launcher.app_bundle import app_config

        app = app_config(Path(args.app))
        given = getattr(args, "given", set())
        from_app = RunSettings.from_run_config(app)
        # the command line first, then what the app's config sets, then the command's own default
        # (``fedge demo`` exports a bundle even though an app's config leaves export-bundle unset)
        in_app = {opt.field for opt in OPTIONS if opt.key in app}
        values = {field: getattr(from_app, field) if field in in_app and field not in given else values[field]
                  for field in values}
    return RunSettings(**values)


def _default_run_dir(prefix: str) -> str:
    return str(Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")


def prepare_run(args: argparse.Namespace, engine: str, nodes: int) -> RunSettings:
    """The settings of a ``demo`` / ``local-cluster`` command, checked as far as this machine can
    before any process starts (paths made absolute, the model file and key usable, the leaves'
    rule, every component built by the preflight): what the command would run. Raises
    ``SettingsError`` (or ``ValueError``, ``OSError``) with the reason. The docs' commands are run
    through it too (``tests/test_doc_commands.py``)."""
    app_dir = Path(args.app).resolve() if getattr(args, "app", None) else None
    if app_dir is not None and str(app_dir) not in sys.path:  # its modules (task.py) import here as in Flower's
        sys.path.insert(0, str(app_dir))
    settings = _settings_from_args(args)
    if not settings.run_dir:
        settings = settings.replace(run_dir=_default_run_dir("demo" if engine == "simulation" else "cluster"))
    settings = settings.replace(run_dir=str(Path(settings.run_dir).resolve()))
    if settings.init:  # the ServerApp runs elsewhere: pass an absolute path, checked here
        from fedge.deploy.model_file import load_model_file
        from fedge.tasks import make_task

        init = Path(settings.init).resolve()
        if load_model_file(init).task != make_task(settings.task).spec:
            raise SettingsError(f"--init {init} was trained for another task than {settings.task!r}")
        settings = settings.replace(init=str(init))
    if settings.export_bundle not in ("", "auto"):  # a key path: absolute, and usable, before the run
        from fedge.deploy.keys import load_private_key

        key = Path(settings.export_bundle).resolve()
        load_private_key(key)
        settings = settings.replace(export_bundle=str(key))
    if settings.eval_data:  # read by the ServerApp elsewhere: absolute
        settings = settings.replace(eval_data=str(Path(settings.eval_data).resolve()))
    if nodes < 1:
        raise SettingsError("need at least one client")
    if getattr(args, "leaves", 0):  # before any process starts: the one rule launch() applies too
        from fedge.server.local import leaves_refusal

        why = leaves_refusal(settings, args.leaves, nodes, engine, leaf_engine=args.leaf_engine,
                             tls=getattr(args, "tls", False), leaf_sample=args.leaf_sample)
        if why is not None:
            raise SettingsError(f"--leaves {args.leaves}: {why}")
    if settings.clients_per_round > nodes:
        settings = settings.replace(clients_per_round=nodes, min_replies=min(settings.min_replies, nodes))
    # Fail in the CLI, not minutes later inside a worker, on a spec that cannot work.
    from fedge.server.preflight import preflight

    simulated = engine == "simulation" or getattr(args, "leaf_engine", "") == "simulation"
    preflight(settings, num_partitions=nodes if simulated else None)
    return settings


def _run(args: argparse.Namespace, engine: str, nodes: int) -> int:
    from rich.console import Console

    from fedge.server.cli.progress import RoundProgress, print_summary
    from fedge.server.local import EngineError, launch
    from fedge.server.preflight import advise

    console = Console(stderr=False)
    app_dir = Path(args.app).resolve() if getattr(args, "app", None) else None
    settings = prepare_run(args, engine, nodes)
    for line in advise(settings, nodes):
        console.print(f"[yellow]note:[/yellow] {line}")

    console.print(
        f"[bold]fedge[/bold] {engine} engine: {nodes} clients, task {settings.task}, "
        f"algorithm {settings.algorithm}, codec {settings.codec}, {settings.rounds} rounds"
    )
    console.print(f"run directory: {settings.run_dir}")
    page = _live_page(args, Path(settings.run_dir))
    if page is not None:
        console.print(f"live page: {page.url}")
    with page or contextlib.nullcontext(), RoundProgress(console, settings.rounds) as progress:
        try:
            result = launch(settings, engine=engine, num_supernodes=nodes, on_row=progress.update,
                            timeout=args.timeout, tls=getattr(args, "tls", False), app_dir=app_dir,
                            ray_address=getattr(args, "ray_address", "") or None,
                            isolation=getattr(args, "isolation", "warm"), client_device=args.client_device,
                            leaves=getattr(args, "leaves", 0), leaf_engine=getattr(args, "leaf_engine", "deployment"),
                            leaf_sample=getattr(args, "leaf_sample", 0))
        except EngineError as err:
            console.print(f"[red]run failed:[/red] {err}")
            return 1
    print_summary(console, result)
    return 0


def _live_page(args: argparse.Namespace, run_dir: Path) -> Any:
    """The run's live page on ``--live``'s address (loopback only from here: ``fedge serve`` serves
    it elsewhere, over TLS with a token), or None."""
    if getattr(args, "live", None) is None:
        return None
    from fedge.server.live.server import LivePage, LivePageError

    host, _, port = args.live.rpartition(":")
    try:
        return LivePage(run_dir, host or "127.0.0.1", int(port or 0))
    except (LivePageError, ValueError, OSError) as err:
        raise SettingsError(f"--live {args.live}: {err}") from None


def cloud_train_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line: torchrun itself does process management and rendezvous."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}"]
    if args.nnodes > 1:
        command += [f"--node-rank={args.node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={args.rdzv_endpoint}"]
    else:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        command += [f"--master-addr={host}", f"--master-port={port}"]
    train_args = [a for a in args.train_args if a != "--"]
    return [*command, "-m", "fedge.deploy.train", *train_args]


def _check_devices(args: argparse.Namespace) -> None:
    """Refuse, before torchrun starts, more processes on this node than it has GPUs for (each would
    crash inside its rank): the same rule every rank applies (``fedge.deploy.train.choose_device``)."""
    from fedge.deploy.train import DeviceError, choose_device, parse_args
    from fedge.tasks.device import gpu_count

    choice = parse_args([a for a in args.train_args if a != "--"]).device  # deploy.train's own parser
    try:
        choose_device(choice, 0, args.nproc_per_node, gpu_count())
    except DeviceError as err:
        raise SettingsError(f"cloud-train: {err}") from None


def _cloud_train(args: argparse.Namespace) -> int:
    import shlex
    import subprocess

    if "--out" not in args.train_args:
        raise SettingsError("cloud-train needs --out DIR among the deploy.train arguments")
    _check_devices(args)
    command = cloud_train_command(args)
    print(shlex.join(command))
    if args.print_only:
        return 0
    return subprocess.run(command, check=False).returncode


def _serve(args: argparse.Namespace) -> int:
    import json

    if args.example:
        from importlib.resources import files

        print(files("fedge.server.daemon").joinpath("fedge.example.toml").read_text(encoding="utf-8"), end="")
        return 0
    from fedge.server.daemon.json_logs import configure_json_logging
    from fedge.server.daemon.service_config import load_service_config

    configure_json_logging(logging.DEBUG if args.verbose else logging.INFO)
    config = load_service_config(args.config)
    if args.check_config:
        print(json.dumps(config.describe(), indent=2))
        return 0
    from fedge.server.daemon.serve import Daemon

    daemon = Daemon(config)
    daemon.install_signal_handlers()
    return daemon.run()


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:  # a user's task or plugin modules import from here, as in Flower
        sys.path.append(os.getcwd())
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # SIGTERM takes the Ctrl-C path, so every started process is stopped either way.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if args.command == "settings":
            from fedge.launcher.environment import toml_value

            for option in OPTIONS:  # defaults as they are written in TOML and in --run-config
                default = toml_value(option.default) if isinstance(option.default, (bool, str)) else repr(option.default)
                print(f"{option.key:<20} {default:<36} {option.help}")
            return 0
        if args.command == "demo":
            return _run(args, "simulation", args.clients)
        if args.command == "local-cluster":
            return _run(args, "deployment", args.supernodes)
        if args.command == "cloud-train":
            return _cloud_train(args)
        if args.command == "new":
            from fedge.server.cli.new_project import new_project

            written = new_project(args.dir, args.template, force=args.force)
            print(f"created {', '.join(str(p) for p in written)}\n"
                  f"next: cd {args.dir} && flwr run . --stream      (or: fedge demo --app {args.dir})\n"
                  f"your model and data: {Path(args.dir) / 'task.py'}")
            return 0
        if args.command == "keys":
            return run_keys(args)
        if args.command == "export":
            return run_export(args)
        if args.command == "certs":
            return run_certs(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "flower-app":
            from fedge.server.flower_app import stage_fedge_app

            out = Path(args.out).resolve()
            if out.exists() and any(out.iterdir()) and "Generated by Fedge" not in (
                    (out / "pyproject.toml").read_text() if (out / "pyproject.toml").is_file() else ""):
                raise SettingsError(f"--out {out} exists and is not a Fedge app directory: give a new one")
            stage_fedge_app(out)
            print(f"Flower app written to {out}: flwr run {args.out} <connection>")
            return 0
    except (SettingsError, ValueError, CertificateError, RegistrationError, OSError, PluginError) as err:
        # OSError covers a missing file, a port already in use (the daemon's metrics address) and a
        # SuperLink that never listened (TimeoutError)
        print(f"fedge: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedge: interrupted; all started processes were stopped", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


def run() -> None:
    """The ``fedge`` command: :func:`main`, then an exit that skips the interpreter's teardown.

    Tearing down the modules a run imported (torch, flwr-datasets, Ray's client) took about 1 s
    after the summary was printed. Every file the command writes is written and closed (atomically)
    before :func:`main` returns, every process it started is stopped, and it registers no exit
    handler, so only the output streams and the logging handlers need flushing first.
    """
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
