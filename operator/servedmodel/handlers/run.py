"""`servedmodel run`: start the operator (kopf) against the current kubeconfig or service account.

kopf runs the process; leader election on a Lease picks the one replica that reconciles and probes.
/healthz and /readyz on OperatorConfig.health_port, the operator's metrics on OperatorConfig.metrics_port.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import MutableMapping

import kopf

from servedmodel.config import OperatorConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch this namespace (repeatable; globs like 'team-*'); default: SERVEDMODEL_NAMESPACES",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch every namespace (the default when none is set)",
    )
    parser.add_argument(
        "--bind-address",
        default="0.0.0.0",
        help="address of the liveness and metrics endpoints (default 0.0.0.0; tests use 127.0.0.1)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")


def name_this_process(environ: MutableMapping[str, str]) -> None:
    """kopf names the process by POD_ID, else by getpass.getuser(), which raises for a UID that has no
    /etc/passwd entry, the arbitrary UID OpenShift's restricted-v2 assigns (KeyError: 'getpwuid(): uid not
    found': the operator's pod exited 1 at start, CrashLoopBackOff). The pod's name (the Deployment's
    downward API POD_NAME), else host and pid: kopf's peering is off (standalone), the name only labels."""
    if not environ.get("POD_ID"):
        environ["POD_ID"] = environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def main(args: argparse.Namespace) -> int:
    name_this_process(os.environ)
    config = OperatorConfig()
    namespaces: list[str] = [] if args.all_namespaces else (args.namespaces or config.namespaces)
    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    for chatty in ("httpx", "httpx2"):  # one INFO line per request otherwise (httpx2: lightkube's)
        logging.getLogger(chatty).setLevel(logging.WARNING)

    import servedmodel.handlers  # noqa: F401  (registers the handlers with kopf)

    # /healthz and /readyz are the operator's own (handlers/health.py), on config.health_port.
    memo = kopf.Memo(config=config, bind_address=args.bind_address, namespaces=namespaces)
    # standalone: kopf's peering is not needed; one leader among the replicas is elected on a Lease
    # (k8s/leader.py). No kopf watch runs: the informers (k8s/informer.py) feed the cache.
    kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces, memo=memo)
    return 0
