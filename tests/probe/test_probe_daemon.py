"""The daemon's pure pieces: when it probes, and the one status patch it writes per cycle."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from servedmodel.api.spec import ServedModelSpec
from servedmodel.api.status import ServedModelStatus
from servedmodel.handlers.probe import engine_ready, status_patch
from servedmodel.probe.client import ProbeOutcome
from servedmodel.probe.errors import ENGINE_UNHEALTHY, ProbeFailure

MANAGED = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "resources": {"gpus": 1}}
EXTERNAL = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "endpoint": "http://127.0.0.1:8000"}


@pytest.mark.parametrize(
    ("spec", "status", "ready"),
    [
        (MANAGED, {}, False),
        (MANAGED, {"phase": "Progressing", "readyReplicas": 0}, False),
        (MANAGED, {"phase": "Ready"}, True),
        (MANAGED, {"phase": "Degraded", "readyReplicas": 1}, True),  # degraded by the probe: keep probing
        (EXTERNAL, {}, True),
    ],
)
def test_engine_ready(spec: dict[str, Any], status: dict[str, Any], ready: bool) -> None:
    assert engine_ready(ServedModelSpec.model_validate(spec), status) is ready


def test_patch_holds_only_the_probes_fields() -> None:
    now = datetime(2026, 11, 29, 19, 0, tzinfo=UTC)
    out = ProbeOutcome(endpoint="http://127.0.0.1:1", started=now, ended=now)
    out.failure = ProbeFailure(ENGINE_UNHEALTHY, "GET /health: 503")
    spec = ServedModelSpec.model_validate({**MANAGED, "probe": {"slo": {"ttftMs": 100}}})
    reconciler_conditions = [{"type": "Ready", "status": "True", "reason": "Available", "message": ""}]
    new, patch = status_patch(out, spec.probe, {"phase": "Ready", "conditions": reconciler_conditions}, 4)
    assert set(patch) == {"probe", "conditions"}
    assert [c["type"] for c in patch["conditions"]] == ["Serving", "TemplateOK", "LatencySLOMet"]
    assert patch["conditions"][0]["reason"] == ENGINE_UNHEALTHY
    assert all(c["observedGeneration"] == 4 for c in patch["conditions"])
    assert new.consecutive_failures == 1
    # what the daemon applies validates against the CR's status model (the CRD is generated from it)
    ServedModelStatus.model_validate(patch)
    # a previous status.probe from an older schema is ignored, not fatal
    _, again = status_patch(out, spec.probe, {"probe": {"unknownField": 1}}, 4)
    assert again["probe"]["consecutiveFailures"] == 1


def test_previous_status_falls_back_to_the_daemons_last_write() -> None:
    """The watch may not have delivered the daemon's last write yet: the window still grows."""
    t1 = datetime(2026, 11, 29, 19, 0, tzinfo=UTC)
    t2 = datetime(2026, 11, 29, 19, 1, tzinfo=UTC)
    spec = ServedModelSpec.model_validate(MANAGED)
    fail1 = ProbeOutcome(endpoint="x", started=t1, ended=t1, failure=ProbeFailure(ENGINE_UNHEALTHY, "503"))
    first, _ = status_patch(fail1, spec.probe, {}, 1)
    fail2 = ProbeOutcome(endpoint="x", started=t2, ended=t2, failure=ProbeFailure(ENGINE_UNHEALTHY, "503"))
    stale_body: dict[str, Any] = {}
    second, _ = status_patch(fail2, spec.probe, stale_body, 1, first)
    assert second.consecutive_failures == 2
