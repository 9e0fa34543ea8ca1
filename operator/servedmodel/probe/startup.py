"""Pure: engine pods' startup timelines (status.startup) from the Pod, its Events and the probe's cycles.

A start is one engine pod from its creation to the first token of the probe's first successful streamed
chat on it. Its stages (api/startup.py) come from what says each of them:

- the Pod's conditions' lastTransitionTime: PodScheduled, Initialized, ContainersReady;
- the engine container's state.running.startedAt, and its restarts before the first token;
- the pod's Events, where the cluster recorded them: the engine container's first Pulled;
- the probe: its first GET /health that answered 200, and the first token of its first successful stream
  (both on this pod's engine incarnation; `observe` follows them cycle by cycle).

A pod KEDA created when it woke the model from zero: `wake_activation` finds KEDA's scale from 0 among the
ScaledObject's Events, and the timeline adds `activated` and `wakeSeconds` (activation to first token).

A start is counted once, when its first token comes: a pod the probe first saw already serving (the
status says so: an operator that restarted, another leader) is not a start it saw, and an engine that
restarts after serving is not a cold start from the pod's creation (neither is recorded).
`summarize_starts` keeps the last STARTUP_HISTORY starts and their p50/p95 in status.startup; the prober's
cycle feeds these, and probe/compose.py puts the result in the probe's status patch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from servedmodel.api.conditions import find
from servedmodel.api.names import ENGINE_CONTAINER
from servedmodel.api.startup import (
    STARTUP_HISTORY,
    STARTUP_STAGES,
    StartupStages,
    StartupStatus,
    StartupTimeline,
)

from .client import ProbeOutcome
from .report import parse_rfc3339
from .sse import percentile

TOTAL: Final = "total"
WAKE: Final = "wake"
# KEDA's Event when it scales a target from 0 (keda pkg/scaling/executor/scale_scaledobjects.go):
# "Scaled apps/v1.Deployment <ns>/<name> from 0 to 1, triggered by <trigger>".
KEDA_ACTIVATED: Final = "KEDAScaleTargetActivated"
_FROM_ZERO = re.compile(r"\bfrom 0 to [1-9]")
# A wake's pod is created by the Deployment controller within seconds of KEDA's scale; an activation older
# than this is another wake's (a pod created later, e.g. after a crash at 1 replica, is not a wake).
WAKE_WINDOW_S: Final = 120.0
# The API server stamps the Event after KEDA's scale call returned, so the ReplicaSet's pod can be created
# a little before the Event's own time.
WAKE_SLACK_S: Final = 5.0


def stage_field(stage: str) -> str:
    """A stage's attribute on StartupStages: imagePulled -> image_pulled_seconds."""
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), stage) + "_seconds"


@dataclasses.dataclass(frozen=True)
class StartTrack:
    """What the probe has seen of one pod's start so far, on one engine incarnation."""

    incarnation: str
    done: bool = False  # counted, or not a start the probe saw from its beginning
    healthy_at: datetime | None = None
    first_token_at: datetime | None = None


def observe(
    track: StartTrack | None, incarnation: str, out: ProbeOutcome, served_before: bool
) -> tuple[StartTrack, bool]:
    """The pod's track after this cycle's outcome on it, and whether its start ended in this cycle (its
    first real token). `served_before`: the status already says the pod serves (checked at first sight)."""
    if track is None:
        track = StartTrack(incarnation, done=served_before)
    elif track.incarnation != incarnation:
        # Another engine process in the same pod: before the first token the start goes on (with the new
        # process's /health), after it a restart is not a start from the pod's creation.
        track = StartTrack(incarnation, done=track.done)
    if track.done:
        return track, False
    if track.healthy_at is None and out.healthy_at is not None:
        track = dataclasses.replace(track, healthy_at=out.healthy_at)
    if out.ok and out.first_token_at is not None:
        return dataclasses.replace(track, done=True, first_token_at=out.first_token_at), True
    return track, False


def _condition_time(status: Mapping[str, Any], type_: str) -> datetime | None:
    c = find(status.get("conditions"), type_)
    return parse_rfc3339(c.get("lastTransitionTime")) if c is not None and c.get("status") == "True" else None


def _engine_status(status: Mapping[str, Any]) -> Mapping[str, Any]:
    statuses = [c for c in status.get("containerStatuses") or [] if isinstance(c, Mapping)]
    return next((c for c in statuses if c.get("name") == ENGINE_CONTAINER), statuses[0] if statuses else {})


def _pulled_at(events: Sequence[Mapping[str, Any]], container: str) -> datetime | None:
    """The first Pulled Event of the engine container (its image pulled, or already present)."""
    times = []
    for e in events:
        involved = e.get("involvedObject") or {}
        if e.get("reason") != "Pulled" or involved.get("fieldPath") not in (
            None,
            f"spec.containers{{{container}}}",
        ):
            continue
        when = _event_time(e)
        if when is not None:
            times.append(when)
    return min(times, default=None)


def _event_time(e: Mapping[str, Any]) -> datetime | None:
    return (
        parse_rfc3339(e.get("eventTime"))
        or parse_rfc3339(e.get("firstTimestamp"))
        or parse_rfc3339(e.get("lastTimestamp"))
    )


def wake_activation(scaled_object_events: Sequence[Mapping[str, Any]], created: datetime) -> datetime | None:
    """When KEDA scaled the model from 0 to make the pod created at `created`: the latest
    KEDAScaleTargetActivated "from 0 to N" Event at most WAKE_WINDOW_S before the pod (None: not a wake)."""
    best: datetime | None = None
    for e in scaled_object_events:
        if e.get("reason") != KEDA_ACTIVATED or not _FROM_ZERO.search(
            str(e.get("message") or e.get("note") or "")
        ):
            continue
        when = _event_time(e)
        if when is None:
            continue
        ahead = (created - when).total_seconds()
        if -WAKE_SLACK_S <= ahead <= WAKE_WINDOW_S and (best is None or when > best):
            best = when
    return best


def timeline(
    pod: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    healthy_at: datetime | None,
    first_token_at: datetime,
    activated_at: datetime | None = None,
) -> StartupTimeline | None:
    """One pod's start, each stage in seconds from its creation (None: the pod has no creationTimestamp).
    A stage nothing said is left out; none is negative (the probe's clock against the API server's).
    `activated_at`: KEDA's scale from 0 that created the pod (wake_activation), for wakeSeconds."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    created = parse_rfc3339(meta.get("creationTimestamp"))
    if created is None:
        return None

    def since(t: datetime | None) -> float | None:
        return None if t is None else round(max(0.0, (t - created).total_seconds()), 3)

    engine = _engine_status(status)
    running = (engine.get("state") or {}).get("running") or {}
    container = str(engine.get("name") or ENGINE_CONTAINER)
    first_token = since(first_token_at)
    return StartupTimeline(
        pod=str(meta.get("name") or ""),
        created=str(meta["creationTimestamp"]),
        restarts=max(0, int(engine.get("restartCount") or 0)),
        scheduled_seconds=since(_condition_time(status, "PodScheduled")),
        initialized_seconds=since(_condition_time(status, "Initialized")),
        image_pulled_seconds=since(_pulled_at(events, container)),
        container_started_seconds=since(parse_rfc3339(running.get("startedAt"))),
        containers_ready_seconds=since(_condition_time(status, "ContainersReady")),
        engine_healthy_seconds=since(healthy_at),
        first_token_seconds=first_token,
        total_seconds=first_token,
        activated=None
        if activated_at is None
        else activated_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        wake_seconds=(
            None
            if activated_at is None
            else round(max(0.0, (first_token_at - activated_at).total_seconds()), 3)
        ),
    )


def stage_seconds(t: StartupStages) -> list[tuple[str, float]]:
    """How long each known stage took (from the stage before it that is known, or from creation), in
    STARTUP_STAGES order. A stage said later than one after it takes 0 s and none runs past the total,
    so they add up to totalSeconds exactly: where the time went."""
    total = t.total_seconds
    out: list[tuple[str, float]] = []
    at = 0.0
    for stage in STARTUP_STAGES:
        moment = getattr(t, stage_field(stage))
        if moment is None:
            continue
        moment = max(at, moment if total is None else min(moment, total))
        out.append((stage, round(moment - at, 3)))
        at = moment
    return out


def _quantile(recent: Sequence[StartupTimeline], q: float) -> StartupStages:
    fields: dict[str, float | None] = {}
    for name in [*(stage_field(s) for s in STARTUP_STAGES), stage_field(TOTAL), stage_field(WAKE)]:
        values = [v for t in recent if (v := getattr(t, name)) is not None]
        p = percentile(values, q)
        fields[name] = None if p is None else round(p, 3)
    return StartupStages(**fields)


def summarize_starts(
    previous: StartupStatus | None, new: Sequence[StartupTimeline]
) -> tuple[StartupStatus | None, list[StartupTimeline]]:
    """status.startup with this cycle's starts (None while there has been none), and the starts it added:
    the last one, the recent STARTUP_HISTORY (a start already there, by pod and creation, is not added
    twice) and their p50/p95."""
    recent = list(previous.recent) if previous is not None else []
    seen = {(t.pod, t.created) for t in recent}
    added = [t for t in new if (t.pod, t.created) not in seen]
    if not added:
        return previous, []
    recent = [*recent, *added][-STARTUP_HISTORY:]
    status = StartupStatus(
        last=added[-1],
        starts=len(recent),
        p50=_quantile(recent, 50),
        p95=_quantile(recent, 95),
        recent=recent,
    )
    return status, added
