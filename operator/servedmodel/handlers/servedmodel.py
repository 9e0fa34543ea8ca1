"""kopf event handlers that feed the watch-fed cache and enqueue the owning ServedModel, and the
reconcile entry point the controller's workers call (`reconcile_key`).

One watch per kind (ServedModels; and the operator's children — Deployments, Pods, Services, PVCs,
HPAs — filtered server-side by ``app.kubernetes.io/managed-by=servedmodel-operator``, see
startup.py). A handler only updates the cache and calls ``controller.enqueue(namespace, name)``: no
on.create/update/resume, no timers, no daemons, so kopf holds no finalizer and writes no annotations.
The work queue de-duplicates, so a burst of Pod events during a rollout is one reconcile.

A ServedModel event enqueues it when something the reconciler reads changed (generation, labels,
annotations, deletion, finalizers, the reconciler's own status fields, the probe's Serving condition):
the probe's other status writes (latencies every cycle) do not cause reconciles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

import kopf

from servedmodel.api import API_GROUP, API_GROUP_VERSION, API_VERSION, PLURAL, conditions, names
from servedmodel.controller import Controller, Result
from servedmodel.k8s import ApiError, Cache, KubeClient, NotFoundError
from servedmodel.reconcile import LEGACY_ANNOTATION_PREFIX, LEGACY_FINALIZER, reconcile
from servedmodel.status import RECONCILER_FIELDS, Transition

from .metrics import RECONCILE_DURATION, RECONCILE_TOTAL, STATUS_WRITES_TOTAL
from .startup import operator_config

log = logging.getLogger("servedmodel.reconcile")

MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
SERVED_MODEL: Final = "ServedModel"


class ApplyFailedError(Exception):
    """A child apply was refused: the status says so (Degraded/ApplyFailed); the controller backs off."""


def _memo_parts(memo: Any) -> tuple[KubeClient, Cache, Controller]:
    return memo.client, memo.cache, memo.controller


def _key(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta.get("name"))


def _raw(event: Any, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object as the API server sent it (plain dicts), not kopf's views over it."""
    raw = event.get("object") if isinstance(event, Mapping) else None
    return raw if isinstance(raw, Mapping) else body


def _inputs(obj: Mapping[str, Any] | None) -> Any:
    """What a reconcile of this ServedModel depends on, besides its children."""
    if obj is None:
        return None
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    serving = conditions.find(status.get("conditions"), conditions.SERVING) or {}
    return (
        meta.get("generation"),
        meta.get("labels"),
        meta.get("annotations"),
        meta.get("deletionTimestamp"),
        meta.get("finalizers"),
        {k: status.get(k) for k in RECONCILER_FIELDS},
        [c for c in status.get("conditions") or [] if c.get("type") in conditions.RECONCILER_CONDITIONS],
        (serving.get("status"), serving.get("reason"), serving.get("message")),
    )


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def servedmodel_event(
    type: str | None, event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Cache the ServedModel; enqueue it when something the reconciler reads changed."""
    _client, cache, controller = _memo_parts(memo)
    key = _key(body)
    old = cache.get(SERVED_MODEL, *key)
    before = _inputs(old)
    cache.apply_event(SERVED_MODEL, type, _raw(event, body))
    if type == "DELETED":
        controller.forget(*key)
        return
    if old is None or before != _inputs(cache.get(SERVED_MODEL, *key)):
        controller.enqueue(*key)


def _child_event(kind: str) -> Any:
    async def handler(
        type: str | None, event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any
    ) -> None:
        _client, cache, controller = _memo_parts(memo)
        cache.apply_event(kind, type, _raw(event, body))
        owner = Cache.owner_key(body)
        if owner is not None and cache.get(SERVED_MODEL, *owner) is not None:
            controller.enqueue(*owner)

    handler.__name__ = handler.__qualname__ = f"{kind.lower()}_event"
    return handler


_CHILDREN = {MANAGED_BY_LABEL: names.MANAGED_BY}
kopf.on.event("apps", "v1", "deployments", labels=_CHILDREN, id="deployment-cache")(
    _child_event("Deployment")
)
kopf.on.event("v1", "pods", labels=_CHILDREN, id="pod-cache")(_child_event("Pod"))
kopf.on.event("v1", "services", labels=_CHILDREN, id="service-cache")(_child_event("Service"))
kopf.on.event("v1", "persistentvolumeclaims", labels=_CHILDREN, id="pvc-cache")(
    _child_event("PersistentVolumeClaim")
)
# spec.autoscaling: an HPA's status (a rescale, a metric it cannot get) becomes status.autoscaling. KEDA's
# keda-hpa-<name> carries the ScaledObject's labels, so the filter and the instance label find it too.
kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=_CHILDREN, id="hpa-cache")(
    _child_event("HorizontalPodAutoscaler")
)


async def remove_legacy_bookkeeping(client: KubeClient, cache: Cache, body: Mapping[str, Any]) -> bool:
    """Drop the finalizer and annotations kopf kept on ServedModels before the control loop (upgrade
    path); True when something was removed. A merge patch guarded by resourceVersion."""
    meta = body.get("metadata") or {}
    finalizers = list(meta.get("finalizers") or [])
    stale = [
        k
        for k, v in (meta.get("annotations") or {}).items()
        if k.startswith(LEGACY_ANNOTATION_PREFIX)
        and (k.endswith("last-handled-configuration") or (isinstance(v, str) and '"started"' in v))
    ]
    if LEGACY_FINALIZER not in finalizers and not stale:
        return False
    patch: dict[str, Any] = {"metadata": {"resourceVersion": meta.get("resourceVersion")}}
    if LEGACY_FINALIZER in finalizers:
        patch["metadata"]["finalizers"] = [f for f in finalizers if f != LEGACY_FINALIZER]
    if stale:
        patch["metadata"]["annotations"] = dict.fromkeys(stale)
    namespace, name = _key(body)
    updated = await client.patch(API_GROUP_VERSION, PLURAL, namespace, name, patch)
    cache.upsert(SERVED_MODEL, updated)
    log.info("[%s/%s] removed the pre-controller kopf finalizer/annotations", namespace, name)
    return True


async def reconcile_key(memo: Any, key: tuple[str, str]) -> Result | None:
    """One reconcile of the ServedModel `key`, from the cache (what the controller's workers run)."""
    client, cache, _controller = _memo_parts(memo)
    config = operator_config(memo)
    namespace, name = key
    body = cache.get(SERVED_MODEL, namespace, name)
    if body is None:
        return None  # deleted: its children go with it (owner references)
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        # Deleting: nothing is written any more, except the legacy finalizer that would block it.
        await remove_legacy_bookkeeping(client, cache, body)
        return None
    if await remove_legacy_bookkeeping(client, cache, body):
        body = cache.get(SERVED_MODEL, namespace, name) or body

    async def post_event(involved: Mapping[str, Any], t: Transition) -> None:
        try:
            await client.create_event(dict(involved), type=t.type, reason=t.reason, message=t.message)
        except ApiError as e:  # an Event is not worth failing the pass for
            log.warning("[%s/%s] could not post Event %s: %s", namespace, name, t.reason, e)

    async def post_events(involved: Mapping[str, Any], changes: list[Transition]) -> None:
        await asyncio.gather(*(post_event(involved, t) for t in changes))

    started = time.monotonic()
    try:
        outcome = await reconcile(client, body, config, cache=cache, post_events=post_events)
    except NotFoundError:
        return None  # deleted under us (the status write found nothing)
    except Exception:
        RECONCILE_TOTAL.labels(result="error").inc()
        RECONCILE_DURATION.labels(kind="refresh").observe(time.monotonic() - started)
        raise
    RECONCILE_DURATION.labels(kind="apply" if outcome.apply_reason else "refresh").observe(
        time.monotonic() - started
    )
    result = (
        "invalid_spec"
        if outcome.invalid_spec
        else "apply_failed"
        if outcome.apply_error
        else "deferred"
        if outcome.deferred
        else "applied"
        if outcome.apply_reason
        else "refreshed"
    )
    RECONCILE_TOTAL.labels(result=result).inc()
    if outcome.apply_reason:
        log.info("[%s/%s] applied %s (%s)", namespace, name, ", ".join(outcome.applied), outcome.apply_reason)
    if outcome.written:
        STATUS_WRITES_TOTAL.inc()
        log.info("[%s/%s] status: phase %s", namespace, name, outcome.status.get("phase"))
    if outcome.pruned:
        log.info("[%s/%s] pruned %s", namespace, name, ", ".join(outcome.pruned))
    if outcome.apply_error:
        raise ApplyFailedError(outcome.apply_error)
    return None
