"""A multi-node group's workers (spec.workers: a LeaderWorkerSet), as the probe sees them.

The probe's chat goes to the group's leader, the only pod that serves the API; it says whether the group
generates, not which pod holds it when it does not. The kserve/kserve#3845 case: a worker hangs, the
leader still answers /health, generation stops. So each cycle also checks every worker at its own
address, with what a worker can tell on its own:

- its containers are ready (the kubelet's view; a vLLM worker runs headless, with no HTTP of its own, so
  this is all a real vLLM group's worker says);
- where it serves HTTP (the simulator's workers do): GET /health, and its /metrics, whose generation
  counter must move while it has requests running (stall_verdict's rule, over the time since its
  previous check).

A worker whose /health fails or whose containers are not ready holds its group (`WorkerNotServing`); one
whose generation counter stands still with requests running stalls it (EngineStalled, naming the worker).
When the leader's generation stalls and no worker's own signals say which pod holds it, the verdict says
so rather than guessing. `check_worker` does the I/O; the verdicts are pure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import httpx

from . import bounds
from .client import PodMetrics
from .errors import ProbeFailure
from .metrics import MetricsSnapshot

HEALTH_TIMEOUT_S: Final = 5.0
MIN_WORKER_STALL_WINDOW_S: Final = 1.0


@dataclass(frozen=True)
class WorkerCheck:
    """One worker pod's check in one cycle."""

    name: str
    ready: bool  # its containers are ready (the kubelet's readiness of the worker)
    health: int | None = None  # /health's HTTP status; None: not asked (no address) or no answer
    error: str | None = None  # why /health or /metrics did not answer
    metrics: MetricsSnapshot | None = None
    at: float = 0.0  # monotonic seconds of the scrape


@dataclass(frozen=True)
class WorkerWindow:
    """A worker's metrics at its previous check."""

    snapshot: MetricsSnapshot
    at: float


def _gauge(s: MetricsSnapshot, key: str) -> float:
    return float(s.gauges.get(key, 0.0))


def worker_stall(check: WorkerCheck, previous: WorkerWindow | None) -> str | None:
    """`worker pod X: …` when the worker's generation counter stood still, across at least
    MIN_WORKER_STALL_WINDOW_S since its previous check, while it had requests running."""
    after = check.metrics
    if after is None or previous is None:
        return None
    gen, gen0 = after.counters.get("generation_tokens"), previous.snapshot.counters.get("generation_tokens")
    span = check.at - previous.at
    if gen is None or gen0 is None or gen != gen0 or span < MIN_WORKER_STALL_WINDOW_S:
        return None
    running = _gauge(after, "running")
    if running <= 0:
        return None
    return (
        f"worker pod {check.name}: generation counter flat at {gen:.0f} tokens for {span:.1f} s while "
        f"{running:.0f} requests run on it (its /health answers {check.health})"
    )


def worker_failure(check: WorkerCheck) -> str | None:
    """`worker pod X: …` when the worker cannot serve its part of the group, else None."""
    if not check.ready:
        return f"worker pod {check.name}: its containers are not ready"
    if check.health is None and check.error is not None:
        return f"worker pod {check.name}: /health did not answer ({check.error})"
    if check.health is not None and check.health != 200:
        return f"worker pod {check.name}: /health answered {check.health}"
    return None


def group_verdicts(
    checks: Sequence[WorkerCheck], previous: dict[str, WorkerWindow], leader_stalled: str | None
) -> tuple[str | None, str | None]:
    """(the group's EngineStalled message, its WorkerNotServing message) from its workers' checks and
    the leader's own stall verdict; None where there is nothing to say."""
    stalls = [m for c in checks if (m := worker_stall(c, previous.get(c.name))) is not None]
    failures = [m for c in checks if (m := worker_failure(c)) is not None]
    stalled: str | None = None
    if stalls:
        stalled = "; ".join(stalls) + (f"; the leader: {leader_stalled}" if leader_stalled else "")
    elif leader_stalled is not None:
        stalled = leader_stalled
        if checks and not failures:
            stalled += (
                f"; none of the group's {len(checks)} worker(s) says which pod holds it "
                "(each answers /health, none reports its own generation stalled)"
            )
    return stalled, ("; ".join(failures) if failures else None)


async def check_worker(
    http: httpx.AsyncClient, name: str, base_url: str | None, ready: bool, model: str | None
) -> WorkerCheck:
    """GET /health and /metrics of one worker at `base_url` (nothing without one: a headless vLLM
    worker serves no HTTP, only its readiness says anything)."""
    if base_url is None or not ready:
        return WorkerCheck(name, ready, at=time.monotonic())
    try:
        r = await bounds.request(
            http,
            "GET",
            f"{base_url}/health",
            "GET /health",
            cap=4096,
            deadline_s=HEALTH_TIMEOUT_S,
            read_limits=httpx.Timeout(HEALTH_TIMEOUT_S),
        )
    except ProbeFailure as f:
        return WorkerCheck(name, ready, error=f"{f.reason}: {f.message}", at=time.monotonic())
    metrics: MetricsSnapshot | None = None
    error: str | None = None
    try:
        metrics = await PodMetrics(http, [base_url], model).snapshot()
    except ProbeFailure as f:
        error = f"/metrics: {f.reason}: {f.message}"
    return WorkerCheck(name, ready, r.status_code, error, metrics, time.monotonic())
