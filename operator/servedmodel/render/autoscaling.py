"""spec.autoscaling → the cluster's own autoscaler object. Pure: no I/O.

- KEDA discovered (keda.sh/v1alpha1): a ScaledObject `<name>` with one Prometheus trigger per target
  on vLLM's series of this model (namespace, model_name) or the operator's probe TTFT p95 gauge, and a
  TriggerAuthentication `<name>-prometheus` carrying the bearer token (and CA) from Secrets when the
  Prometheus needs one (OpenShift's Thanos querier). KEDA makes the HPA itself (keda-hpa-<name>).
- Otherwise an autoscaling/v2 HorizontalPodAutoscaler `<name>` on custom metrics as prometheus-adapter
  serves them (the adapter rule is in docs/operations.md): Pods metrics for vLLM's gauges, an Object
  metric on the ServedModel for the probe TTFT p95.

Both target the engine Deployment, whose spec.replicas the operator then leaves out of its apply.
"""

from __future__ import annotations

from typing import Final

from servedmodel import access
from servedmodel.access import AllowList
from servedmodel.api import API_GROUP_VERSION, KIND, ServedModel, names
from servedmodel.api.autoscaling import AutoscalingPrometheus, AutoscalingTargets, ServedModelAutoscaling
from servedmodel.api.base import Obj
from servedmodel.api.probe import PrometheusSource

from .errors import RenderError
from .meta import child_metadata
from .wake import http_scaled_object, wake_trigger

KEDA_API: Final = "keda.sh/v1alpha1"
HPA_API: Final = "autoscaling/v2"
# vLLM's series (Prometheus names) and the names prometheus-adapter serves them under (`vllm:` → `vllm_`,
# see the adapter rule in docs/operations.md): custom-metric names are URL path segments.
VLLM_WAITING: Final = "vllm:num_requests_waiting"
VLLM_RUNNING: Final = "vllm:num_requests_running"
VLLM_KV_CACHE: Final = "vllm:kv_cache_usage_perc"
# The operator's own gauge (handlers/metrics.py), labelled with the ServedModel's namespace and name.
PROBE_TTFT_P95: Final = "servedmodel_probe_ttft_p95_seconds"


def adapter_name(series: str) -> str:
    """The custom-metric name prometheus-adapter serves a series under (the rule renames `:` to `_`)."""
    return series.replace(":", "_")


def hpa_name(name: str) -> str:
    """The HPA the operator makes (HPA path)."""
    return name


def keda_hpa_name(name: str) -> str:
    """The HPA KEDA makes for the ScaledObject `<name>` (KEDA's default name, advanced.…config.name unset)."""
    return f"keda-hpa-{name}"


def scaled_object_name(name: str) -> str:
    return name


def trigger_auth_name(name: str) -> str:
    return f"{name}-prometheus"


def quantity(value: float) -> str:
    """A Quantity for a target: whole numbers as they are, fractions in milli-units (0.8 → 800m)."""
    if value == int(value):
        return str(int(value))
    return f"{max(1, round(value * 1000))}m"


def _decimal(value: float) -> str:
    """A KEDA threshold (a decimal string)."""
    return f"{value:g}"


def _label_value(text: str) -> str:
    """A PromQL string literal's content: backslash and double quote escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _target_ref(cr: ServedModel) -> Obj:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": names.deployment_name(cr.name)}


def _behavior(auto: ServedModelAutoscaling) -> Obj | None:
    out: Obj = {}
    for key, rules in (("scaleUp", auto.scale_up), ("scaleDown", auto.scale_down)):
        if rules is not None and rules.stabilization_window_seconds is not None:
            out[key] = {"stabilizationWindowSeconds": rules.stabilization_window_seconds}
    return out or None


def _pods_metric(series: str, average: float) -> Obj:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": adapter_name(series)},
            "target": {"type": "AverageValue", "averageValue": quantity(average)},
        },
    }


def hpa_metrics(cr: ServedModel, targets: AutoscalingTargets) -> list[Obj]:
    """The HPA's metrics, one per target set, in a fixed order."""
    metrics: list[Obj] = []
    if targets.waiting_requests_per_replica is not None:
        metrics.append(_pods_metric(VLLM_WAITING, targets.waiting_requests_per_replica))
    if targets.running_requests_per_replica is not None:
        metrics.append(_pods_metric(VLLM_RUNNING, targets.running_requests_per_replica))
    if targets.kv_cache_usage is not None:
        metrics.append(_pods_metric(VLLM_KV_CACHE, targets.kv_cache_usage))
    if targets.probe_ttft_p95_ms is not None:
        # One value for the whole model (the probe measures the Service), so Value, not AverageValue:
        # the HPA asks for replicas * p95 / target. ms → seconds is a milli-quantity: 800 ms = 800m.
        metrics.append(
            {
                "type": "Object",
                "object": {
                    "describedObject": {"apiVersion": API_GROUP_VERSION, "kind": KIND, "name": cr.name},
                    "metric": {"name": PROBE_TTFT_P95},
                    "target": {"type": "Value", "value": quantity(targets.probe_ttft_p95_ms / 1000)},
                },
            }
        )
    return metrics


def horizontal_pod_autoscaler(cr: ServedModel) -> Obj:
    auto = cr.spec.autoscaling
    assert auto is not None
    spec: Obj = {
        "scaleTargetRef": _target_ref(cr),
        # The HPA cannot go below 1 (HPAScaleToZero is alpha); scaleToZero needs KEDA.
        "minReplicas": auto.min_replicas,
        "maxReplicas": auto.max_replicas,
        "metrics": hpa_metrics(cr, auto.targets),
    }
    if (behavior := _behavior(auto)) is not None:
        spec["behavior"] = behavior
    return {
        "apiVersion": HPA_API,
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(cr, hpa_name(cr.name)),
        "spec": spec,
    }


def keda_prometheus(cr: ServedModel) -> PrometheusSource:
    """The Prometheus KEDA queries: autoscaling.prometheus, else the probe's Prometheus source."""
    auto = cr.spec.autoscaling
    assert auto is not None
    prom = auto.prometheus or cr.spec.probe.metrics_source.prometheus
    if prom is None:
        raise RenderError(
            "spec.autoscaling.prometheus",
            "KEDA (keda.sh) is installed and its Prometheus triggers need a query URL: set "
            "autoscaling.prometheus.url (e.g. https://thanos-querier.openshift-monitoring.svc:9092 on "
            "OpenShift) or spec.probe.metricsSource.prometheus",
        )
    return prom


def keda_triggers(cr: ServedModel, prom: PrometheusSource) -> list[Obj]:
    """One Prometheus trigger per target; each query returns one number for the whole model."""
    auto = cr.spec.autoscaling
    assert auto is not None
    namespace = cr.metadata.namespace or "default"
    model = cr.spec.resolved_served_model_name
    vllm = f'namespace="{_label_value(namespace)}",model_name="{_label_value(model)}"'
    base: Obj = {
        "serverAddress": prom.url,
        # Thanos querier's tenancy port (9092) needs ?namespace=; plain Prometheus ignores it.
        "namespace": namespace,
    }
    if prom.bearer_token_secret_ref is not None:
        base["authModes"] = "bearer"
    if prom.insecure_skip_verify:
        base["unsafeSsl"] = "true"
    t = auto.targets
    # (trigger name, query, threshold, metricType, activation threshold)
    rows: list[tuple[str, str, float, str, float | None]] = []
    # sum(...) with AverageValue: the HPA KEDA makes divides by the replicas, so the target is per replica.
    if t.waiting_requests_per_replica is not None:
        rows.append(
            (
                "waiting-requests",
                f"sum({VLLM_WAITING}{{{vllm}}})",
                t.waiting_requests_per_replica,
                "AverageValue",
                None,
            )
        )
    if t.running_requests_per_replica is not None:
        rows.append(
            (
                "running-requests",
                f"sum({VLLM_RUNNING}{{{vllm}}})",
                t.running_requests_per_replica,
                "AverageValue",
                None,
            )
        )
    if t.kv_cache_usage is not None:
        rows.append(
            ("kv-cache-usage", f"sum({VLLM_KV_CACHE}{{{vllm}}})", t.kv_cache_usage, "AverageValue", None)
        )
    if t.probe_ttft_p95_ms is not None:
        ns, sm = _label_value(namespace), _label_value(cr.name)
        # The operator's series carry the ServedModel's namespace in `namespace`, or in
        # `exported_namespace` where the scraping Prometheus enforces its own (OpenShift user workloads).
        ttft = (
            f'{PROBE_TTFT_P95}{{namespace="{ns}",name="{sm}"}} or '
            f'{PROBE_TTFT_P95}{{exported_namespace="{ns}",name="{sm}"}}'
        )
        seconds = t.probe_ttft_p95_ms / 1000
        # Active only above the target: a fast model must not be kept awake (or woken) by its latency.
        rows.append(("probe-ttft-p95", f"max({ttft})", seconds, "Value", seconds))
    triggers: list[Obj] = []
    for name, query, threshold, metric_type, activation in rows:
        metadata = {**base, "query": query, "threshold": _decimal(threshold)}
        if activation is not None:
            metadata["activationThreshold"] = _decimal(activation)
        trigger: Obj = {"type": "prometheus", "name": name, "metricType": metric_type}
        trigger["metadata"] = dict(sorted(metadata.items()))
        if trigger_authentication(cr, prom) is not None:
            trigger["authenticationRef"] = {
                "kind": "TriggerAuthentication",
                "name": trigger_auth_name(cr.name),
            }
        triggers.append(trigger)
    return triggers


def scaled_object(cr: ServedModel, prom: PrometheusSource, wake_scaler_address: str | None = None) -> Obj:
    """The ScaledObject; with `wake_scaler_address` (scaleToZero and the HTTP add-on installed) it also
    carries the add-on's external-push trigger, which wakes the model from zero (render/wake.py)."""
    auto = cr.spec.autoscaling
    assert auto is not None
    spec: Obj = {"scaleTargetRef": _target_ref(cr)}
    if auto.polling_interval_seconds is not None:
        spec["pollingInterval"] = auto.polling_interval_seconds
    if auto.cooldown_seconds is not None:
        spec["cooldownPeriod"] = auto.cooldown_seconds
    if auto.scale_to_zero:
        # Idle (every trigger at or below its activation threshold) → 0; active → minReplicas..maxReplicas.
        spec["idleReplicaCount"] = 0
    spec["minReplicaCount"] = auto.min_replicas
    spec["maxReplicaCount"] = auto.max_replicas
    if (behavior := _behavior(auto)) is not None:
        spec["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": behavior}}
    spec["triggers"] = keda_triggers(cr, prom)
    if wake_scaler_address is not None:
        spec["triggers"].append(wake_trigger(cr, wake_scaler_address))
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": child_metadata(cr, scaled_object_name(cr.name)),
        "spec": spec,
    }


def trigger_authentication(cr: ServedModel, prom: PrometheusSource) -> Obj | None:
    """The bearer token and CA by reference (KEDA reads the Secret; the operator never does for this)."""
    refs = []
    if prom.bearer_token_secret_ref is not None:
        refs.append(("bearerToken", prom.bearer_token_secret_ref))
    if isinstance(prom, AutoscalingPrometheus) and prom.ca_secret_ref is not None:
        refs.append(("ca", prom.ca_secret_ref))
    if not refs:
        return None
    return {
        "apiVersion": KEDA_API,
        "kind": "TriggerAuthentication",
        "metadata": child_metadata(cr, trigger_auth_name(cr.name)),
        "spec": {"secretTargetRef": [{"parameter": p, "name": r.name, "key": r.key} for p, r in refs]},
    }


def _keda_target_allowed(
    cr: ServedModel, prom: PrometheusSource, allowed: AllowList, allow_insecure_tls: bool
) -> None:
    auto = cr.spec.autoscaling
    field = "spec.autoscaling.prometheus"
    if auto is None or auto.prometheus is None:
        field = "spec.probe.metricsSource.prometheus"
    refusal = access.target_refusal(prom.url, allowed, f"{field}.url", base_path_only=False)
    if refusal is not None:
        raise RenderError(f"{field}.url", f"{refusal.reason}: {refusal.message}")
    if prom.insecure_skip_verify and not allow_insecure_tls:
        raise RenderError(
            f"{field}.insecureSkipVerify",
            f"{access.INSECURE_TLS_NOT_ALLOWED}: the operator verifies TLS for every ServedModel (a "
            "cluster admin may allow skipping it: SERVEDMODEL_ALLOW_INSECURE_TLS)",
        )


def wakes(
    cr: ServedModel, has_keda_api: bool, has_http_add_on_api: bool, http_scaler_address: str | None
) -> bool:
    """A request wakes this model from zero: scaleToZero, KEDA, the HTTP add-on's API and scaler address."""
    auto = cr.spec.autoscaling
    return (
        auto is not None
        and auto.scale_to_zero
        and has_keda_api
        and has_http_add_on_api
        and bool(http_scaler_address)
    )


def autoscaler_objects(
    cr: ServedModel,
    *,
    has_keda_api: bool,
    allowed_targets: AllowList | None = None,
    allow_insecure_tls: bool = False,
    has_http_add_on_api: bool = False,
    http_scaler_address: str | None = None,
) -> list[Obj]:
    """The autoscaler's objects for spec.autoscaling (none when unset or in external mode). KEDA's
    Prometheus URL must pass `allowed_targets` (when given) and may skip TLS verification only with
    `allow_insecure_tls`: KEDA sends the namespace's token there on the ServedModel author's word.
    With scaleToZero, KEDA and its HTTP add-on (http.keda.sh) discovered and the add-on's scaler address
    configured: the wake-up trigger and an HTTPScaledObject that routes (render/wake.py)."""
    if cr.spec.autoscaling is None or cr.spec.external:
        return []
    if has_keda_api:
        prom = keda_prometheus(cr)
        if allowed_targets is not None:
            _keda_target_allowed(cr, prom, allowed_targets, allow_insecure_tls)
        auth = trigger_authentication(cr, prom)
        wake = wakes(cr, has_keda_api, has_http_add_on_api, http_scaler_address)
        woken = [http_scaled_object(cr)] if wake else []
        return [
            *([auth] if auth is not None else []),
            *woken,
            scaled_object(cr, prom, http_scaler_address if wake else None),
        ]
    return [horizontal_pod_autoscaler(cr)]
