"""kopf handlers of ServedModels: thin wrappers over `servedmodel.reconcile`.

- create / update (spec, labels) / resume: render and server-side apply the children, then status.
- the engine Deployment or one of its Pods changes (starting, failing, ready): refresh status; the
  Deployment deleted: apply again.
- a timer every RESYNC_INTERVAL_S: refresh status (the safety net, and how the probe's Serving
  condition reaches the phase); nothing is written when nothing changed.

No handler lets an exception escape to kopf unbounded: API failures retry with backoff up to
APPLY_RETRIES times, after which the resync takes over; a spec that cannot be served is a
permanent error until the spec changes (the InvalidSpec condition says why).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any, Final, cast

import kopf

from servedmodel.api import API_GROUP, API_GROUP_VERSION, API_VERSION, KIND, PLURAL, names
from servedmodel.k8s import ApiError, KubeClient
from servedmodel.reconcile import Outcome, reconcile

from .metrics import RECONCILE_DURATION, RECONCILE_TOTAL, STATUS_WRITES_TOTAL
from .startup import operator_config

RESYNC_INTERVAL_S: Final = 30.0
APPLY_RETRIES: Final = 8
# A rollout sends bursts of Deployment events; one status refresh per burst is enough.
COALESCE_S: Final = 0.3
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"


def _key(namespace: str, name: str) -> tuple[str, str]:
    return namespace, name


async def run_reconcile(
    memo: Any, logger: kopf.Logger, namespace: str, name: str, *, apply: bool
) -> tuple[Outcome, Mapping[str, Any]] | None:
    """Reconcile the ServedModel as it is now (read fresh under its lock, so two passes never act on
    a stale status and post the same Event twice); None if it no longer exists."""
    client: KubeClient = memo.client
    config = operator_config(memo)
    key = _key(namespace, name)
    lock: asyncio.Lock = memo.locks.setdefault(key, asyncio.Lock())
    async with lock:
        body = await client.get(API_GROUP_VERSION, PLURAL, namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        apply = apply or key in memo.needs_apply
        started = time.monotonic()
        try:
            outcome = await reconcile(client, body, config, apply=apply)
        except Exception:
            RECONCILE_TOTAL.labels(result="error").inc()
            if apply:
                memo.needs_apply.add(key)
            raise
        finally:
            RECONCILE_DURATION.labels(kind="apply" if apply else "refresh").observe(
                time.monotonic() - started
            )
    if apply:
        if outcome.apply_error:
            memo.needs_apply.add(key)
        else:
            memo.needs_apply.discard(key)
    result = (
        "invalid_spec"
        if outcome.invalid_spec
        else "error"
        if outcome.apply_error
        else "applied"
        if apply
        else "refreshed"
    )
    RECONCILE_TOTAL.labels(result=result).inc()
    if outcome.written:
        STATUS_WRITES_TOTAL.inc()
        logger.info("status: phase %s", outcome.status.get("phase"))
    if outcome.pruned:
        logger.info("pruned %s", ", ".join(outcome.pruned))
    for t in outcome.transitions:
        kopf.event(kopf.Body(cast(kopf.RawBody, body)), type=t.type, reason=t.reason, message=t.message)
    return outcome, body


@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL)
async def apply_servedmodel(
    name: str | None, namespace: str | None, memo: kopf.Memo, logger: kopf.Logger, retry: int, **_: Any
) -> None:
    """Render and apply the children, then status. Returns None: kopf writes nothing into status."""
    assert name is not None
    ns = namespace or "default"
    try:
        done = await run_reconcile(memo, logger, ns, name, apply=True)
    except ApiError as e:
        if retry >= APPLY_RETRIES:
            logger.error("giving up after %d retries (the resync keeps trying): %s", retry, e)
            return
        raise kopf.TemporaryError(f"API server: {e}", delay=min(60.0, 2.0**retry)) from e
    except Exception as e:  # a bug must not become a crash loop: log it, retry a bounded number of times
        logger.exception("reconcile failed")
        if retry >= APPLY_RETRIES:
            return
        raise kopf.TemporaryError(f"{type(e).__name__}: {e}", delay=min(60.0, 2.0**retry)) from e
    if done is None:
        return
    outcome, _body = done
    if outcome.invalid_spec:
        raise kopf.PermanentError(f"InvalidSpec: {outcome.invalid_spec}")
    if outcome.apply_error and retry < APPLY_RETRIES:
        raise kopf.TemporaryError(outcome.apply_error, delay=min(60.0, 2.0**retry))


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=RESYNC_INTERVAL_S, initial_delay=RESYNC_INTERVAL_S)
async def resync(
    name: str | None, namespace: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Refresh status from the children (applying again only after a failed apply); cheap when idle."""
    assert name is not None
    try:
        await run_reconcile(memo, logger, namespace or "default", name, apply=False)
    except Exception as e:  # the next tick retries
        logger.warning("resync failed: %s", e)


def _owner_name(body: Mapping[str, Any]) -> str | None:
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion") == API_GROUP_VERSION and ref.get("controller"):
            return str(ref.get("name"))
    return None


async def _refresh_owner(memo: Any, logger: kopf.Logger, namespace: str, owner: str, *, apply: bool) -> None:
    """Refresh (or re-apply) one ServedModel after a child changed; bursts coalesce into one pass."""
    key = _key(namespace, owner)
    if not apply:
        if key in memo.refresh_pending:
            return
        memo.refresh_pending.add(key)
        await asyncio.sleep(COALESCE_S)
        memo.refresh_pending.discard(key)
    try:
        await run_reconcile(memo, logger, namespace, owner, apply=apply)
    except Exception as e:  # the resync timer catches up
        logger.warning("status refresh of %s/%s failed: %s", namespace, owner, e)


# Both watches are filtered server-side to the operator's children (settings.watching.label_selectors
# in startup), so the operator never lists every Pod of the cluster.
@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: names.MANAGED_BY})
async def engine_deployment_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """The engine Deployment moved: refresh the owner's status (apply again if it was deleted)."""
    owner = _owner_name(body)
    namespace = body.get("metadata", {}).get("namespace")
    if owner is not None and namespace:
        await _refresh_owner(memo, logger, namespace, owner, apply=type == "DELETED")


@kopf.on.event("v1", "pods", labels={MANAGED_BY_LABEL: names.MANAGED_BY, INSTANCE_LABEL: kopf.PRESENT})
async def engine_pod_event(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """An engine pod moved (scheduled, pulling, crashing, ready): refresh the owner's status, so pod
    reasons such as ImagePullBackOff or CrashLoopBackOff show without waiting for the resync."""
    meta = body.get("metadata", {})
    owner, namespace = (meta.get("labels") or {}).get(INSTANCE_LABEL), meta.get("namespace")
    if owner and namespace:
        await _refresh_owner(memo, logger, namespace, str(owner), apply=False)
