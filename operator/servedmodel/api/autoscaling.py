"""spec.autoscaling and status.autoscaling: scaling the engine on what vLLM and the probe see, through
the cluster's own autoscalers (KEDA when keda.sh/v1alpha1 exists, else an autoscaling/v2
HorizontalPodAutoscaler on prometheus-adapter's custom metrics). The operator computes no replica
count itself: it renders the autoscaler's object and reports what the autoscaler did.

While spec.autoscaling is set, the Deployment's replicas belong to the autoscaler: the operator's
server-side apply leaves spec.replicas out, and spec.replicas (the ServedModel's scale subresource) is
frozen by a CEL transition rule, so `kubectl scale sm` is refused with a message naming
autoscaling.minReplicas/maxReplicas instead of being silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .base import ApiModel, cel
from .probe import PrometheusSource, SecretKeyRef

# The targets in the field's words; the wire names are the camelCase forms of these attributes.
TARGET_FIELDS = (
    "waitingRequestsPerReplica",
    "runningRequestsPerReplica",
    "kvCacheUsage",
    "probeTtftP95Ms",
)


class AutoscalingTargets(ApiModel):
    """What to scale on; every target set is one metric of the autoscaler, which scales to the most
    replicas any of them asks for."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    " || ".join(f"has(self.{f})" for f in TARGET_FIELDS),
                    "autoscaling.targets needs at least one of " + ", ".join(TARGET_FIELDS),
                ),
            ]
        }
    )

    waiting_requests_per_replica: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description=(
            "Requests waiting in vLLM's queue per replica (vllm:num_requests_waiting, averaged over the "
            "replicas): the queue is the first sign a replica is saturated."
        ),
    )
    running_requests_per_replica: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description=(
            "Requests in vLLM's running batch per replica (vllm:num_requests_running, averaged over the "
            "replicas); useful below engine.maxNumSeqs."
        ),
    )
    kv_cache_usage: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=(
            "KV-cache usage per replica, 0 < x <= 1 (vllm:kv_cache_usage_perc, averaged over the replicas): "
            "a full KV cache preempts requests."
        ),
    )
    probe_ttft_p95_ms: float | None = Field(
        default=None,
        gt=0,
        le=3_600_000,
        description=(
            "The operator's probe TTFT p95 over its rolling window, ms (servedmodel_probe_ttft_p95_seconds "
            "on the operator's /metrics): replicas grow in proportion while the p95 is above it."
        ),
    )

    @model_validator(mode="after")
    def _at_least_one(self) -> AutoscalingTargets:
        if all(
            v is None
            for v in (
                self.waiting_requests_per_replica,
                self.running_requests_per_replica,
                self.kv_cache_usage,
                self.probe_ttft_p95_ms,
            )
        ):
            raise ValueError("autoscaling.targets needs at least one of " + ", ".join(TARGET_FIELDS))
        return self


class AutoscalingPrometheus(PrometheusSource):
    """The Prometheus KEDA's triggers query, and how KEDA authenticates to it."""

    ca_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "Secret key with the CA bundle that signed the Prometheus URL's certificate (KEDA's `ca` "
            "parameter), e.g. service-ca.crt of an OpenShift service-account token Secret."
        ),
    )


class ScalingRules(ApiModel):
    """One direction of scaling (the HPA's behavior.scaleUp / scaleDown)."""

    stabilization_window_seconds: int | None = Field(
        default=None,
        ge=0,
        le=3600,
        description=(
            "Recommendations of this long ago still count: scale down only to the highest, up only to the "
            "lowest, seen in the window. Unset: the HPA's defaults (up 0 s, down 300 s)."
        ),
    )


class ServedModelAutoscaling(ApiModel):
    """Autoscaling of the engine replicas by the cluster's autoscaler (KEDA if installed, else the HPA)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.maxReplicas >= self.minReplicas",
                    "autoscaling.maxReplicas must be at least autoscaling.minReplicas",
                    ".maxReplicas",
                ),
                cel(
                    "!has(self.cooldownSeconds) || self.scaleToZero",
                    "autoscaling.cooldownSeconds is the idle time before scaling to zero: it needs "
                    "autoscaling.scaleToZero: true",
                    ".cooldownSeconds",
                ),
            ]
        }
    )

    min_replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Fewest replicas while serving (scaling to zero is autoscaling.scaleToZero).",
    )
    max_replicas: int = Field(ge=1, le=1024, description="Most replicas the autoscaler may run.")
    targets: AutoscalingTargets = Field(description="What to scale on (at least one).")
    scale_up: ScalingRules | None = Field(default=None, description="Scale-up behaviour.")
    scale_down: ScalingRules | None = Field(default=None, description="Scale-down behaviour.")
    scale_to_zero: bool = Field(
        default=False,
        description=(
            "KEDA only (idleReplicaCount 0): no replicas while every trigger is idle. At zero the probe "
            "sends no chat (it would wake nothing, and would count as traffic); the ServedModel says "
            "ScaledToZero. vLLM's own series vanish at zero, so waking needs a request signal that exists "
            "without an engine (see docs/operations.md)."
        ),
    )
    cooldown_seconds: int | None = Field(
        default=None,
        ge=0,
        le=86_400,
        description="KEDA's cooldownPeriod: idle time after the last active trigger before scaling to zero.",
    )
    polling_interval_seconds: int | None = Field(
        default=None, ge=1, le=3600, description="KEDA's pollingInterval: how often triggers are queried."
    )
    prometheus: AutoscalingPrometheus | None = Field(
        default=None,
        description=(
            "The Prometheus KEDA's triggers query (e.g. OpenShift's Thanos querier, port 9092 with a bearer "
            "token). Unset: spec.probe.metricsSource.prometheus. Not used by the HPA path, where "
            "prometheus-adapter holds the connection."
        ),
    )

    @model_validator(mode="after")
    def _cross_fields(self) -> ServedModelAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.maxReplicas must be at least autoscaling.minReplicas")
        if self.cooldown_seconds is not None and not self.scale_to_zero:
            raise ValueError("autoscaling.cooldownSeconds needs autoscaling.scaleToZero: true")
        return self


Autoscaler = Literal["HorizontalPodAutoscaler", "KEDA"]


class LastScale(ApiModel):
    """The last rescale the autoscaler reported."""

    time: str | None = Field(default=None, description="When (the HPA's status.lastScaleTime).")
    from_replicas: int | None = Field(default=None, ge=0, description="Replicas before.")
    to_replicas: int | None = Field(default=None, ge=0, description="Replicas the autoscaler asked for.")


class AutoscalingStatus(ApiModel):
    """What the autoscaler (the HPA, or the one KEDA made) says; written by the reconciler on change."""

    autoscaler: Autoscaler | None = Field(
        default=None, description="HorizontalPodAutoscaler (prometheus-adapter metrics) or KEDA."
    )
    horizontal_pod_autoscaler: str | None = Field(
        default=None, max_length=253, description="Name of the HPA doing the scaling (KEDA's keda-hpa-…)."
    )
    current_replicas: int | None = Field(default=None, ge=0, description="The HPA's currentReplicas.")
    desired_replicas: int | None = Field(default=None, ge=0, description="The HPA's desiredReplicas.")
    last_scale: LastScale | None = Field(default=None, description="The last scaling event seen.")
    reason: str | None = Field(
        default=None,
        max_length=128,
        description=(
            "CamelCase: the HPA's telling condition reason (ValidMetricFound, FailedGetPodsMetric, "
            "TooManyReplicas, …), or the operator's (ScaledToZero, AutoscalerMissing, ScaleToZeroNeedsKEDA)."
        ),
    )
    message: str | None = Field(default=None, max_length=1024, description="Human-readable details.")
