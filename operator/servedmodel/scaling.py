"""Pure pieces of autoscaling the reconciler and the probe scheduler share (no I/O, no clock).

- Replicas hand-over. While spec.autoscaling is set the operator's server-side apply leaves the
  Deployment's spec.replicas out. Server-side apply deletes a field its last owner stops applying, and
  the Deployment would fall back to 1 replica before the autoscaler writes it: so while the operator's
  field manager is the field's only owner, the reconciler first applies just `spec.replicas` (its live
  value) as HANDOVER_MANAGER; then dropping the field changes nothing, and the autoscaler's first
  scale (an update through /scale) takes the field over. This is the procedure the Kubernetes
  server-side apply documentation gives for handing replicas to an HPA.
- status.autoscaling from the HPA doing the scaling (the operator's `<name>`, or KEDA's
  `keda-hpa-<name>`): current/desired replicas, the last rescale seen, the telling condition.
- Scale to zero: the Deployment at 0 replicas under spec.autoscaling means the autoscaler put it there;
  the probe then sends no chat and states Serving Unknown (ScaledToZero) instead of a stale verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from .api import conditions
from .api.base import Obj
from .api.spec import ServedModelSpec

HANDOVER_MANAGER: Final = "servedmodel-replicas-handover"
SCALED_TO_ZERO: Final = "ScaledToZero"
HPA_MISSING: Final = "HorizontalPodAutoscalerMissing"
SCALE_TO_ZERO_NEEDS_KEDA: Final = "ScaleToZeroNeedsKEDA"
WAKE_NEEDS_HTTP_ADD_ON: Final = "WakeNeedsHTTPAddOn"


def replicas_owners(deployment: Obj | None) -> set[str]:
    """Field managers that own the Deployment's spec.replicas (from metadata.managedFields)."""
    owners: set[str] = set()
    for entry in ((deployment or {}).get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, Mapping):
            continue
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if isinstance(spec, Mapping) and "f:replicas" in spec:
            owners.add(str(entry.get("manager") or ""))
    return owners


def needs_handover(deployment: Obj | None, field_manager: str) -> bool:
    """True when dropping spec.replicas from `field_manager`'s apply would delete the field (so reset the
    Deployment to 1 replica): the operator owns it alone."""
    owners = replicas_owners(deployment)
    return field_manager in owners and owners == {field_manager}


def handover_object(deployment: Obj) -> dict[str, Any]:
    """The apply that keeps spec.replicas at its live value under HANDOVER_MANAGER. It carries the
    resourceVersion read: if the autoscaler rescaled in between, the API server answers 409 instead of
    putting the old count back (the pass retries with the new one)."""
    meta = deployment.get("metadata") or {}
    precondition = {"resourceVersion": meta["resourceVersion"]} if meta.get("resourceVersion") else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), **precondition},
        "spec": {"replicas": int((deployment.get("spec") or {}).get("replicas", 1))},
    }


def _telling_condition(hpa: Obj) -> tuple[str, str] | None:
    """(reason, message) of the HPA condition that says most: a failure first, then a limit, then the
    metric it scales on."""
    conds = (hpa.get("status") or {}).get("conditions")
    for type_, bad in (("ScalingActive", "False"), ("AbleToScale", "False"), ("ScalingLimited", "True")):
        c = conditions.find(conds, type_)
        if c is not None and c.get("status") == bad:
            return str(c.get("reason") or type_), str(c.get("message") or "")
    c = conditions.find(conds, "ScalingActive")
    if c is not None:
        return str(c.get("reason") or "ScalingActive"), str(c.get("message") or "")
    return None


def autoscaling_status(
    spec: ServedModelSpec,
    *,
    autoscaler: str,
    hpa_name: str,
    hpa: Obj | None,
    deployment: Obj | None,
    previous: Obj | None,
    wakes: bool = True,
) -> dict[str, Any]:
    """status.autoscaling (camelCase). `previous` is the current status.autoscaling: a rescale already
    recorded keeps its fromReplicas. `wakes`: a request wakes the model from zero (KEDA's HTTP add-on,
    render/wake.py); False under KEDA with scaleToZero is said in the message. Deterministic: same HPA
    status, same dict (no write churn)."""
    auto = spec.autoscaling
    assert auto is not None
    out: dict[str, Any] = {"autoscaler": autoscaler, "horizontalPodAutoscaler": hpa_name}
    previous = previous or {}
    hst = (hpa or {}).get("status") or {}
    if hpa is not None:
        if "currentReplicas" in hst:
            out["currentReplicas"] = int(hst["currentReplicas"])
        if "desiredReplicas" in hst:
            out["desiredReplicas"] = int(hst["desiredReplicas"])
        if hst.get("lastScaleTime"):
            before = previous.get("lastScale") or {}
            if before.get("time") == hst["lastScaleTime"]:
                out["lastScale"] = dict(before)
            else:
                to = out.get("desiredReplicas")
                frm = out.get("currentReplicas")
                if frm == to:  # seen after the rescale happened: what we reported before it
                    frm = previous.get("desiredReplicas")
                last: dict[str, Any] = {"time": hst["lastScaleTime"]}
                if frm is not None and frm != to:
                    last["fromReplicas"] = frm
                if to is not None:
                    last["toReplicas"] = to
                out["lastScale"] = last
    dep_spec = (deployment or {}).get("spec") or {}
    dep_status = (deployment or {}).get("status") or {}
    if deployment is not None and int(dep_spec.get("replicas", 1)) == 0 and not dep_status.get("replicas"):
        out["reason"] = SCALED_TO_ZERO
        by = "KEDA (idleReplicaCount 0: every trigger idle)" if autoscaler == "KEDA" else "the autoscaler"
        out["message"] = f"scaled to zero by {by}; the probe sends no chat until it scales up"
    elif hpa is None:
        out["reason"] = HPA_MISSING
        out["message"] = (
            f"waiting for KEDA to make HorizontalPodAutoscaler {hpa_name} (is the KEDA operator running?)"
            if autoscaler == "KEDA"
            else f"HorizontalPodAutoscaler {hpa_name} not found"
        )
    elif (telling := _telling_condition(hpa)) is not None:
        out["reason"], out["message"] = telling[0], conditions.clip(telling[1])
    if autoscaler != "KEDA" and auto.scale_to_zero and out.get("reason") != SCALED_TO_ZERO:
        note = "autoscaling.scaleToZero needs KEDA (keda.sh not found): the HPA keeps at least minReplicas"
        out["message"] = f"{out['message']}; {note}" if out.get("message") else note
        out.setdefault("reason", SCALE_TO_ZERO_NEEDS_KEDA)
    if autoscaler == "KEDA" and auto.scale_to_zero and not wakes:
        note = (
            "nothing wakes the model from zero: KEDA's HTTP add-on (http.keda.sh) is not installed or "
            "SERVEDMODEL_KEDA_HTTP_SCALER_ADDRESS is empty"
        )
        out["message"] = f"{out['message']}; {note}" if out.get("message") else note
        out.setdefault("reason", WAKE_NEEDS_HTTP_ADD_ON)
    return out


def scaled_to_zero(spec: ServedModelSpec, status: Obj) -> bool:
    """The autoscaler holds the engine at zero (the reconciler's status.autoscaling says so)."""
    auto = status.get("autoscaling")
    return (
        spec.autoscaling is not None
        and isinstance(auto, Mapping)
        and auto.get("reason") == SCALED_TO_ZERO
        and not status.get("readyReplicas")
    )


def scaled_to_zero_conditions(existing: Any, generation: int | None, now: str) -> list[dict[str, Any]]:
    """The probe's conditions while at zero: Serving Unknown (ScaledToZero), its others as they are."""
    out = [
        conditions.transition(
            existing,
            conditions.SERVING,
            "Unknown",
            SCALED_TO_ZERO,
            "scaled to zero by the autoscaler: no chat is sent (it would be traffic) until it scales up",
            generation=generation,
            now=now,
        )
    ]
    for type_ in conditions.PROBE_CONDITIONS:
        if type_ == conditions.SERVING:
            continue
        old = conditions.find(existing, type_)
        if old is not None:
            out.append(dict(old))
    return out
