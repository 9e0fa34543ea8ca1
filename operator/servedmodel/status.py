"""Pure: what the reconciler writes into a ServedModel's status, computed from what its children say.

Input: the engine Deployment and its Pods (as the API returns them), the Route if exposed, and the
status as it is now. Output: the reconciler's status fragment — phase, observedGeneration, replicas,
readyReplicas, ready ("1/1": ready/desired, the `Ready` printer column), endpoint, routeUrl,
servedModelName, selector (the scale subresource's label selector) and the conditions Ready /
Progressing / Degraded (always) and InvalidSpec (only while the spec cannot be served) — plus the Events
its transitions deserve. Nothing here does I/O, reads a clock or imports kopf: the reconciler passes
`now` in.

URL convention, the same as spec.endpoint's: the server's base URL without /v1 (the OpenAI routes are
under <base>/v1; /health, /metrics and /tokenize under <base>). endpoint: in-cluster
`http://<name>-engine.<namespace>.svc:8000`, or spec.endpoint verbatim in external mode. routeUrl:
`https://<host>` (http when the Route has no TLS) once the Route has a host.

Reasons come from the children: Pods (Unschedulable, ErrImagePull, ImagePullBackOff, CrashLoopBackOff,
OOMKilled, CreateContainerConfigError, …, and while starting ContainerCreating / ContainersNotReady)
and the Deployment (ProgressDeadlineExceeded, MinimumReplicasUnavailable, FailedCreate,
NewReplicaSetAvailable, ReplicaSetUpdated). Operator's own: InvalidSpec, ApplyFailed, ExternalEndpoint,
ScaledToZero, DeploymentMissing. From the probe: while its Serving condition is False, a Ready
ServedModel is Degraded with Serving's reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from .api import names

Obj = Mapping[str, Any]
Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]

READY: Final = "Ready"
PROGRESSING: Final = "Progressing"
DEGRADED: Final = "Degraded"
INVALID_SPEC: Final = "InvalidSpec"
RECONCILER_CONDITIONS: Final = (READY, PROGRESSING, DEGRADED, INVALID_SPEC)
# Status fields the reconciler's field manager owns (the probe owns status.probe and its own conditions).
RECONCILER_FIELDS: Final = (
    "phase",
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "ready",
    "endpoint",
    "routeUrl",
    "servedModelName",
    "selector",
)

# Container waiting reasons that are failures (not the normal ContainerCreating/PodInitializing), most
# actionable first: a bad image name or a missing Secret (the HF token!) won't fix itself.
FAILURE_WAITING_REASONS: Final = (
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "ErrImagePull",
    "ImagePullBackOff",
    "CreateContainerError",
    "RunContainerError",
    "OOMKilled",  # not a waiting reason itself: CrashLoopBackOff whose last exit was the OOM killer
    "CrashLoopBackOff",
    "Unschedulable",
    "Evicted",
)
_RANK: Final = {reason: i for i, reason in enumerate(FAILURE_WAITING_REASONS)}


@dataclass(frozen=True)
class Problem:
    """Something a Pod or the Deployment says is wrong (or, when not `failure`, still starting)."""

    reason: str
    message: str
    failure: bool = True


@dataclass(frozen=True)
class Observed:
    """The children as read from the API server; `deployment` None when it does not exist (yet)."""

    deployment: Obj | None = None
    pods: Sequence[Obj] = ()
    route: Obj | None = None


@dataclass(frozen=True)
class Transition:
    """An Event the reconciler should record about the ServedModel."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class _Conditions:
    ready: tuple[str, str, str]  # status, reason, message
    progressing: tuple[str, str, str]
    degraded: tuple[str, str, str]


def _cond(items: Any, type_: str) -> Obj | None:
    for c in items or []:
        if isinstance(c, Mapping) and c.get("type") == type_:
            return c
    return None


def _containers(pod: Obj) -> list[Obj]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def pod_problem(pod: Obj) -> Problem | None:
    """The most actionable thing a Pod says, failure or not; None when it is ready or says nothing."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name = meta.get("name", "?")
    if status.get("phase") == "Failed" and status.get("reason") == "Evicted":
        return Problem("Evicted", f"pod {name}: {status.get('message') or 'evicted'}")
    failures: list[Problem] = []
    for cs in _containers(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if not reason:
            continue
        cname = cs.get("name", "?")
        if reason == "CrashLoopBackOff":
            last = (cs.get("lastState") or {}).get("terminated") or {}
            # Back-off messages embed a growing delay ("back-off 40s"); describe the last exit instead so
            # the condition message (and the status) stays the same from one resync to the next.
            if last.get("reason") == "OOMKilled":
                failures.append(
                    Problem("OOMKilled", f"pod {name}: container {cname} was OOM-killed and keeps restarting")
                )
            else:
                detail = f"exit code {last['exitCode']}" if "exitCode" in last else "no exit code"
                failures.append(
                    Problem(
                        "CrashLoopBackOff",
                        f"pod {name}: container {cname} keeps exiting "
                        f"({last.get('reason') or 'Error'}, {detail})",
                    )
                )
        elif reason in _RANK:
            message = waiting.get("message") or reason
            failures.append(Problem(reason, f"pod {name}: container {cname}: {message}"))
    scheduled = _cond(status.get("conditions"), "PodScheduled")
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        failures.append(
            Problem("Unschedulable", f"pod {name}: {scheduled.get('message') or 'unschedulable'}")
        )
    if failures:
        return min(failures, key=lambda p: _RANK[p.reason])
    ready = _cond(status.get("conditions"), "Ready")
    if ready is not None and ready.get("status") == "True":
        return None
    for cs in _containers(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):  # ContainerCreating, PodInitializing
            return Problem(
                waiting["reason"], f"pod {name}: container {cs.get('name', '?')} {waiting['reason']}", False
            )
    if status.get("phase") == "Running":
        # Running but not Ready: for vLLM, loading weights and warming up until /health answers.
        return Problem("ContainersNotReady", f"pod {name}: running, waiting for readiness", False)
    if status.get("phase") == "Pending" and scheduled and scheduled.get("status") == "True":
        return Problem("PodInitializing", f"pod {name}: scheduled, starting", False)
    return None


def deployment_problems(deployment: Obj) -> list[Problem]:
    """Failures the Deployment controller reports: a passed progress deadline, pods it cannot create."""
    conditions = (deployment.get("status") or {}).get("conditions")
    out: list[Problem] = []
    progressing = _cond(conditions, "Progressing")
    if (
        progressing
        and progressing.get("status") == "False"
        and progressing.get("reason") == "ProgressDeadlineExceeded"
    ):
        out.append(
            Problem(
                "ProgressDeadlineExceeded", str(progressing.get("message") or "progress deadline exceeded")
            )
        )
    replica_failure = _cond(conditions, "ReplicaFailure")
    if replica_failure and replica_failure.get("status") == "True":
        out.append(
            Problem(
                str(replica_failure.get("reason") or "FailedCreate"),
                str(replica_failure.get("message") or ""),
            )
        )
    return out


def endpoint_url(name: str, namespace: str) -> str:
    """The in-cluster base URL of the engine Service (no /v1, like spec.endpoint)."""
    return f"http://{names.service_name(name)}.{namespace}.svc:{names.ENGINE_PORT}"


def route_url(route: Obj | None) -> str | None:
    """https://<host> of a Route (http without TLS); None until the Route has a host."""
    if route is None:
        return None
    ingress = ((route.get("status") or {}).get("ingress") or [{}])[0]
    host = (route.get("spec") or {}).get("host") or ingress.get("host")
    if not host:
        return None
    return f"{'https' if (route.get('spec') or {}).get('tls') else 'http'}://{host}"


def _replica_counts(deployment: Obj | None) -> dict[str, int]:
    if deployment is None:
        return {"desired": 0, "replicas": 0, "ready": 0, "available": 0, "updated": 0}
    spec, st = deployment.get("spec") or {}, deployment.get("status") or {}
    return {
        "desired": int(spec.get("replicas", 1)),
        "replicas": int(st.get("replicas") or 0),
        "ready": int(st.get("readyReplicas") or 0),
        "available": int(st.get("availableReplicas") or 0),
        "updated": int(st.get("updatedReplicas") or 0),
    }


def rollout_complete(deployment: Obj) -> bool:
    """kubectl rollout status's test: newest spec seen; every replica is new and available."""
    meta, st = deployment.get("metadata") or {}, deployment.get("status") or {}
    n = _replica_counts(deployment)
    return (
        int(st.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        and n["updated"] >= n["desired"]
        and n["replicas"] <= n["updated"]
        and n["available"] >= n["updated"]
    )


def _assess_managed(observed: Observed) -> tuple[Phase, _Conditions]:
    dep = observed.deployment
    if dep is None:
        msg = "the engine Deployment does not exist yet"
        return "Pending", _Conditions(
            ("False", "DeploymentMissing", msg),
            ("True", "DeploymentMissing", msg),
            ("False", "AsExpected", ""),
        )
    n = _replica_counts(dep)
    if n["desired"] == 0 and n["replicas"] == 0:
        msg = "spec.replicas is 0: nothing serves"
        return "Pending", _Conditions(
            ("False", "ScaledToZero", msg), ("False", "ScaledToZero", msg), ("False", "AsExpected", "")
        )
    live_pods = sorted(
        (p for p in observed.pods if not (p.get("metadata") or {}).get("deletionTimestamp")),
        key=lambda p: str((p.get("metadata") or {}).get("name", "")),
    )
    pod_problems = [pr for pr in map(pod_problem, live_pods) if pr is not None]
    failing_pods = [pr for pr in pod_problems if pr.failure]
    failures: list[Problem] = []
    if failing_pods:
        # One condition message stays short: the worst pod, and how many more fail too. A pod's reason
        # says more than the Deployment's (a passed deadline), so it comes first.
        worst = min(failing_pods, key=lambda p: _RANK[p.reason])
        more = len(failing_pods) - 1
        suffix = f" (and {more} more pod{'s' if more > 1 else ''} failing)" if more else ""
        failures.append(Problem(worst.reason, worst.message + suffix))
    failures.extend(deployment_problems(dep))

    counts = f"{n['available']}/{n['desired']} replicas available"
    available = _cond((dep.get("status") or {}).get("conditions"), "Available")
    is_ready = n["available"] >= 1 and (
        available.get("status") == "True" if available is not None else n["available"] >= n["desired"]
    )
    if is_ready:
        ready = ("True", str((available or {}).get("reason") or "MinimumReplicasAvailable"), counts)
    elif failures:
        ready = ("False", failures[0].reason, failures[0].message)
    elif pod_problems:
        ready = ("False", pod_problems[0].reason, f"{counts}; {pod_problems[0].message}")
    else:
        ready = ("False", str((available or {}).get("reason") or "MinimumReplicasUnavailable"), counts)

    deadline = next((f for f in failures if f.reason == "ProgressDeadlineExceeded"), None)
    complete = rollout_complete(dep)
    progress_cond = _cond((dep.get("status") or {}).get("conditions"), "Progressing")
    rollout_msg = f"{n['updated']}/{n['desired']} replicas updated, {counts}"
    if deadline is not None:
        progressing = ("False", "ProgressDeadlineExceeded", deadline.message)
    elif complete:
        progressing = ("False", "NewReplicaSetAvailable", f"rollout complete: {counts}")
    else:
        reason = str((progress_cond or {}).get("reason") or "ReplicaSetUpdated")
        seen = int((dep.get("status") or {}).get("observedGeneration") or 0)
        if seen < int((dep.get("metadata") or {}).get("generation") or 0):
            reason = "ReplicaSetUpdated"  # its condition still describes the previous template
        progressing = ("True", reason, rollout_msg)

    degraded = ("True", failures[0].reason, failures[0].message) if failures else ("False", "AsExpected", "")

    phase: Phase
    if deadline is not None and n["available"] == 0:
        phase = "Failed"
    elif failures:
        phase = "Degraded"
    elif is_ready and complete:
        phase = "Ready"
    elif n["replicas"] == 0 and not live_pods:
        phase = "Pending"
    else:
        phase = "Progressing"
    return phase, _Conditions(ready, progressing, degraded)


def compute_status(
    *,
    name: str,
    namespace: str,
    generation: int,
    previous: Obj | None,
    now: str,
    observed: Observed | None = None,
    external_endpoint: str | None = None,
    served_model_name: str | None = None,
    invalid_spec: str | None = None,
    apply_error: tuple[str, str] | None = None,
    serving: Obj | None = None,
) -> dict[str, Any]:
    """The reconciler's status fragment (camelCase, ready for apply_status).

    Exactly one of the modes: `invalid_spec` (the message of why the spec cannot be served),
    `external_endpoint` (spec.endpoint, no children), or `observed` children. `apply_error` (reason,
    message) marks a failed server-side apply of a child on top of what is observed. `previous` is the
    current status: a condition whose status did not change keeps its lastTransitionTime.

    `serving` is the probe's Serving condition (pass it only while probing is on): replicas that are
    ready but fail a real chat request make the phase Degraded, with the probe's reason on Degraded.
    """
    n = _replica_counts(observed.deployment if observed else None)
    status: dict[str, Any] = {"observedGeneration": generation}
    if invalid_spec is not None:
        phase: Phase = "Failed"
        conds = _Conditions(
            ("False", "InvalidSpec", invalid_spec),
            ("False", "InvalidSpec", invalid_spec),
            ("True", "InvalidSpec", invalid_spec),
        )
    elif external_endpoint is not None:
        phase = "Ready"
        msg = f"external mode: no children; serving at {external_endpoint} (the probe checks it)"
        conds = _Conditions(
            ("True", "ExternalEndpoint", msg), ("False", "ExternalEndpoint", msg), ("False", "AsExpected", "")
        )
        status["endpoint"] = external_endpoint
    else:
        phase, conds = _assess_managed(observed or Observed())
        status["endpoint"] = endpoint_url(name, namespace)
        if (url := route_url(observed.route if observed else None)) is not None:
            status["routeUrl"] = url
    if served_model_name is not None:
        status["servedModelName"] = served_model_name
    if phase == "Ready" and serving is not None and serving.get("status") == "False":
        # Ready by Kubernetes' account, yet a real chat request fails: what users care about.
        reason = str(serving.get("reason") or "ProbeFailed")
        conds.degraded = ("True", reason, f"Serving=False: {serving.get('message') or reason}")
        phase = "Degraded"
    if apply_error is not None:
        conds.degraded = ("True", apply_error[0], apply_error[1])
        if phase != "Failed":
            phase = "Degraded"
    if external_endpoint is None and (invalid_spec is None or (observed and observed.deployment)):
        status.update(
            replicas=n["replicas"],
            readyReplicas=n["ready"],
            ready=f"{n['ready']}/{n['desired']}",
            selector=names.selector_string(name),
        )
    status["phase"] = phase
    before = {c.get("type"): c for c in (previous or {}).get("conditions") or [] if isinstance(c, Mapping)}
    conditions = []
    rows = [(READY, conds.ready), (PROGRESSING, conds.progressing), (DEGRADED, conds.degraded)]
    if invalid_spec is not None:
        # Present only while true: a spec the schema let through but the operator cannot serve.
        rows.append((INVALID_SPEC, ("True", "InvalidSpec", invalid_spec)))
    for type_, (st, reason, message) in rows:
        old = before.get(type_)
        kept = old is not None and old.get("status") == st and old.get("lastTransitionTime")
        conditions.append(
            {
                "type": type_,
                "status": st,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": old["lastTransitionTime"] if kept and old else now,
            }
        )
    status["conditions"] = conditions
    return status


def _comparable(status: Obj | None) -> dict[str, Any]:
    status = status or {}
    conds = {
        c.get("type"): {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions") or []
        if isinstance(c, Mapping) and c.get("type") in RECONCILER_CONDITIONS
    }
    return {**{k: status.get(k) for k in RECONCILER_FIELDS}, "conditions": conds}


def status_changed(current: Obj | None, desired: Obj) -> bool:
    """Would writing `desired` change the reconciler's part of `current`? Times are ignored, and so is
    everything the probe owns, so a resync that observes nothing new writes nothing."""
    return _comparable(current) != _comparable(desired)


def transitions(current: Obj | None, desired: Obj) -> list[Transition]:
    """Events for what changed: the phase, and a new failure reason while still Degraded."""
    current = current or {}
    old_phase, new_phase = current.get("phase"), desired.get("phase")
    old = {c.get("type"): c for c in current.get("conditions") or [] if isinstance(c, Mapping)}
    new = {c.get("type"): c for c in desired.get("conditions") or []}
    out: list[Transition] = []
    if old_phase != new_phase:
        bad = new_phase in ("Degraded", "Failed")
        cause = new.get(DEGRADED if bad else READY) or {}
        detail = cause.get("message") or cause.get("reason") or ""
        out.append(
            Transition(
                "Warning" if bad else "Normal",
                str(new_phase),
                f"{old_phase or 'new'} → {new_phase}"
                + (f": {cause.get('reason')}: {detail}" if detail else ""),
            )
        )
    elif new_phase in ("Degraded", "Failed"):
        before, after = old.get(DEGRADED) or {}, new.get(DEGRADED) or {}
        if before.get("reason") != after.get("reason"):
            out.append(Transition("Warning", str(after.get("reason")), str(after.get("message") or "")))
    return out
