"""The operator's own Prometheus metrics, on one registry served at OperatorConfig.metrics_port.

`REGISTRY` is the registry every operator metric goes to (the probe's metrics too): define new ones
with `registry=REGISTRY`. Names start with `servedmodel_`.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILE_TOTAL = Counter(
    "servedmodel_reconcile",
    "Reconciles of ServedModels by result: applied (children applied), refreshed (status only), "
    "invalid_spec, error.",
    ["result"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "servedmodel_reconcile_duration_seconds",
    "Wall time of one reconcile (apply or status refresh), seconds.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
STATUS_WRITES_TOTAL = Counter(
    "servedmodel_status_writes",
    "Status writes of the reconciler (one per observed change; none on a no-op resync).",
    registry=REGISTRY,
)
KUBE_REQUESTS = Gauge(
    "servedmodel_kube_api_requests",
    "HTTP requests the operator's Kubernetes client has sent to the API server (retries included); "
    "kopf's own watches and patches are not counted.",
    registry=REGISTRY,
)
for _result in ("applied", "refreshed", "invalid_spec", "error"):
    RECONCILE_TOTAL.labels(result=_result)  # export zeros from the start
for _kind in ("apply", "refresh"):
    RECONCILE_DURATION.labels(kind=_kind)


def serve(port: int, address: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread] | None:
    """Start /metrics on a daemon thread; None when port is 0 (off). Stop with `server.shutdown()`."""
    if not port:
        return None
    server, thread = start_http_server(port, addr=address, registry=REGISTRY)
    return server, thread
