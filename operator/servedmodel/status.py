"""Pure: what the reconciler writes into a ServedModel's status, computed from what its children say.

Input: the engine Deployment and its Pods (as the API returns them), the Route if exposed, and the
status as it is now. Output: the reconciler's status fragment — phase, observedGeneration, replicas,
readyReplicas, ready ("1/1": ready/desired, the `Ready` printer column), endpoint, routeUrl,
servedModelName, selector (the scale subresource's label selector), restarts (the engine pods' container
restarts) and the conditions Ready /
Progressing / Degraded (always) and InvalidSpec (only while the spec cannot be served) — plus the Events
its transitions deserve. Nothing here does I/O, reads a clock or imports kopf: the reconciler passes
`now` in.

`compute_status(subject, mode)` takes one of four explicit modes: `Managed` (observed children, and
the probe's Serving while probing is on), `ApplyFailed` (a child's apply was refused), `External`
(spec.endpoint, no children) and `InvalidSpec` (the spec cannot be served).

URL convention, the same as spec.endpoint's: the server's base URL without /v1 (the OpenAI routes are
under <base>/v1; /health, /metrics and /tokenize under <base>). endpoint: in-cluster
`http://<name>-engine.<namespace>.svc:8000`, or spec.endpoint verbatim in external mode. routeUrl:
`https://<host>` (http when the Route has no TLS) once the Route has a host.

Reasons come from the children: Pods (Unschedulable, ErrImagePull, ImagePullBackOff, CrashLoopBackOff,
OOMKilled, CreateContainerConfigError, …; ContainerRestarted while a container the kubelet restarted is
not ready again; while starting ContainerCreating / ContainersNotReady)
and the Deployment (ProgressDeadlineExceeded, MinimumReplicasUnavailable, FailedCreate,
NewReplicaSetAvailable, ReplicaSetUpdated). Operator's own: InvalidSpec, ApplyFailed, ExternalEndpoint,
ScaledToZero, DeploymentMissing. From the probe: while its Serving condition is False, a Ready
ServedModel is Degraded with Serving's reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from .api import Phase, conditions, names
from .api.base import Obj
from .api.conditions import ConditionStatus

# Status fields the reconciler's field manager owns (the probe owns status.probe and its own conditions).
RECONCILER_FIELDS: Final = (
    "phase",
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "ready",
    "restarts",
    "endpoint",
    "routeUrl",
    "servedModelName",
    "selector",
    "autoscaling",
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
    # Not a kubelet reason: a container the kubelet restarted (its process exited or was killed) that is
    # running again but not ready yet; the last exit in the message. Gone once it is ready again.
    "ContainerRestarted",
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


@dataclass(frozen=True)
class Verdict:
    """What one condition should say: status, reason (CamelCase), message."""

    status: ConditionStatus
    reason: str
    message: str


AS_EXPECTED: Final = Verdict("False", "AsExpected", "")


@dataclass
class _Conditions:
    ready: Verdict
    progressing: Verdict
    degraded: Verdict


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
    for cs in _containers(pod):
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if "running" in (cs.get("state") or {}) and not cs.get("ready") and last:
            detail = f"exit code {last['exitCode']}" if "exitCode" in last else "no exit code"
            restarts = int(cs.get("restartCount") or 0)
            failures.append(
                Problem(
                    "ContainerRestarted",
                    f"pod {name}: container {cs.get('name', '?')} restarted (restart {restarts}, "
                    f"last exit {last.get('reason') or 'Error'}, {detail}), not ready yet",
                )
            )
    scheduled = conditions.find(status.get("conditions"), "PodScheduled")
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        failures.append(
            Problem("Unschedulable", f"pod {name}: {scheduled.get('message') or 'unschedulable'}")
        )
    if failures:
        return min(failures, key=lambda p: _RANK[p.reason])
    ready = conditions.find(status.get("conditions"), "Ready")
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
    dep_conditions = (deployment.get("status") or {}).get("conditions")
    out: list[Problem] = []
    progressing = conditions.find(dep_conditions, "Progressing")
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
    replica_failure = conditions.find(dep_conditions, "ReplicaFailure")
    if replica_failure and replica_failure.get("status") == "True":
        out.append(
            Problem(
                str(replica_failure.get("reason") or "FailedCreate"),
                str(replica_failure.get("message") or ""),
            )
        )
    return out


def group_as_deployment(lws: Obj | None) -> Obj | None:
    """A LeaderWorkerSet (spec.workers) as the Deployment-shaped view the rest of this module reads: its
    replicas are groups, and its status' replicas / readyReplicas / updatedReplicas (a group is ready when
    all its pods are) become the Deployment's counts; a ready group is an available one. LWS keeps no
    observedGeneration: the view says the newest generation is seen (lagging_groups covers the lag)."""
    if lws is None:
        return None
    meta, spec, st = lws.get("metadata") or {}, lws.get("spec") or {}, lws.get("status") or {}
    generation = int(meta.get("generation") or 0)
    ready = int(st.get("readyReplicas") or 0)
    return {
        "metadata": {"name": meta.get("name"), "generation": generation},
        "spec": {"replicas": int(spec.get("replicas", 1))},
        "status": {
            "observedGeneration": generation,
            "replicas": int(st.get("replicas") or 0),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": int(st.get("updatedReplicas") or 0),
        },
    }


def ready_groups(pods: Sequence[Obj], group_label: str) -> int:
    """Groups (by `group_label`) whose every live pod is Ready."""
    groups: dict[str, bool] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        group = (meta.get("labels") or {}).get(group_label)
        if group is None or meta.get("deletionTimestamp"):
            continue
        ready = conditions.find((pod.get("status") or {}).get("conditions"), "Ready") or {}
        groups[group] = groups.get(group, True) and ready.get("status") == "True"
    return sum(1 for ok in groups.values() if ok)


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
    spec, dep_status = deployment.get("spec") or {}, deployment.get("status") or {}
    return {
        "desired": int(spec.get("replicas", 1)),
        "replicas": int(dep_status.get("replicas") or 0),
        "ready": int(dep_status.get("readyReplicas") or 0),
        "available": int(dep_status.get("availableReplicas") or 0),
        "updated": int(dep_status.get("updatedReplicas") or 0),
    }


def rollout_complete(deployment: Obj) -> bool:
    """kubectl rollout status's test: newest spec seen; every replica is new and available."""
    meta, dep_status = deployment.get("metadata") or {}, deployment.get("status") or {}
    counts = _replica_counts(deployment)
    return (
        int(dep_status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        and counts["updated"] >= counts["desired"]
        and counts["replicas"] <= counts["updated"]
        and counts["available"] >= counts["updated"]
    )


def _assess_managed(observed: Observed) -> tuple[Phase, _Conditions]:
    dep = observed.deployment
    if dep is None:
        msg = "the engine Deployment does not exist yet"
        return "Pending", _Conditions(
            Verdict("False", "DeploymentMissing", msg),
            Verdict("True", "DeploymentMissing", msg),
            AS_EXPECTED,
        )
    counts = _replica_counts(dep)
    if counts["desired"] == 0 and counts["replicas"] == 0:
        msg = "spec.replicas is 0: nothing serves"
        return "Pending", _Conditions(
            Verdict("False", "ScaledToZero", msg), Verdict("False", "ScaledToZero", msg), AS_EXPECTED
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

    dep_conditions = (dep.get("status") or {}).get("conditions")
    available_msg = f"{counts['available']}/{counts['desired']} replicas available"
    available = conditions.find(dep_conditions, "Available")
    is_ready = counts["available"] >= 1 and (
        available.get("status") == "True"
        if available is not None
        else counts["available"] >= counts["desired"]
    )
    if is_ready:
        ready = Verdict(
            "True", str((available or {}).get("reason") or "MinimumReplicasAvailable"), available_msg
        )
    elif failures:
        ready = Verdict("False", failures[0].reason, failures[0].message)
    elif pod_problems:
        ready = Verdict("False", pod_problems[0].reason, f"{available_msg}; {pod_problems[0].message}")
    else:
        ready = Verdict(
            "False", str((available or {}).get("reason") or "MinimumReplicasUnavailable"), available_msg
        )

    deadline = next((f for f in failures if f.reason == "ProgressDeadlineExceeded"), None)
    complete = rollout_complete(dep)
    progress_cond = conditions.find(dep_conditions, "Progressing")
    rollout_msg = f"{counts['updated']}/{counts['desired']} replicas updated, {available_msg}"
    if deadline is not None:
        progressing = Verdict("False", "ProgressDeadlineExceeded", deadline.message)
    elif complete:
        progressing = Verdict("False", "NewReplicaSetAvailable", f"rollout complete: {available_msg}")
    else:
        reason = str((progress_cond or {}).get("reason") or "ReplicaSetUpdated")
        seen = int((dep.get("status") or {}).get("observedGeneration") or 0)
        if seen < int((dep.get("metadata") or {}).get("generation") or 0):
            reason = "ReplicaSetUpdated"  # its condition still describes the previous template
        progressing = Verdict("True", reason, rollout_msg)

    degraded = Verdict("True", failures[0].reason, failures[0].message) if failures else AS_EXPECTED

    phase: Phase
    if deadline is not None and counts["available"] == 0:
        phase = "Failed"
    elif failures:
        phase = "Degraded"
    elif is_ready and complete:
        phase = "Ready"
    elif counts["replicas"] == 0 and not live_pods:
        phase = "Pending"
    else:
        phase = "Progressing"
    return phase, _Conditions(ready, progressing, degraded)


# ---- the modes of compute_status --------------------------------------------------------------------


@dataclass(frozen=True)
class Subject:
    """The ServedModel a status is computed for, and when: what every mode shares.

    `previous` is its status as it is now (both writers' fields): a condition whose status does not
    change keeps its lastTransitionTime from there."""

    name: str
    namespace: str
    generation: int
    previous: Obj | None
    now: str  # RFC 3339, seconds (metav1.Time)


@dataclass(frozen=True)
class Managed:
    """The operator deploys the engine: the status follows the observed children.

    `serving` is the probe's Serving condition, passed only while probing is on: replicas that are
    ready by Kubernetes' account but fail a real chat request make the phase Degraded."""

    observed: Observed
    served_model_name: str
    serving: Mapping[str, Any] | None = None
    # status.autoscaling as servedmodel.scaling computed it from the HPA (spec.autoscaling set), else None.
    autoscaling: Obj | None = None
    # Something the engine is configured with that the operator could not find (the chat template
    # ConfigMap or its key, render.chat_template): Degraded with its reason, whatever the pods say.
    missing: Problem | None = None
    # The spec's revision was Blocked by the readiness gate and the last proven one put back (or could
    # not be: RollbackUnavailable), reconcile.rollback: Degraded with its reason until the spec changes.
    rolled_back: Problem | None = None


@dataclass(frozen=True)
class ApplyFailed:
    """Managed, but the API server refused a child's server-side apply (a 4xx): Degraded with that
    reason whatever the children say (the refused change never reached them)."""

    observed: Observed
    served_model_name: str
    reason: str
    message: str


@dataclass(frozen=True)
class External:
    """spec.endpoint: no children; Ready by definition, Degraded while the probe's Serving is False."""

    endpoint: str
    served_model_name: str
    serving: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class InvalidSpec:
    """The spec passed the schema but cannot be served. `observed`: the children of the last good
    spec, left as they are (they may still serve); their replica counts stay in the status."""

    message: str
    observed: Observed = Observed()


Mode = Managed | ApplyFailed | External | InvalidSpec


def _degraded_by_probe(phase: Phase, conds: _Conditions, serving: Mapping[str, Any] | None) -> Phase:
    """Ready by Kubernetes' account, yet a real chat request fails (on every replica: Serving=False, or
    on some: reason ReplicasFailing): what users care about. ReplicasFailing also from Progressing: with
    the readiness gate a failing replica is NotReady, which the Deployment reports as an unfinished
    rollout while the other replicas serve."""
    if phase not in ("Ready", "Progressing") or serving is None:
        return phase
    reason = str(serving.get("reason") or "ProbeFailed")
    if serving.get("status") == "False" and phase == "Ready":  # starting: the Deployment's story stands
        conds.degraded = Verdict("True", reason, f"Serving=False: {serving.get('message') or reason}")
    elif serving.get("status") == "True" and reason == conditions.REPLICAS_FAILING:
        conds.degraded = Verdict("True", reason, str(serving.get("message") or reason))
    else:
        return phase
    return "Degraded"


def engine_restarts(pods: Sequence[Obj]) -> int:
    """The kubelet's restarts of the containers of the live engine pods (kubectl get pods' RESTARTS,
    summed): a pod replaced by a rollout starts again from 0."""
    return sum(
        int(cs.get("restartCount") or 0)
        for pod in pods
        if not (pod.get("metadata") or {}).get("deletionTimestamp")
        for cs in (pod.get("status") or {}).get("containerStatuses") or []
    )


def _replica_fields(name: str, observed: Observed) -> dict[str, Any]:
    counts = _replica_counts(observed.deployment)
    return {
        "replicas": counts["replicas"],
        "restarts": engine_restarts(observed.pods),
        "readyReplicas": counts["ready"],
        "ready": f"{counts['ready']}/{counts['desired']}",
        "selector": names.selector_string(name),
    }


def compute_status(subject: Subject, mode: Mode) -> dict[str, Any]:
    """The reconciler's status fragment (camelCase, ready for apply_status): its fields
    (`RECONCILER_FIELDS`) and conditions (`conditions.RECONCILER_CONDITIONS`), never the probe's."""
    status: dict[str, Any] = {"observedGeneration": subject.generation}
    phase: Phase
    match mode:
        case InvalidSpec(message=message, observed=observed):
            phase = "Failed"
            conds = _Conditions(
                Verdict("False", conditions.INVALID_SPEC, message),
                Verdict("False", conditions.INVALID_SPEC, message),
                Verdict("True", conditions.INVALID_SPEC, message),
            )
            if observed.deployment is not None:
                status.update(_replica_fields(subject.name, observed))
        case External(endpoint=endpoint, served_model_name=served, serving=serving):
            msg = f"external mode: no children; serving at {endpoint} (the probe checks it)"
            conds = _Conditions(
                Verdict("True", "ExternalEndpoint", msg),
                Verdict("False", "ExternalEndpoint", msg),
                AS_EXPECTED,
            )
            phase = _degraded_by_probe("Ready", conds, serving)
            status.update(endpoint=endpoint, servedModelName=served)
        case Managed() | ApplyFailed():
            phase, conds = _assess_managed(mode.observed)
            status["endpoint"] = endpoint_url(subject.name, subject.namespace)
            if (url := route_url(mode.observed.route)) is not None:
                status["routeUrl"] = url
            status["servedModelName"] = mode.served_model_name
            status.update(_replica_fields(subject.name, mode.observed))
            if isinstance(mode, Managed):
                phase = _degraded_by_probe(phase, conds, mode.serving)
                for problem in (mode.rolled_back, mode.missing):
                    if problem is not None:
                        conds.degraded = Verdict("True", problem.reason, problem.message)
                        phase = phase if phase == "Failed" else "Degraded"
                if mode.autoscaling is not None:
                    status["autoscaling"] = dict(mode.autoscaling)
                    if conds.ready.reason == "ScaledToZero" and mode.autoscaling.get("message"):
                        # The autoscaler's words (KEDA's idle scale to zero), not "spec.replicas is 0".
                        msg = str(mode.autoscaling["message"])
                        conds.ready = Verdict("False", "ScaledToZero", msg)
                        conds.progressing = Verdict("False", "ScaledToZero", msg)
            else:
                conds.degraded = Verdict("True", mode.reason, mode.message)
                if phase != "Failed":
                    phase = "Degraded"
    status["phase"] = phase
    rows = [
        (conditions.READY, conds.ready),
        (conditions.PROGRESSING, conds.progressing),
        (conditions.DEGRADED, conds.degraded),
    ]
    if isinstance(mode, InvalidSpec):
        # Present only while true: a spec the schema let through but the operator cannot serve.
        rows.append((conditions.INVALID_SPEC, Verdict("True", conditions.INVALID_SPEC, mode.message)))
    previous = (subject.previous or {}).get("conditions")
    status["conditions"] = [
        conditions.transition(
            previous, type_, v.status, v.reason, v.message, generation=subject.generation, now=subject.now
        )
        for type_, v in rows
    ]
    return status


def _comparable(status: Obj | None) -> dict[str, Any]:
    status = status or {}
    ours = {
        c.get("type"): {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions") or []
        if isinstance(c, Mapping) and c.get("type") in conditions.RECONCILER_CONDITIONS
    }
    return {**{k: status.get(k) for k in RECONCILER_FIELDS}, "conditions": ours}


def status_changed(current: Obj | None, desired: Obj) -> bool:
    """Would writing `desired` change the reconciler's part of `current`? Times are ignored, and so is
    everything the probe owns, so a resync that observes nothing new writes nothing."""
    return _comparable(current) != _comparable(desired)


def transitions(current: Obj | None, desired: Obj) -> list[Transition]:
    """Events for what changed: the phase, and a new failure reason while still Degraded."""
    current = current or {}
    old_phase, new_phase = current.get("phase"), desired.get("phase")
    old_conditions, new_conditions = current.get("conditions"), desired.get("conditions")
    out: list[Transition] = []
    if old_phase != new_phase:
        bad = new_phase in ("Degraded", "Failed")
        cause = conditions.find(new_conditions, conditions.DEGRADED if bad else conditions.READY) or {}
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
        before = conditions.find(old_conditions, conditions.DEGRADED) or {}
        after = conditions.find(new_conditions, conditions.DEGRADED) or {}
        if before.get("reason") != after.get("reason"):
            out.append(Transition("Warning", str(after.get("reason")), str(after.get("message") or "")))
    return out
