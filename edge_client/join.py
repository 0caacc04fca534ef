"""``fedge-edge join``: a device joins a federation with its own data, in one command.

It checks everything it can before connecting (the data file against the task, the key, the CA
certificate), then runs Flower's own ``flower-supernode`` with the Fedge ClientApp's node config::

    data="<own.npz>" threads=N state-dir="<dir>" [device="cpu|cuda|cuda:N"]

and supervises it. By default the SuperNode runs with Flower's ``--isolation process`` next to one warm
process (``fedge.edge_client.warm_executor``) that runs each message in a child forked from its
pre-imported parent, instead of a new ``flwr-clientapp`` process per message (``--isolation
subprocess``, Flower's default, opts out). When the SuperNode exits (the network or the SuperLink went away for longer than
Flower's own retries) it is started again with a growing pause (2 s doubling to 60 s); when the
SuperLink refuses the node's key (Flower code 305: not registered yet) it says so in the log and keeps
trying with the same pauses, since the operator may register it at any moment.
SIGTERM / Ctrl-C stop the SuperNode and exit 0. The error-feedback memory lives in ``state-dir``
(``edge_client/persistent_state.py``), so it survives this command's own restart too.

The process helpers come from the process layer (``fedge.launcher``): the same code starts
SuperNodes for ``fedge local-cluster``, the daemon and the tests; the device imports nothing of the
coordinator.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fedge.launcher.federation import EXIT_NODE_REFUSED
from fedge.protocol.device_policy import NO_DEFAULT_POLICY

__all__ = ["JoinError", "JoinOptions", "check_join", "join"]

log = logging.getLogger("fedge.edge.join")

#: how Flower logs a SuperNode whose key the SuperLink refused (``fedge.launcher.federation``)
_REFUSED = f"Exit Code: {EXIT_NODE_REFUSED}"


class JoinError(ValueError):
    """Something a device can fix before it connects (data, key, certificate, options)."""


@dataclass(frozen=True)
class JoinOptions:
    superlink: str
    data: Path
    task: str = "digits"
    root_cert: Path | None = None
    auth_key: Path | None = None
    insecure: bool = False
    threads: int = 1
    device: str = "auto"  # where training runs (fedge.tasks.device.resolve_device)
    state_dir: Path = Path("fedge-edge-state")
    port: int = 0
    max_restarts: int = -1  # -1: keep trying
    isolation: str = "warm"  # fedge.launcher.isolation: warm (default) or Flower's subprocess
    when: str = ""  # participation conditions, e.g. "charging,unmetered,idle" (edge_client.eligibility)
    max_rounds_per_day: int = 0  # 0: no budget
    max_mb_per_day: float = 0.0
    #: refuse any round without secure aggregation, and federated evaluation (edge_client.privacy_policy)
    require_secure_aggregation: bool = False
    #: take part only in secure rounds of at least this many devices (0: any)
    min_participants: int = 0
    #: take part only in secure rounds whose share threshold is above this fraction of the neighbours
    min_threshold: float = 0.0
    #: take part only in secure rounds with distributed DP of at least this noise multiplier and at
    #: most this clip (0: no requirement)
    dp_min_noise: float = 0.0
    dp_max_clip: float = 0.0
    #: the ClientApp this device runs, from its own installation (fedge.edge_client.device_code)
    client_app: str = "fedge.edge_client.app:app"
    #: modules a run's plugins or task may import on this device (installed ones only)
    allowed_modules: tuple[str, ...] = ()
    #: run whatever ClientApp the run's FAB ships (Flower's behaviour; with trusted_entities, signed)
    unpinned: bool = False
    #: Flower's FAB signature check (flower-supernode --trusted-entities YAML)
    trusted_entities: Path | None = None
    #: an issued identity's defaults (secure aggregation, 3 participants, 2/3 threshold) turned off
    no_default_policy: bool = False




def check_join(options: JoinOptions) -> str:
    """Validate everything before connecting; a one-line description of the device's data."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from cryptography.x509 import load_pem_x509_certificate

    from fedge.edge_client.node_data import DataFileError, load_npz
    from fedge.tasks import make_task

    if ":" not in options.superlink:
        raise JoinError(f"--superlink must be HOST:PORT, got {options.superlink!r}")
    if options.threads < 1:
        raise JoinError(f"--threads must be >= 1, got {options.threads}")
    from fedge.tasks.device import DeviceUnavailable, resolve_device

    try:
        resolve_device(options.device)
    except DeviceUnavailable as err:
        raise JoinError(f"--device: {err}") from None
    if not 0 <= options.min_threshold <= 1:
        raise JoinError(f"--min-threshold is a fraction of the neighbours in [0, 1], got {options.min_threshold}")
    if options.min_participants < 0 or options.dp_min_noise < 0 or options.dp_max_clip < 0:
        raise JoinError("--min-participants, --dp-min-noise and --dp-max-clip must be >= 0 (0: no requirement)")
    if options.max_rounds_per_day < 0 or options.max_mb_per_day < 0:
        raise JoinError("--max-rounds-per-day and --max-mb-per-day must be >= 0 (0: no budget)")
    if not options.unpinned and options.isolation != "warm":
        raise JoinError("--isolation subprocess runs the ClientApp the run's FAB ships (Flower's runtime loads it); "
                        "a device pinned to its installed code needs --isolation warm, or --unpinned to run the "
                        "FAB's code (with --trusted-entities: only FABs signed by a key you trust)")
    module, _, attribute = options.client_app.partition(":")
    if not module or not attribute:
        raise JoinError(f"--app must be MODULE:ATTRIBUTE, got {options.client_app!r}")
    if not options.unpinned:
        import importlib.util

        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise JoinError(f"--app {options.client_app}: module {module!r} is not installed on this device")
    from fedge.protocol.plugins import PluginError, plugin_modules

    try:
        plugin_modules(",".join(options.allowed_modules))
    except PluginError as err:
        raise JoinError(f"--allow-module: {err}") from None
    if options.trusted_entities is not None and not Path(options.trusted_entities).is_file():
        raise JoinError(f"--trusted-entities {options.trusted_entities}: no such file")
    from fedge.edge_client.eligibility import Policy
    from fedge.protocol.refusals import BadConfigRefusal

    try:
        Policy.from_node_config(dict(_node_config(options)))
    except BadConfigRefusal as err:
        raise JoinError(f"--when / budgets: {err}") from None
    if options.insecure and (options.root_cert or options.auth_key):
        raise JoinError("--insecure contradicts --root-cert/--auth-key: choose one")
    if not options.insecure and options.root_cert is None:
        raise JoinError("give --root-cert CA.crt (TLS), or --insecure for a plaintext test federation")
    if options.root_cert is not None:
        try:
            load_pem_x509_certificate(Path(options.root_cert).read_bytes())
        except (OSError, ValueError) as err:
            raise JoinError(f"--root-cert {options.root_cert}: not a readable PEM certificate ({err})") from None
    if options.auth_key is not None:
        try:
            key = load_ssh_private_key(Path(options.auth_key).read_bytes(), None)
        except (OSError, ValueError) as err:
            raise JoinError(f"--auth-key {options.auth_key}: not a readable OpenSSH private key ({err})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise JoinError(f"--auth-key {options.auth_key}: SuperNode keys are EC (`fedge certs node`)")
        _check_endorsement(options, key)
    try:
        task = make_task(options.task)
        data = load_npz(options.data, task)
    except DataFileError as err:
        raise JoinError(str(err)) from None
    except ValueError as err:
        raise JoinError(f"--task {options.task!r}: {err}") from None
    classes = sorted(set(data.y.tolist()))
    return f"{len(data)} samples of task {task.spec}, labels {classes}"


def _check_endorsement(options: JoinOptions, key) -> None:  # type: ignore[no-untyped-def]
    """An endorsement next to the key must be the federation CA's, for this key: found now, not
    when the first secure round refuses the device."""
    from fedge.privacy.credentials import CredentialError, bind_identity, load_issuer, verify_credential

    from fedge.deploy.certs import endorsement_path

    endorsement = endorsement_path(Path(options.auth_key))
    if not endorsement.exists() or options.root_cert is None:
        return
    probe = bytes(32)  # any identity: the check is of the endorsement's chain, not of the identity
    try:
        verify_credential(bind_identity(key, endorsement.read_bytes(), probe), probe, load_issuer(options.root_cert))
    except CredentialError as err:
        raise JoinError(f"{endorsement}: {err}") from None


def _node_config(options: JoinOptions) -> dict[str, str | int | float]:
    from fedge.edge_client.device_code import ALLOWED_MODULES, CLIENT_APP, DEVICE_CODE, PINNED

    config: dict[str, str | int | float] = {"data": str(Path(options.data).resolve()), "threads": options.threads,
                                            "state-dir": str(Path(options.state_dir).resolve())}
    if not options.unpinned:
        config.update({DEVICE_CODE: PINNED, CLIENT_APP: options.client_app})
        if options.allowed_modules:
            config[ALLOWED_MODULES] = ",".join(options.allowed_modules)
    if options.device != "auto":
        config["device"] = options.device
    if options.when:
        config["when"] = options.when
    if options.max_rounds_per_day:
        config["max-rounds-per-day"] = options.max_rounds_per_day
    if options.max_mb_per_day:
        config["max-mb-per-day"] = float(options.max_mb_per_day)
    if options.require_secure_aggregation:
        config["require-secure-aggregation"] = "true"
    if options.min_participants:
        config["min-participants"] = int(options.min_participants)
    if options.min_threshold:
        config["min-threshold"] = float(options.min_threshold)
    if options.dp_min_noise:
        config["dp-min-noise"] = float(options.dp_min_noise)
    if options.dp_max_clip:
        config["dp-max-clip"] = float(options.dp_max_clip)
    if options.auth_key is not None and options.root_cert is not None:
        from fedge.deploy.certs import identity_node_config

        # an endorsement next to the key (`fedge certs node` with the CA at hand): this device's
        # secure-aggregation identity is issued by the operator, and it trusts none on first use
        config.update(identity_node_config(Path(options.auth_key), Path(options.root_cert)))
    if issued_identity(config):
        if options.no_default_policy:
            config[NO_DEFAULT_POLICY] = "true"  # logged by the device at every message (privacy_policy)
        else:  # safe by default: the owner's own, stricter, values win
            config["require-secure-aggregation"] = "true"
            config["min-participants"] = max(int(config.get("min-participants", 0)), 3)
            config["min-threshold"] = max(float(config.get("min-threshold", 0.0)), 0.66)
    return config


def issued_identity(config: dict[str, str | int | float]) -> bool:
    """Whether the node config carries an identity the operator's CA issued (else: trust on first use)."""
    from fedge.deploy.certs import IDENTITY_NODE_CONFIG

    return all(config.get(key) for key in IDENTITY_NODE_CONFIG)


def join(options: JoinOptions, stop: threading.Event | None = None) -> int:
    """Run (and re-run) the SuperNode until stopped (0), or until ``max_restarts`` is used up (1)."""
    from fedge.launcher.environment import flower_environment, node_config_arg
    from fedge.launcher.federation import supernode_argv
    from fedge.launcher.isolation import choose_isolation, supernode_isolation_argv, warm_executor_argv, write_secret
    from fedge.launcher.processes import ProcessGroup, free_port

    stop = stop or threading.Event()
    state_dir = Path(options.state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    env = flower_environment(state_dir / "flwr-home")
    env.update({"OMP_NUM_THREADS": str(options.threads), "MKL_NUM_THREADS": str(options.threads)})
    isolation = choose_isolation(options.isolation)
    if isolation != "warm" and not options.unpinned:
        log.error("warm isolation is not available here, and Flower's subprocess isolation runs the code the "
                  "run's FAB ships: this device, pinned to its installed ClientApp, does not join (--unpinned "
                  "accepts the FAB's code; with --trusted-entities only signed FABs)")
        return 2
    secret = write_secret(state_dir / "superexec.secret") if isolation == "warm" else None
    port = options.port or free_port()
    argv = supernode_argv(
        options.superlink, port, node_config_arg(_node_config(options)),
        root_cert=None if options.insecure else Path(options.root_cert).resolve(),  # type: ignore[arg-type]
        auth_key=Path(options.auth_key).resolve() if options.auth_key else None,
        extra=[*supernode_isolation_argv(isolation, secret),
               *(["--trusted-entities", str(Path(options.trusted_entities).resolve())] if options.trusted_entities else [])],
    )
    config = _node_config(options)
    if issued_identity(config):
        log.info("secure-aggregation identity issued by the operator's CA; %s", "default policy OFF "
                 "(--no-default-policy): rounds in clear and small rounds are answered" if options.no_default_policy
                 else f"requiring secure aggregation, >= {config['min-participants']} participants, a share "
                 f"threshold above {config['min-threshold']} of the neighbours")
    else:
        log.warning("no identity issued by the operator's CA (--auth-key with its .endorsement and --root-cert): "
                    "this device trusts secure-aggregation identities on first use")
    log.info("device code: %s", "the run's FAB (--unpinned)" if options.unpinned else
             f"pinned to the installed {options.client_app}; modules allowed to runs: "
             f"{', '.join(options.allowed_modules) or 'none'}")
    # warm: one process with torch, Flower and Fedge imported, a child forked from it per message;
    # it outlives SuperNode restarts (it asks the Runtime API again until the node is back)
    warm_argv = (warm_executor_argv([(f"127.0.0.1:{port}", None)], secret, ledger=state_dir / "logs" / "warm-messages.jsonl")
                 if secret is not None else None)
    pause, restarts = 2.0, 0
    with ProcessGroup(state_dir / "logs", env=env, also_match={"FLWR_HOME": env["FLWR_HOME"]}) as group:
        warm = group.start("warm-executor", warm_argv, cwd=state_dir) if warm_argv else None
        warm_started = time.monotonic()
        while not stop.is_set():
            log_path = state_dir / "logs" / "supernode.log"
            offset = log_path.stat().st_size if log_path.exists() else 0
            node = group.start("supernode", argv, cwd=state_dir)
            started = time.monotonic()
            log.info("SuperNode started (pid %d), dialing %s; log %s", node.pid, options.superlink, node.log_path)
            while node.alive() and not stop.wait(0.5):
                # a warm process that died is started again, at most every 30 s (one that cannot start
                # must not spin: its log says why)
                if warm is not None and not warm.alive() and time.monotonic() - warm_started > 30:
                    log.error("the warm process exited (code %s); starting it again; log %s",
                              warm.popen.returncode, warm.log_path)
                    group.processes.remove(warm)
                    warm = group.start("warm-executor", warm_argv, cwd=state_dir)  # type: ignore[arg-type]
                    warm_started = time.monotonic()
            if stop.is_set():
                break
            with open(node.log_path, "rb") as handle:  # this start's output only (the log is appended)
                handle.seek(offset)
                refused = _REFUSED.encode() in handle.read()
            if refused:  # not registered (yet): the operator may register it any moment now
                log.error("the SuperLink refused this node's key: it must be registered "
                          "(fedge certs register %s.pub ...); trying again", options.auth_key)
            restarts += 1
            if 0 <= options.max_restarts < restarts:
                log.error("SuperNode exited %d times; giving up", restarts)
                return 1
            log.warning("SuperNode exited with code %s; restarting in %.0f s", node.popen.returncode, pause)
            group.processes.remove(node)
            if stop.wait(pause):
                break
            # a node that had been up for a while lost its SuperLink: start over with short pauses
            pause = 2.0 if time.monotonic() - started > 120 else min(60.0, pause * 2)
    return 0


def install_stop_signals(stop: threading.Event) -> None:
    def handler(signum: int, frame: object) -> None:
        log.info("signal %d: stopping the SuperNode", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "fedge-edge"
