"""Glue of the prober (servedmodel.prober): startup.py calls `start_scheduler(memo)` when this
replica starts leading (the client, the synced cache and the controller are in memo), and
`stop_scheduler(memo)` when it stops leading and in cleanup. The scheduler is one operator-wide task; it
follows the cache's ServedModels itself, so no handler feeds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from servedmodel.prober import ProbeMetrics, ProbeScheduler

from .metrics import REGISTRY
from .startup import operator_config

# Registered at import, so /metrics lists the probe's families from the start.
PROBE_METRICS = ProbeMetrics(REGISTRY)


def _enqueue(memo: Any) -> Any:
    controller = getattr(memo, "controller", None)
    enqueue = getattr(controller, "enqueue", None)
    return enqueue if callable(enqueue) else None


def _reconciler_backlog(memo: Any) -> Callable[[], bool] | None:
    """Whether the reconciler has keys waiting for a worker (the scheduler yields while it has)."""
    controller = getattr(memo, "controller", None)
    if controller is None or not hasattr(controller, "backlog"):
        return None
    return lambda: controller.backlog > 0


async def start_scheduler(memo: Any) -> ProbeScheduler:
    """Make and start the scheduler once (memo.probe_scheduler); idempotent."""
    scheduler = getattr(memo, "probe_scheduler", None)
    if isinstance(scheduler, ProbeScheduler):
        return scheduler
    scheduler = ProbeScheduler(
        kube=memo.client,
        config=operator_config(memo),
        metrics=PROBE_METRICS,
        cache=getattr(memo, "cache", None),
        enqueue=_enqueue(memo),
        yield_to=_reconciler_backlog(memo),
        owns=getattr(getattr(memo, "membership", None), "owns", None),
    )
    memo.probe_scheduler = scheduler
    await scheduler.start()
    return scheduler


async def stop_scheduler(memo: Any) -> None:
    """Stop and drop it: a replica that leads again starts a fresh one (nothing carried over)."""
    scheduler = getattr(memo, "probe_scheduler", None)
    if isinstance(scheduler, ProbeScheduler):
        memo.probe_scheduler = None
        await scheduler.stop()
