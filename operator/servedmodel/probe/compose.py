"""Pure: the probe's whole share of a ServedModel's status after one cycle, composed in one place.

One call (`compose`) turns what a cycle found into everything the probe writes:

- status.probe (report.build_status over the window; with pods, replicas.summarize's "k/n");
- its conditions: Serving, TemplateOK, LatencySLOMet (report.probe_conditions), and with pods
  EngineStalled, KVCachePressure, ProbeUnreliable (replicas.replica_conditions);
- status.startup: the starts whose first token came in this cycle (probe/startup.py), added to the
  recent ones with their p50/p95;
- with the readiness gate, each probed pod's gate condition (replicas.gate_condition, the latency guard's
  hold included), then status.rollout and RolloutBlocked from the pods as those gates leave them, and the
  TemplateChanged message when this cycle's fingerprint says the template changed.

Server-side apply deletes what a writer leaves out, so every field the probe owns is in every patch: a
cycle that does not compute status.rollout (no revision on the pods, the gate off) keeps it as it was.
The prober's cycle (prober/cycle.py) does the I/O: it writes the gates, the patch and the Events this returns.
The at-zero set (nothing probed: the autoscaler scaled the engine to zero) is scaling.py's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from servedmodel.api.adapters import AdapterProbe
from servedmodel.api.base import Obj
from servedmodel.api.conditions import ROLLOUT_BLOCKED
from servedmodel.api.conditions import find as find_condition
from servedmodel.api.probe import READINESS_GATE_CONDITION, ProbeSpec, ProbeStatus, RolloutStatus
from servedmodel.api.spec import ServedModelSpec
from servedmodel.api.startup import StartupStatus, StartupTimeline

from .client import ProbeOutcome
from .replicas import (
    PodResult,
    gate_condition,
    latency_regression,
    merge_pods,
    pod_revision,
    replica_conditions,
    rollout_condition,
    rollout_status,
    summarize,
    template_change,
)
from .report import build_status, probe_conditions
from .startup import summarize_starts


@dataclass(frozen=True)
class Pods:
    """A managed cycle's pods: the ones probed, the ones that could be, how many exist, all by name."""

    probed: Sequence[PodResult]
    eligible: Sequence[str]
    replicas: int
    by_name: Mapping[str, Obj]
    rolled_back_from: str | None = None  # the engine Deployment's rolled-back-from annotation


@dataclass(frozen=True)
class AdapterShare:
    """spec.adapters' share, composed by prober/adapters.py: status.probe.adapters, adaptersServing and
    the AdaptersServing condition."""

    entries: list[AdapterProbe]
    serving: str
    condition: dict[str, Any]


@dataclass(frozen=True)
class Cycle:
    """What one cycle found, and what it continues from."""

    outcome: ProbeOutcome
    spec: ServedModelSpec
    status: Mapping[str, Any]  # the ServedModel's status as read
    generation: int | None
    now: datetime
    last_patch: Mapping[str, Any] | None = None  # this scheduler's last patch (status.probe as it wrote it)
    pods: Pods | None = None  # None: external mode (one endpoint, no pods)
    adapters: AdapterShare | None = None  # None: no spec.adapters
    metrics_compatible: dict[str, Any] | None = None  # the MetricsCompatible condition (probe/compat.py)
    startups: Sequence[StartupTimeline] = ()  # pods whose start ended in this cycle (probe/startup.py)
    # status.probe to continue from, where the caller parsed it already (previous_probe_status of the same
    # status and last_patch); None: parsed here. One parse less a cycle: ~2 % of the operator's CPU
    # probing 1,000 ServedModels.
    previous: ProbeStatus | None = None


@dataclass
class Composed:
    status: ProbeStatus
    patch: dict[str, Any]  # status.probe, conditions (and status.rollout): one server-side apply
    gates: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod -> its gate condition to write
    template_changed: str | None = None  # the TemplateChanged Event's message
    started: list[StartupTimeline] = field(default_factory=list)  # starts new to status.startup


def previous_probe_status(
    body_status: Mapping[str, Any], last_patch: Mapping[str, Any] | None
) -> ProbeStatus | None:
    """The status.probe to continue from: the object's, or what this scheduler wrote last (its last
    patch's) when the watch has not delivered that write yet (the newer lastProbeTime wins).

    Parsed here, at each use: the scheduler keeps what it wrote once, as the patch's dicts (a parsed
    ProbeStatus kept beside them was ~12 KB per ServedModel)."""
    read, written = body_status.get("probe"), (last_patch or {}).get("probe")
    if _probe_time(read) < _probe_time(written):
        read = None  # ours is newer (no lastProbeTime: "", older than any)
    previous = _parsed_probe(read)
    return previous if previous is not None else _parsed_probe(written)


def _probe_time(probe: Any) -> str:
    return str(probe.get("lastProbeTime") or "") if isinstance(probe, Mapping) else ""


def _parsed_probe(probe: Any) -> ProbeStatus | None:
    if not isinstance(probe, Mapping):
        return None
    try:
        return ProbeStatus.model_validate(probe)
    except ValidationError:
        return None  # an older schema: start the window afresh


def _last_written(status: Mapping[str, Any], last_patch: Mapping[str, Any] | None, field_: str) -> Any:
    """status.<field_> as this scheduler last wrote it (newer than the cache's copy may be), else as read."""
    if last_patch is not None and isinstance(last_patch.get(field_), dict):
        return last_patch[field_]
    return status.get(field_)


def previous_rollout(status: Mapping[str, Any], last_patch: Mapping[str, Any] | None) -> RolloutStatus | None:
    previous = _last_written(status, last_patch, "rollout")
    return RolloutStatus.model_validate(previous) if isinstance(previous, dict) else None


def previous_startup(status: Mapping[str, Any], last_patch: Mapping[str, Any] | None) -> StartupStatus | None:
    previous = _last_written(status, last_patch, "startup")
    if not isinstance(previous, dict):
        return None
    try:
        return StartupStatus.model_validate(previous)
    except ValidationError:
        return None  # an older schema: start afresh


def status_patch(
    out: ProbeOutcome,
    probe: ProbeSpec,
    body_status: Mapping[str, Any],
    generation: int | None,
    last_patch: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> tuple[ProbeStatus, dict[str, Any]]:
    """External mode's share of the status: status.probe and its conditions (`last_patch`: this
    scheduler's last write, see previous_probe_status)."""
    previous = previous_probe_status(body_status, last_patch)
    new = build_status(out, probe, previous)
    return new, _patch(new, probe, body_status, generation, now or out.ended or out.started)


def compose(c: Cycle) -> Composed:
    """Everything the probe writes after this cycle (see the module docstring)."""
    if c.pods is None:
        new, patch = status_patch(c.outcome, c.spec.probe, c.status, c.generation, c.last_patch, c.now)
        keep_startup(c.status, c.last_patch, patch)
        return Composed(new, patch)
    previous = c.previous if c.previous is not None else previous_probe_status(c.status, c.last_patch)
    old_pods = list(previous.pods or []) if previous is not None else []
    pods = merge_pods(old_pods, list(c.pods.probed), list(c.pods.eligible))
    new = summarize(build_status(c.outcome, c.spec.probe, previous), pods, c.pods.replicas)
    if c.adapters is not None:
        new.adapters, new.adapters_serving = c.adapters.entries, c.adapters.serving
    patch = _patch(new, c.spec.probe, c.status, c.generation, c.now)
    if c.adapters is not None:
        patch["conditions"].append(c.adapters.condition)
    if c.metrics_compatible is not None:
        patch["conditions"].append(c.metrics_compatible)
    patch["conditions"] += [
        cond.model_dump(by_alias=True, exclude_none=True)
        for cond in replica_conditions(c.pods.probed, c.status.get("conditions") or [], c.generation, c.now)
    ]
    composed = Composed(new, patch)
    if c.spec.probe.readiness_gate and c.pods.probed:
        rollout = previous_rollout(c.status, c.last_patch)
        composed.gates = _gates(c, new, rollout)
        _rollout(c, composed, rollout)
    if "rollout" not in patch:
        keep_rollout(c.status, c.last_patch, patch)
    startup, composed.started = summarize_starts(previous_startup(c.status, c.last_patch), c.startups)
    if startup is not None:
        patch["startup"] = startup.model_dump(by_alias=True, exclude_none=True)
    return composed


def keep_startup(
    status: Mapping[str, Any], last_patch: Mapping[str, Any] | None, patch: dict[str, Any]
) -> None:
    """status.startup as this scheduler last wrote it (else as read), into a write that adds no start:
    server-side apply drops what we omit, and the cache's copy may be a write behind."""
    kept = _last_written(status, last_patch, "startup")
    if isinstance(kept, dict):
        patch["startup"] = kept


def keep_rollout(
    status: Mapping[str, Any], last_patch: Mapping[str, Any] | None, patch: dict[str, Any]
) -> None:
    """status.rollout and RolloutBlocked as this scheduler last wrote them (else as read), into a write
    that does not compute them."""
    kept = _last_written(status, last_patch, "rollout")
    if isinstance(kept, dict):
        patch["rollout"] = kept
    conditions = last_patch.get("conditions") if last_patch is not None else status.get("conditions")
    blocked = find_condition(conditions, ROLLOUT_BLOCKED)
    if blocked is not None and find_condition(patch.get("conditions"), ROLLOUT_BLOCKED) is None:
        patch["conditions"] = [*patch.get("conditions", []), dict(blocked)]


def _patch(
    new: ProbeStatus, probe: ProbeSpec, body_status: Mapping[str, Any], generation: int | None, now: datetime
) -> dict[str, Any]:
    conds = probe_conditions(new, probe, body_status.get("conditions") or [], generation, now)
    return {
        "probe": new.model_dump(by_alias=True, exclude_none=True),
        "conditions": [cond.model_dump(by_alias=True, exclude_none=True) for cond in conds],
    }


def _gates(c: Cycle, new: ProbeStatus, rollout: RolloutStatus | None) -> dict[str, dict[str, Any]]:
    """Each probed pod's gate condition to write (none where what it has is right), with the spec's
    thresholds over the counts in `new`'s pods and the latency guard's holds."""
    assert c.pods is not None
    entries = {p.name: p for p in new.pods or []}
    held = _latency_held(c, rollout)
    gates: dict[str, dict[str, Any]] = {}
    for r in c.pods.probed:
        pod, entry = c.pods.by_name.get(r.name), entries.get(r.name)
        if pod is None or entry is None:
            continue
        # A multi-node group's pods (its leader, then its workers) share the leader's verdict: the
        # group serves whole or not at all.
        for name in (r.name, *r.workers):
            member = c.pods.by_name.get(name)
            if member is None:
                continue
            cond = gate_condition(
                r,
                entry,
                member,
                c.now,
                failure_threshold=c.spec.probe.failure_threshold,
                success_threshold=c.spec.probe.success_threshold,
                held=held.get(r.name),
            )
            if cond is not None:
                gates[name] = cond
    return gates


def _latency_held(c: Cycle, rollout: RolloutStatus | None) -> dict[str, tuple[str, str]]:
    """Pod name -> why its closed gate stays closed (reason, message): a pod of a revision other than the
    last proven one, slower than that revision's serving pods probed in this cycle, or not comparable with
    them this cycle (replicas.latency_regression)."""
    assert c.pods is not None
    proven = rollout.last_proven_revision if rollout is not None else None
    if proven is None:
        return {}
    revision = {r.name: pod_revision(c.pods.by_name.get(r.name)) for r in c.pods.probed}
    baseline = [r for r in c.pods.probed if r.serving and revision[r.name] == proven]
    held: dict[str, tuple[str, str]] = {}
    for r in c.pods.probed:
        if r.serving and revision[r.name] not in (None, proven):
            why = latency_regression(r, baseline, c.spec.rollout.max_latency_regression)
            if why is not None:
                held[r.name] = why
    return held


def with_gate(pod: Obj, cond: Mapping[str, Any]) -> Obj:
    """The pod as it is once its gate condition is written (a copy; the pod itself is not touched)."""
    status = dict(pod.get("status") or {})
    others = [x for x in status.get("conditions") or [] if x.get("type") != READINESS_GATE_CONDITION]
    return {**pod, "status": {**status, "conditions": [*others, dict(cond)]}}


def _rollout(c: Cycle, composed: Composed, previous: RolloutStatus | None) -> None:
    """status.rollout and RolloutBlocked into the patch, from the pods as this cycle's gates leave them."""
    assert c.pods is not None
    pods = {
        n: with_gate(p, composed.gates[n]) if n in composed.gates else p for n, p in c.pods.by_name.items()
    }
    fingerprints = {
        revision: r.outcome.template_fingerprint
        for r in c.pods.probed
        if r.outcome.template_fingerprint and (revision := pod_revision(c.pods.by_name.get(r.name)))
    }
    rollout = rollout_status(
        pods,
        previous,
        c.now,
        c.spec.rollout.progress_deadline_seconds,
        c.pods.rolled_back_from,
        fingerprints,
    )
    if rollout is None:
        return
    patch = composed.patch
    patch["rollout"] = rollout.model_dump(by_alias=True, exclude_none=True)
    cond = rollout_condition(rollout, c.status.get("conditions") or [], c.generation, c.now)
    patch["conditions"] = [
        *(x for x in patch["conditions"] if x.get("type") != ROLLOUT_BLOCKED),
        cond.model_dump(by_alias=True, exclude_none=True),
    ]
    composed.template_changed = template_change(previous, rollout)
