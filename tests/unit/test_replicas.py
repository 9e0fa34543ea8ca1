"""Pure pieces of replica truth: per-pod verdicts (EngineStalled, KVCachePressure), the aggregate over
pods, "k/n" and the Serving message, the readiness-gate condition, per-pod overrides, the pod template."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from servedmodel.api import ServedModel
from servedmodel.api.conditions import ENGINE_STALLED, PROBE_CONDITIONS, REPLICAS_FAILING
from servedmodel.api.names import REVISION_LABEL
from servedmodel.api.probe import READINESS_GATE_CONDITION, ProbeCheck, ProbeSpec
from servedmodel.probe import compose, replicas
from servedmodel.probe.client import ProbeOutcome
from servedmodel.probe.endpoints import parse_override, parse_pod_overrides, pod_base_url
from servedmodel.probe.errors import (
    FIRST_BYTE_TIMEOUT,
    PROMPT_TOO_LONG,
    SECRET_UNAVAILABLE,
    STREAM_CUT,
    ProbeFailure,
)
from servedmodel.probe.metrics import MetricsSnapshot
from servedmodel.probe.replicas import PodResult, Window
from servedmodel.probe.report import build_status
from servedmodel.probe.sse import ClientFigures
from servedmodel.prober import containers_ready
from servedmodel.render import RenderContext, deployment

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def assert_verdict(got: str | None, expected: str | None, *also: str) -> None:
    """No verdict where none is expected; else one that says `expected` and each of `also`."""
    if expected is None:
        assert got is None
        return
    assert got is not None
    for part in (expected, *also):
        assert part in got, got


def snap(
    gen: float, running: float = 0, waiting: float = 0, kv: float = 0.1, preempt: float = 0
) -> MetricsSnapshot:
    return MetricsSnapshot(
        counters={"generation_tokens": gen, "request_success": 10, "preemptions": preempt},
        gauges={"running": running, "waiting": waiting, "kv_cache_usage": kv},
    )


def outcome(
    before: MetricsSnapshot | None,
    after: MetricsSnapshot | None,
    seconds: float = 20.0,
    failure: ProbeFailure | None = None,
    ttft: float = 10.0,
) -> ProbeOutcome:
    out = ProbeOutcome(endpoint="http://127.0.0.1:1", started=T0, ended=T0 + timedelta(seconds=seconds))
    out.before, out.after, out.failure = before, after, failure
    if failure is None:
        out.figures = ClientFigures(
            headers_ms=1.0,
            ttft_ms=ttft,
            tpot_ms=2.0,
            itl_ms=[],
            itl_p50_ms=2.0,
            itl_p95_ms=3.0,
            e2e_ms=ttft + 20,
            completion_tokens=8,
        )
    return out


TIMEOUT = ProbeFailure(
    FIRST_BYTE_TIMEOUT, "POST /v1/chat/completions: no response within the first-byte limit"
)


@pytest.mark.parametrize(
    ("before", "after", "seconds", "previous", "expected"),
    [
        # a hung forward pass: requests run, the counter stands still across the probe's window
        (
            snap(100, running=3),
            snap(100, running=3),
            20.0,
            None,
            "flat at 100 tokens for 20.0 s while requests run",
        ),
        # nothing admitted: the probe's own request waits while nothing runs
        (snap(100), snap(100, waiting=1), 20.0, None, "requests waiting while nothing runs for 20.0 s"),
        # generating: not stalled
        (snap(100, running=3), snap(130, running=3), 20.0, None, None),
        # a hung engine core reports nothing (gauges frozen at 0, 0) while the probe's request got no token
        (snap(100), snap(100), 20.0, None, "the probe's request got no token for 20.0 s (FirstByteTimeout)"),
        # a short window says nothing (a door error in 50 ms) ...
        (snap(100, running=3), snap(100, running=3), 0.05, None, None),
        # ... but the counter flat since the previous cycle, 30 s ago, does
        (snap(100, running=3), snap(100, running=3), 0.05, Window(snap(100, running=3), 70.0), "for 30.0 s"),
    ],
    ids=[
        "flat-while-running",
        "waiting-nothing-runs",
        "generating",
        "frozen-gauges",
        "short-window",
        "across-cycles",
    ],
)
def test_stall_verdict(
    before: MetricsSnapshot,
    after: MetricsSnapshot,
    seconds: float,
    previous: Window | None,
    expected: str | None,
) -> None:
    got = replicas.stall_verdict(outcome(before, after, seconds, TIMEOUT), 100.0, previous)
    assert_verdict(got, expected, "running", "waiting", "KV cache")  # the gauges are in the message


@pytest.mark.parametrize(
    ("before", "after", "previous", "expected"),
    [
        (
            snap(1, kv=0.97, preempt=10),
            snap(50, kv=0.99, preempt=14),
            Window(snap(0, preempt=8), 0),
            "6 preemptions",
        ),
        (snap(1, kv=0.97, preempt=10), snap(50, kv=0.99, preempt=14), None, "4 preemptions during the probe"),
        (snap(1, kv=0.97, preempt=10), snap(50, kv=0.99, preempt=10), Window(snap(0, preempt=10), 0), None),
        (snap(1, kv=0.5, preempt=10), snap(50, kv=0.6, preempt=20), Window(snap(0, preempt=8), 0), None),
    ],
    ids=["full-and-rising", "within-the-probe", "full-but-no-preemptions", "preempting-but-not-full"],
)
def test_kv_pressure_verdict(
    before: MetricsSnapshot, after: MetricsSnapshot, previous: Window | None, expected: str | None
) -> None:
    got = replicas.kv_pressure_verdict(outcome(before, after), previous)
    assert_verdict(got, expected, "KV cache usage 99%")


def results() -> list[PodResult]:
    ok_a = PodResult("q-a", "http://127.0.0.1:1", outcome(snap(10), snap(18), 1.0, ttft=10.0))
    ok_b = PodResult("q-b", "http://127.0.0.1:2", outcome(snap(20), snap(28), 1.0, ttft=30.0))
    bad = PodResult(
        "q-c", "http://127.0.0.1:3", outcome(snap(5), snap(5), 1.0, ProbeFailure(STREAM_CUT, "cut"))
    )
    return [ok_a, ok_b, bad]


def test_an_idle_engine_that_answers_is_not_stalled() -> None:
    """Nothing waits, nothing runs, the chat failed for another reason (a 500 at the door): no stall."""
    failure = ProbeFailure(STREAM_CUT, "cut")
    assert replicas.stall_verdict(outcome(snap(100), snap(100), 20.0, failure), 100.0, None) is None
    assert replicas.stall_verdict(outcome(snap(100), snap(100), 20.0), 100.0, None) is None  # success: never


def test_one_failing_replica_of_three_is_named_and_still_serving() -> None:
    rs = results()
    agg = replicas.aggregate(rs)
    assert agg.ok
    assert agg.figures is not None
    assert agg.figures.ttft_ms == 20.0  # the median of the serving pods
    assert agg.after is not None
    assert agg.after.gauges["running"] == 0
    assert agg.after.counters["generation_tokens"] == 18 + 28 + 5  # summed over pods
    status = build_status(agg, ProbeSpec(), None)
    pods = replicas.merge_pods([], rs, [r.name for r in rs])
    status = replicas.summarize(status, pods, 3)
    assert status.serving == "2/3"
    assert status.reason == REPLICAS_FAILING
    assert status.message is not None
    assert status.message.startswith("2/3 replicas serving; pod q-c: StreamCut: cut")
    assert [(p.name, p.serving, p.reason) for p in status.pods or []] == [
        ("q-a", "True", "Serving"),
        ("q-b", "True", "Serving"),
        ("q-c", "False", "StreamCut"),
    ]
    assert status.pods is not None
    assert status.pods[2].consecutive_failures == 1
    assert status.pods[0].ttft_ms == 10.0


def test_no_replica_serving_fails_with_the_first_pods_reason() -> None:
    rs = [r for r in results() if not r.serving] + [
        PodResult("q-d", "u", outcome(snap(1), snap(1), 1.0, TIMEOUT))
    ]
    agg = replicas.aggregate(rs)
    assert agg.failure is not None
    assert agg.failure.reason == STREAM_CUT
    status = replicas.summarize(
        build_status(agg, ProbeSpec(), None), replicas.merge_pods([], rs, ["q-c", "q-d"]), 2
    )
    assert status.serving == "0/2"
    assert status.result == "Failure"
    assert status.message is not None
    assert "pod q-d: FirstByteTimeout" in status.message


def test_rotation_keeps_the_last_entry_of_pods_not_probed_this_cycle() -> None:
    rs = results()
    first = replicas.merge_pods([], rs, ["q-a", "q-b", "q-c"])
    again = replicas.merge_pods(first, rs[:1], ["q-a", "q-b", "q-c"])
    assert [p.name for p in again] == ["q-a", "q-b", "q-c"]
    assert again[2] == first[2]
    # a pod that went away drops out
    assert [p.name for p in replicas.merge_pods(first, rs[:1], ["q-a"])] == ["q-a"]


def test_engine_stalled_condition_with_the_pods_and_gauges() -> None:
    rs = results()
    rs[2].stalled = replicas.stall_verdict(outcome(snap(5, running=2), snap(5, running=2)), 0.0, None)
    assert rs[2].reason == ENGINE_STALLED
    conds = {c.type: c for c in replicas.replica_conditions(rs, [], 3, T0)}
    assert conds["EngineStalled"].status == "True"
    assert conds["EngineStalled"].message.startswith("pod q-c: generation counter flat at 5 tokens")
    assert conds["KVCachePressure"].status == "False"
    # no gauges read at all (metrics unavailable): neither is claimed anew, and what the last cycle said
    # stays as it was (server-side apply would delete a condition the write left out)
    blind = [PodResult("x", "u", outcome(None, None))]
    assert {c.type for c in replicas.replica_conditions(blind, [], 3, T0)} == {"ProbeUnreliable"}
    said = [c.model_dump(by_alias=True, exclude_none=True) for c in conds.values()]
    kept = {c.type: c for c in replicas.replica_conditions(blind, said, 4, T0 + timedelta(minutes=1))}
    assert kept["EngineStalled"] == conds["EngineStalled"]
    assert kept["KVCachePressure"] == conds["KVCachePressure"]


def pod(name: str, ready: bool = True, gate: dict[str, Any] | None = None) -> dict[str, Any]:
    conds = [{"type": "ContainersReady", "status": "True" if ready else "False"}]
    if gate is not None:
        conds.append(gate)
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"phase": "Running", "podIP": "10.244.0.7", "conditions": conds},
    }


def gate(r: PodResult, p: dict[str, Any], previous: Any = None, at: datetime = T0, **thresholds: int) -> Any:
    """The gate condition after r's cycle, from the pod entry its counts give (as prober/cycle.py does)."""
    entry = replicas.pod_entry(r, previous)
    return replicas.gate_condition(r, entry, p, at, **thresholds), entry


def test_gate_condition_written_only_on_change_and_never_for_operator_side_failures() -> None:
    ok, _, bad = results()
    cond, _ = gate(bad, pod("q-c"))
    assert cond is not None
    assert (cond["type"], cond["status"], cond["reason"]) == (READINESS_GATE_CONDITION, "False", "StreamCut")
    assert gate(bad, pod("q-c", gate=cond))[0] is None  # already says so
    back, _ = gate(ok, pod("q-a", gate=cond), at=T0 + timedelta(minutes=1))
    assert back is not None
    assert (back["status"], back["reason"]) == ("True", "ChatCompletionSucceeded")
    assert back["lastTransitionTime"] == "2026-12-01T10:01:00Z"
    secret = PodResult("q-a", "u", outcome(None, None, failure=ProbeFailure(SECRET_UNAVAILABLE, "no key")))
    assert gate(secret, pod("q-a", gate=back))[0] is None


def test_an_open_gate_closes_after_failure_threshold_engine_failures_in_a_row_only() -> None:
    """failureThreshold 3: one or two failed cycles leave a serving pod in the Service, a success in
    between starts the count again, the third in a row closes the gate; operator-side failures between
    them count neither way."""
    ok, _, bad = results()
    secret = PodResult("q-c", "u", outcome(None, None, failure=ProbeFailure(SECRET_UNAVAILABLE, "no key")))
    opened, entry = gate(ok, pod("q-c"))
    assert opened is not None
    assert opened["status"] == "True"
    p = pod("q-c", gate=opened)
    seen: list[str | None] = []
    for r in (bad, bad, ok, bad, secret, bad, secret, bad):
        cond, entry = gate(r, p, entry, failure_threshold=3)
        seen.append(None if cond is None else cond["status"])
        if cond is not None:
            p = pod("q-c", gate=cond)
    assert seen == [None, None, None, None, None, None, None, "False"]
    assert entry.consecutive_failures == 3
    assert (p["status"]["conditions"][-1]["reason"]) == "StreamCut"


def test_a_closed_or_new_gate_opens_after_success_threshold_successes_in_a_row() -> None:
    ok, _, bad = results()
    first, entry = gate(ok, pod("q-a"), success_threshold=2)
    assert first is not None
    assert (first["status"], first["reason"]) == ("False", "SuccessThresholdNotMet")
    assert "1 of 2" in first["message"]
    p = pod("q-a", gate=first)
    cond, entry = gate(bad, p, entry, success_threshold=2)  # the count starts again
    assert cond is not None
    assert cond["reason"] == "StreamCut"
    p = pod("q-a", gate=cond)
    cond, entry = gate(ok, p, entry, success_threshold=2)
    assert cond is not None
    assert cond["status"] == "False"
    p = pod("q-a", gate=cond)
    cond, entry = gate(ok, p, entry, success_threshold=2)
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("True", "ChatCompletionSucceeded")


def test_a_gate_opens_only_on_a_request_path_whose_checks_pass_and_is_not_closed_by_one() -> None:
    """A new pod whose chat completed but whose template check failed takes no traffic (ChecksFailed,
    naming the check); once its checks pass it opens; an open gate stays open through a failed check."""
    ok, _, _ = results()
    ok.outcome.checks = {
        "template": ProbeCheck(result="Fail", reason="RoleMarkersMissing", message="no <|im_start|>"),
        "stop": ProbeCheck(result="Pass", reason="StopHonoured"),
        "limits": ProbeCheck(result="Skipped", reason="Disabled"),
    }
    held, entry = gate(ok, pod("q-a"))
    assert held is not None
    assert (held["status"], held["reason"]) == ("False", "ChecksFailed")
    assert held["message"] == "template: RoleMarkersMissing: no <|im_start|>"
    ok.outcome.checks["template"] = ProbeCheck(result="Pass", reason="PromptTokensMatch")
    opened, entry = gate(ok, pod("q-a", gate=held), entry)
    assert opened is not None
    assert (opened["status"], opened["reason"]) == ("True", "ChatCompletionSucceeded")
    ok.outcome.checks["stop"] = ProbeCheck(result="Fail", reason="StopIgnored")
    assert gate(ok, pod("q-a", gate=opened), entry)[0] is None  # serving: open it stays


def test_probe_unreliable_names_the_operators_own_failures() -> None:
    ok, _, _ = results()
    secret = PodResult("q-c", "u", outcome(None, None, failure=ProbeFailure(SECRET_UNAVAILABLE, "no key")))
    conds = {c.type: c for c in replicas.replica_conditions([ok, secret], [], 3, T0)}
    c = conds["ProbeUnreliable"]
    assert (c.status, c.reason) == ("True", SECRET_UNAVAILABLE)
    assert c.message.startswith("pod q-c: SecretUnavailable: no key")
    conds = {c.type: c for c in replicas.replica_conditions([ok], [], 3, T0)}
    assert (conds["ProbeUnreliable"].status, conds["ProbeUnreliable"].reason) == ("False", "ProbeReliable")
    # no token in time while the probe's own loop was stalled: the prober's doing, not the engine's
    late = outcome(None, None, failure=ProbeFailure(FIRST_BYTE_TIMEOUT, "no response"))
    late.probe_stall_ms = 900.0
    r = PodResult("q-b", "u", late)
    assert r.operator_side
    conds = {c.type: c for c in replicas.replica_conditions([r], [], 3, T0)}
    c = conds["ProbeUnreliable"]
    assert (c.status, c.reason) == ("True", "ProbeLoopStalled")
    assert "pod q-b: FirstByteTimeout" in c.message


def test_per_pod_overrides_and_pod_addresses() -> None:
    text = "ns/qwen/qwen-abc-1=http://127.0.0.1:8001/v1,ns/qwen/qwen-abc-2=http://127.0.0.1:8002,ns/other=http://x"
    assert parse_pod_overrides(text, "ns", "qwen") == {
        "qwen-abc-1": "http://127.0.0.1:8001",
        "qwen-abc-2": "http://127.0.0.1:8002",
    }
    assert parse_pod_overrides(text, "ns", "other") == {}
    assert parse_override(text, "ns", "other") == "http://x"
    assert parse_override(text, "ns", "qwen") is None  # per-pod keys are not a model-wide entry
    assert pod_base_url(pod("p")) == "http://10.244.0.7:8000"
    assert containers_ready(pod("p"))
    assert not containers_ready(pod("p", ready=False))


def test_pod_template_carries_the_readiness_gate_by_default_unless_opted_out() -> None:
    def template(probe: dict[str, Any]) -> dict[str, Any]:
        body = {
            "metadata": {"name": "qwen", "namespace": "ai", "uid": "u"},
            "spec": {"model": "Qwen/Qwen2.5-7B-Instruct", "probe": probe},
        }
        spec: dict[str, Any] = deployment(ServedModel.model_validate(body), RenderContext())["spec"][
            "template"
        ]["spec"]
        return spec

    gate = [{"conditionType": READINESS_GATE_CONDITION}]
    assert template({})["readinessGates"] == gate  # on by default
    assert template({"readinessGate": True})["readinessGates"] == gate
    assert "readinessGates" not in template({"readinessGate": False})  # opted out
    assert "readinessGates" not in template(
        {"readinessGate": True, "enabled": False}
    )  # nothing would open it


def test_rollout_status_proving_blocked_rolled_back_and_cleared_by_a_new_spec() -> None:
    """The newest revision through its gates: Proven; a new one Proving (its first pod by name that has
    not passed named, and why); Blocked past the deadline, remembering why; RolledBack while the
    Deployment says it was rolled back from it; a Deployment applied from the spec again clears it."""

    def rev(
        name: str, revision: str, created: str, gate_status: str | None, reason: str = ""
    ) -> dict[str, Any]:
        g = (
            None
            if gate_status is None
            else {"type": READINESS_GATE_CONDITION, "status": gate_status, "reason": reason}
        )
        p = pod(name, gate=g)
        p["metadata"] |= {
            "labels": {"inference.servedmodel.io/revision": revision},
            "creationTimestamp": created,
        }
        return p

    def at(seconds: int) -> datetime:
        return T0 + timedelta(seconds=seconds)

    old = {n: rev(n, "a1", "2026-12-01T09:00:00Z", "True", "ChatCompletionSucceeded") for n in ("q-a", "q-b")}
    st = replicas.rollout_status(old, None, at(0), 60)
    assert st is not None
    assert (st.revision, st.state, st.passed, st.total, st.last_proven_revision) == (
        "a1",
        "Proven",
        2,
        2,
        "a1",
    )
    rolling = {
        "q-a": old["q-a"],
        "q-d": rev("q-d", "b2", "2026-12-01T10:00:00Z", None),
        "q-c": rev("q-c", "b2", "2026-12-01T10:00:01Z", "False", "ChecksFailed"),
    }
    st = replicas.rollout_status(rolling, st, at(0), 60)
    assert st is not None
    assert (st.revision, st.state, st.passed, st.total) == ("b2", "Proving", 0, 2)
    assert (st.failing_pod, st.failing_reason, st.since) == ("q-c", "ChecksFailed", "2026-12-01T10:00:00Z")
    assert st.last_proven_revision == "a1"
    cond = replicas.rollout_condition(st, [], 3, at(0))
    assert (cond.type, cond.status, cond.reason) == ("RolloutBlocked", "False", "RolloutProving")
    st = replicas.rollout_status(rolling, st, at(59), 60)
    assert st is not None
    assert st.state == "Proving"
    st = replicas.rollout_status(rolling, st, at(61), 60)
    assert st is not None
    assert (st.state, st.blocked_revision) == ("Blocked", "b2")
    assert st.blocked_message == "pod q-c: ChecksFailed; Proving for 61 s (progressDeadlineSeconds 60)"
    cond = replicas.rollout_condition(st, [], 3, at(61))
    assert (cond.status, cond.reason) == ("True", "ChecksFailed")
    # rolled back: the Deployment runs a1's template again, its new pods are a1's
    back = {"q-a": old["q-a"], "q-e": rev("q-e", "a1", "2026-12-01T10:02:00Z", None)}
    reverted = replicas.rollout_status(back, st, at(120), 60)  # the same pods, the spec applied again
    assert reverted is not None
    assert (reverted.state, reverted.blocked_revision) == ("Proving", None)
    st = replicas.rollout_status(back, st, at(120), 60, rolled_back_from="b2")
    assert st is not None
    assert (st.revision, st.state, st.blocked_revision) == ("a1", "RolledBack", "b2")
    back["q-e"] = rev("q-e", "a1", "2026-12-01T10:02:00Z", "True", "ChatCompletionSucceeded")
    st = replicas.rollout_status(back, st, at(180), 60, rolled_back_from="b2")
    assert st is not None
    assert (st.state, st.passed, st.blocked_revision, st.last_proven_revision) == (
        "RolledBack",
        2,
        "b2",
        "a1",
    )
    cond = replicas.rollout_condition(st, [], 3, at(180))
    assert (cond.status, cond.reason) == ("True", "RolledBack")
    assert "revision b2 was blocked (pod q-c: ChecksFailed" in cond.message
    # the user fixes the spec: the Deployment is applied from it (no annotation), revision c3
    fixed = {**back, "q-f": rev("q-f", "c3", "2026-12-01T10:05:00Z", "True", "ChatCompletionSucceeded")}
    st = replicas.rollout_status(fixed, st, at(300), 60)
    assert st is not None
    assert (st.revision, st.state, st.blocked_revision, st.last_proven_revision) == (
        "c3",
        "Proven",
        None,
        "c3",
    )
    assert replicas.rollout_status({"x": pod("x")}, None, at(0), 60) is None  # no revision label: no rollout


def test_the_last_proven_revision_is_never_blocked_against_itself() -> None:
    """A revision never proven is Blocked past the deadline (with nothing to roll back to); the last
    proven revision, whose pod restarted, is Proving again and never Blocked."""
    p = pod("q-a")
    p["metadata"] |= {
        "labels": {"inference.servedmodel.io/revision": "a1"},
        "creationTimestamp": "2026-12-01T09:00:00Z",
    }
    previous = replicas.rollout_status({"q-a": p}, None, T0, 60)
    assert previous is not None
    assert previous.state == "Proving"
    later = replicas.rollout_status({"q-a": p}, previous, T0 + timedelta(hours=1), 60)
    assert later is not None
    assert later.state == "Blocked"  # never proven at all: blocked, but there is nothing to roll back to
    assert later.last_proven_revision is None
    proven = previous.model_copy(update={"last_proven_revision": "a1", "state": "Proven"})
    again = replicas.rollout_status({"q-a": p}, proven, T0 + timedelta(hours=1), 60)
    assert again is not None
    assert again.state == "Proving"


def timed(name: str, ttft: float, tpot: float = 2.0) -> PodResult:
    r = PodResult(name, "u", outcome(None, None, ttft=ttft))
    assert r.outcome.figures is not None
    r.outcome.figures = replace(r.outcome.figures, tpot_ms=tpot)
    return r


@pytest.mark.parametrize(
    ("new", "baseline", "held"),
    [
        (timed("n", 90.0), [timed("o1", 30.0), timed("o2", 31.0)], "TTFT 90.0 ms against 30.5 ms"),
        (timed("n", 40.0), [timed("o1", 30.0)], None),  # x1.3: within x1.5
        (timed("n", 12.0), [timed("o1", 4.0)], None),  # x3, but 8 ms: the machine's noise
        (timed("n", 30.0, tpot=60.0), [timed("o1", 30.0, tpot=20.0)], "TPOT 60.0 ms against 20.0 ms"),
        (timed("n", 90.0), [], None),  # nothing to compare with
    ],
    ids=["ttft-x3", "within-ratio", "under-noise-floor", "tpot-x3", "no-baseline"],
)
def test_latency_regression_against_the_proven_revisions_pods(
    new: PodResult, baseline: list[PodResult], held: str | None
) -> None:
    verdict = replicas.latency_regression(new, baseline, 1.5)
    assert verdict is None or verdict[0] == "LatencyRegression"
    assert_verdict(verdict[1] if verdict else None, held)


def test_figures_a_stall_of_the_probe_took_are_not_compared_and_hold_the_gate() -> None:
    """A new pod whose figures a stall of the probe's own loop took is neither judged slow nor let
    through: LatencyNotCompared until a cycle compares it. A stalled baseline pod is left out of the
    median; a stall that took only the decode still lets TTFT convict. Stalls that took every baseline
    pod's figure leave nothing to compare with: LatencyNotCompared too, not a pass."""
    slow = timed("n", 90.0)
    slow.outcome.probe_stall_first_token = True
    slow.outcome.probe_stall_ms = 412.0
    verdict = replicas.latency_regression(slow, [timed("o1", 30.0)], 1.5)
    assert verdict is not None
    assert verdict[0] == "LatencyNotCompared"
    assert verdict[1].startswith("TTFT and TPOT not compared")
    assert "stalled 412 ms" in verdict[1]
    decode_only = timed("n", 30.0, tpot=200.0)
    decode_only.outcome.probe_stall_decode = True
    verdict = replicas.latency_regression(decode_only, [timed("o1", 30.0)], 1.5)
    assert verdict is not None
    assert verdict[0] == "LatencyNotCompared"
    assert verdict[1].startswith("TPOT not")
    assert decode_only.outcome.figures is not None
    decode_only.outcome.figures = replace(decode_only.outcome.figures, ttft_ms=120.0)
    verdict = replicas.latency_regression(decode_only, [timed("o1", 30.0)], 1.5)
    assert verdict is not None
    assert verdict[0] == "LatencyRegression"
    assert replicas.latency_regression(slow, [], 1.5) is None  # nothing to compare with either way
    stalled_old = timed("o2", 5.0)
    stalled_old.outcome.probe_stall_first_token = True
    assert replicas.latency_regression(timed("n", 40.0), [timed("o1", 30.0), stalled_old], 1.5) is None
    # Every baseline pod's figures taken: nothing to compare with this cycle, and not let through.
    verdict = replicas.latency_regression(timed("n", 300.0, tpot=20.0), [stalled_old], 1.5)
    assert verdict is not None
    assert verdict[0] == "LatencyNotCompared"
    assert verdict[1].startswith("TTFT and TPOT not compared with the last proven revision's pods")
    decode_old = timed("o3", 30.0)
    decode_old.outcome.probe_stall_decode = True
    verdict = replicas.latency_regression(timed("n", 40.0, tpot=20.0), [decode_old], 1.5)
    assert verdict is not None
    assert verdict[0] == "LatencyNotCompared"
    assert verdict[1].startswith("TPOT not compared")  # TTFT compared (x1.3: within x1.5)


def test_a_held_pod_keeps_its_gate_closed_and_an_open_one_is_not_closed() -> None:
    """A new revision's pod that serves and passes its checks but is slower stays out (LatencyRegression,
    the guard's message); without the hold it opens; an open gate is not closed by it."""
    ok, _, _ = results()
    why = ("LatencyRegression", "TTFT x3")
    held = replicas.gate_condition(ok, replicas.pod_entry(ok, None), pod("q-a"), T0, held=why)
    assert held is not None
    assert (held["status"], held["reason"], held["message"]) == ("False", "LatencyRegression", "TTFT x3")
    opened, _ = gate(ok, pod("q-a", gate=held))
    assert opened is not None
    assert opened["status"] == "True"
    entry = replicas.pod_entry(ok, None)
    assert replicas.gate_condition(ok, entry, pod("q-a", gate=opened), T0, held=why) is None


def test_fingerprints_kept_per_revision_and_a_change_is_said_once() -> None:
    """The newest revision's fingerprint is taken once and kept; Proven makes it the last proven one's;
    a later revision whose rendering differs is a TemplateChanged message the cycle it is taken, not after."""

    def revision_pods(revision: str, created: str, status: str) -> dict[str, Any]:
        p = pod("q-" + revision, gate={"type": READINESS_GATE_CONDITION, "status": status, "reason": "x"})
        p["metadata"] |= {
            "labels": {"inference.servedmodel.io/revision": revision},
            "creationTimestamp": created,
        }
        return {p["metadata"]["name"]: p}

    a = revision_pods("a1", "2026-12-01T09:00:00Z", "True")
    first = replicas.rollout_status(a, None, T0, 60, fingerprints={"a1": "sha256:aaaa/20"})
    assert first is not None
    assert (first.fingerprint, first.last_proven_fingerprint) == ("sha256:aaaa/20", "sha256:aaaa/20")
    assert replicas.template_change(None, first) is None
    assert replicas.known_fingerprints(first) == {"a1": "sha256:aaaa/20"}
    b = {**a, **revision_pods("b2", "2026-12-01T09:30:00Z", "False")}
    proving = replicas.rollout_status(b, first, T0, 60)
    assert proving is not None
    assert (proving.revision, proving.fingerprint) == ("b2", None)  # not taken yet
    taken = replicas.rollout_status(b, proving, T0, 60, fingerprints={"b2": "sha256:bbbb/23"})
    assert taken is not None
    assert (taken.fingerprint, taken.last_proven_fingerprint) == ("sha256:bbbb/23", "sha256:aaaa/20")
    said = replicas.template_change(proving, taken)
    assert said is not None
    assert_verdict(said, "revision b2", "sha256:aaaa/20 → sha256:bbbb/23", "revision a1")
    later = replicas.rollout_status(b, taken, T0, 60)
    assert later is not None
    assert later.fingerprint == "sha256:bbbb/23"
    assert replicas.template_change(taken, later) is None  # said once
    same = replicas.rollout_status(b, proving, T0, 60, fingerprints={"b2": "sha256:aaaa/20"})
    assert same is not None
    assert replicas.template_change(proving, same) is None  # the same rendering: nothing to say


def test_a_probe_prompt_the_engine_cannot_take_holds_a_closed_gate_and_leaves_an_open_one() -> None:
    """PromptTooLong (the probe's messages over max_model_len) may be the engine's flag or the probe's spec:
    a new pod stays out, a serving pod stays in however many cycles it lasts."""
    ok, _, _ = results()
    too_long = ProbeFailure(
        PROMPT_TOO_LONG, "POST /v1/chat/completions: HTTP 400: maximum context length is 16"
    )
    bad = PodResult("q-a", "u", outcome(None, None, failure=too_long))
    closed, entry = gate(bad, pod("q-a"))
    assert closed is not None
    assert (closed["status"], closed["reason"]) == ("False", "PromptTooLong")
    opened, entry = gate(ok, pod("q-a"))
    assert opened is not None
    p = pod("q-a", gate=opened)
    for _ in range(5):
        cond, entry = gate(bad, p, entry, failure_threshold=3)
        assert cond is None
    assert entry.consecutive_failures == 5


def managed_cycle() -> tuple[Any, Any, compose.Pods]:
    """(spec, outcome, pods) of one managed cycle over results(): three pods of revision a1, one failing."""
    probed = results()
    by_name = {}
    for r in probed:
        p = pod(r.name)
        p["metadata"] |= {"labels": {REVISION_LABEL: "a1"}, "creationTimestamp": "2026-12-01T09:00:00Z"}
        by_name[r.name] = p
    spec = ServedModel.model_validate(
        {"metadata": {"name": "q", "namespace": "ns"}, "spec": {"model": "Qwen/Qwen2.5-7B-Instruct"}}
    ).spec
    return spec, replicas.aggregate(probed), compose.Pods(probed, [r.name for r in probed], 3, by_name)


def test_compose_writes_every_condition_the_probe_owns_and_the_gates_it_decided() -> None:
    """One managed cycle through probe/compose: Serving True ReplicasFailing naming the failing pod (no
    second author rewrites it), every probe condition present (server-side apply would delete one left
    out), the failing pod's gate closed and the serving ones opened, status.rollout from the pods as
    those gates leave them, and a cycle without gate or revisions keeping status.rollout as it was."""
    spec, out, pods = managed_cycle()
    done = compose.compose(compose.Cycle(out, spec, {}, 2, T0, pods=pods))
    types = [c["type"] for c in done.patch["conditions"]]
    # no SLO and no adapters in the spec; MetricsCompatible is the prober's to hand over (none here)
    absent = {"LatencySLOMet", "AdaptersServing", "MetricsCompatible"}
    assert sorted(types) == sorted(set(PROBE_CONDITIONS) - absent)
    serving = next(c for c in done.patch["conditions"] if c["type"] == "Serving")
    assert (serving["status"], serving["reason"]) == ("True", REPLICAS_FAILING)
    assert "pod q-c: StreamCut" in serving["message"]
    assert {n: g["status"] for n, g in done.gates.items()} == {"q-a": "True", "q-b": "True", "q-c": "False"}
    rollout = done.patch["rollout"]
    assert (rollout["revision"], rollout["state"], rollout["passed"], rollout["total"]) == (
        "a1",
        "Proving",
        2,
        3,
    )
    assert rollout["failingPod"] == "q-c"
    # the gate off: nothing decided, status.rollout and RolloutBlocked kept as they were
    off = spec.model_copy(update={"probe": spec.probe.model_copy(update={"readiness_gate": False})})
    kept = {
        "rollout": rollout,
        "conditions": [c for c in done.patch["conditions"] if c["type"] == "RolloutBlocked"],
    }
    again = compose.compose(compose.Cycle(out, off, kept, 2, T0, pods=pods))
    assert again.gates == {}
    assert again.patch["rollout"] == rollout
    assert "RolloutBlocked" in [c["type"] for c in again.patch["conditions"]]


def test_compose_continues_from_the_status_the_cycle_parsed_without_parsing_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cycle parses status.probe once (previous_probe_status) and hands it to compose in
    Cycle.previous: the same patch as compose parsing it itself, and no second parse."""
    spec, out, pods = managed_cycle()
    first = compose.compose(compose.Cycle(out, spec, {}, 2, T0, pods=pods))
    status = {"probe": first.status.model_dump(by_alias=True, exclude_none=True, mode="json")}
    parsed = compose.previous_probe_status(status, None)
    assert parsed is not None
    assert parsed.consecutive_failures == 0
    itself = compose.compose(compose.Cycle(out, spec, status, 2, T0, pods=pods))
    parses: list[Any] = []
    real = compose._parsed_probe
    monkeypatch.setattr(compose, "_parsed_probe", lambda p: parses.append(p) or real(p))
    handed = compose.compose(compose.Cycle(out, spec, status, 2, T0, pods=pods, previous=parsed))
    assert parses == []
    assert handed.patch == itself.patch
