"""The startup timeline (probe/startup.py, status.startup): one engine pod's stages from its conditions,
its engine container, its Events and the probe's moments; the probe's tracking of a start cycle by cycle;
the bounded recent list with p50/p95; compose's share (kept by writes that add no start); the histogram."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from servedmodel.api.spec import ServedModelSpec
from servedmodel.api.startup import STARTUP_HISTORY, STARTUP_STAGES, StartupStatus, StartupTimeline
from servedmodel.probe import compose, startup
from servedmodel.probe.client import ProbeOutcome
from servedmodel.probe.errors import ENGINE_UNHEALTHY, ProbeFailure
from servedmodel.probe.replicas import PodResult
from servedmodel.prober.telemetry import ProbeMetrics

CREATED = datetime(2026, 12, 1, 9, 0, 0, tzinfo=UTC)


def ts(seconds: float) -> str:
    """A Kubernetes timestamp `seconds` after the pod's creation (whole seconds, as the API writes them)."""
    return (CREATED + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def at(seconds: float) -> datetime:
    return CREATED + timedelta(seconds=seconds)


def pod(name: str = "q-a", restarts: int = 0, **moments: float) -> dict[str, Any]:
    """An engine pod with a PodScheduled/Initialized/ContainersReady condition and a running engine
    container for each moment given (seconds from creation)."""
    conds = [
        {"type": type_, "status": "True", "lastTransitionTime": ts(moments[key])}
        for key, type_ in (
            ("scheduled", "PodScheduled"),
            ("initialized", "Initialized"),
            ("containers_ready", "ContainersReady"),
        )
        if key in moments
    ]
    conds.append({"type": "Ready", "status": "False", "lastTransitionTime": ts(0)})
    engine: dict[str, Any] = {"name": "engine", "restartCount": restarts, "ready": True, "state": {}}
    if "started" in moments:
        engine["state"] = {"running": {"startedAt": ts(moments["started"])}}
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": ts(0)},
        "status": {
            "phase": "Running",
            "conditions": conds,
            "containerStatuses": [{"name": "sidecar", "state": {"running": {"startedAt": ts(1)}}}, engine],
        },
    }


def pulled(seconds: float, container: str = "engine", field: str = "firstTimestamp") -> dict[str, Any]:
    return {
        "reason": "Pulled",
        "involvedObject": {"kind": "Pod", "name": "q-a", "fieldPath": f"spec.containers{{{container}}}"},
        field: ts(seconds),
    }


FULL = {"scheduled": 1, "initialized": 2, "started": 31, "containers_ready": 40}


def test_timeline_takes_each_stage_from_what_says_it() -> None:
    events = [pulled(5, container="init-weights"), pulled(33), pulled(30, field="eventTime")]
    t = startup.timeline(pod(**FULL), events, at(45.5), at(50.25))
    assert t is not None
    assert (t.pod, t.created, t.restarts) == ("q-a", ts(0), 0)
    got = {s: getattr(t, startup.stage_field(s)) for s in STARTUP_STAGES}
    assert got == {
        "scheduled": 1.0,
        "initialized": 2.0,
        "imagePulled": 30.0,  # the engine container's first Pulled, not the init container's
        "containerStarted": 31.0,  # the engine container's startedAt, not the sidecar's
        "containersReady": 40.0,
        "engineHealthy": 45.5,
        "firstToken": 50.25,
    }
    assert t.total_seconds == 50.25
    # in status as camelCase seconds
    wire = t.model_dump(by_alias=True, exclude_none=True)
    assert wire["imagePulledSeconds"] == 30.0
    assert wire["totalSeconds"] == 50.25


def test_a_stage_nothing_said_is_left_out() -> None:
    """kwok: no Events, no Initialized; and no /health moment (a light cycle after an operator restart)."""
    t = startup.timeline(pod(scheduled=0, started=1, containers_ready=1), [], None, at(12))
    assert t is not None
    assert [s for s, _ in startup.stage_seconds(t)] == [
        "scheduled",
        "containerStarted",
        "containersReady",
        "firstToken",
    ]
    wire = t.model_dump(by_alias=True, exclude_none=True)
    assert "imagePulledSeconds" not in wire
    assert "engineHealthySeconds" not in wire
    no_created = pod(**FULL)
    del no_created["metadata"]["creationTimestamp"]
    assert startup.timeline(no_created, [], None, at(12)) is None


@pytest.mark.parametrize(
    ("moments", "healthy", "token", "expected"),
    [
        (
            FULL,
            45.5,
            50.25,
            [
                ("scheduled", 1.0),
                ("initialized", 1.0),
                ("containerStarted", 29.0),
                ("containersReady", 9.0),
                ("engineHealthy", 5.5),
                ("firstToken", 4.75),
            ],
        ),
        # ContainersReady said after the probe's /health (the API's whole seconds): it takes 0 s, the
        # next stage runs from the later of the two
        (
            {"scheduled": 1, "started": 2, "containers_ready": 9},
            8.5,
            10.0,
            [
                ("scheduled", 1.0),
                ("containerStarted", 1.0),
                ("containersReady", 7.0),
                ("engineHealthy", 0.0),
                ("firstToken", 1.0),
            ],
        ),
        # a condition stamped after the first token (clock skew) does not run past the total
        (
            {"scheduled": 1, "containers_ready": 14},
            None,
            12.0,
            [("scheduled", 1.0), ("containersReady", 11.0), ("firstToken", 0.0)],
        ),
    ],
    ids=["in-order", "containers-ready-late", "past-the-token"],
)
def test_stage_seconds_are_ordered_and_add_up_to_the_total(
    moments: dict[str, float], healthy: float | None, token: float, expected: list[tuple[str, float]]
) -> None:
    t = startup.timeline(pod(**moments), [], None if healthy is None else at(healthy), at(token))
    assert t is not None
    stages = startup.stage_seconds(t)
    assert stages == expected
    assert [s for s, _ in stages] == [s for s in STARTUP_STAGES if s in dict(stages)]  # STARTUP_STAGES order
    assert all(seconds >= 0 for _, seconds in stages)
    assert sum(seconds for _, seconds in stages) == pytest.approx(t.total_seconds)


def outcome(healthy: float | None = None, token: float | None = None, fail: bool = False) -> ProbeOutcome:
    out = ProbeOutcome(endpoint="http://x", started=at(0), ended=at(0))
    out.healthy_at = None if healthy is None else at(healthy)
    out.first_token_at = None if token is None else at(token)
    if fail:
        out.failure = ProbeFailure(ENGINE_UNHEALTHY, "GET /health: 503")
    return out


def test_observe_ends_a_start_once_at_its_first_real_token() -> None:
    track, ended = startup.observe(None, "u/0", outcome(fail=True), served_before=False)
    assert not ended
    assert track.healthy_at is None
    track, ended = startup.observe(track, "u/0", outcome(healthy=20, fail=True), served_before=False)
    assert not ended
    assert track.healthy_at == at(20)
    track, ended = startup.observe(track, "u/0", outcome(healthy=30, token=31), served_before=False)
    assert ended
    assert (track.healthy_at, track.first_token_at) == (at(20), at(31))  # the first /health that answered
    track, ended = startup.observe(track, "u/0", outcome(healthy=90, token=91), served_before=False)
    assert not ended
    assert track.first_token_at == at(31)
    # the engine restarts after serving: not a start from the pod's creation
    track, ended = startup.observe(track, "u/1", outcome(healthy=200, token=201), served_before=False)
    assert not ended


def test_observe_a_restart_before_the_first_token_goes_on_with_the_new_engine() -> None:
    track, _ = startup.observe(None, "u/0", outcome(healthy=10, fail=True), served_before=False)
    track, ended = startup.observe(track, "u/1", outcome(fail=True), served_before=False)
    assert not ended
    assert track.healthy_at is None
    track, ended = startup.observe(track, "u/1", outcome(healthy=40, token=41), served_before=False)
    assert ended
    assert (track.healthy_at, track.first_token_at) == (at(40), at(41))


def test_observe_a_pod_already_serving_at_first_sight_is_no_start() -> None:
    """An operator that restarted (or a new leader) sees the status call the pod serving."""
    track, ended = startup.observe(None, "u/0", outcome(healthy=500, token=501), served_before=True)
    assert not ended
    assert track.done


def start(name: str, total: float) -> StartupTimeline:
    return StartupTimeline(
        pod=name, created=ts(0), scheduled_seconds=1.0, first_token_seconds=total, total_seconds=total
    )


def test_summarize_keeps_the_recent_starts_bounded_with_their_p50_p95() -> None:
    status, added = startup.summarize_starts(None, [])
    assert (status, added) == (None, [])
    status = None
    for i in range(1, 21):
        status, added = startup.summarize_starts(status, [start(f"q-{i}", float(i))])
        assert [t.pod for t in added] == [f"q-{i}"]
    assert status is not None
    assert status.starts == STARTUP_HISTORY == len(status.recent)
    assert [t.pod for t in status.recent] == [f"q-{i}" for i in range(11, 21)]  # oldest first
    assert status.last is not None
    assert status.last.pod == "q-20"
    assert status.p50 is not None
    assert status.p95 is not None
    assert status.p50.total_seconds == 15.5
    assert status.p95.total_seconds == pytest.approx(19.55)
    assert status.p50.scheduled_seconds == 1.0
    assert status.p50.image_pulled_seconds is None  # no start said it
    # the same start again (the cache's copy behind our write) is not added twice
    again, added = startup.summarize_starts(status, [start("q-20", 20.0)])
    assert added == []
    assert again == status


def managed_cycle(status: dict[str, Any], starts: list[StartupTimeline], **kw: Any) -> compose.Composed:
    spec = ServedModelSpec.model_validate({"model": "Qwen/Qwen2.5-7B-Instruct"})
    out = ProbeOutcome(endpoint="http://x", started=at(60), ended=at(60))
    pods = compose.Pods([PodResult("q-a", "http://x", out)], ["q-a"], 1, {"q-a": pod(**FULL)})
    return compose.compose(compose.Cycle(out, spec, status, 1, at(60), pods=pods, startups=starts, **kw))


def test_compose_writes_status_startup_and_keeps_it_in_every_later_write() -> None:
    """Server-side apply drops what a write of the probe's field manager leaves out: status.startup is in
    every patch once there is one, as this scheduler last wrote it (newer than the cache's copy)."""
    assert "startup" not in managed_cycle({}, []).patch
    first = managed_cycle({}, [start("q-a", 50.0)])
    assert [t.pod for t in first.started] == ["q-a"]
    written = first.patch["startup"]
    assert (written["last"]["pod"], written["starts"], written["p50"]["totalSeconds"]) == ("q-a", 1, 50.0)
    kept = managed_cycle({"startup": written}, [])
    assert kept.patch["startup"] == written
    assert kept.started == []
    # the cache not yet showing our write: the last patch is what continues
    behind = managed_cycle({}, [start("q-b", 30.0)], last_patch=first.patch)
    assert [t["pod"] for t in behind.patch["startup"]["recent"]] == ["q-a", "q-b"]
    assert StartupStatus.model_validate(behind.patch["startup"]).p50 is not None
    # external mode (no pods) and the at-zero write keep it too
    spec = ServedModelSpec.model_validate({"model": "Qwen/Qwen2.5-7B-Instruct"})
    out = ProbeOutcome(endpoint="http://x", started=at(60), ended=at(60))
    external = compose.compose(compose.Cycle(out, spec, {"startup": written}, 1, at(60)))
    assert external.patch["startup"] == written
    at_zero: dict[str, Any] = {}
    compose.keep_startup({"startup": written}, None, at_zero)
    assert at_zero == {"startup": written}
    # ... as this scheduler last wrote it when the cache's copy is a write behind (it would take a start
    # back out of status.startup)
    newer = behind.patch["startup"]
    compose.keep_startup({"startup": written}, behind.patch, at_zero)
    assert at_zero == {"startup": newer}
    external = compose.compose(
        compose.Cycle(out, spec, {"startup": written}, 1, at(60), last_patch=behind.patch)
    )
    assert external.patch["startup"] == newer


def test_a_write_that_computes_no_rollout_keeps_the_last_written_one() -> None:
    """status.rollout and RolloutBlocked as this scheduler last wrote them, not the cache's older copy."""
    old = {"rollout": {"revision": "r1", "phase": "Progressing"}, "conditions": []}
    blocked = {"type": "RolloutBlocked", "status": "True", "reason": "ChecksFailed", "message": "m"}
    last = {"rollout": {"revision": "r2", "phase": "Blocked"}, "conditions": [blocked]}
    patch: dict[str, Any] = {"conditions": []}
    compose.keep_rollout(old, last, patch)
    assert patch == {"conditions": [blocked], "rollout": last["rollout"]}
    patch = {"conditions": []}
    compose.keep_rollout(old, None, patch)  # nothing written by this scheduler yet: as read
    assert patch == {"conditions": [], "rollout": old["rollout"]}


def test_the_histogram_counts_each_start_once_and_its_stages_sum_to_the_total() -> None:
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry)
    t = startup.timeline(pod(**FULL), [pulled(30)], at(45.5), at(50.25))
    assert t is not None
    metrics.record_start("ns", "q", t)
    metrics.record_start("ns", "q", start("q-b", 10.0))

    def sample(suffix: str, stage: str) -> float:
        labels = {"namespace": "ns", "name": "q", "stage": stage}
        value = registry.get_sample_value(f"servedmodel_cold_start_seconds_{suffix}", labels)
        return 0.0 if value is None else value

    assert sample("count", "total") == 2
    assert sample("sum", "total") == pytest.approx(60.25)
    assert sample("count", "imagePulled") == 1  # only the first start said it
    stages = sum(sample("sum", s) for s in STARTUP_STAGES)
    assert stages == pytest.approx(sample("sum", "total"))
    metrics.forget("ns", "q")
    assert sample("count", "total") == 0


def activated(seconds: float, message: str = "from 0 to 1", field: str = "eventTime") -> dict[str, Any]:
    """KEDA's Event on the ScaledObject when it scales the target (keda's scale executor's wording)."""
    when = (CREATED + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "reason": startup.KEDA_ACTIVATED,
        "involvedObject": {"kind": "ScaledObject", "name": "q"},
        "message": f"Scaled apps/v1.Deployment ns/q {message}, triggered by http-requests",
        field: when,
    }


def test_a_wake_is_keda_s_latest_scale_from_zero_before_the_pod() -> None:
    events = [
        activated(-600),  # an earlier wake's
        activated(-1.2),
        activated(-0.5, message="from 1 to 2"),  # not from zero: scaling up an awake model
        {"reason": "KEDAScaleTargetDeactivated", "message": "from 1 to 0", "eventTime": ts(-0.2)},
        activated(30),  # after the pod: another wake's
    ]
    assert startup.wake_activation(events, at(0)) == at(-1.2)
    # firstTimestamp where the Event has no eventTime (a core/v1 recorder); the pod a little earlier than
    # the Event the API server stamped after KEDA's scale call.
    assert startup.wake_activation([activated(2.0, field="firstTimestamp")], at(0)) == at(2.0)
    # a pod created long after the last wake (a crash at 1 replica) is no wake
    assert startup.wake_activation([activated(-600)], at(0)) is None
    assert startup.wake_activation([], at(0)) is None


def test_a_woken_pod_s_timeline_counts_its_wake_from_keda_s_activation() -> None:
    t = startup.timeline(pod(**FULL), [], at(45.5), at(50.25), at(-1.75))
    assert t is not None
    assert t.wake_seconds == 52.0
    assert t.total_seconds == 50.25
    assert t.activated is not None
    assert startup.parse_rfc3339(t.activated) == at(-1.75)
    dumped = t.model_dump(by_alias=True, exclude_none=True)
    assert dumped["wakeSeconds"] == 52.0
    assert dumped["activated"].endswith("Z")
    # not a wake: neither field
    plain = startup.timeline(pod(**FULL), [], at(45.5), at(50.25))
    assert plain is not None
    assert plain.wake_seconds is None
    assert plain.activated is None


def test_wakes_have_their_p50_and_histogram() -> None:
    woken = startup.timeline(pod("q-a", **FULL), [], at(45.5), at(50.25), at(-1.75))
    cold = startup.timeline(pod("q-b", **FULL), [], at(45.5), at(60.0))
    assert woken is not None
    assert cold is not None
    status, added = startup.summarize_starts(None, [woken, cold])
    assert status is not None
    assert len(added) == 2
    assert status.p50 is not None
    assert status.p50.wake_seconds == 52.0
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry)
    for start in added:
        metrics.record_start("ns", "q", start)
    labels = {"namespace": "ns", "name": "q"}
    assert registry.get_sample_value("servedmodel_wake_seconds_count", labels) == 1
    assert registry.get_sample_value("servedmodel_wake_seconds_sum", labels) == 52.0
    metrics.forget("ns", "q")
    assert registry.get_sample_value("servedmodel_wake_seconds_count", labels) is None
