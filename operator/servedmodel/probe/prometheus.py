"""Engine figures from Prometheus (e.g. OpenShift's Thanos querier) instead of scraping pods.

prometheus-api-client is synchronous (requests); every query runs in a worker thread with a timeout and
a bounded retry. The bearer token is sent as a header and never logged.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_api_client import PrometheusConnect
from urllib3.util.retry import Retry

from . import errors as er
from .errors import ProbeFailure
from .metrics import GAUGES, MAX_GAUGES, MetricsSnapshot, snapshot_from_values, wanted_sample_names

QUERY_TIMEOUT_S = 5.0
SETTLE_POLL_S = 0.5


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


class PrometheusMetrics:
    """A MetricsReader over PromQL, filtered by model_name and namespace."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None,
        namespace: str | None,
        bearer_token: str | None = None,
        insecure_skip_verify: bool = False,
        settle_timeout_s: float = 30.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else None
        self._prom = PrometheusConnect(
            url=url.rstrip("/"),
            headers=headers,
            disable_ssl=insecure_skip_verify,
            retry=Retry(total=2, backoff_factor=0.2, status_forcelist=(502, 503, 504)),
            timeout=int(QUERY_TIMEOUT_S),
        )
        self.model, self.namespace = model, namespace
        self.settle_timeout_s = settle_timeout_s

    def close(self) -> None:
        """Close the HTTP session (connections to Prometheus)."""
        self._prom._session.close()

    async def _query(self, q: str) -> list[dict[str, Any]]:
        try:
            result = await asyncio.wait_for(
                asyncio.to_thread(self._prom.custom_query, q, None, QUERY_TIMEOUT_S), QUERY_TIMEOUT_S + 1
            )
        except TimeoutError:
            raise ProbeFailure(er.PROBE_TIMEOUT, "Prometheus query timed out") from None
        except Exception as exc:  # requests/urllib3/PrometheusApiClientException: all mean "no figures"
            raise ProbeFailure(
                er.CONNECTION_FAILED, f"Prometheus query failed: {type(exc).__name__}"
            ) from None
        return list(result)

    async def snapshot(self) -> MetricsSnapshot:
        q_sum, q_max, q_count = snapshot_queries(self.model, self.namespace)
        r_sum, r_max, r_count = await asyncio.gather(
            self._query(q_sum), self._query(q_max), self._query(q_count)
        )
        values = values_from_results(r_sum, r_max)
        if not values:
            raise ProbeFailure(
                er.NO_READY_ENDPOINTS,
                f"Prometheus has no vllm series for {{{selector(self.model, self.namespace)}}}",
            )
        sources = round(float(r_count[0]["value"][1])) if r_count else 1
        return snapshot_from_values(values, sources=max(sources, 1))

    async def latest_scrape(self) -> float | None:
        """Unix time of the newest scrape of the engine's series."""
        q = f"max(timestamp(vllm:num_requests_running{{{selector(self.model, self.namespace)}}}))"
        r = await self._query(q)
        return float(r[0]["value"][1]) if r else None

    async def wait_for_series(self, timeout_s: float) -> None:
        """Until Prometheus has scraped the engine at least twice (a fresh target), bounded."""
        deadline = time.monotonic() + timeout_s
        q = f"count_over_time(vllm:num_requests_running{{{selector(self.model, self.namespace)}}}[1m])"
        while True:
            r = await self._query(q)
            if r and float(r[0]["value"][1]) >= 2:
                return
            if time.monotonic() >= deadline:
                raise ProbeFailure(er.PROBE_TIMEOUT, f"Prometheus has no series after {timeout_s:g} s")
            await asyncio.sleep(SETTLE_POLL_S)

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
                    er.PROBE_TIMEOUT,
                    f"Prometheus had no scrape counting the probe within {self.settle_timeout_s:g} s",
                )
            await asyncio.sleep(SETTLE_POLL_S)
