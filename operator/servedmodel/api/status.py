"""status of a ServedModel. Two writers share it through server-side apply: the reconciler (phase,
replicas, ready, endpoint, selector, autoscaling and the Ready/Progressing/Degraded/InvalidSpec
conditions) and the probe (status.probe, status.rollout and its conditions: Serving, TemplateOK,
LatencySLOMet, EngineStalled, KVCachePressure, ProbeUnreliable; status.startup).
`conditions` is a list-map keyed by type, so each field manager owns its own entries.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .autoscaling import AutoscalingStatus
from .base import ApiModel, Condition
from .probe import ProbeStatus, RolloutStatus
from .startup import StartupStatus

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
PHASES: tuple[Phase, ...] = ("Pending", "Progressing", "Ready", "Degraded", "Failed")


class ServedModelStatus(ApiModel):
    """Observed state. No field has a default, so neither writer ever sets the other's fields."""

    phase: Phase | None = Field(
        default=None,
        description=(
            "Pending (nothing observed yet), Progressing (rolling out or starting), Ready (all replicas "
            "ready), Degraded (some replicas or the probe failing), Failed (invalid spec or rollout gave up)."
        ),
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the reconciler last acted on."
    )
    replicas: int | None = Field(
        default=None, ge=0, description="Engine pods that exist (the scale subresource's status replicas)."
    )
    ready_replicas: int | None = Field(default=None, ge=0, description="Engine pods that are ready.")
    ready: str | None = Field(
        default=None, max_length=32, description="readyReplicas/replicas for the Ready column, e.g. 1/1."
    )
    restarts: int | None = Field(
        default=None,
        ge=0,
        description="Restarts of the engine pods' containers by the kubelet (process exited or killed), "
        "summed over the pods that exist now (as kubectl get pods' RESTARTS; a new pod starts at 0).",
    )
    endpoint: str | None = Field(
        default=None,
        max_length=2048,
        description="In-cluster base URL of the OpenAI-compatible API (spec.endpoint in external mode).",
    )
    route_url: str | None = Field(
        default=None, max_length=2048, description="URL of the Route, when one exists."
    )
    selector: str | None = Field(
        default=None,
        max_length=1024,
        description="Label selector of the engine pods (the scale subresource's labelSelectorPath).",
    )
    served_model_name: str | None = Field(
        default=None, max_length=255, description="Name clients send as `model` (resolved servedModelName)."
    )
    conditions: list[Condition] | None = Field(
        default=None,
        max_length=32,
        description=(
            "Ready, Progressing, Degraded, InvalidSpec (the reconciler) and Serving, TemplateOK, "
            "LatencySLOMet (the probe)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    probe: ProbeStatus | None = Field(default=None, description="What the request-path probe measured.")
    rollout: RolloutStatus | None = Field(
        default=None,
        description="The newest engine revision's proof through the readiness gate (managed mode, gate on).",
    )
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="What the autoscaler (HPA, or KEDA's) did, while spec.autoscaling is set."
    )
    startup: StartupStatus | None = Field(
        default=None,
        description="Where the engine pods' cold starts went: the last start's stages, p50/p95 (the probe).",
    )
