"""kopf glue of the probe scheduler (servedmodel.probing): start it, feed it ServedModels, stop it.

The scheduler is one operator-wide task, not a per-object kopf daemon, so kopf holds no finalizer for
it. Hook for the startup handler: `start_scheduler(memo)` after the Kubernetes client (and the cache,
the controller) are in memo; `stop_scheduler(memo)` in cleanup. Until the controller's startup calls
them, this module's own startup/cleanup handlers do (registered after startup.py's: it is imported
first).
"""

from __future__ import annotations

from typing import Any

import kopf

from servedmodel.api.base import API_GROUP, API_VERSION, PLURAL
from servedmodel.probing import ProbeMetrics, ProbeScheduler

from .metrics import REGISTRY
from .startup import operator_config

# Registered at import, so /metrics lists the probe's families from the start.
PROBE_METRICS = ProbeMetrics(REGISTRY)


def _enqueue(memo: Any) -> Any:
    controller = getattr(memo, "controller", None)
    enqueue = getattr(controller, "enqueue", None)
    return enqueue if callable(enqueue) else None


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
    )
    memo.probe_scheduler = scheduler
    await scheduler.start()
    return scheduler


async def stop_scheduler(memo: Any) -> None:
    scheduler = getattr(memo, "probe_scheduler", None)
    if isinstance(scheduler, ProbeScheduler):
        await scheduler.stop()


@kopf.on.startup()
async def probe_startup(memo: kopf.Memo, **_: Any) -> None:
    await start_scheduler(memo)


@kopf.on.cleanup()
async def probe_cleanup(memo: kopf.Memo, **_: Any) -> None:
    await stop_scheduler(memo)


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def servedmodel_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Every ServedModel the operator watches is tracked; a deleted (or deleting) one is forgotten."""
    scheduler = getattr(memo, "probe_scheduler", None)
    if not isinstance(scheduler, ProbeScheduler):
        return
    meta = body.get("metadata") or {}
    if type == "DELETED":
        scheduler.forget(str(meta.get("namespace") or "default"), str(meta.get("name")))
    else:
        scheduler.track(dict(body))
