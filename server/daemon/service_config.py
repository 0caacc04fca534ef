"""``fedge.toml``: everything the coordinator daemon (``fedge serve``) needs, checked before it starts.

.. code-block:: toml

    [service]
    address = "0.0.0.0:9093"          # where the SuperLink listens (devices dial this port)
    dial = "127.0.0.1:9093"           # how the daemon itself reaches it (default: loopback, same port)
    state-dir = "/var/lib/fedge"      # SuperLink database, the run directory, logs
    metrics-address = "127.0.0.1:9100"   # /metrics (Prometheus) and /healthz; "" turns it off
    page-address = "127.0.0.1:9101"   # the live page of the federation; "" turns it off
    page-token-file = "page.token"    # beyond loopback: the page needs this token (and TLS, the tls-* files)
    tls-ca = "certs/ca.crt"           # from `fedge certs init` / `fedge certs server`
    tls-cert = "certs/server.crt"
    tls-key = "certs/server.key"
    node-auth = true                  # only registered SuperNode keys may connect (needs TLS)
    register-keys = ["certs/device-1.pub"]   # registered at start (already registered is fine)
    insecure = false                  # plaintext outside loopback needs this, and logs a warning
    stop-grace-seconds = 300          # SIGTERM: how long the current round may take to finish
    run-retries = 3                   # a failed run restarts from its checkpoint this many times in a row

    [run]                             # the run settings: the keys of [tool.flwr.app.config]
    rounds = 30
    algorithm = "fedavg"
    codec = "qsgd:bits=4,bucket=512,norm=max"

Rules (each a :class:`ServiceConfigError` naming the key): TLS is on for any non-loopback address
unless ``insecure = true``; ``node-auth`` needs TLS; the server certificate must name the host the
daemon dials, match its key and be valid now; every ``[run]`` key is a known setting and passes the
same preflight as ``fedge demo``. Relative paths are relative to the config file.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fedge.launcher.addresses import is_loopback
from fedge.launcher.federation import ServerTLS
from fedge.server.settings import RunSettings, SettingsError

__all__ = ["ServiceConfig", "ServiceConfigError", "load_service_config"]

log = logging.getLogger(__name__)

_SERVICE_KEYS = {
    "address", "dial", "state-dir", "metrics-address", "tls-ca", "tls-cert", "tls-key", "node-auth",
    "register-keys", "insecure", "stop-grace-seconds", "node-poll-seconds", "run-retries", "page-address",
    "page-token-file",
}


class ServiceConfigError(ValueError):
    """The daemon's configuration cannot work; the message names the key."""


@dataclass(frozen=True)
class ServiceConfig:
    source: Path
    host: str
    port: int
    dial: str  # host:port for this daemon's own `flwr` calls
    state_dir: Path
    metrics_host: str | None
    metrics_port: int
    tls: ServerTLS | None
    register_keys: tuple[Path, ...]
    insecure: bool
    stop_grace_seconds: float
    node_poll_seconds: float
    settings: RunSettings
    #: restarts after a failed run (SuperLink or ServerApp) without a round completing in between
    run_retries: int = 3
    #: the live page (``fedge.server.live``): where, and the token it needs beyond loopback
    page_host: str | None = None
    page_port: int = 0
    page_token: str | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.settings.run_dir)

    @property
    def database(self) -> Path:
        return self.state_dir / "superlink.db"

    def describe(self) -> dict[str, Any]:
        return {
            "config": str(self.source), "address": f"{self.host}:{self.port}", "dial": self.dial,
            "state_dir": str(self.state_dir), "run_dir": str(self.run_dir),
            "metrics": f"http://{self.metrics_host}:{self.metrics_port}/metrics" if self.metrics_host else None,
            "page": (f"{'https' if self.page_token else 'http'}://{self.page_host}:{self.page_port}/"
                     if self.page_host else None),
            "tls": self.tls is not None, "node_auth": bool(self.tls and self.tls.node_auth),
            "register_keys": [str(p) for p in self.register_keys],
            "run": {k: v for k, v in self.settings.to_run_config().items()},
        }


def _split_address(value: Any, key: str) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise ServiceConfigError(f"[service] {key} must be 'host:port', got {value!r}")
    host, _, port_text = value.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ServiceConfigError(f"[service] {key}: port must be a number, got {port_text!r}") from None
    if not host or not 0 < port < 65536:
        raise ServiceConfigError(f"[service] {key} must be 'host:port' with a port in 1..65535, got {value!r}")
    return host, port


def _path(base: Path, value: Any, key: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ServiceConfigError(f"[service] {key} must be a path, got {value!r}")
    path = Path(value).expanduser()
    return (path if path.is_absolute() else base / path).resolve()


def _check_certificate(tls: ServerTLS, dial_host: str) -> None:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    for key, path in (("tls-ca", tls.ca_cert), ("tls-cert", tls.certificate), ("tls-key", tls.key)):
        if not path.is_file():
            raise ServiceConfigError(f"[service] {key}: {path} does not exist (make it with `fedge certs`)")
    try:
        cert = x509.load_pem_x509_certificate(tls.certificate.read_bytes())
        ca = x509.load_pem_x509_certificate(tls.ca_cert.read_bytes())
        key = serialization.load_pem_private_key(tls.key.read_bytes(), password=None)
    except ValueError as err:
        raise ServiceConfigError(f"[service] TLS files unreadable: {err}") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as err:
        raise ServiceConfigError(f"[service] tls-cert {tls.certificate} is not signed by tls-ca {tls.ca_cert}: "
                                 f"{type(err).__name__}") from None
    if cert.public_key().public_numbers() != key.public_key().public_numbers():  # type: ignore[union-attr]
        raise ServiceConfigError(f"[service] tls-key {tls.key} does not belong to tls-cert {tls.certificate}")
    now = dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ServiceConfigError(f"[service] tls-cert {tls.certificate} is not valid now "
                                 f"({cert.not_valid_before_utc:%Y-%m-%d} .. {cert.not_valid_after_utc:%Y-%m-%d})")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise ServiceConfigError(f"[service] tls-cert {tls.certificate} names no hosts (no SAN)") from None
    names = set(san.get_values_for_type(x509.DNSName)) | {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    if dial_host not in names:
        raise ServiceConfigError(
            f"[service] tls-cert names {sorted(names)} but the daemon dials {dial_host!r}: issue it with "
            f"`fedge certs server --host {dial_host} --host <the name devices dial>`"
        )


def load_service_config(path: str | Path) -> ServiceConfig:
    source = Path(path).resolve()
    try:
        raw = tomllib.loads(source.read_text())
    except OSError as err:
        raise ServiceConfigError(f"cannot read {source}: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ServiceConfigError(f"{source} is not valid TOML: {err}") from None
    unknown_tables = set(raw) - {"service", "run"}
    if unknown_tables:
        raise ServiceConfigError(f"unknown tables {sorted(unknown_tables)}; expected [service] and [run]")
    service, run = raw.get("service", {}), raw.get("run", {})
    unknown = set(service) - _SERVICE_KEYS
    if unknown:
        raise ServiceConfigError(f"unknown [service] keys {sorted(unknown)}; known: {', '.join(sorted(_SERVICE_KEYS))}")
    base = source.parent
    host, port = _split_address(service.get("address", "127.0.0.1:9093"), "address")
    dial_host, dial_port = _split_address(
        service.get("dial", f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"), "dial")
    state_dir = _path(base, service.get("state-dir", "fedge-state"), "state-dir")
    metrics = service.get("metrics-address", "127.0.0.1:9100")
    metrics_host, metrics_port = _split_address(metrics, "metrics-address") if metrics else (None, 0)
    insecure = service.get("insecure", False)
    if not isinstance(insecure, bool):
        raise ServiceConfigError(f"[service] insecure must be true or false, got {insecure!r}")
    tls_keys = [k for k in ("tls-ca", "tls-cert", "tls-key") if k in service]
    tls = None
    if tls_keys:
        if len(tls_keys) != 3:
            raise ServiceConfigError(f"[service] TLS needs tls-ca, tls-cert and tls-key; only {tls_keys} given")
        if insecure:
            raise ServiceConfigError("[service] insecure = true contradicts the tls-* files: choose one")
        node_auth = service.get("node-auth", True)
        if not isinstance(node_auth, bool):
            raise ServiceConfigError(f"[service] node-auth must be true or false, got {node_auth!r}")
        tls = ServerTLS(_path(base, service["tls-ca"], "tls-ca"), _path(base, service["tls-cert"], "tls-cert"),
                        _path(base, service["tls-key"], "tls-key"), node_auth=node_auth)
        _check_certificate(tls, dial_host)
    else:
        if service.get("node-auth", False):
            raise ServiceConfigError("[service] node-auth needs TLS (tls-ca, tls-cert, tls-key)")
        if not is_loopback(host) and not insecure:
            raise ServiceConfigError(
                f"[service] address {host}:{port} is not loopback: give tls-ca/tls-cert/tls-key (see `fedge certs`) "
                "or set insecure = true to accept plaintext"
            )
        if not is_loopback(host):
            log.warning("plaintext SuperLink on %s:%d (insecure = true): updates and models travel unencrypted "
                        "and any device can join", host, port)
    page = service.get("page-address", "127.0.0.1:9101")
    page_host, page_port = _split_address(page, "page-address") if page else (None, 0)
    page_token = None
    if page_host and not is_loopback(page_host):
        if tls is None:
            raise ServiceConfigError(f"[service] page-address {page}: beyond loopback the live page needs TLS "
                                     "(tls-ca, tls-cert, tls-key) and page-token-file")
        if "page-token-file" not in service:
            raise ServiceConfigError(f"[service] page-address {page}: beyond loopback the live page needs "
                                     "page-token-file (a file holding the token a viewer gives as ?token=)")
        token_path = _path(base, service["page-token-file"], "page-token-file")
        try:
            page_token = token_path.read_text(encoding="utf-8").strip()
        except OSError as err:
            raise ServiceConfigError(f"[service] page-token-file {token_path}: {err}") from None
        if len(page_token) < 16:
            raise ServiceConfigError(f"[service] page-token-file {token_path}: the token must be at least 16 "
                                     "characters (e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)")
    keys = service.get("register-keys", [])
    if not isinstance(keys, list):
        raise ServiceConfigError("[service] register-keys must be a list of public key paths")
    register_keys = tuple(_path(base, k, "register-keys") for k in keys)
    for key in register_keys:
        if not key.is_file():
            raise ServiceConfigError(f"[service] register-keys: {key} does not exist")
    if register_keys and not (tls and tls.node_auth):
        raise ServiceConfigError("[service] register-keys needs node-auth with TLS")
    numbers = {}
    for key, default in (("stop-grace-seconds", 300.0), ("node-poll-seconds", 30.0)):
        value = service.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ServiceConfigError(f"[service] {key} must be a positive number, got {value!r}")
        numbers[key] = float(value)
    retries = service.get("run-retries", 3)
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
        raise ServiceConfigError(f"[service] run-retries must be a whole number in 0..100, got {retries!r}")
    if not isinstance(run, dict):
        raise ServiceConfigError("[run] must be a table of run settings")
    try:
        settings = RunSettings.from_run_config(run)
    except SettingsError as err:
        raise ServiceConfigError(f"[run] {err}") from None
    settings = settings.replace(
        run_dir=str(_path(base, settings.run_dir, "run-dir") if settings.run_dir else state_dir / "run"))
    from fedge.server.preflight import preflight

    try:
        preflight(settings)
    except ValueError as err:
        raise ServiceConfigError(f"[run] {err}") from None
    return ServiceConfig(
        source=source, host=host, port=port, dial=f"{dial_host}:{dial_port}", state_dir=state_dir,
        metrics_host=metrics_host, metrics_port=metrics_port, tls=tls, register_keys=register_keys,
        insecure=insecure, stop_grace_seconds=numbers["stop-grace-seconds"],
        node_poll_seconds=numbers["node-poll-seconds"], settings=settings, run_retries=retries,
        page_host=page_host, page_port=page_port, page_token=page_token,
    )
