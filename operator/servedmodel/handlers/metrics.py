"""The operator's own Prometheus metrics, on one registry served at OperatorConfig.metrics_port.

`REGISTRY` is the registry every operator metric goes to (the probe's metrics too): define new ones
with `registry=REGISTRY`. Names start with `servedmodel_`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servedmodel.controller import Controller
from servedmodel.k8s import Cache, KubeClient

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILE_TOTAL = Counter(
    "servedmodel_reconcile",
    "Reconciles of ServedModels by result: applied (children applied), refreshed (status from the cache), "
    "invalid_spec, apply_failed, deferred (Deployment controller behind: wait for its event), error.",
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
    "kopf's watches are not counted (servedmodel_kube_api_requests_by_verb splits this by verb and code).",
    registry=REGISTRY,
)


class _LoopCollector(Collector):
    """The control loop's figures, read at scrape time from the objects that keep them."""

    def __init__(self, client: KubeClient, cache: Cache, controller: Controller) -> None:
        self.client, self.cache, self.controller = client, cache, controller

    def collect(self) -> Iterator[Metric]:
        by_verb = CounterMetricFamily(
            "servedmodel_kube_api_requests_by_verb",
            "HTTP requests of the operator's Kubernetes client by method and status code (0: no answer).",
            labels=["verb", "code"],
        )
        for (verb, code), n in sorted(self.client.requests.items()):
            by_verb.add_metric([verb, str(code)], n)
        yield by_verb
        slot_wait, response = self.client.request_seconds
        for name, doc, values in (
            (
                "servedmodel_kube_api_slot_wait_seconds",
                "Seconds requests waited for one of the client's in-flight slots, by method.",
                slot_wait,
            ),
            (
                "servedmodel_kube_api_response_seconds",
                "Seconds from a request's slot to its response headers, by method (the API server's time "
                "plus the operator's own event-loop delays).",
                response,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["verb"])
            for verb, seconds in sorted(values.items()):
                family.add_metric([verb], seconds)
            yield family
        yield GaugeMetricFamily(
            "servedmodel_kube_api_in_flight", "Kubernetes API requests in flight now.", self.client.in_flight
        )
        q = self.controller.queue
        depth = GaugeMetricFamily(
            "servedmodel_workqueue_depth", "ServedModel keys in the work queue, by state.", labels=["state"]
        )
        depth.add_metric(["queued"], len(q))
        depth.add_metric(["delayed"], q.delayed)
        depth.add_metric(["in_process"], q.in_process)
        yield depth
        s = self.controller.stats
        for name, doc, value in (
            (
                "servedmodel_controller_reconciles",
                "Reconciles run by the controller's workers.",
                s.reconciles,
            ),
            ("servedmodel_controller_failures", "Reconciles that raised (retried with backoff).", s.failures),
            ("servedmodel_controller_resyncs", "Safety resyncs (every ServedModel enqueued).", s.resyncs),
            ("servedmodel_controller_enqueued", "enqueue() calls (before de-duplication).", s.enqueued),
        ):
            yield CounterMetricFamily(name, doc, value)
        objects = GaugeMetricFamily(
            "servedmodel_cache_objects", "Objects in the watch-fed cache.", labels=["kind"]
        )
        for kind in ("ServedModel", "Deployment", "Pod", "Service", "PersistentVolumeClaim"):
            objects.add_metric([kind], self.cache.count(kind))
        yield objects


_COLLECTOR: list[_LoopCollector] = []


def watch_loop(client: KubeClient, cache: Cache, controller: Controller) -> None:
    """Export the client's, cache's and controller's figures (once per process; a restart replaces them)."""
    KUBE_REQUESTS.set_function(lambda: client.request_count)
    for old in _COLLECTOR:
        REGISTRY.unregister(old)
    _COLLECTOR[:] = [_LoopCollector(client, cache, controller)]
    REGISTRY.register(_COLLECTOR[0])


for _result in ("applied", "refreshed", "invalid_spec", "apply_failed", "deferred", "error"):
    RECONCILE_TOTAL.labels(result=_result)  # export zeros from the start
for _kind in ("apply", "refresh"):
    RECONCILE_DURATION.labels(kind=_kind)


def serve(port: int, address: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread] | None:
    """Start /metrics on a daemon thread; None when port is 0 (off). Stop with `server.shutdown()`."""
    if not port:
        return None
    server, thread = start_http_server(port, addr=address, registry=REGISTRY)
    return server, thread
