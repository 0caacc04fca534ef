"""``fedge certs``: a federation's CA, the SuperLink's TLS certificate and SuperNode keys.

    fedge certs init     --dir certs                               # ca.crt + ca.key (keep ca.key offline)
    fedge certs server   --dir certs --host coordinator.example.org --host 10.0.0.5
    fedge certs node     --dir certs --name device-1               # device-1 (private) + device-1.pub
    fedge certs register certs/device-1.pub --superlink coordinator.example.org:9093 --root-cert certs/ca.crt
    fedge certs revoke   --dir certs --name device-1               # certs/revocations.fedge, signed by the CA

``register`` runs Flower's own ``flwr supernode register`` against the running SuperLink.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

__all__ = ["add_certs_parser", "run_certs"]


def add_certs_parser(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser("certs", help="CA, SuperLink TLS certificate and SuperNode keys (no OpenSSL needed)",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = certs.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="create the federation's CA (ca.crt, ca.key)")
    server = actions.add_parser("server", help="issue server.crt/server.key for the SuperLink, signed by the CA")
    node = actions.add_parser("node", help="make a SuperNode key pair (EC P-384, OpenSSH format)")
    for parser in (init, server, node):
        parser.add_argument("--dir", required=True, help="the certificate directory")
        parser.add_argument("--force", action="store_true", help="replace existing files")
    init.add_argument("--name", default="Fedge federation CA", help="the CA's common name")
    init.add_argument("--days", type=int, default=3650, help="the CA certificate's validity (default: 3650)")
    server.add_argument("--host", action="append", required=True,
                        help="a DNS name or IP address devices dial (repeatable)")
    server.add_argument("--days", type=int, default=397, help="the server certificate's validity (default: 397)")
    node.add_argument("--name", required=True, help="the node's name (the file name of its key)")
    node.add_argument("--days", type=float, default=365,
                      help="how long the node's endorsement (its secure-aggregation identity) is valid (default: 365)")
    revoke = actions.add_parser("revoke", help="revoke a node's endorsement (the CA-signed revocations.fedge)")
    revoke.add_argument("--dir", required=True, help="the certificate directory (with ca.key and <name>.pub)")
    revoke.add_argument("--name", required=True, help="the node to revoke")
    register = actions.add_parser("register", help="register a node's public key with a running SuperLink")
    register.add_argument("public_key", help="<name>.pub from `fedge certs node`")
    register.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink")
    register.add_argument("--root-cert", required=True, help="the CA certificate (ca.crt)")
    register.add_argument("--name", default=None, help="a name for the node on the SuperLink")


def run_certs(args: argparse.Namespace) -> int:
    from fedge.deploy.certs import init_ca, issue_server_certificate, make_node_key, revoke_node

    if args.certs_command == "init":
        path = init_ca(args.dir, name=args.name, days=args.days, force=args.force)
        print(f"CA certificate: {path} (give it to every device)\nCA key: {Path(args.dir) / 'ca.key'} "
              "(signs server certificates; keep it offline)")
    elif args.certs_command == "server":
        issued = issue_server_certificate(args.dir, args.host, days=args.days, force=args.force)
        print(f"server certificate: {issued.certificate} for {', '.join(issued.hosts)} "
              f"(valid until {issued.not_after:%Y-%m-%d})\nserver key: {issued.key} (the coordinator only)")
    elif args.certs_command == "node":
        key = make_node_key(args.dir, args.name, force=args.force, days=args.days)
        print(f"node key: {key.private_key} (copy to the device only)\npublic key: {key.public_key} "
              f"({key.fingerprint}); register it: fedge certs register {key.public_key} --superlink HOST:PORT "
              f"--root-cert {Path(args.dir) / 'ca.crt'}")
        if key.endorsement is not None:
            print(f"endorsement: {key.endorsement} (copy to the device next to its key: its secure-aggregation "
                  "identity is then issued by this CA)")
    elif args.certs_command == "revoke":
        path = revoke_node(args.dir, args.name)
        print(f"revoked {args.name}: {path} (copy it next to ca.crt on the coordinator and every device; "
              "each refuses this node's identity from then on)")
    else:
        from fedge.launcher.environment import flower_environment
        from fedge.launcher.federation import register_node, write_connection

        with tempfile.TemporaryDirectory(prefix="fedge-register-") as home:
            write_connection(Path(home), "target", args.superlink, Path(args.root_cert).resolve())
            node_id = register_node(Path(args.public_key), "target", flower_environment(Path(home)), name=args.name)
        print(f"registered {args.public_key} as node {node_id}")
    return 0
