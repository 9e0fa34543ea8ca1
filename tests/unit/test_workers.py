"""spec.workers: the LeaderWorkerSet render (its shape, the leader's and the workers' commands, the
Service selecting the leaders), the spec's rules, and the probe's verdicts on a group's workers
(probe/group.py: a stalled worker named, a worker that cannot serve holds the group)."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from servedmodel import status
from servedmodel.api import ServedModel, names
from servedmodel.probe import group
from servedmodel.probe.group import WorkerCheck, WorkerWindow
from servedmodel.probe.metrics import MetricsSnapshot
from servedmodel.render import RenderContext, RenderError, render
from servedmodel.render.workers import MULTI_NODE_ARGS

LWS = RenderContext(has_lws_api=True)


def cr(workers: dict[str, Any] | None = None, **spec: Any) -> ServedModel:
    body: dict[str, Any] = {"model": "Qwen/Qwen2.5-72B-Instruct", "resources": {"gpus": 2}}
    body["engine"] = {"tensorParallelSize": 2}
    if workers is not None:
        body["workers"] = workers
    body.update(spec)
    return ServedModel.model_validate(
        {"metadata": {"name": "q", "namespace": "ai", "uid": "u"}, "spec": body}
    )


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def test_a_leader_worker_set_instead_of_the_deployment_where_discovered() -> None:
    objs = by_kind(render(cr({"size": 2}), LWS))
    assert "Deployment" not in objs
    lws = objs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "q"
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "ServedModel"
    spec = lws["spec"]
    assert spec["replicas"] == 1
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 0, "maxUnavailable": 1}
    tpl = spec["leaderWorkerTemplate"]
    assert tpl["size"] == 2
    assert tpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    # Both templates carry the readiness gate and one revision over both.
    leader, worker = tpl["leaderTemplate"], tpl["workerTemplate"]
    for t in (leader, worker):
        assert t["spec"]["readinessGates"] == [{"conditionType": "inference.servedmodel.io/serving"}]
    assert (
        leader["metadata"]["labels"][names.REVISION_LABEL]
        == worker["metadata"]["labels"][names.REVISION_LABEL]
    )


def test_without_the_api_nothing_runs_the_engine() -> None:
    assert [o["kind"] for o in render(cr({"size": 2}), RenderContext())] == ["Service"]


def test_leader_and_worker_commands() -> None:
    tpl = by_kind(render(cr({"size": 3}), LWS))["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    lead = tpl["leaderTemplate"]["spec"]["containers"][0]
    work = tpl["workerTemplate"]["spec"]["containers"][0]
    tail = ["--pipeline-parallel-size", "3", *MULTI_NODE_ARGS]
    assert lead["args"][-len(tail) :] == tail
    assert work["args"][-len(tail) - 1 :] == [*tail, "--headless"]
    assert lead["args"][: -len(tail)] == work["args"][: -len(tail) - 1]  # the same model and flags
    assert "$(LWS_LEADER_ADDRESS)" in lead["args"]
    # the leader serves the API with its probes; a headless vLLM worker has neither port nor probes
    assert "readinessProbe" in lead
    assert lead["ports"][0]["name"] == "http"
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(work)


def test_workers_resources_apply_to_the_workers_only() -> None:
    obj = cr(
        {"size": 2, "resources": {"gpus": 4, "requests": {"cpu": "2"}}}, engine={"tensorParallelSize": 2}
    )
    tpl = by_kind(render(obj, LWS))["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    lead = tpl["leaderTemplate"]["spec"]["containers"][0]["resources"]
    work = tpl["workerTemplate"]["spec"]["containers"][0]["resources"]
    assert lead["limits"]["nvidia.com/gpu"] == "2"
    assert work["limits"]["nvidia.com/gpu"] == "4"
    assert work["requests"]["cpu"] == "2"


def test_service_selects_the_leaders() -> None:
    svc = by_kind(render(cr({"size": 2}), LWS))["Service"]
    assert svc["spec"]["selector"] == {**names.selector_labels("q"), names.LWS_WORKER_INDEX_LABEL: "0"}
    plain = by_kind(render(cr(), LWS))["Service"]
    assert plain["spec"]["selector"] == names.selector_labels("q")


def test_simulator_workers_keep_their_http() -> None:
    obj = cr({"size": 2}, engine={"kind": "simulator"}, resources={"gpus": 0})
    work = by_kind(render(obj, LWS))["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert "readinessProbe" in work["spec"]["containers"][0]


def test_a_derived_flag_in_extra_args_is_refused() -> None:
    with pytest.raises(RenderError, match="--pipeline-parallel-size"):
        render(cr({"size": 2}, engine={"extraArgs": ["--pipeline-parallel-size=2"]}), LWS)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"resources": {"gpus": 0}}, "workers needs GPUs"),
        (
            {"autoscaling": {"maxReplicas": 3, "targets": {"waitingRequestsPerReplica": 4}}},
            "not supported with autoscaling",
        ),
        ({"workers": {"size": 2, "resources": {"gpus": 3}}}, "multiple of engine.tensorParallelSize"),
        ({"workers": {"size": 1}}, "greater than or equal to 2"),
    ],
)
def test_spec_rules(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        cr(spec.pop("workers", {"size": 2}), **spec)


def snap(gen: float, running: float) -> MetricsSnapshot:
    return MetricsSnapshot(counters={"generation_tokens": gen}, gauges={"running": running})


def check(name: str, gen: float, running: float, at: float, **kw: Any) -> WorkerCheck:
    return WorkerCheck(name, kw.pop("ready", True), kw.pop("health", 200), None, snap(gen, running), at)


def test_a_stalled_worker_is_named() -> None:
    previous = {"q-0-1": WorkerWindow(snap(50, 1), 10.0)}
    stalled, failing = group.group_verdicts([check("q-0-1", 50, 1, 20.0)], previous, None)
    assert failing is None
    assert stalled is not None
    assert stalled.startswith("worker pod q-0-1: generation counter flat at 50 tokens for 10.0 s")
    assert "its /health answers 200" in stalled


@pytest.mark.parametrize(
    ("gen", "running", "at"),
    [(60, 1, 20.0), (50, 0, 20.0), (50, 1, 10.5)],
    ids=["generating", "idle", "short-window"],
)
def test_a_worker_not_stalled(gen: float, running: float, at: float) -> None:
    previous = {"q-0-1": WorkerWindow(snap(50, 1), 10.0)}
    assert group.group_verdicts([check("q-0-1", gen, running, at)], previous, None) == (None, None)


def test_the_leaders_stall_with_no_worker_to_blame_says_so() -> None:
    stalled, failing = group.group_verdicts([check("q-0-1", 50, 0, 20.0)], {}, "pod q-0: flat")
    assert failing is None
    assert stalled == (
        "pod q-0: flat; none of the group's 1 worker(s) says which pod holds it (each answers /health, "
        "none reports its own generation stalled)"
    )


def test_a_worker_that_cannot_serve_holds_the_group() -> None:
    checks = [
        WorkerCheck("q-0-1", ready=False),
        WorkerCheck("q-0-2", ready=True, error="ConnectError: refused"),
        WorkerCheck("q-0-3", ready=True, health=503),
        WorkerCheck("q-0-4", ready=True, health=200),
    ]
    stalled, failing = group.group_verdicts(checks, {}, None)
    assert stalled is None
    assert failing == (
        "worker pod q-0-1: its containers are not ready; "
        "worker pod q-0-2: /health did not answer (ConnectError: refused); "
        "worker pod q-0-3: /health answered 503"
    )


def test_a_leader_worker_set_read_as_the_deployment_the_status_reads() -> None:
    lws = {
        "metadata": {"name": "q", "generation": 3},
        "spec": {"replicas": 2},
        "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2},
    }
    view = status.group_as_deployment(lws)
    assert view is not None
    assert view["spec"] == {"replicas": 2}
    assert view["status"] == {
        "observedGeneration": 3,
        "replicas": 2,
        "readyReplicas": 1,
        "availableReplicas": 1,
        "updatedReplicas": 2,
    }
    assert status.group_as_deployment(None) is None


def test_ready_groups_counts_groups_whose_every_pod_is_ready() -> None:
    def pod(group: str, ready: bool, gone: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"labels": {names.LWS_GROUP_INDEX_LABEL: group}}
        if gone:
            meta["deletionTimestamp"] = "2026-12-01T10:00:00Z"
        cond = {"type": "Ready", "status": "True" if ready else "False"}
        return {"metadata": meta, "status": {"conditions": [cond]}}

    pods = [
        pod("0", True),
        pod("0", True),
        pod("1", True),
        pod("1", False),
        pod("2", True),
        pod("2", False, True),
    ]
    assert status.ready_groups(pods, names.LWS_GROUP_INDEX_LABEL) == 2
