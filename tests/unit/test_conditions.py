"""api/conditions.py: the one condition helper both status writers use (the reconciler and the probe)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from servedmodel.api import conditions
from servedmodel.api.probe import ProbeSpec, ProbeStatus
from servedmodel.probe.report import probe_conditions
from servedmodel.status import Managed, Observed, Subject, compute_status

T0 = "2026-11-29T18:00:00Z"
T1 = "2026-11-29T18:05:00Z"
READY_TRUE = {
    "type": "Ready",
    "status": "True",
    "reason": "MinimumReplicasAvailable",
    "lastTransitionTime": T0,
}


@pytest.mark.parametrize(
    ("items", "found"),
    [
        ([READY_TRUE], READY_TRUE),
        ([{"type": "Progressing"}, READY_TRUE], READY_TRUE),
        ([], None),
        (None, None),
        ("Ready", None),  # a hand-edited object: not a list
        ([None, 3, "Ready", READY_TRUE], READY_TRUE),  # entries that are not mappings are skipped
    ],
    ids=["only", "second", "empty", "none", "not-a-list", "junk-entries"],
)
def test_find(items: Any, found: dict[str, Any] | None) -> None:
    assert conditions.find(items, "Ready") == found


@pytest.mark.parametrize(
    ("previous", "status", "reason", "time"),
    [
        (None, "True", "MinimumReplicasAvailable", T1),  # new condition: now
        ([READY_TRUE], "True", "MinimumReplicasAvailable", T0),  # unchanged: kept
        ([READY_TRUE], "True", "SomethingElse", T0),  # only the reason changed: not a transition
        ([READY_TRUE], "False", "MinimumReplicasUnavailable", T1),  # status changed: now
        (
            [{**READY_TRUE, "lastTransitionTime": None}],
            "True",
            "MinimumReplicasAvailable",
            T1,
        ),  # no time held
    ],
    ids=["new", "unchanged", "reason-only", "flipped", "no-time-held"],
)
def test_transition_keeps_time_only_while_status_holds(
    previous: list[dict[str, Any]] | None, status: Any, reason: str, time: str
) -> None:
    got = conditions.transition(previous, "Ready", status, reason, "msg", generation=4, now=T1)
    assert got == {
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": "msg",
        "observedGeneration": 4,
        "lastTransitionTime": time,
    }


def test_each_writer_owns_its_own_condition_types() -> None:
    assert not set(conditions.RECONCILER_CONDITIONS) & set(conditions.PROBE_CONDITIONS)


def test_both_writers_write_the_same_shape() -> None:
    """The reconciler's and the probe's conditions come out of the same helper: same keys, same time
    format, lastTransitionTime kept from the shared condition list when the status holds."""
    deployment = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": 1,
            "availableReplicas": 1,
            "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}],
        },
    }
    ours = compute_status(Subject("q", "ml", 2, None, T0), Managed(Observed(deployment), "q"))["conditions"]
    serving_earlier = {"type": "Serving", "status": "True", "reason": "ChatCompletionSucceeded"}
    shared = [*ours, {**serving_earlier, "lastTransitionTime": T0}]
    probe = ProbeStatus(result="Success", reason="Serving", message="ok")
    later = datetime(2026, 11, 29, 18, 5, tzinfo=UTC)
    theirs = [
        c.model_dump(by_alias=True, exclude_none=True)
        for c in probe_conditions(probe, ProbeSpec(), shared, 2, later)
    ]
    keys = {"type", "status", "reason", "message", "observedGeneration", "lastTransitionTime"}
    assert all(c.keys() == keys for c in [*ours, *theirs])
    by_type = {c["type"]: c for c in theirs}
    assert by_type["Serving"]["lastTransitionTime"] == T0  # still True: kept
    assert by_type["TemplateOK"]["lastTransitionTime"] == T1  # new: the probe's now, same format


def test_every_message_is_clipped_in_one_place() -> None:
    """An engine's 64 KiB error body becomes a condition a person can read: transition clips it, and
    status.probe's messages use the same clip (no writer cuts messages its own way)."""
    long = "x" * 65536
    cond = conditions.transition([], "Serving", "False", "EngineError", long, generation=1, now=T0)
    assert len(cond["message"]) == conditions.MESSAGE_MAX
    assert conditions.clip(long) == cond["message"]
    assert conditions.clip("short") == "short"
