"""The probe daemon: one cancellable kopf daemon per ServedModel that probes its request path every
spec.probe.interval (jittered, backing off on failure) once the engine is ready, and writes status.probe
plus the Serving/TemplateOK/LatencySLOMet conditions with its own field manager: at most one status write
per cycle, none when nothing changed (probing off, engine not ready yet).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import random
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import httpx
import kopf
from prometheus_client import Counter, Gauge, Histogram
from pydantic import ValidationError

from servedmodel.api import API_GROUP_VERSION
from servedmodel.api.base import API_GROUP, API_VERSION, PLURAL
from servedmodel.api.names import service_name
from servedmodel.api.probe import ProbeSpec, ProbeStatus
from servedmodel.api.spec import ServedModelSpec
from servedmodel.config import OperatorConfig
from servedmodel.k8s.client import ApiError, KubeClient, NotFoundError
from servedmodel.probe import errors as er
from servedmodel.probe.client import MetricsReader, PodMetrics, ProbeOutcome, http_timeout, run_probe
from servedmodel.probe.endpoints import (
    ProbeTarget,
    parse_override,
    resolve_external,
    resolve_managed,
    resolve_override,
)
from servedmodel.probe.errors import ProbeFailure
from servedmodel.probe.prometheus import PrometheusMetrics
from servedmodel.probe.report import build_status, probe_conditions
from servedmodel.probe.schedule import NOT_READY_WAIT_S, first_delay, next_delay

from .metrics import REGISTRY

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PROBE_TTFT = Histogram(
    "servedmodel_probe_ttft_seconds",
    "Probe TTFT (request sent -> first content token), seconds.",
    ["namespace", "name"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
PROBE_TPOT = Histogram(
    "servedmodel_probe_tpot_seconds",
    "Probe TPOT, vLLM's definition ((e2e - TTFT)/(completion tokens - 1)), seconds.",
    ["namespace", "name"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0),
    registry=REGISTRY,
)
PROBE_E2E = Histogram(
    "servedmodel_probe_e2e_seconds",
    "Probe end to end (request sent -> [DONE]), seconds.",
    ["namespace", "name"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
PROBE_SERVING = Gauge(
    "servedmodel_probe_serving",
    "1 when the last probe succeeded, else 0.",
    ["namespace", "name"],
    registry=REGISTRY,
)
PROBE_FAILURES = Counter(
    "servedmodel_probe_failures",
    "Failed probes by reason.",
    ["namespace", "name", "reason"],
    registry=REGISTRY,
)
PROBE_TOTAL = Counter(
    "servedmodel_probe", "Probe cycles run, by result.", ["namespace", "name", "result"], registry=REGISTRY
)
PROBE_STATUS_WRITES = Counter(
    "servedmodel_probe_status_writes",
    "Status writes of the probe (at most one per cycle).",
    ["namespace", "name"],
    registry=REGISTRY,
)

T = TypeVar("T")


class _KeyRef(Protocol):
    name: str
    key: str


def _from_memo(memo: Any, kind: type[T]) -> T | None:
    """The startup handler's shared object of that type, whatever key it was stored under."""
    values = memo.values() if hasattr(memo, "values") else vars(memo).values()
    return next((v for v in values if isinstance(v, kind)), None)


async def _secret_value(kube: KubeClient, namespace: str, ref: _KeyRef) -> str:
    """A Secret key's value; the message of the failure never contains the value."""
    try:
        secret = await kube.get("v1", "secrets", namespace, ref.name)
    except ApiError as exc:
        raise ProbeFailure(er.SECRET_UNAVAILABLE, f"Secret {ref.name}: {exc.status} {exc.reason}") from None
    data = (secret or {}).get("data") or {}
    if ref.key not in data:
        raise ProbeFailure(er.SECRET_UNAVAILABLE, f"Secret {ref.name} has no key {ref.key}")
    return base64.b64decode(data[ref.key]).decode("utf-8").strip()


async def _target(
    kube: KubeClient, config: OperatorConfig, namespace: str, name: str, spec: ServedModelSpec
) -> ProbeTarget:
    override = parse_override(config.endpoint_override, namespace, name)
    if override is not None:
        return resolve_override(override)
    if spec.endpoint is not None:
        return resolve_external(spec.endpoint)
    svc_name = service_name(name)
    try:
        service = await kube.get("v1", "services", namespace, svc_name)
        slices = await kube.list_endpoint_slices(namespace, svc_name)
    except ApiError as exc:
        raise ProbeFailure(
            er.NO_READY_ENDPOINTS, f"reading Service {svc_name}: {exc.status} {exc.reason}"
        ) from None
    if service is None:
        raise ProbeFailure(er.NO_READY_ENDPOINTS, f"Service {svc_name} does not exist")
    target = resolve_managed(service, slices)
    if not target.metrics_urls:
        raise ProbeFailure(er.NO_READY_ENDPOINTS, f"Service {svc_name} has no ready engine pod")
    return target


async def _metrics_reader(
    kube: KubeClient, http: httpx.AsyncClient, namespace: str, spec: ServedModelSpec, target: ProbeTarget
) -> MetricsReader:
    src = spec.probe.metrics_source
    model = spec.resolved_served_model_name
    if src.type == "prometheus" and src.prometheus is not None:
        prom = src.prometheus
        token = None
        if prom.bearer_token_secret_ref is not None:
            token = await _secret_value(kube, namespace, prom.bearer_token_secret_ref)
        return PrometheusMetrics(
            prom.url,
            model=model,
            namespace=namespace,
            bearer_token=token,
            insecure_skip_verify=prom.insecure_skip_verify,
            settle_timeout_s=spec.probe.timeout,
        )
    return PodMetrics(http, target.metrics_urls, model)


def engine_ready(spec: ServedModelSpec, status: dict[str, Any]) -> bool:
    """Probe once the reconciler saw a ready engine (or always, in external mode). Degraded with a ready
    replica still probes: the probe is how Degraded-by-probe recovers."""
    if spec.external:
        return True
    return status.get("phase") == "Ready" or (status.get("readyReplicas") or 0) >= 1


async def probe_once(
    kube: KubeClient,
    http: httpx.AsyncClient,
    config: OperatorConfig,
    namespace: str,
    name: str,
    spec: ServedModelSpec,
) -> ProbeOutcome:
    """One cycle's measurements; resolution and secret failures are outcomes too."""
    http.timeout = http_timeout(spec.probe)
    try:
        target = await _target(kube, config, namespace, name, spec)
        api_key = None
        if spec.engine.api_key_secret_ref is not None:
            api_key = await _secret_value(kube, namespace, spec.engine.api_key_secret_ref)
        metrics = await _metrics_reader(kube, http, namespace, spec, target)
    except ProbeFailure as f:
        now = datetime.now(UTC)
        return ProbeOutcome(endpoint="", started=now, ended=now, failure=f)
    try:
        return await run_probe(
            http, target, spec.probe, model=spec.resolved_served_model_name, api_key=api_key, metrics=metrics
        )
    finally:
        if isinstance(metrics, PrometheusMetrics):
            metrics.close()


def status_patch(
    out: ProbeOutcome,
    probe: ProbeSpec,
    body_status: dict[str, Any],
    generation: int | None,
    last_written: ProbeStatus | None = None,
) -> tuple[ProbeStatus, dict[str, Any]]:
    """The probe's whole share of status: status.probe and its three conditions (SSA removes what we omit).

    The previous status.probe (rolling window, counters) comes from the object, or from what this daemon
    wrote last when the watch has not delivered that write yet."""
    previous = None
    if isinstance(body_status.get("probe"), dict):
        try:
            previous = ProbeStatus.model_validate(body_status["probe"])
        except ValidationError:
            previous = None  # an older schema: start the window afresh
    if last_written is not None and (
        previous is None or (previous.last_probe_time or "") < (last_written.last_probe_time or "")
    ):
        previous = last_written
    new = build_status(out, probe, previous)
    conds = probe_conditions(
        new, probe, body_status.get("conditions") or [], generation, out.ended or datetime.now(UTC)
    )
    return new, {
        "probe": new.model_dump(by_alias=True, exclude_none=True),
        "conditions": [c.model_dump(by_alias=True, exclude_none=True) for c in conds],
    }


def _record(namespace: str, name: str, out: ProbeOutcome) -> None:
    PROBE_TOTAL.labels(namespace, name, "success" if out.ok else "failure").inc()
    PROBE_SERVING.labels(namespace, name).set(1 if out.ok else 0)
    if out.failure is not None:
        PROBE_FAILURES.labels(namespace, name, out.failure.reason).inc()
        return
    f = out.figures
    if f is not None:
        if f.ttft_ms is not None:
            PROBE_TTFT.labels(namespace, name).observe(f.ttft_ms / 1000)
        if f.tpot_ms is not None:
            PROBE_TPOT.labels(namespace, name).observe(f.tpot_ms / 1000)
        if f.e2e_ms is not None:
            PROBE_E2E.labels(namespace, name).observe(f.e2e_ms / 1000)


def _forget(namespace: str, name: str) -> None:
    """Drop a deleted ServedModel's series so dashboards do not show ghosts."""
    for metric in (PROBE_TTFT, PROBE_TPOT, PROBE_E2E, PROBE_SERVING, PROBE_STATUS_WRITES):
        with contextlib.suppress(KeyError):
            metric.remove(namespace, name)
    for result in ("success", "failure"):
        with contextlib.suppress(KeyError):
            PROBE_TOTAL.remove(namespace, name, result)
    for reason in er.ALL_FAILURE_REASONS:
        with contextlib.suppress(KeyError):
            PROBE_FAILURES.remove(namespace, name, reason)


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, id="probe", cancellation_timeout=10.0)
async def probe_daemon(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    """Probe until the ServedModel goes away (kopf cancels the task); never raises for a failed probe."""
    if namespace is None:
        raise kopf.PermanentError("ServedModel is namespaced")
    kube = _from_memo(memo, KubeClient)
    config = _from_memo(memo, OperatorConfig) or OperatorConfig()
    if kube is None:
        raise kopf.PermanentError("no Kubernetes client in memo (startup handler did not run)")
    rng = random.Random()
    last_written: dict[str, Any] | None = None
    last_status: ProbeStatus | None = None
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            first = True
            while True:
                try:
                    spec = ServedModelSpec.model_validate(body.get("spec") or {})
                except ValidationError:
                    await asyncio.sleep(NOT_READY_WAIT_S * 6)  # the reconciler reports InvalidSpec
                    continue
                probe = spec.probe
                status = dict(body.get("status") or {})
                if not probe.enabled or not engine_ready(spec, status):
                    await asyncio.sleep(probe.interval if not probe.enabled else NOT_READY_WAIT_S)
                    continue
                if first:
                    first = False
                    await asyncio.sleep(first_delay(probe.interval, rng))
                out = await probe_once(kube, http, config, namespace, name, spec)
                _record(namespace, name, out)
                generation = (body.get("metadata") or {}).get("generation")
                new, patch = status_patch(out, probe, status, generation, last_status)
                logger.info(
                    "probe %s: %s",
                    new.result,
                    new.message if new.result == "Success" else f"{new.reason}: {new.message}",
                )
                if patch != last_written:
                    try:
                        await kube.apply_status(
                            API_GROUP_VERSION,
                            PLURAL,
                            namespace,
                            name,
                            patch,
                            config.probe_field_manager,
                        )
                        last_written, last_status = patch, new
                        PROBE_STATUS_WRITES.labels(namespace, name).inc()
                    except NotFoundError:
                        return  # deleted between the probe and the write
                    except ApiError as exc:
                        logger.warning("probe status write failed: %s %s", exc.status, exc.reason)
                await asyncio.sleep(next_delay(probe.interval, new.consecutive_failures, rng))
    finally:
        _forget(namespace, name)
