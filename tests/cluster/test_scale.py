"""A few hundred ServedModels at once through the control loop: all become Ready, and once they are,
the operator's own API traffic stays flat (counted from its request counter, never timed).

Kept short for CI (SCALE_N ServedModels, simulator engine with no GPU, probing off so the only writer
would be the reconciler). bench/operator_scale.py measures the same at 100 / 1,000 / 3,000.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cluster_support import metric_sum

import controlplane

# The `operator` fixture's OperatorProcess (tests/cluster/conftest.py; conftests are not importable).
OperatorProcess = Any

# No bound on how long SCALE_N take on shared cores: the wait fails when they stop becoming Ready
# (STALL_S), and pytest's own limit is raised to match.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

SCALE_N = int(os.environ.get("SERVEDMODEL_SCALE_N", "200"))
IDLE_S = 15.0  # an idle window to count requests in, not a bound on anything
# No ServedModel became Ready for this long: the loop is stuck, not slow (docs/benchmarks.md: 1,000 all
# Ready in 137 s on 2 cores, several a second).
STALL_S = 120.0


def body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": name},
        "spec": {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "engine": {"kind": "simulator"},
            "resources": {"gpus": 0},
            "probe": {"enabled": False},
        },
    }


def phases(cp: controlplane.ControlPlane, namespace: str) -> dict[str, str]:
    out = cp.kubectl("get", "sm", "-n", namespace, "-o", "json", timeout=120).stdout
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase", "") for i in json.loads(out)["items"]}


def wait_while_progressing(
    cp: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> list[int]:
    """Poll until all SCALE_N are Ready; fail when the Ready count has not grown for STALL_S. Returns the
    Ready counts seen, in order (for a failure's message)."""
    counts: list[int] = []
    grew_at = time.monotonic()
    while True:
        seen = phases(cp, namespace)
        ready = sum(p == "Ready" for p in seen.values())
        if counts and ready > max(counts):
            grew_at = time.monotonic()
        counts.append(ready)
        if len(seen) == SCALE_N and ready == SCALE_N:
            return counts
        if time.monotonic() - grew_at > STALL_S:
            pytest.fail(
                f"{ready} of {SCALE_N} ServedModels Ready and none more for {STALL_S:.0f} s "
                f"(counts seen: {counts[-10:]}):\n{operator.log(40)}"
            )
        time.sleep(2.0)


def test_hundreds_become_ready_and_idle_traffic_stays_flat(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    path = f"/apis/inference.servedmodel.io/v1alpha1/namespaces/{namespace}/servedmodels"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: cp.request("POST", path, body(f"m{i:03d}")), range(SCALE_N)))

    wait_while_progressing(cp, namespace, operator)
    busy_requests = metric_sum(operator, "servedmodel_kube_api_requests")
    busy_writes = metric_sum(operator, "servedmodel_status_writes_total")
    applied = metric_sum(operator, "servedmodel_reconcile_total", result="applied")
    # Every child applied about once per ServedModel: the loop does not re-apply on child events.
    assert applied <= SCALE_N * 1.2, applied

    # Let the last events drain, then count an idle window: no reconciler writes, and the operator's
    # requests do not grow with the number of ServedModels.
    time.sleep(3.0)

    def requests() -> float:
        # The Lease's renewals are a fixed cost (a GET and a PUT every 2 s), whatever the fleet.
        return metric_sum(operator, "servedmodel_kube_api_requests") - metric_sum(
            operator, "servedmodel_leader_election_requests_total"
        )

    def leases_lag_ticks() -> float:  # the Leases' own loop is watched, always (handlers/startup.py)
        return metric_sum(operator, "servedmodel_event_loop_lag_seconds_count", loop="leases")

    before, ticks = requests(), leases_lag_ticks()
    writes = metric_sum(operator, "servedmodel_status_writes_total")
    time.sleep(IDLE_S)
    idle_requests = requests() - before
    assert leases_lag_ticks() > ticks
    assert metric_sum(operator, "servedmodel_status_writes_total") == writes
    assert idle_requests <= 5, f"{idle_requests} API requests while idle with {SCALE_N} ServedModels"
    assert busy_requests < SCALE_N * 8, f"{busy_requests} requests for {SCALE_N} ServedModels"
    assert busy_writes >= SCALE_N  # each wrote its status at least once (Pending → Ready)

    # No finalizer: deleting them all does not wait on the operator.
    cp.kubectl("delete", "sm", "--all", "-n", namespace, "--wait=true", "--timeout=120s", timeout=180)
    assert phases(cp, namespace) == {}
    assert operator.alive()
