"""status.py: table-driven, with Deployment and Pod dicts shaped like the API server returns them."""

from __future__ import annotations

from typing import Any

import pytest

from servedmodel.api import ServedModelStatus
from servedmodel.status import (
    ApplyFailed,
    External,
    InvalidSpec,
    Managed,
    Observed,
    Problem,
    Subject,
    compute_status,
    endpoint_url,
    pod_problem,
    route_url,
    status_changed,
    transitions,
)

T0 = "2026-11-29T18:00:00Z"
T1 = "2026-11-29T18:05:00Z"
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def subject(
    generation: int = 1, previous: dict[str, Any] | None = None, now: str = T0, name: str = "qwen"
) -> Subject:
    return Subject(name, "ml", generation, previous, now)


def deployment(
    *,
    desired: int = 1,
    generation: int = 1,
    observed_generation: int = 1,
    replicas: int | None = None,
    ready: int = 0,
    available: int = 0,
    updated: int | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    replicas = desired if replicas is None else replicas
    status: dict[str, Any] = {"observedGeneration": observed_generation}
    if replicas:
        status.update(replicas=replicas, updatedReplicas=replicas if updated is None else updated)
    if ready:
        status["readyReplicas"] = ready
    if available:
        status["availableReplicas"] = available
    if replicas - available > 0:
        status["unavailableReplicas"] = replicas - available
    if conditions is not None:
        status["conditions"] = conditions
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "ml", "generation": generation},
        "spec": {"replicas": desired},
        "status": status,
    }


def dcond(type_: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastUpdateTime": T0,
        "lastTransitionTime": T0,
    }


AVAILABLE = dcond("Available", "True", "MinimumReplicasAvailable", "Deployment has minimum availability.")
UNAVAILABLE = dcond(
    "Available", "False", "MinimumReplicasUnavailable", "Deployment does not have minimum availability."
)
ROLLED = dcond(
    "Progressing",
    "True",
    "NewReplicaSetAvailable",
    'ReplicaSet "qwen-6d4cf56db6" has successfully progressed.',
)
ROLLING = dcond("Progressing", "True", "ReplicaSetUpdated", 'ReplicaSet "qwen-6d4cf56db6" is progressing.')
DEADLINE = dcond(
    "Progressing",
    "False",
    "ProgressDeadlineExceeded",
    'ReplicaSet "qwen-6d4cf56db6" has timed out progressing.',
)
QUOTA = dcond(
    "ReplicaFailure",
    "True",
    "FailedCreate",
    'pods "qwen-6d4cf56db6-x" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1',
)


def pod(
    name: str = "qwen-6d4cf56db6-7xk2p",
    *,
    phase: str = "Running",
    ready: bool = True,
    scheduled: tuple[str, str, str] = ("True", "", ""),
    waiting: tuple[str, str] | None = None,
    last_terminated: dict[str, Any] | None = None,
    deleting: bool = False,
    extra_status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.33.0",
        "ready": ready,
        "restartCount": 0,
    }
    if waiting is not None:
        container["state"] = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
    elif phase == "Running":
        container["state"] = {"running": {"startedAt": T0}}
    if last_terminated is not None:
        container["lastState"] = {"terminated": last_terminated}
        container["restartCount"] = 4
    conditions = [
        {"type": "PodScheduled", "status": scheduled[0], "reason": scheduled[1], "message": scheduled[2]},
    ]
    if scheduled[0] == "True":
        conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    meta: dict[str, Any] = {"name": name, "namespace": "ml"}
    if deleting:
        meta["deletionTimestamp"] = T0
    status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if scheduled[0] == "True":
        status["containerStatuses"] = [container]
    status.update(extra_status or {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


def rolling_out(*pods: dict[str, Any]) -> Observed:
    """A Deployment rolling out and not yet available, with these pods."""
    return Observed(deployment(conditions=[UNAVAILABLE, ROLLING]), list(pods))


def waiting(reason: str, message: str = "", **fields: Any) -> dict[str, Any]:
    """A pod whose engine container is waiting (not ready) for `reason`."""
    return pod(ready=False, waiting=(reason, message), **fields)


READY_OBS = Observed(deployment(ready=1, available=1, conditions=[AVAILABLE, ROLLED]), [pod()])
STARTING_OBS = rolling_out(pod(ready=False))

UNSCHEDULABLE = (
    "False",
    "Unschedulable",
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available.",
)

CASES: list[tuple[str, Observed, str, tuple[str, str], tuple[str, str], tuple[str, str], str]] = [
    # id, observed, phase, Ready, Progressing, Degraded, ready column
    (
        "available",
        Observed(deployment(ready=1, available=1, conditions=[AVAILABLE, ROLLED]), [pod()]),
        "Ready",
        ("True", "MinimumReplicasAvailable"),
        ("False", "NewReplicaSetAvailable"),
        ("False", "AsExpected"),
        "1/1",
    ),
    (
        "just-created",
        Observed(deployment(replicas=0, observed_generation=0)),
        "Pending",
        ("False", "MinimumReplicasUnavailable"),
        ("True", "ReplicaSetUpdated"),
        ("False", "AsExpected"),
        "0/1",
    ),
    (
        "container-creating",
        rolling_out(waiting("ContainerCreating", "", phase="Pending")),
        "Progressing",
        ("False", "ContainerCreating"),
        ("True", "ReplicaSetUpdated"),
        ("False", "AsExpected"),
        "0/1",
    ),
    (
        "loading-weights",
        rolling_out(pod(ready=False)),
        "Progressing",
        ("False", "ContainersNotReady"),
        ("True", "ReplicaSetUpdated"),
        ("False", "AsExpected"),
        "0/1",
    ),
    (
        "no-gpu-node",
        rolling_out(pod(phase="Pending", ready=False, scheduled=UNSCHEDULABLE)),
        "Degraded",
        ("False", "Unschedulable"),
        ("True", "ReplicaSetUpdated"),
        ("True", "Unschedulable"),
        "0/1",
    ),
    (
        "image-pull",
        rolling_out(
            waiting("ImagePullBackOff", 'Back-off pulling image "vllm/vllm-openai:v0.99"', phase="Pending")
        ),
        "Degraded",
        ("False", "ImagePullBackOff"),
        ("True", "ReplicaSetUpdated"),
        ("True", "ImagePullBackOff"),
        "0/1",
    ),
    (
        "missing-hf-token-secret",
        rolling_out(waiting("CreateContainerConfigError", 'secret "hf-token" not found', phase="Pending")),
        "Degraded",
        ("False", "CreateContainerConfigError"),
        ("True", "ReplicaSetUpdated"),
        ("True", "CreateContainerConfigError"),
        "0/1",
    ),
    (
        "oom",
        rolling_out(
            waiting(
                "CrashLoopBackOff",
                "back-off 40s restarting failed container=vllm",
                last_terminated={"reason": "OOMKilled", "exitCode": 137},
            )
        ),
        "Degraded",
        ("False", "OOMKilled"),
        ("True", "ReplicaSetUpdated"),
        ("True", "OOMKilled"),
        "0/1",
    ),
    (
        "crashloop",
        rolling_out(
            waiting(
                "CrashLoopBackOff",
                "back-off 5m0s restarting failed container=vllm",
                last_terminated={"reason": "Error", "exitCode": 1},
            )
        ),
        "Degraded",
        ("False", "CrashLoopBackOff"),
        ("True", "ReplicaSetUpdated"),
        ("True", "CrashLoopBackOff"),
        "0/1",
    ),
    (
        "deadline-nothing-serves",
        Observed(
            deployment(conditions=[UNAVAILABLE, DEADLINE]),
            [pod(ready=False)],
        ),
        "Failed",
        ("False", "ProgressDeadlineExceeded"),
        ("False", "ProgressDeadlineExceeded"),
        ("True", "ProgressDeadlineExceeded"),
        "0/1",
    ),
    (
        "quota",
        Observed(deployment(replicas=0, conditions=[UNAVAILABLE, ROLLING, QUOTA])),
        "Degraded",
        ("False", "FailedCreate"),
        ("True", "ReplicaSetUpdated"),
        ("True", "FailedCreate"),
        "0/1",
    ),
    (
        "rolling-update-old-pod-serves",
        Observed(
            deployment(
                generation=3,
                observed_generation=3,
                replicas=2,
                updated=1,
                ready=1,
                available=1,
                conditions=[AVAILABLE, ROLLING],
            ),
            [pod("qwen-old-1"), pod("qwen-new-1", ready=False)],
        ),
        "Progressing",
        ("True", "MinimumReplicasAvailable"),
        ("True", "ReplicaSetUpdated"),
        ("False", "AsExpected"),
        "1/1",
    ),
    (
        "spec-not-yet-seen-by-deployment-controller",
        Observed(
            deployment(
                generation=2, observed_generation=1, ready=1, available=1, conditions=[AVAILABLE, ROLLED]
            ),
            [pod()],
        ),
        "Progressing",
        ("True", "MinimumReplicasAvailable"),
        ("True", "ReplicaSetUpdated"),
        ("False", "AsExpected"),
        "1/1",
    ),
    (
        "one-of-two-crashes",
        Observed(
            deployment(desired=2, ready=1, available=1, conditions=[AVAILABLE, ROLLED]),
            [
                pod("qwen-a"),
                pod(
                    "qwen-b",
                    ready=False,
                    waiting=("CrashLoopBackOff", "back-off"),
                    last_terminated={"reason": "Error", "exitCode": 1},
                ),
            ],
        ),
        "Degraded",
        ("True", "MinimumReplicasAvailable"),
        ("True", "NewReplicaSetAvailable"),
        ("True", "CrashLoopBackOff"),
        "1/2",
    ),
    (
        "scaled-to-zero",
        Observed(deployment(desired=0, replicas=0, conditions=[AVAILABLE, ROLLED])),
        "Pending",
        ("False", "ScaledToZero"),
        ("False", "ScaledToZero"),
        ("False", "AsExpected"),
        "0/0",
    ),
    (
        "deployment-missing",
        Observed(None),
        "Pending",
        ("False", "DeploymentMissing"),
        ("True", "DeploymentMissing"),
        ("False", "AsExpected"),
        "0/0",
    ),
    (
        "terminating-pod-ignored",
        Observed(
            deployment(ready=1, available=1, conditions=[AVAILABLE, ROLLED]),
            [pod("qwen-a"), pod("qwen-b", ready=False, waiting=("CrashLoopBackOff", "x"), deleting=True)],
        ),
        "Ready",
        ("True", "MinimumReplicasAvailable"),
        ("False", "NewReplicaSetAvailable"),
        ("False", "AsExpected"),
        "1/1",
    ),
]


@pytest.mark.parametrize(
    ("observed", "phase", "ready", "progressing", "degraded", "ready_column"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_managed_status(
    observed: Observed,
    phase: str,
    ready: tuple[str, str],
    progressing: tuple[str, str],
    degraded: tuple[str, str],
    ready_column: str,
) -> None:
    status = compute_status(subject(7), Managed(observed, MODEL))
    assert status["phase"] == phase
    got = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert got == {"Ready": ready, "Progressing": progressing, "Degraded": degraded}
    assert status["ready"] == ready_column
    assert status["observedGeneration"] == 7
    assert status["endpoint"] == "http://qwen-engine.ml.svc:8000"
    assert "routeUrl" not in status
    assert status["selector"] == (
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=qwen,app.kubernetes.io/name=servedmodel"
    )
    for c in status["conditions"]:
        assert c["observedGeneration"] == 7
        assert c["lastTransitionTime"] == T0
        assert c["reason"].isidentifier()  # CamelCase
        assert c["reason"][0].isupper()


def test_messages_say_what_the_pods_say() -> None:
    obs = rolling_out(pod(phase="Pending", ready=False, scheduled=UNSCHEDULABLE))
    status = compute_status(subject(1), Managed(obs, MODEL))
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "Insufficient nvidia.com/gpu" in degraded["message"]
    assert "qwen-6d4cf56db6-7xk2p" in degraded["message"]


def test_crashloop_message_is_stable_across_backoff() -> None:
    def crashing(backoff: str) -> dict[str, Any]:
        return pod(
            ready=False,
            waiting=("CrashLoopBackOff", f"back-off {backoff} restarting failed container=vllm"),
            last_terminated={"reason": "Error", "exitCode": 1},
        )

    first, later = pod_problem(crashing("10s")), pod_problem(crashing("5m0s"))
    assert first == later
    assert first is not None
    assert "exit code 1" in first.message


def test_more_failing_pods_are_counted() -> None:
    pull = ("ErrImagePull", "manifest unknown")
    pods = [pod(f"qwen-{i}", phase="Pending", ready=False, waiting=pull) for i in range(3)]
    obs = Observed(deployment(desired=3, conditions=[UNAVAILABLE, ROLLING]), pods)
    status = compute_status(subject(1), Managed(obs, MODEL))
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == "pod qwen-0: container vllm: manifest unknown (and 2 more pods failing)"


def test_evicted_pod() -> None:
    p = pod(
        phase="Failed", ready=False, extra_status={"reason": "Evicted", "message": "low on ephemeral-storage"}
    )
    problem = pod_problem(p)
    assert problem is not None
    assert (problem.reason, problem.failure) == ("Evicted", True)


def test_invalid_spec() -> None:
    status = compute_status(subject(4), InvalidSpec("tensorParallelSize 3 > gpus 2"))
    assert status["phase"] == "Failed"
    assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]} == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
        "InvalidSpec": ("True", "InvalidSpec"),
    }
    assert all(c["message"] == "tensorParallelSize 3 > gpus 2" for c in status["conditions"])
    assert "replicas" not in status
    # Fixed: the InvalidSpec condition goes away (server-side apply drops what the manager no longer sends).
    fixed = compute_status(subject(5, previous=status, now=T1), Managed(READY_OBS, MODEL))
    assert "InvalidSpec" not in {c["type"] for c in fixed["conditions"]}
    assert status_changed(status, fixed)


def test_external_mode() -> None:
    status = compute_status(subject(), External("https://llm.example.com/v1", MODEL))
    assert status["endpoint"] == "https://llm.example.com/v1"
    assert status["phase"] == "Ready"
    assert not {"replicas", "readyReplicas", "ready", "selector"} & status.keys()
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ExternalEndpoint")


def test_apply_error_degrades() -> None:
    obs = Observed(deployment(ready=1, available=1, conditions=[AVAILABLE, ROLLED]), [pod()])
    status = compute_status(
        subject(2),
        ApplyFailed(obs, MODEL, "ApplyFailed", "PersistentVolumeClaim qwen-cache: spec is immutable"),
    )
    assert status["phase"] == "Degraded"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")


@pytest.mark.parametrize(
    ("route", "url"),
    [
        (None, None),
        (
            {"spec": {"host": "qwen-ml.apps.example.com", "tls": {"termination": "edge"}}},
            "https://qwen-ml.apps.example.com",
        ),
        (
            {"spec": {}, "status": {"ingress": [{"host": "qwen-ml.apps.example.com"}]}},
            "http://qwen-ml.apps.example.com",
        ),
        ({"spec": {}}, None),  # the router has not admitted it yet
    ],
)
def test_route_url(route: dict[str, Any] | None, url: str | None) -> None:
    assert route_url(route) == url
    status = compute_status(subject(1), Managed(Observed(None, (), route), MODEL))
    assert status.get("routeUrl") == url
    assert status["endpoint"] == endpoint_url("qwen", "ml") == "http://qwen-engine.ml.svc:8000"


def test_fragment_is_valid_status_and_served_model_name() -> None:
    for observed in (READY_OBS, STARTING_OBS, Observed(None)):
        status = compute_status(subject(3), Managed(observed, MODEL))
        parsed = ServedModelStatus.model_validate(status)
        assert parsed.served_model_name == "Qwen/Qwen2.5-7B-Instruct"
        assert parsed.model_dump(by_alias=True, exclude_none=True) == status


def test_no_change_on_resync_and_times_kept() -> None:
    first = compute_status(subject(1), Managed(READY_OBS, MODEL))
    # What the server holds: ours plus the probe's fields and conditions.
    on_server = {
        **first,
        "probe": {"lastResult": "Success"},
        "conditions": [
            *first["conditions"],
            {"type": "Serving", "status": "True", "reason": "ChatCompleted"},
        ],
    }
    again = compute_status(subject(1, previous=on_server, now=T1), Managed(READY_OBS, MODEL))
    assert not status_changed(on_server, again)
    assert [c["lastTransitionTime"] for c in again["conditions"]] == [T0, T0, T0]
    assert transitions(on_server, again) == []


def test_transition_times_and_events() -> None:
    starting = compute_status(subject(1), Managed(STARTING_OBS, MODEL))
    ready = compute_status(subject(1, previous=starting, now=T1), Managed(READY_OBS, MODEL))
    assert status_changed(starting, ready)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0}
    (event,) = transitions(starting, ready)
    assert (event.type, event.reason) == ("Normal", "Ready")
    assert event.message.startswith("Progressing → Ready")

    first = transitions(None, starting)
    assert [(e.type, e.reason) for e in first] == [("Normal", "Progressing")]


def test_degraded_events_on_each_new_reason() -> None:
    def failing(waiting: tuple[str, str]) -> Observed:
        return rolling_out(pod(phase="Pending", ready=False, waiting=waiting))

    a = compute_status(subject(1, name="q"), Managed(failing(("ErrImagePull", "x")), MODEL))
    b = compute_status(
        subject(1, previous=a, now=T1, name="q"), Managed(failing(("ImagePullBackOff", "x")), MODEL)
    )
    (ev_a,) = transitions(None, a)
    (ev_b,) = transitions(a, b)
    assert (ev_a.type, ev_a.reason) == ("Warning", "Degraded")
    assert "ErrImagePull" in ev_a.message
    assert (ev_b.type, ev_b.reason) == ("Warning", "ImagePullBackOff")
    # The Degraded condition stayed True: its transition time stays.
    assert next(c for c in b["conditions"] if c["type"] == "Degraded")["lastTransitionTime"] == T0


def test_generation_change_is_a_change() -> None:
    first = compute_status(subject(1), Managed(READY_OBS, MODEL))
    second = compute_status(subject(2, previous=first, now=T1), Managed(READY_OBS, MODEL))
    assert status_changed(first, second)
    assert transitions(first, second) == []


SERVING_FALSE = {
    "type": "Serving",
    "status": "False",
    "reason": "ConnectionRefused",
    "message": "connect: refused",
}
SERVING_TRUE = {"type": "Serving", "status": "True", "reason": "ChatCompletionSucceeded", "message": ""}
SERVING_PARTLY = {
    "type": "Serving",
    "status": "True",
    "reason": "ReplicasFailing",
    "message": "2/3 replicas serving; pod q-2: StreamStalled: no chunk within the read limit",
}


@pytest.mark.parametrize(
    ("observed", "external", "serving", "phase", "degraded"),
    [
        (READY_OBS, None, SERVING_FALSE, "Degraded", ("True", "ConnectionRefused")),
        (READY_OBS, None, SERVING_TRUE, "Ready", ("False", "AsExpected")),
        (READY_OBS, None, None, "Ready", ("False", "AsExpected")),
        (None, "http://llm.example:8000", SERVING_FALSE, "Degraded", ("True", "ConnectionRefused")),
        # Not ready anyway: the Deployment's story stands, the probe adds nothing.
        (STARTING_OBS, None, SERVING_FALSE, "Progressing", ("False", "AsExpected")),
        # One replica of three fails its own probe: Degraded, naming it, not "not serving".
        (READY_OBS, None, SERVING_PARTLY, "Degraded", ("True", "ReplicasFailing")),
    ],
    ids=[
        "ready-but-chat-fails",
        "ready-and-serving",
        "probe-off",
        "external-chat-fails",
        "starting",
        "one-replica-fails",
    ],
)
def test_probe_serving_degrades_a_ready_model(
    observed: Observed | None,
    external: str | None,
    serving: dict[str, Any] | None,
    phase: str,
    degraded: tuple[str, str],
) -> None:
    mode = External(external, MODEL, serving) if external else Managed(observed or Observed(), MODEL, serving)
    status = compute_status(subject(), mode)
    assert status["phase"] == phase
    cond = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (cond["status"], cond["reason"]) == degraded
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == ("False" if observed is STARTING_OBS else "True")


def test_missing_chat_template_degrades_with_its_reason() -> None:
    """spec.engine.chatTemplate names a ConfigMap (or key) that does not exist: Degraded says which,
    whatever the pods say; Ready keeps the children's story."""
    missing = Problem("ChatTemplateNotFound", "spec.engine.chatTemplate: ConfigMap t not found")
    status = compute_status(subject(), Managed(READY_OBS, MODEL, missing=missing))
    assert status["phase"] == "Degraded"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ChatTemplateNotFound")
    assert degraded["message"] == missing.message
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    (event,) = transitions(None, status)
    assert (event.type, event.reason) == ("Warning", "Degraded")


def test_a_restarted_engine_is_degraded_until_ready_and_restarts_counted() -> None:
    """The kubelet restarted the engine container (its process was killed: exit 137): running again, not
    ready yet. Degraded with the restart and the last exit until it is ready; status.restarts counts it
    (summed over the live pods, a deleting one left out) and stays once it serves again."""
    killed = {"reason": "Error", "exitCode": 137}
    down = pod(ready=False, last_terminated=killed)
    problem = pod_problem(down)
    assert problem == Problem(
        "ContainerRestarted",
        "pod qwen-6d4cf56db6-7xk2p: container vllm restarted (restart 4, last exit Error, exit code 137), "
        "not ready yet",
    )
    leaving = pod("qwen-old", ready=False, last_terminated=killed, deleting=True)
    unavailable = Observed(deployment(conditions=[UNAVAILABLE, ROLLED]), [down, leaving])
    status = compute_status(subject(1), Managed(unavailable, MODEL))
    assert status["phase"] == "Degraded"
    assert status["restarts"] == 4
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ContainerRestarted")

    back = pod(last_terminated=killed)
    assert pod_problem(back) is None
    status = compute_status(subject(1), Managed(Observed(READY_OBS.deployment, [back]), MODEL))
    assert (status["phase"], status["restarts"]) == ("Ready", 4)
    assert compute_status(subject(1), Managed(READY_OBS, MODEL))["restarts"] == 0
