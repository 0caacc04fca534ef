"""Command lines of Flower's own processes, with or without TLS and SuperNode authentication.

One place builds the ``flower-superlink`` / ``flower-supernode`` argv, the ``flwr`` connection
(``$FLWR_HOME/config.toml``) and the node registration, for ``fedge local-cluster``, ``fedge serve``
and ``fedge-edge join`` alike, so the secure and the plaintext path cannot drift apart.

Flower 1.41's security model (``../shared/reference/FLOWER.md``): the SuperLink serves TLS on its one
HTTP port (``--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile``); a SuperNode checks the server against
the CA (``--root-certificates``) and signs every request with its EC key
(``--auth-supernode-private-key``); with ``--enable-supernode-auth`` the SuperLink accepts only keys
registered through ``flwr supernode register``. An unregistered node exits (Flower code 305); a
plaintext node never gets past the TLS handshake.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedge.deploy.certs import (
    CA_CERT,
    SERVER_CERT,
    SERVER_KEY,
    identity_node_config,
    init_ca,
    issue_server_certificate,
    make_node_key,
)
from fedge.launcher.flower_cli import FlowerCli, FlowerCliError, json_replies

__all__ = [
    "LoopbackSecurity",
    "RegistrationError",
    "ServerTLS",
    "register_node",
    "register_nodes",
    "superlink_argv",
    "supernode_argv",
    "write_connection",
]

#: Flower's code for a SuperNode whose key the SuperLink refuses: logged as "Exit Code: 305"
#: (the process itself exits with status 1).
EXIT_NODE_REFUSED = 305


class RegistrationError(RuntimeError):
    """``flwr supernode register`` failed; the message carries its output."""


@dataclass(frozen=True)
class ServerTLS:
    """The SuperLink's TLS files (PEM) and whether only registered SuperNodes may connect."""

    ca_cert: Path
    certificate: Path
    key: Path
    node_auth: bool = True

    def argv(self) -> list[str]:
        flags = ["--ssl-ca-certfile", str(self.ca_cert), "--ssl-certfile", str(self.certificate),
                 "--ssl-keyfile", str(self.key)]
        return flags + (["--enable-supernode-auth"] if self.node_auth else [])

    def check(self) -> None:
        missing = [str(p) for p in (self.ca_cert, self.certificate, self.key) if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"TLS files not found: {', '.join(missing)} (make them with `fedge certs`)")


@dataclass(frozen=True)
class LoopbackSecurity:
    """Certificates for a whole federation on one machine (``fedge local-cluster --tls``): a CA,
    a server certificate for 127.0.0.1/localhost and one key per SuperNode, kept in ``directory``
    (made once, reused when the run resumes)."""

    directory: Path

    @classmethod
    def create(cls, directory: Path, nodes: int) -> LoopbackSecurity:
        directory.mkdir(parents=True, exist_ok=True)
        if not (directory / CA_CERT).exists():
            init_ca(directory, name="Fedge local-cluster CA", force=True)
            issue_server_certificate(directory, ["127.0.0.1", "localhost"], force=True)
        for i in range(nodes):
            if not (directory / f"node-{i}").exists():
                make_node_key(directory, f"node-{i}", force=True)
        return cls(directory)

    @property
    def server(self) -> ServerTLS:
        d = self.directory
        return ServerTLS(d / CA_CERT, d / SERVER_CERT, d / SERVER_KEY, node_auth=True)

    def node_key(self, index: int) -> Path:
        return self.directory / f"node-{index}"

    def node_identity(self, index: int) -> dict[str, str]:
        """Node config for SuperNode ``index``'s secure-aggregation identity, issued by this CA
        (its key's endorsement, written with the key), when there is one."""
        return identity_node_config(self.node_key(index), self.directory / CA_CERT)

    def issue_secure_aggregation(self, spec: str) -> str:
        """``spec`` with this CA as its identity issuer: a TLS federation trusts no identity on
        first use (its devices are issued theirs and refuse rounds that would)."""
        if not spec or spec.strip().lower() == "none" or "issuer=" in spec:
            return spec
        return f"{spec}{',' if ':' in spec else ':'}issuer={self.directory / CA_CERT}"


def superlink_argv(host: str, port: int, tls: ServerTLS | None, *, database: Path | None = None,
                   simulation: bool = False) -> list[str]:
    argv = ["flower-superlink", "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]
    argv += tls.argv() if tls else ["--insecure"]
    if database is not None:
        argv += ["--database", str(database)]
    if simulation:
        argv.append("--simulation")
    return argv


def supernode_argv(superlink: str, port: int, node_config: str, *, root_cert: Path | None = None,
                   auth_key: Path | None = None, extra: list[str] | None = None) -> list[str]:
    """A SuperNode dialing ``superlink`` (``host:port``); plaintext only without ``root_cert``."""
    argv = ["flower-supernode", "--superlink", superlink, "--port", str(port), "--node-config", node_config]
    if root_cert is None:
        argv.append("--insecure")
    else:
        argv += ["--root-certificates", str(root_cert)]
    if auth_key is not None:
        argv += ["--auth-supernode-private-key", str(auth_key)]
    return argv + list(extra or [])


def write_connection(flwr_home: Path, name: str, address: str, root_cert: Path | None) -> None:
    """The ``flwr`` CLI's connection ``name`` in ``$FLWR_HOME/config.toml`` (the only one there)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    security = f'root-certificates = "{root_cert}"\n' if root_cert else "insecure = true\n"
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\n{security}'
    )


def register_nodes(keys: Sequence[tuple[Path, str | None]], connection: str, env: Mapping[str, str], *,
                   registered_ok: bool = False, timeout: float = 60.0,
                   cli: FlowerCli | None = None) -> list[int | None]:
    """Register SuperNodes' public keys (each with its name, or None) with Flower's own ``flwr
    supernode register``, all in one process (``cli``, a caller's helper that stays up, such as the
    daemon's; else one for these keys: :class:`~fedge.launcher.flower_cli.FlowerCli`); their node
    ids, in order (None: the key was registered before, with ``registered_ok``). A key Flower refuses
    raises :class:`RegistrationError` with Flower's answer, after every key was tried."""
    if not keys:
        return []
    answers = []
    # a helper of its own runs in the keys' directory, never a user's project (``FlowerCli``'s ``cwd``)
    helper = contextlib.nullcontext(cli) if cli is not None else FlowerCli(env, cwd=Path(keys[0][0]).resolve().parent)
    with helper as flwr:
        for key, name in keys:
            try:
                code, text = flwr.call(["supernode", "register", str(Path(key).resolve()), connection, "--format",
                                        "json", *(["--name", name] if name else [])], timeout=timeout)
            except FlowerCliError as err:
                raise RegistrationError(f"flwr supernode register {key} failed: {err}") from None
            replies = json_replies(text)
            if len(replies) != 1 or not isinstance(replies[0], dict):
                raise RegistrationError(f"flwr supernode register {key} failed ({code}): {text.strip()[-800:]}")
            answers.append(replies[0])
    ids: list[int | None] = []
    for (key, _), reply in zip(keys, answers):
        message = str(reply.get("error-message", ""))
        if reply.get("success") and "node-id" in reply:
            ids.append(int(reply["node-id"]))
        elif registered_ok and "already in use" in message:
            ids.append(None)
        else:
            raise RegistrationError(f"flwr supernode register {key} failed: {message.strip()[-800:]}")
    return ids


def register_node(public_key: Path, connection: str, env: Mapping[str, str], *, name: str | None = None,
                  timeout: float = 60.0) -> int:
    """Register one SuperNode's public key (:func:`register_nodes`); its node id."""
    (node,) = register_nodes([(public_key, name)], connection, env, timeout=timeout)
    assert node is not None
    return node
