"""Engine figures from Prometheus (e.g. OpenShift's Thanos querier) instead of scraping pods.

Prometheus' HTTP API is one request here: GET <url>/api/v1/query?query=<PromQL> returning a JSON
instant vector. It is sent on the caller's shared httpx.AsyncClient (the probe's connection pool), not
through prometheus-api-client: that library is synchronous (requests), so each query needed a worker
thread that asyncio cannot cancel (a timed-out query kept running), it opens its own requests session
(and has no public way to close it), and its failures all look alike. With httpx the query is a
coroutine: `asyncio.timeout` really stops it, connections are reused across cycles, and failures are
classified like the probe's own (ConnectionRefused, DNSFailure, ConnectTimeout, Unauthorized for a
refused bearer token, UnexpectedStatus with Prometheus' errorType, MalformedResponse). It also keeps
requests, dateparser and regex out of the operator image.

The bearer token is sent as a header and never logged or put in a message.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

import httpx

from . import bounds, errors
from .errors import ProbeFailure
from .metrics import GAUGES, MAX_GAUGES, MetricsSnapshot, snapshot_from_values, wanted_sample_names

QUERY_TIMEOUT_S: Final = 5.0
SETTLE_POLL_S: Final = 0.5
# Gateway answers of a querier behind a proxy (Thanos, oauth-proxy): worth a bounded retry.
RETRY_STATUSES: Final = (502, 503, 504)
RETRIES: Final = 2
RETRY_BACKOFF_S: Final = 0.2
QUERY_STEP: Final = "Prometheus GET /api/v1/query"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def selector(model: str | None, namespace: str | None, extra: str = "") -> str:
    """Label matchers (without braces) filtering on model_name and namespace."""
    parts = [extra] if extra else []
    if model is not None:
        parts.append(f'model_name="{_escape(model)}"')
    if namespace is not None:
        parts.append(f'namespace="{_escape(namespace)}"')
    return ",".join(parts)


def snapshot_queries(model: str | None, namespace: str | None) -> tuple[str, str, str]:
    """(sum by name of everything, max by name of the max-gauges, number of engine series)."""
    max_names = {n for k in MAX_GAUGES for n in GAUGES[k]}
    names = [n for n in wanted_sample_names() if n not in max_names]
    sum_sel = selector(model, namespace, f'__name__=~"{"|".join(names)}"')
    max_sel = selector(model, namespace, f'__name__=~"{"|".join(sorted(max_names))}"')
    count_sel = selector(model, namespace)
    return (
        f"sum by (__name__) ({{{sum_sel}}})",
        f"max by (__name__) ({{{max_sel}}})",
        f"count(vllm:num_requests_running{{{count_sel}}})",
    )


def values_from_results(*results: list[dict[str, Any]]) -> dict[str, float]:
    """Instant-vector results -> {__name__: value}."""
    out: dict[str, float] = {}
    for result in results:
        for item in result:
            name = item.get("metric", {}).get("__name__")
            value = item.get("value")
            if isinstance(name, str) and isinstance(value, list) and len(value) == 2:
                out[name] = float(value[1])
    return out


def parse_vector(status: int, body: bytes) -> list[dict[str, Any]]:
    """An instant-vector result of /api/v1/query, or the ProbeFailure its answer amounts to."""
    try:
        doc = bounds.loads(body, QUERY_STEP)
    except ProbeFailure as f:
        if f.reason != errors.MALFORMED_RESPONSE or status == 200:
            raise
        doc = None
    if status in (401, 403):
        raise ProbeFailure(errors.UNAUTHORIZED, f"{QUERY_STEP}: HTTP {status} (the bearer token was refused)")
    if not isinstance(doc, dict):
        if status != 200:
            raise ProbeFailure(errors.UNEXPECTED_STATUS, f"{QUERY_STEP}: HTTP {status}: not Prometheus' API")
        raise ProbeFailure(errors.MALFORMED_RESPONSE, f"{QUERY_STEP}: the answer is not JSON")
    if status != 200 or doc.get("status") != "success":
        kind, detail = doc.get("errorType") or "error", errors.snippet(str(doc.get("error") or ""))
        raise ProbeFailure(errors.UNEXPECTED_STATUS, f"{QUERY_STEP}: HTTP {status}: {kind}: {detail}")
    data = doc.get("data")
    if (
        not isinstance(data, dict)
        or data.get("resultType") != "vector"
        or not isinstance(data.get("result"), list)
    ):
        raise ProbeFailure(errors.MALFORMED_RESPONSE, f"{QUERY_STEP}: not an instant vector")
    return list(data["result"])


class PrometheusMetrics:
    """A MetricsReader over PromQL, filtered by model_name and namespace.

    `http` is the caller's client, reused across cycles (its timeouts do not matter: every query sets
    its own). For `insecureSkipVerify` pass a client whose transport does not verify TLS."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        url: str,
        *,
        model: str | None,
        namespace: str | None,
        bearer_token: str | None = None,
        settle_timeout_s: float = 30.0,
    ) -> None:
        self._http = http
        self._url = f"{url.rstrip('/')}/api/v1/query"
        self._headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else {}
        self._token = bearer_token
        self.model, self.namespace = model, namespace
        self.settle_timeout_s = settle_timeout_s

    async def query(self, promql: str) -> list[dict[str, Any]]:
        """One instant query: its result vector. Bounded by QUERY_TIMEOUT_S (cancelled, not abandoned),
        retried at most RETRIES times on a gateway status; failures are ProbeFailures with a reason."""
        params = {"query": promql, "timeout": f"{QUERY_TIMEOUT_S:g}s"}
        timeout = httpx.Timeout(QUERY_TIMEOUT_S)
        attempt = 0
        while True:
            try:
                r = await bounds.request(
                    self._http,
                    "GET",
                    self._url,
                    QUERY_STEP,
                    cap=bounds.PROMETHEUS_MAX_BYTES,
                    deadline_s=QUERY_TIMEOUT_S + 1,
                    headers=self._headers,
                    params=params,
                    read_limits=timeout,
                )
            except ProbeFailure as f:
                if f.reason in (errors.FIRST_BYTE_TIMEOUT, errors.PROBE_TIMEOUT):
                    raise ProbeFailure(
                        errors.PROBE_TIMEOUT, f"{QUERY_STEP}: no answer within {QUERY_TIMEOUT_S:g} s"
                    ) from None
                raise ProbeFailure(f.reason, errors.redact(f.message, (self._token,))) from None
            if r.status_code not in RETRY_STATUSES or attempt >= RETRIES:
                try:
                    return parse_vector(r.status_code, r.body)
                except ProbeFailure as f:
                    raise ProbeFailure(f.reason, errors.redact(f.message, (self._token,))) from None
            await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
            attempt += 1

    async def snapshot(self) -> MetricsSnapshot:
        q_sum, q_max, q_count = snapshot_queries(self.model, self.namespace)
        r_sum, r_max, r_count = await asyncio.gather(
            self.query(q_sum), self.query(q_max), self.query(q_count)
        )
        values = values_from_results(r_sum, r_max)
        if not values:
            raise ProbeFailure(
                errors.NO_READY_ENDPOINTS,
                f"Prometheus has no vllm series for {{{selector(self.model, self.namespace)}}}",
            )
        sources = round(float(r_count[0]["value"][1])) if r_count else 1
        return snapshot_from_values(values, sources=max(sources, 1))

    async def latest_scrape(self) -> float | None:
        """Unix time of the newest scrape of the engine's series."""
        q = f"max(timestamp(vllm:num_requests_running{{{selector(self.model, self.namespace)}}}))"
        r = await self.query(q)
        return float(r[0]["value"][1]) if r else None

    async def settled(self, before: MetricsSnapshot, requests: int, ended_wall: float) -> MetricsSnapshot:
        """Wait (bounded) for a scrape after the probe ended and for its requests to be counted."""
        deadline = time.monotonic() + self.settle_timeout_s
        while True:
            ts = await self.latest_scrape()
            if ts is not None and ts >= ended_wall:
                after = await self.snapshot()
                done = after.counters.get("request_success", 0.0) - before.counters.get(
                    "request_success", 0.0
                )
                if done >= requests or "request_success" not in after.counters:
                    return after
            if time.monotonic() >= deadline:
                raise ProbeFailure(
                    errors.PROBE_TIMEOUT,
                    f"Prometheus had no scrape counting the probe within {self.settle_timeout_s:g} s",
                )
            await asyncio.sleep(SETTLE_POLL_S)
