"""Pure: one probe cycle over several engine pods -> each pod's verdict, the aggregate status.probe,
the Serving summary ("2/3"), EngineStalled / KVCachePressure / ProbeUnreliable, each pod's
readiness-gate condition, and status.rollout (the newest revision's pods through their gates).

Each pod is probed at its own address (prober/cycle.py does the I/O); what comes back per pod is a
ProbeOutcome with that pod's own /metrics before and after. From those and the previous cycle's figures:

- EngineStalled: the engine's generation counter (vllm:generation_tokens_total) did not move across a
  window of at least MIN_STALL_WINDOW_S while requests were running (a hung forward pass), or while
  requests were waiting and none running (a scheduler that admits nothing), or while the probe's own
  request got no token in time (a hung engine core reports no gauges at all: vLLM's stay frozen).
  The window is the probe's own (scrape before → scrape after the chat, so it is reported even when
  the chat times out) or, when that was too short, the time since the pod's previous cycle.
- KVCachePressure: KV cache usage at or above KV_PRESSURE_USAGE with vllm:num_preemptions rising since
  the previous cycle (or across the probe's window): the engine is recomputing requests it had to evict.
- The readiness gate, the kubelet's way: a serving pod's gate closes after spec.probe.failureThreshold
  failed probes in a row of the engine's own making, a closed (or new) one opens after successThreshold
  successes in a row (the counts are kept in status.probe.pods[], so a failed-over operator goes on from
  them). To open, the pod's request path must pass whole, its checks included (template, limits, stop,
  usage, streaming: none Fail): a new pod, a new revision's above all, takes no traffic before it proved
  the template renders and the server stops and counts as it should. An open gate is not closed by a
  failed check (the model answers; the check says what is wrong), nor by a probe prompt the engine
  cannot take (NOT_CLOSING): only by the engine's failures. A
  failure of the operator's own making (OPERATOR_SIDE, or no token in time while the probe's own loop
  was stalled) counts neither way and leaves the gate as it is: ProbeUnreliable says so instead.

Top-level status.probe is the aggregate over the pods probed this cycle: client latencies are the median
of the serving pods, scheduler gauges and counters add up over pods (KV cache usage: the highest pod),
server phases come from the summed histograms; checks, usage and finish reason are those of the first
serving pod by name.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from servedmodel.api import names
from servedmodel.api.base import Condition
from servedmodel.api.conditions import (
    ENGINE_STALLED,
    KV_CACHE_PRESSURE,
    PROBE_UNRELIABLE,
    REPLICAS_FAILING,
    ROLLOUT_BLOCKED,
    ConditionStatus,
    clip,
    find,
    transition,
)
from servedmodel.api.probe import READINESS_GATE_CONDITION, PodProbe, ProbeStatus, RolloutStatus

from . import errors
from .client import PROBE_LOOP_STALLED, ProbeOutcome
from .metrics import MetricsSnapshot, combine, delta
from .report import parse_rfc3339, rfc3339

MIN_STALL_WINDOW_S: Final = 1.0
# A multi-node group's leader serves, but a worker of its group cannot (probe/group.py).
WORKER_NOT_SERVING: Final = "WorkerNotServing"
# The probe's own chat got no token in time: together with a flat generation counter, a stall.
NO_TOKEN_REASONS: Final = frozenset({errors.FIRST_BYTE_TIMEOUT, errors.STREAM_STALLED, errors.PROBE_TIMEOUT})
KV_PRESSURE_USAGE: Final = 0.9
# Failures on the operator's side (it could not read a Secret, its own pool had no connection free): they
# say nothing about the pod, so its readiness gate keeps what it had.
OPERATOR_SIDE: Final = frozenset({errors.SECRET_UNAVAILABLE, errors.PROBE_POOL_EXHAUSTED})
# The probe's own request does not fit the engine (its messages over max_model_len): that may be the
# engine's flag or the probe's spec, so it keeps a closed gate closed (a new revision that cannot take the
# prompt is held) but never closes an open one (an edit of spec.probe must not empty the Service).
NOT_CLOSING: Final = frozenset({errors.PROMPT_TOO_LONG})
# A pod's gate stays closed: its chat completed, but a check of the request path failed.
CHECKS_FAILED: Final = "ChecksFailed"
# A new revision's pod's gate stays closed: it serves, but slower than the last proven revision's pods.
LATENCY_REGRESSION: Final = "LatencyRegression"
# ... or its figures could not be compared this cycle: a stall of the probe's own loop took them.
LATENCY_NOT_COMPARED: Final = "LatencyNotCompared"
# Below these a difference is the machine's noise whatever the ratio (a 4 ms TTFT that became 7 ms).
LATENCY_NOISE_MS: Final = {"TTFT": 20.0, "TPOT": 5.0}
# The Event when a new revision's chat template renders the reference conversation differently.
TEMPLATE_CHANGED: Final = "TemplateChanged"


@dataclass(frozen=True)
class Window:
    """A pod's figures at the end of a cycle, for the next cycle's deltas (monotonic seconds)."""

    snapshot: MetricsSnapshot
    at: float


@dataclass
class PodResult:
    """One pod's cycle: where it was probed, what came back, and what that says."""

    name: str
    endpoint: str
    outcome: ProbeOutcome
    stalled: str | None = None  # the EngineStalled message, with the gauges
    kv_pressure: str | None = None  # the KVCachePressure message, with the figures
    # A multi-node group's leader (spec.workers): the workers of its group that cannot serve their part
    # (probe/group.py), and the group's pods (its workers), whose gates follow the leader's verdict.
    worker_failure: str | None = None
    workers: tuple[str, ...] = ()

    @property
    def serving(self) -> bool:
        return self.outcome.ok and self.stalled is None and self.worker_failure is None

    @property
    def reason(self) -> str:
        if self.stalled is not None:
            return ENGINE_STALLED
        if self.worker_failure is not None and self.outcome.failure is None:
            return WORKER_NOT_SERVING
        return errors.SERVING if self.outcome.failure is None else self.outcome.failure.reason

    @property
    def operator_side(self) -> bool:
        """Failed for the operator's own reasons: a Secret, its pool, or no token in time while its own
        loop was stalled (the engine may have sent one)."""
        if self.serving:
            return False
        if self.reason in OPERATOR_SIDE:
            return True
        return self.outcome.probe_stall_ms is not None and self.reason in NO_TOKEN_REASONS

    @property
    def message(self) -> str:
        f = self.outcome.failure
        parts = [] if f is None else [f.message]
        if self.stalled is not None:
            parts.append(self.stalled)
        if self.worker_failure is not None:
            parts.append(self.worker_failure)
        if f is None and self.outcome.figures is not None:
            fig = self.outcome.figures
            parts.append(f"TTFT {fig.ttft_ms or 0:.1f} ms, e2e {fig.e2e_ms or 0:.1f} ms")
        return "; ".join(parts)[:500]


def _gauge(s: MetricsSnapshot | None, key: str) -> float:
    return float((s.gauges if s is not None else {}).get(key, 0.0))


def _gauges_text(s: MetricsSnapshot) -> str:
    return (
        f"running {_gauge(s, 'running'):.0f}, waiting {_gauge(s, 'waiting'):.0f}, "
        f"KV cache {_gauge(s, 'kv_cache_usage'):.0%}"
    )


def stall_verdict(out: ProbeOutcome, now: float, previous: Window | None) -> str | None:
    """The EngineStalled message when the generation counter stood still with requests in the engine."""
    after = out.after
    if after is None:
        return None
    gen = after.counters.get("generation_tokens")
    if gen is None:
        return None
    windows: list[tuple[MetricsSnapshot, float]] = []
    if out.before is not None and out.ended is not None:
        windows.append((out.before, (out.ended - out.started).total_seconds()))
    if previous is not None:
        windows.append((previous.snapshot, now - previous.at))
    running, waiting = _gauge(after, "running"), _gauge(after, "waiting")
    for start, span in windows:
        g0 = start.counters.get("generation_tokens")
        if span < MIN_STALL_WINDOW_S or g0 is None or gen != g0:
            continue
        if running > 0:
            return (
                f"generation counter flat at {gen:.0f} tokens for {span:.1f} s while requests run "
                f"({_gauges_text(after)})"
            )
        if waiting > 0:
            return (
                f"requests waiting while nothing runs for {span:.1f} s, generation counter flat at "
                f"{gen:.0f} tokens ({_gauges_text(after)})"
            )
    # The probe's own request is one that waits: a hung engine core (vLLM #39863) stops reporting, so its
    # gauges stay as they were (often 0, 0) while the API server keeps answering /health.
    f = out.failure
    if f is not None and f.reason in NO_TOKEN_REASONS and windows:
        start, span = windows[0]
        if span >= MIN_STALL_WINDOW_S and start.counters.get("generation_tokens") == gen:
            return (
                f"the probe's request got no token for {span:.1f} s ({f.reason}) and the generation counter "
                f"stood still at {gen:.0f} tokens; the engine's gauges: {_gauges_text(after)}"
            )
    return None


def kv_pressure_verdict(out: ProbeOutcome, previous: Window | None) -> str | None:
    """The KVCachePressure message when KV cache usage is near full and preemptions rose."""
    after = out.after
    if after is None or "preemptions" not in after.counters:
        return None
    # The gauge is sampled at each scrape and drops as soon as a preemption frees blocks: take the
    # highest of the window's samples (before, after, and the previous cycle's).
    usage = max(
        _gauge(after, "kv_cache_usage"),
        _gauge(out.before, "kv_cache_usage"),
        _gauge(previous.snapshot if previous is not None else None, "kv_cache_usage"),
    )
    if usage < KV_PRESSURE_USAGE:
        return None
    now_p = after.counters["preemptions"]
    start = previous.snapshot if previous is not None else out.before
    if start is None or "preemptions" not in start.counters:
        return None
    rose = now_p - start.counters["preemptions"]
    if rose <= 0:
        return None
    since = "since the previous probe" if previous is not None else "during the probe"
    return (
        f"KV cache usage {usage:.0%} with {rose:.0f} preemptions {since} ({now_p:.0f} in all); "
        f"running {_gauge(after, 'running'):.0f}, waiting {_gauge(after, 'waiting'):.0f}"
    )


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(results: Sequence[PodResult]) -> ProbeOutcome:
    """The cycle as one outcome (see the module docstring); a failure only when no pod serves."""
    assert results, "aggregate of no pod"
    serving = [r for r in results if r.serving]
    base = serving[0].outcome if serving else results[0].outcome
    out = dataclasses.replace(base)
    if not serving:
        first = results[0]
        out.failure = errors.ProbeFailure(first.reason, first.message)
    figs = [r.outcome.figures for r in serving if r.outcome.figures is not None]
    if len(figs) > 1:
        out.figures = dataclasses.replace(
            figs[0],
            headers_ms=_median([f.headers_ms for f in figs]),
            ttft_ms=_median([f.ttft_ms for f in figs]),
            tpot_ms=_median([f.tpot_ms for f in figs]),
            itl_p50_ms=_median([f.itl_p50_ms for f in figs]),
            itl_p95_ms=_median([f.itl_p95_ms for f in figs]),
            e2e_ms=_median([f.e2e_ms for f in figs]),
        )
    paired = [r.outcome for r in results if r.outcome.before is not None and r.outcome.after is not None]
    if len(paired) > 1:
        out.before = combine(o.before for o in paired if o.before is not None)
        out.after = combine(o.after for o in paired if o.after is not None)
        if out.before is not None and out.after is not None:
            out.window = delta(out.before, out.after)
            done = out.window.counters.get("request_success")
            sent = sum(len(o.timings) for o in paired)
            out.isolated = None if out.window.reset or done is None else round(done) == sent and sent > 0
    out.ended = max((r.outcome.ended for r in results if r.outcome.ended is not None), default=base.ended)
    return out


def pod_entry(r: PodResult, previous: PodProbe | None) -> PodProbe:
    """status.probe.pods[] for a pod probed this cycle."""
    out = r.outcome
    snap = out.after or out.before
    f = out.figures if r.serving else None

    def rnd(v: float | None) -> float | None:
        return None if v is None else round(v, 3)

    kv = snap.gauges.get("kv_cache_usage") if snap is not None else None
    return PodProbe(
        name=r.name,
        serving="True" if r.serving else "False",
        reason=r.reason,
        message=r.message or None,
        endpoint=r.endpoint,
        ttft_ms=rnd(f.ttft_ms) if f else None,
        tpot_ms=rnd(f.tpot_ms) if f else None,
        e2e_ms=rnd(f.e2e_ms) if f else None,
        running=round(snap.gauges["running"]) if snap is not None and "running" in snap.gauges else None,
        waiting=round(snap.gauges["waiting"]) if snap is not None and "waiting" in snap.gauges else None,
        kv_cache_usage=round(min(max(kv, 0.0), 1.0), 4) if kv is not None else None,
        last_probe_time=rfc3339(out.ended or out.started),
        **_counts(r, previous),
    )


def _counts(r: PodResult, previous: PodProbe | None) -> dict[str, int]:
    """The pod's probes in a row: a success or an engine failure moves them, an operator-side failure
    leaves both as they were (it says nothing about the pod)."""
    failures = previous.consecutive_failures if previous else 0
    successes = previous.consecutive_successes if previous else 0
    if r.operator_side:
        return {"consecutive_failures": failures, "consecutive_successes": successes}
    if r.serving:
        return {"consecutive_failures": 0, "consecutive_successes": successes + 1}
    return {"consecutive_failures": failures + 1, "consecutive_successes": 0}


def merge_pods(
    previous: Sequence[PodProbe], probed: Sequence[PodResult], eligible: Sequence[str]
) -> list[PodProbe]:
    """This cycle's pods, plus the last entry of probe-able pods a bounded rotation skipped; by name.
    Pods that went away, or whose containers are no longer ready, drop out."""
    before = {p.name: p for p in previous}
    out = {r.name: pod_entry(r, before.get(r.name)) for r in probed}
    for name in eligible:
        if name not in out and name in before:
            out[name] = before[name]
    return [out[n] for n in sorted(out)]


def summarize(status: ProbeStatus, pods: Sequence[PodProbe], replicas: int) -> ProbeStatus:
    """status.probe with the replicas' view: "k/n" (pods whose last probe served / engine pods that exist,
    ready or not), and which pods fail and why."""
    serving = sum(1 for p in pods if p.serving == "True")
    failing = [p for p in pods if p.serving != "True"]
    total = max(replicas, len(pods))
    status = status.model_copy(update={"pods": list(pods), "serving": f"{serving}/{total}"})
    if not failing:
        return status
    detail = "; ".join(f"pod {p.name}: {p.reason}: {p.message or ''}".rstrip(": ") for p in failing)
    head = f"{serving}/{total} replicas serving"
    if serving:
        return status.model_copy(
            update={"reason": REPLICAS_FAILING, "message": clip(f"{head}; {detail}; {status.message or ''}")}
        )
    return status.model_copy(update={"message": clip(f"{head}; {detail}")})


def _condition(
    ctype: str,
    cstatus: ConditionStatus,
    reason: str,
    message: str,
    existing: Sequence[Mapping[str, Any]],
    generation: int | None,
    now: datetime,
) -> Condition:
    stamp = rfc3339(now, "seconds")
    return Condition.model_validate(
        transition(list(existing), ctype, cstatus, reason, message, generation=generation, now=stamp)
    )


def replica_conditions(
    probed: Sequence[PodResult],
    existing: Sequence[Mapping[str, Any]],
    generation: int | None,
    now: datetime,
) -> list[Condition]:
    """EngineStalled and KVCachePressure from the pods' gauges (kept as they were when no pod's gauges
    were read: server-side apply would drop what this cycle left out), and ProbeUnreliable."""
    out = [*_gauge_conditions(probed, existing, generation, now)]
    unreliable = [r for r in probed if r.operator_side]
    stalled = [r for r in probed if r.outcome.stall_took_figures or r.outcome.lumped_by_prober]
    if unreliable:
        reason = unreliable[0].reason if unreliable[0].reason in OPERATOR_SIDE else PROBE_LOOP_STALLED
        text = "; ".join(f"pod {r.name}: {r.reason}: {r.message}" for r in unreliable)
        out.append(_condition(PROBE_UNRELIABLE, "True", reason, text, existing, generation, now))
    elif stalled:
        text = "; ".join(
            f"pod {r.name}: read while the probe's own loop was "
            + ("stalled" if r.outcome.stall_took_figures else "held up (its stream read in lumps)")
            for r in stalled
        )
        out.append(_condition(PROBE_UNRELIABLE, "True", PROBE_LOOP_STALLED, text, existing, generation, now))
    else:
        out.append(_condition(PROBE_UNRELIABLE, "False", "ProbeReliable", "", existing, generation, now))
    return out


def _gauge_conditions(
    probed: Sequence[PodResult],
    existing: Sequence[Mapping[str, Any]],
    generation: int | None,
    now: datetime,
) -> list[Condition]:
    if not any(r.outcome.after is not None for r in probed):
        return [
            Condition.model_validate(c)
            for t in (ENGINE_STALLED, KV_CACHE_PRESSURE)
            if (c := find(existing, t))
        ]
    stalled = [f"pod {r.name}: {r.stalled}" for r in probed if r.stalled]
    pressure = [f"pod {r.name}: {r.kv_pressure}" for r in probed if r.kv_pressure]
    return [
        _condition(ENGINE_STALLED, "True", "GenerationStalled", "; ".join(stalled), existing, generation, now)
        if stalled
        else _condition(ENGINE_STALLED, "False", "GenerationProgressing", "", existing, generation, now),
        _condition(
            KV_CACHE_PRESSURE, "True", "PreemptionsRising", "; ".join(pressure), existing, generation, now
        )
        if pressure
        else _condition(KV_CACHE_PRESSURE, "False", "NoPressure", "", existing, generation, now),
    ]


def pod_revision(pod: Mapping[str, Any] | None) -> str | None:
    """The engine revision a pod runs (names.REVISION_LABEL), None for a pod without one."""
    revision = (((pod or {}).get("metadata") or {}).get("labels") or {}).get(names.REVISION_LABEL)
    return str(revision) if revision else None


def latency_regression(
    r: PodResult, baseline: Sequence[PodResult], max_ratio: float
) -> tuple[str, str] | None:
    """Why `r`, a new revision's pod, keeps its closed gate closed next to `baseline` (the last proven
    revision's serving pods probed in the same cycle), as (reason, message), or None. LatencyRegression:
    its TTFT or TPOT above max_ratio times their median and above it by more than LATENCY_NOISE_MS.
    LatencyNotCompared: a stall of the probe's own loop took its figures, so this cycle cannot tell a slow
    engine from a slow prober (the next one compares again); or it took every baseline pod's figure, so
    there is nothing to compare with this cycle (a stall of a few baseline pods only leaves them out)."""

    def figure(x: PodResult, attr: str) -> float | None:
        # A stall before the first token took TTFT and TPOT (TPOT runs from it); one in the decode, TPOT.
        fig, out = x.outcome.figures, x.outcome
        if fig is None or out.probe_stall_first_token or (attr == "tpot_ms" and out.probe_stall_decode):
            return None
        value: float | None = getattr(fig, attr)
        return value

    baseline_taken: list[str] = []  # figures of r that every baseline pod lost to a stall
    for label, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")):
        new = figure(r, attr)
        old = [v for b in baseline if (v := figure(b, attr)) is not None]
        if new is not None and not old and any(b.outcome.stall_took_figures for b in baseline):
            baseline_taken.append(label)
        if new is None or not old:
            continue
        median = statistics.median(old)
        if new > max_ratio * median and new - median > LATENCY_NOISE_MS[label]:
            ratio = f"x{new / median:.1f}" if median > 0 else "from 0"
            return LATENCY_REGRESSION, (
                f"{label} {new:.1f} ms against {median:.1f} ms, the median of {len(old)} pod(s) of the last "
                f"proven revision probed in this cycle: {ratio} > x{max_ratio:g} "
                "(spec.rollout.maxLatencyRegression)"
            )
    if r.outcome.stall_took_figures and any(figure(b, "ttft_ms") is not None for b in baseline):
        taken = "TTFT and TPOT" if r.outcome.probe_stall_first_token else "TPOT"
        return LATENCY_NOT_COMPARED, (
            f"{taken} not compared with the last proven revision's pods this cycle: the probe's own loop "
            f"stalled {r.outcome.probe_stall_ms or 0:.0f} ms while it read this pod's stream "
            "(spec.rollout.maxLatencyRegression is checked again next cycle)"
        )
    if baseline_taken:
        # Not let through for want of a comparison (before, None here opened the gate).
        return LATENCY_NOT_COMPARED, (
            f"{' and '.join(baseline_taken)} not compared with the last proven revision's pods this cycle: "
            "the probe's own loop stalled while it read every one of theirs "
            "(spec.rollout.maxLatencyRegression is checked again next cycle)"
        )
    return None


def gate_condition(
    r: PodResult,
    entry: PodProbe,
    pod: Mapping[str, Any],
    now: datetime,
    *,
    failure_threshold: int = 1,
    success_threshold: int = 1,
    held: tuple[str, str] | None = None,
) -> dict[str, Any] | None:
    """The readiness-gate pod condition to write for this pod after its cycle (`entry`: its counts in
    status.probe.pods[]), None when what it has is still right: an open gate stays open until
    failure_threshold engine failures in a row, a closed or new one opens after success_threshold
    successes in a row, and an operator-side failure changes nothing. `held`: why a closed gate stays
    closed although the pod serves and its checks pass (latency_regression's reason and message)."""
    if r.operator_side:
        return None
    conds = (pod.get("status") or {}).get("conditions") or []
    prev = find(conds, READINESS_GATE_CONDITION)
    is_open = prev is not None and prev.get("status") == "True"
    status: ConditionStatus
    failed = [
        f"{k}: {c.reason}: {c.message}".rstrip(": ")
        for k, c in r.outcome.checks.items()
        if c.result == "Fail"
    ]
    if r.serving:
        if is_open:
            status, reason, message = "True", "ChatCompletionSucceeded", r.message
        elif failed:
            status, reason, message = "False", CHECKS_FAILED, "; ".join(failed)
        elif held is not None:
            status, (reason, message) = "False", held
        elif entry.consecutive_successes >= success_threshold:
            status, reason, message = "True", "ChatCompletionSucceeded", r.message
        else:
            status, reason = "False", "SuccessThresholdNotMet"
            message = f"{entry.consecutive_successes} of {success_threshold} successful probes in a row"
    elif is_open and (entry.consecutive_failures < failure_threshold or r.reason in NOT_CLOSING):
        return None  # open until failure_threshold failures in a row of the engine's own
    else:
        status, reason, message = "False", r.reason, r.message
    if prev is not None and prev.get("status") == status and prev.get("reason") == reason:
        return None
    stamp = rfc3339(now, "seconds")
    # A PodCondition: no observedGeneration, and a lastProbeTime.
    condition = transition(
        conds,
        READINESS_GATE_CONDITION,
        status,
        reason,
        message or reason,
        generation=None,
        now=stamp,
    )
    return {**condition, "lastProbeTime": stamp}


def known_fingerprints(previous: RolloutStatus | None) -> dict[str, str]:
    """Revision -> template fingerprint, as status.rollout remembers them (a revision in it needs none
    taken again)."""
    if previous is None:
        return {}
    pairs = [
        (previous.last_proven_revision, previous.last_proven_fingerprint),
        (previous.revision, previous.fingerprint),
    ]
    return {r: f for r, f in pairs if r and f}


def rollout_status(
    pods: Mapping[str, Mapping[str, Any]],
    previous: RolloutStatus | None,
    now: datetime,
    deadline_s: float,
    rolled_back_from: str | None = None,
    fingerprints: Mapping[str, str] | None = None,
) -> RolloutStatus | None:
    """status.rollout from the engine pods as they are after this cycle's gate writes: the newest revision
    (names.REVISION_LABEL of the most recently created pods), how many of its pods passed their gate,
    the first (by name) that has not and why; Blocked once it has been Proving for `deadline_s` (unless
    it is the last proven revision: nothing to go back to); RolledBack while the engine Deployment says
    it was rolled back from the blocked revision (`rolled_back_from`, its annotation) and its pods are
    the last proven revision's again. A Deployment applied from the spec again (fixed, or reverted)
    clears the block. `fingerprints`: revision -> template fingerprint taken this cycle. None when no pod
    carries a revision."""
    revisions: dict[str, list[Mapping[str, Any]]] = {}
    for p in pods.values():
        revision = pod_revision(p)
        if revision:
            revisions.setdefault(revision, []).append(p)
    if not revisions:
        return None

    def created(revision: str) -> str:
        return max(str((p.get("metadata") or {}).get("creationTimestamp") or "") for p in revisions[revision])

    newest = max(revisions, key=lambda r: (created(r), r))
    members = sorted(revisions[newest], key=lambda p: str((p.get("metadata") or {}).get("name")))
    closed: list[tuple[str, Mapping[str, Any] | None]] = []
    for p in members:
        gate = find((p.get("status") or {}).get("conditions"), READINESS_GATE_CONDITION)
        if gate is None or gate.get("status") != "True":
            closed.append((str((p.get("metadata") or {}).get("name")), gate))
    last = previous.last_proven_revision if previous is not None else None
    fingerprint = (fingerprints or {}).get(newest) or known_fingerprints(previous).get(newest)
    last_fingerprint = previous.last_proven_fingerprint if previous is not None else None
    blocked = previous.blocked_revision if previous is not None else None
    blocked_message = previous.blocked_message if previous is not None else None
    if blocked is not None and newest != blocked and rolled_back_from != blocked:
        blocked = blocked_message = None  # the Deployment runs the spec again: fixed or reverted
    since = previous.since if previous is not None and previous.revision == newest else None
    failing_pod, gate = closed[0] if closed else (None, None)
    failing_reason = (
        (str(gate.get("reason"))[:128] if gate is not None else "NotProbedYet") if closed else None
    )
    message = (str(gate.get("message") or "")[:1024] or None) if gate is not None else None
    state: Literal["Proving", "Proven", "Blocked", "RolledBack"]
    if not closed:
        since = None
        if blocked is not None and newest != blocked:
            state = "RolledBack"
        else:
            state, blocked, blocked_message = "Proven", None, None
        last, last_fingerprint = newest, fingerprint
    else:
        since = since or rfc3339(now, "seconds")
        started = parse_rfc3339(since) or now
        proving_s = (now - started).total_seconds()
        if blocked is not None and newest == blocked:
            state = "Blocked"
        elif blocked is not None and newest == last:
            state = "RolledBack"
        elif newest != last and proving_s > deadline_s:
            state, blocked = "Blocked", newest
            blocked_message = (
                f"pod {failing_pod}: {failing_reason}: {message or ''}".rstrip(": ")
                + f"; Proving for {proving_s:.0f} s (progressDeadlineSeconds {deadline_s:.0f})"
            )[:1024]
        else:
            state = "Proving"
    return RolloutStatus(
        revision=newest[:63],
        state=state,
        since=since,
        passed=len(members) - len(closed),
        total=len(members),
        failing_pod=failing_pod,
        failing_reason=failing_reason,
        message=message,
        last_proven_revision=last,
        blocked_revision=blocked,
        blocked_message=blocked_message,
        fingerprint=fingerprint,
        last_proven_fingerprint=last_fingerprint,
    )


def template_change(previous: RolloutStatus | None, rollout: RolloutStatus) -> str | None:
    """The TemplateChanged Event's message: this cycle took the newest revision's first fingerprint and it
    differs from the last proven revision's. None otherwise (no change, or not new this cycle)."""
    if previous is None or rollout.fingerprint is None or rollout.revision in known_fingerprints(previous):
        return None
    old, old_revision = previous.last_proven_fingerprint, previous.last_proven_revision
    if old is None or old == rollout.fingerprint or old_revision == rollout.revision:
        return None
    return (
        f"revision {rollout.revision} renders spec.probe.messages differently from revision {old_revision}, "
        f"the last proven: {old} → {rollout.fingerprint} (token ids, sha256/count)"
    )


def rollout_condition(
    rollout: RolloutStatus, existing: Sequence[Mapping[str, Any]], generation: int | None, now: datetime
) -> Condition:
    """RolloutBlocked: True while the newest revision is Blocked (reason: why its pod's gate is closed)
    or was rolled back (RolledBack, with why it was blocked); False while it is Proving or Proven."""
    if rollout.state == "Blocked":
        reason = rollout.failing_reason or "ProgressDeadlineExceeded"
        text = f"revision {rollout.revision}: {rollout.blocked_message or ''}"
        return _condition(ROLLOUT_BLOCKED, "True", reason, text, existing, generation, now)
    if rollout.state == "RolledBack":
        text = (
            f"revision {rollout.blocked_revision} was blocked ({rollout.blocked_message or ''}): the engine "
            f"runs revision {rollout.revision} again; spec unchanged: fix it and apply again"
        )
        return _condition(ROLLOUT_BLOCKED, "True", "RolledBack", text, existing, generation, now)
    reason = "RolloutProven" if rollout.state == "Proven" else "RolloutProving"
    text = f"revision {rollout.revision}: {rollout.passed}/{rollout.total} pods passed their readiness gate"
    return _condition(ROLLOUT_BLOCKED, "False", reason, text, existing, generation, now)
