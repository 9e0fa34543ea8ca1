"""status.startup: where an engine pod's cold start went, stage by stage (the probe writes it).

Every stage is a moment of one pod's start, in seconds from the pod's creation (metadata.creationTimestamp):
scheduled (PodScheduled), initialized (Initialized: init containers done), imagePulled (the engine
container's Pulled Event, when the cluster recorded one), containerStarted (the engine container's
state.running.startedAt), containersReady (ContainersReady: the kubelet's readiness probe, /health, passed),
engineHealthy (the probe's first GET /health answered 200 on that pod), firstToken (the first content
token of the probe's first successful streamed chat on that pod: the cold start's end, `totalSeconds`).
probe/startup.py builds them; a stage the cluster did not say is left out.

A pod KEDA created by waking the model from zero (spec.autoscaling.scaleToZero with the HTTP add-on) also
has `activated`, KEDA's scale from 0 (its KEDAScaleTargetActivated Event: the add-on's scaler reported a
held request), and `wakeSeconds`, from that moment to the pod's first real token: the wait of the request
the interceptor held, less the scaler's and KEDA's polling before the activation and the interceptor's
forward after it (bench/cold_start.py puts both side by side).
"""

from __future__ import annotations

from typing import Final

from pydantic import Field

from .base import ApiModel

# The stages in the order a start passes them (the wire names of StartupStages' fields).
STARTUP_STAGES: Final = (
    "scheduled",
    "initialized",
    "imagePulled",
    "containerStarted",
    "containersReady",
    "engineHealthy",
    "firstToken",
)
STARTUP_HISTORY: Final = 10  # starts kept in status.startup.recent (p50/p95 are over them)


def _s(what: str) -> str:
    return f"{what}, seconds from the pod's creation."


class StartupStages(ApiModel):
    """One start's stages (or their p50/p95 over the recent starts), seconds from the pod's creation."""

    scheduled_seconds: float | None = Field(default=None, ge=0, description=_s("PodScheduled turned True"))
    initialized_seconds: float | None = Field(
        default=None, ge=0, description=_s("Initialized turned True (init containers done)")
    )
    image_pulled_seconds: float | None = Field(
        default=None,
        ge=0,
        description=_s("The engine container's image pulled (its Pulled Event), if recorded"),
    )
    container_started_seconds: float | None = Field(
        default=None, ge=0, description=_s("The engine container running (containerStatuses[].state.running)")
    )
    containers_ready_seconds: float | None = Field(
        default=None,
        ge=0,
        description=_s("ContainersReady turned True (the kubelet's /health readiness probe)"),
    )
    engine_healthy_seconds: float | None = Field(
        default=None, ge=0, description=_s("The probe's first GET /health answered 200 on the pod")
    )
    first_token_seconds: float | None = Field(
        default=None, ge=0, description=_s("The first token of the probe's first successful streamed chat")
    )
    total_seconds: float | None = Field(
        default=None, ge=0, description="The cold start: pod creation to the first real token, seconds."
    )
    wake_seconds: float | None = Field(
        default=None,
        ge=0,
        description="A wake from zero: KEDA's scale from 0 (`activated`) to the first real token, seconds "
        "(counted from the activation, not from the pod's creation).",
    )


class StartupTimeline(StartupStages):
    """One engine pod's start."""

    pod: str = Field(max_length=253, description="The engine pod.")
    created: str = Field(
        max_length=64, description="The pod's creationTimestamp (what the stages count from)."
    )
    restarts: int = Field(
        default=0, ge=0, description="Engine container restarts before its first real token."
    )
    activated: str | None = Field(
        default=None,
        max_length=64,
        description="A wake from zero: when KEDA scaled the model from 0 (KEDAScaleTargetActivated).",
    )


class StartupStatus(ApiModel):
    """The last engine pod's start, and p50/p95 of each stage over the recent starts."""

    last: StartupTimeline | None = Field(default=None, description="The last start to reach its first token.")
    starts: int = Field(default=0, ge=0, description="Starts in `recent` (the p50/p95 sample).")
    p50: StartupStages | None = Field(default=None, description="p50 of each stage over the recent starts.")
    p95: StartupStages | None = Field(default=None, description="p95 of each stage over the recent starts.")
    recent: list[StartupTimeline] = Field(
        default_factory=list,
        max_length=STARTUP_HISTORY,
        description=f"The last {STARTUP_HISTORY} starts, oldest first (in status: a restart loses none).",
    )
