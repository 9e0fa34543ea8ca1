"""Conditions, Kubernetes' shape (metav1.Condition), for both writers of a ServedModel's status.

One lookup (`find`) for any condition list — a Pod's, a Deployment's, a ServedModel's — and one way to
(re)state a condition (`transition`): lastTransitionTime moves only when the status changes, and every
condition says which metadata.generation it was computed from. Every message is clipped in one place
(`clip`, MESSAGE_MAX): a condition or status message stays readable in `kubectl describe`, whatever an
engine answered.

Who writes which condition (server-side apply, `status.conditions` is a list-map keyed by type, so each
field manager owns its own entries; see docs/architecture-reconcile.md):

- the reconciler (field manager `servedmodel-operator`): Ready, Progressing, Degraded, InvalidSpec;
- the request-path probe (field manager `servedmodel-probe`): Serving, TemplateOK, LatencySLOMet,
  EngineStalled, KVCachePressure, ProbeUnreliable, RolloutBlocked, AdaptersServing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from .base import ConditionStatus

__all__ = [
    "ADAPTERS_SERVING",
    "DEGRADED",
    "ENGINE_STALLED",
    "INVALID_SPEC",
    "KV_CACHE_PRESSURE",
    "LATENCY_SLO_MET",
    "MESSAGE_MAX",
    "METRICS_COMPATIBLE",
    "PROBE_CONDITIONS",
    "PROBE_UNRELIABLE",
    "PROGRESSING",
    "READY",
    "RECONCILER_CONDITIONS",
    "REPLICAS_FAILING",
    "ROLLED_BACK",
    "ROLLOUT_BLOCKED",
    "SERVING",
    "TEMPLATE_OK",
    "ConditionStatus",
    "clip",
    "find",
    "transition",
]

READY: Final = "Ready"
PROGRESSING: Final = "Progressing"
DEGRADED: Final = "Degraded"
INVALID_SPEC: Final = "InvalidSpec"
SERVING: Final = "Serving"
TEMPLATE_OK: Final = "TemplateOK"
LATENCY_SLO_MET: Final = "LatencySLOMet"
ENGINE_STALLED: Final = "EngineStalled"
KV_CACHE_PRESSURE: Final = "KVCachePressure"
# True while the probe itself cannot be trusted to judge the engine (a Secret it cannot read, its own
# connection pool exhausted, its own loop stalled): the readiness gate stays as it was meanwhile.
PROBE_UNRELIABLE: Final = "ProbeUnreliable"
# The newest engine revision did not pass its readiness gates in time (probe/replicas.rollout_status); the
# reconciler's Degraded then says RolledBack once it put the last proven revision's pod template back.
ROLLOUT_BLOCKED: Final = "RolloutBlocked"
ROLLED_BACK: Final = "RolledBack"
# Serving=True with this reason: some replicas serve, others fail their own probe (probe/replicas.py);
# the reconciler makes it Degraded.
REPLICAS_FAILING: Final = "ReplicasFailing"

# spec.adapters: every declared LoRA adapter served its own chat request (False names each one that did
# not and why: a load refusal, its probe's failure); absent without adapters. The base model's Serving is
# not affected by it.
ADAPTERS_SERVING: Final = "AdaptersServing"
# Every probed engine pod exposes the series GIE's endpoint picker and the probe read, with their types
# and labels (probe/compat.py); False names the pod and what is missing. Absent with a Prometheus source.
METRICS_COMPATIBLE: Final = "MetricsCompatible"

RECONCILER_CONDITIONS: Final = (READY, PROGRESSING, DEGRADED, INVALID_SPEC)
PROBE_CONDITIONS: Final = (
    SERVING,
    TEMPLATE_OK,
    LATENCY_SLO_MET,
    ENGINE_STALLED,
    KV_CACHE_PRESSURE,
    PROBE_UNRELIABLE,
    ROLLOUT_BLOCKED,
    ADAPTERS_SERVING,
    METRICS_COMPATIBLE,
)


def find(conditions: object, type_: str) -> Mapping[str, Any] | None:
    """The condition of that type in a condition list as the API server returns it (None if absent).

    Tolerates what a hand-edited object may hold: no list, or entries that are not mappings."""
    if not isinstance(conditions, list | tuple):
        return None
    for c in conditions:
        if isinstance(c, Mapping) and c.get("type") == type_:
            return c
    return None


# metav1.Condition allows 32 KiB; a message is for a person reading `kubectl describe`, not a log.
MESSAGE_MAX: Final = 1000


def clip(message: str) -> str:
    """`message` cut to MESSAGE_MAX characters (a condition's, status.probe's)."""
    return message[:MESSAGE_MAX]


def transition(
    previous: object,
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    """The condition `type_` as it should be now (camelCase, ready for server-side apply).

    `previous` is the current condition list; when the condition there has the same status, its
    lastTransitionTime is kept, else it becomes `now` (RFC 3339, seconds: metav1.Time). A status
    that only changes its reason or message is not a transition. The message is clipped (`clip`).
    """
    old = find(previous, type_)
    kept = old.get("lastTransitionTime") if old is not None and old.get("status") == status else None
    out: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": clip(message)}
    if generation is not None:
        out["observedGeneration"] = generation
    out["lastTransitionTime"] = str(kept) if kept else now
    return out
