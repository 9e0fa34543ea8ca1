"""Probe sharding (SERVEDMODEL_PROBE_SHARDING, k8s/members.py): two operator processes on one namespace
each probe a share of the ServedModels — disjoint, together all of them — and when one is SIGKILLed the
other takes its share within one lease duration (+10 s). Counted from the operators' own
`servedmodel_probe_scheduled_models`, not timed."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from cluster_support import metric_sum, wait_for

import controlplane
import faults
from servedmodel.config import OperatorConfig

pytestmark = pytest.mark.cluster

N = 16  # with two replicas, the chance that one owns all of them is 2 / 2**16


def test_two_replicas_probe_disjoint_shares_and_take_over(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Callable[..., Any]
) -> None:
    env = {**faults.ENV, "SERVEDMODEL_PROBE_SHARDING": "true"}
    a = start_operator(namespaces=[namespace], env=env)
    b = start_operator(namespaces=[namespace], env=env)
    faults.create(control_plane, namespace, [f"m{i:02d}" for i in range(N)], probe=True)

    def shares() -> tuple[int, int] | None:
        got = (
            int(metric_sum(a, "servedmodel_probe_scheduled_models")),
            int(metric_sum(b, "servedmodel_probe_scheduled_models")),
        )
        return got if sum(got) == N and min(got) > 0 else None

    split = wait_for(
        "both replicas probing a share", shares, timeout=90, detail=lambda: a.log(30) + b.log(30)
    )
    time.sleep(5.0)  # steady: still disjoint (the sum stays N, no model on both)
    assert shares() is not None, (split, shares())

    a.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_for(
        "the survivor probing all of them",
        lambda: metric_sum(b, "servedmodel_probe_scheduled_models") == N,
        timeout=OperatorConfig().lease_duration + 10.0,
        detail=lambda: b.log(30),
    )
    assert time.monotonic() - killed <= OperatorConfig().lease_duration + 10.0
