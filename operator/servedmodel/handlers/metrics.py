"""The operator's own Prometheus metrics, on one registry served at OperatorConfig.metrics_port.

`REGISTRY` is the registry every operator metric goes to (the probe's metrics too): define new ones
with `registry=REGISTRY`. Names start with `servedmodel_`. It is served in the text format (0.0.4), piece
by piece, by prober/series.Registry.exposition_chunks: the per-ServedModel families write their own lines,
the rest go through prometheus_client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
import time
import zlib
from collections import Counter as CounterType
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer, gzip_accepted
from prometheus_client.registry import Collector

from servedmodel.api.base import Obj
from servedmodel.config import OperatorConfig
from servedmodel.controller import Controller
from servedmodel.k8s import ApiError, Cache, KubeClient
from servedmodel.k8s.informer import Informers
from servedmodel.k8s.leader import LeaderElector
from servedmodel.prober.series import Registry

log = logging.getLogger(__name__)

REGISTRY = Registry()

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
    "HTTP requests the operator's Kubernetes clients (the workers' and the Leases') have sent to the API "
    "server (retries included); watches included (servedmodel_kube_api_requests_by_verb splits this by "
    "verb and code).",
    registry=REGISTRY,
)


class _LoopCollector(Collector):
    """The control loop's figures, read at scrape time from the objects that keep them."""

    def __init__(
        self,
        clients: Sequence[KubeClient],
        cache: Cache,
        controller: Controller,
        informers: Informers | None = None,
        elector: LeaderElector | None = None,
    ) -> None:
        self.clients, self.cache, self.controller = clients, cache, controller
        self.informers, self.elector = informers, elector

    def collect(self) -> Iterator[Metric]:
        by_verb = CounterMetricFamily(
            "servedmodel_kube_api_requests_by_verb",
            "HTTP requests of the operator's Kubernetes clients by method and status code (0: no answer).",
            labels=["verb", "code"],
        )
        requests: CounterType[tuple[str, int]] = CounterType()
        slot_wait: defaultdict[str, float] = defaultdict(float)
        response: defaultdict[str, float] = defaultdict(float)
        for client in self.clients:
            requests.update(client.requests)
            waited, answered = client.request_seconds
            for into, values in ((slot_wait, waited), (response, answered)):
                for verb, seconds in values.items():
                    into[verb] += seconds
        for (verb, code), n in sorted(requests.items()):
            by_verb.add_metric([verb, str(code)], n)
        yield by_verb
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
            "servedmodel_kube_api_in_flight",
            "Kubernetes API requests in flight now.",
            sum(c.in_flight for c in self.clients),
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
        for kind in self.cache.kinds():
            objects.add_metric([kind], self.cache.count(kind))
        yield objects
        yield from self._watches()

    def _watches(self) -> Iterator[Metric]:
        if self.informers is not None:
            synced = GaugeMetricFamily(
                "servedmodel_informer_synced",
                "1 once the watch listed its kind into the cache, and while no error is outstanding.",
                labels=["watch"],
            )
            relists = CounterMetricFamily(
                "servedmodel_informer_relists",
                "Full lists of the watched kind (start, 410, backstop).",
                labels=["watch"],
            )
            errors = CounterMetricFamily(
                "servedmodel_informer_errors",
                "Failed lists and watches (each retried with backoff).",
                labels=["watch"],
            )
            for inf in self.informers.informers:
                synced.add_metric([inf.name], float(inf.synced.is_set() and inf.last_error is None))
                relists.add_metric([inf.name], inf.relists)
                errors.add_metric([inf.name], inf.errors)
            yield from (synced, relists, errors)
        leading = self.elector is None or self.elector.leading
        yield GaugeMetricFamily(
            "servedmodel_leader",
            "1 while this replica leads (reconciles and probes), else 0.",
            float(leading),
        )
        if self.elector is not None:
            yield CounterMetricFamily(
                "servedmodel_leader_transitions",
                "Times this replica became the leader.",
                self.elector.transitions,
            )
            yield CounterMetricFamily(
                "servedmodel_leader_election_requests",
                "API requests for the Lease, on a client of their own (counted in "
                "servedmodel_kube_api_requests too): a fixed cost, "
                "a PUT every retry period while leading (and a GET when that PUT is refused), a GET while "
                "following.",
                self.elector.requests,
            )


_COLLECTOR: list[_LoopCollector] = []


def watch_loop(
    clients: Sequence[KubeClient],
    cache: Cache,
    controller: Controller,
    informers: Informers | None = None,
    elector: LeaderElector | None = None,
) -> None:
    """Export the clients', cache's, controller's, informers' and leader election's figures (once per
    process; a restart replaces them)."""
    KUBE_REQUESTS.set_function(lambda: sum(c.request_count for c in clients))
    for old in _COLLECTOR:
        REGISTRY.unregister(old)
    _COLLECTOR[:] = [_LoopCollector(clients, cache, controller, informers, elector)]
    REGISTRY.register(_COLLECTOR[0])


for _result in ("applied", "refreshed", "invalid_spec", "apply_failed", "deferred", "error"):
    RECONCILE_TOTAL.labels(result=_result)  # export zeros from the start
for _kind in ("apply", "refresh"):
    RECONCILE_DURATION.labels(kind=_kind)


class MetricsAuthorizer:
    """Who may read /metrics, decided by the API server as controller-runtime's
    `filters.WithAuthenticationAndAuthorization` does: the caller's bearer token through a TokenReview
    (not authenticated: 401), then a SubjectAccessReview of that user for the non-resource URL (the
    request's path, verb the lowercased method; not allowed: 403; the ClusterRole
    servedmodel-metrics-reader grants `get` on /metrics). A failed review is 500.

    Decisions are reused, keyed by a hash of the token (never the token): an allow for `allow_ttl_s`
    (controller-runtime: 1 min authentication, 5 min authorisation), a 401/403 for `deny_ttl_s`, so a
    scrape every 30 s costs two API requests a minute at most. The reviews run on the operator's event
    loop (its one Kubernetes client); the metrics server's thread waits for them up to `timeout_s`."""

    MAX_ENTRIES = 4096

    def __init__(
        self,
        review: Callable[[Obj], Awaitable[Obj]],
        loop: asyncio.AbstractEventLoop,
        *,
        allow_ttl_s: float = 60.0,
        deny_ttl_s: float = 10.0,
        timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.review, self.loop = review, loop
        self.allow_ttl_s, self.deny_ttl_s, self.timeout_s = (
            allow_ttl_s,
            min(deny_ttl_s, allow_ttl_s),
            timeout_s,
        )
        self.clock = clock
        self._decisions: dict[tuple[str, str, str], tuple[float, int, str]] = {}
        self.reviews = 0  # API requests made (tests read it: a cached decision makes none)

    async def decide(self, authorization: str | None, verb: str, path: str) -> tuple[int, str]:
        """(HTTP status, message) for a request with this Authorization header."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401, "Unauthorized: a bearer token is required"
        key = (hashlib.sha256(token.encode()).hexdigest(), verb, path)
        now = self.clock()
        cached = self._decisions.get(key)
        if cached is not None and cached[0] > now:
            return cached[1], cached[2]
        try:
            code, message = await self._review(token, verb, path)
        except ApiError as e:
            log.warning("/metrics: %s review failed: %s %s", "token or access", e.status, e.reason)
            return 500, "Authentication or authorization failed"
        if code != 500:
            if len(self._decisions) >= self.MAX_ENTRIES:
                self._decisions = {k: v for k, v in self._decisions.items() if v[0] > now}
                if len(self._decisions) >= self.MAX_ENTRIES:
                    self._decisions.clear()
            ttl = self.allow_ttl_s if code == 200 else self.deny_ttl_s
            self._decisions[key] = (now + ttl, code, message)
        return code, message

    async def _review(self, token: str, verb: str, path: str) -> tuple[int, str]:
        self.reviews += 1
        tr = await self.review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        )
        status = tr.get("status") or {}
        if not status.get("authenticated"):
            return 401, "Unauthorized"
        user = status.get("user") or {}
        spec: Obj = {
            "user": user.get("username"),
            "groups": user.get("groups") or [],
            "nonResourceAttributes": {"path": path, "verb": verb},
        }
        if user.get("uid"):
            spec["uid"] = user["uid"]
        if user.get("extra"):
            spec["extra"] = user["extra"]
        self.reviews += 1
        sar = await self.review(
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
        )
        if (sar.get("status") or {}).get("allowed"):
            return 200, "ok"
        return 403, f"Authorization denied for user {user.get('username')}"

    def decide_blocking(self, authorization: str | None, verb: str, path: str) -> tuple[int, str]:
        """`decide` from another thread (the metrics server's), bounded by timeout_s."""
        future = asyncio.run_coroutine_threadsafe(self.decide(authorization, verb, path), self.loop)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return 500, "Authentication or authorization timed out"


def authorizer(config: OperatorConfig, client: KubeClient) -> MetricsAuthorizer | None:
    """The /metrics authorizer the config asks for (None: SERVEDMODEL_METRICS_AUTH=false, local dev);
    call it on the operator's event loop."""
    if not config.metrics_auth:
        return None
    return MetricsAuthorizer(
        client.create_review, asyncio.get_running_loop(), allow_ttl_s=config.metrics_auth_cache_seconds
    )


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:  # no access log on stderr
        return None


def exposition_app(registry: Registry) -> Callable[..., Any]:
    """GET (or HEAD) any path: the registry in the text format, gzipped where the scraper accepts it, only
    the families a `name[]` query names (as prometheus_client's app serves them). The body is sent piece
    by piece as it is written (no Content-Length: the response ends when the connection closes), so a
    scrape holds one piece of the text at a time, not the whole of it."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = str(environ.get("REQUEST_METHOD") or "GET")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [f"# {method}: use GET\n".encode()]
        params = parse_qs(str(environ.get("QUERY_STRING") or ""))
        names = set(params["name[]"]) if "name[]" in params else None
        headers = [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)]
        gzipped = gzip_accepted(str(environ.get("HTTP_ACCEPT_ENCODING") or ""))
        if gzipped:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        if method == "HEAD":
            return [b""]
        body = registry.exposition_chunks(names)
        return _gzipped(body) if gzipped else body

    return app


def _gzipped(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """One gzip member (what gzip.compress writes) of the chunks, compressed as they come."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # 16+: a gzip header and trailer
    for chunk in chunks:
        if out := z.compress(chunk):
            yield out
    yield z.flush()


def metrics_app(auth: MetricsAuthorizer | None) -> Callable[..., Any]:
    """REGISTRY's exposition, behind `auth` when there is one."""
    inner = exposition_app(REGISTRY)
    if auth is None:
        return inner

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        verb = str(environ.get("REQUEST_METHOD") or "GET").lower()
        path = str(environ.get("PATH_INFO") or "/")
        code, message = auth.decide_blocking(environ.get("HTTP_AUTHORIZATION"), verb, path)
        if code != 200:
            body = f"{message}\n".encode()
            reason = {401: "Unauthorized", 403: "Forbidden"}.get(code, "Internal Server Error")
            headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
            if code == 401:
                headers.append(("WWW-Authenticate", 'Bearer realm="servedmodel-operator"'))
            start_response(f"{code} {reason}", headers)
            return [body]
        return inner(environ, start_response)

    return app


def serve(
    port: int, address: str = "0.0.0.0", auth: MetricsAuthorizer | None = None
) -> tuple[WSGIServer, threading.Thread] | None:
    """Start /metrics on a daemon thread (behind `auth` unless None); None when port is 0 (off). Stop
    with `server.shutdown()`."""
    if not port:
        return None
    server = make_server(address, port, metrics_app(auth), ThreadingWSGIServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
