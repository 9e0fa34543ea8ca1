"""The reconcile entry point the controller's workers call (`reconcile_key`): one pass over a
ServedModel from the cache, its outcome turned into Events, metrics and log lines.

What enqueues a ServedModel is servedmodel/watches.py (the informers' handlers), the probe scheduler,
the resync and the controller's own retries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from servedmodel.access import SECRET_NOT_ALLOWED
from servedmodel.controller import Controller
from servedmodel.k8s import ApiError, Cache, KubeClient, NotFoundError
from servedmodel.reconcile import reconcile
from servedmodel.status import Transition

from .metrics import RECONCILE_DURATION, RECONCILE_TOTAL, STATUS_WRITES_TOTAL
from .startup import operator_config

log = logging.getLogger("servedmodel.reconcile")

SERVED_MODEL = "ServedModel"
SECRET_RECHECK_S = 30.0


class ApplyFailedError(Exception):
    """A child apply was refused: the status says so (Degraded/ApplyFailed); the controller backs off."""


def _memo_parts(memo: Any) -> tuple[KubeClient, Cache, Controller]:
    return memo.client, memo.cache, memo.controller


def memo_posted(memo: Any) -> dict[tuple[str, str], set[Transition]]:
    """(uid, name) → the Events posted for a status write that has not succeeded yet."""
    posted = getattr(memo, "posted_events", None)
    if not isinstance(posted, dict):
        posted = memo.posted_events = {}
    return posted


async def reconcile_key(memo: Any, key: tuple[str, str]) -> None:
    """One reconcile of the ServedModel `key`, from the cache (what the controller's workers run)."""
    client, cache, _controller = _memo_parts(memo)
    config = operator_config(memo)
    namespace, name = key
    body = cache.get(SERVED_MODEL, namespace, name)
    if body is None:
        return  # deleted: its children go with it (owner references)
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return  # deleting: nothing is written any more (the operator holds no finalizer)

    async def post_event(involved: Mapping[str, Any], t: Transition) -> None:
        try:
            await client.create_event(dict(involved), type=t.type, reason=t.reason, message=t.message)
        except ApiError as e:  # an Event is not worth failing the pass for
            log.warning("[%s/%s] could not post Event %s: %s", namespace, name, t.reason, e)

    # Events are posted before the status write that records their transition (an operator that dies
    # in between posts them again rather than never); a write that fails and is retried must not post
    # them again, so what was posted for the status not yet written is remembered until it is.
    posted: dict[tuple[str, str], set[Transition]] = memo_posted(memo)
    uid = str((body.get("metadata") or {}).get("uid") or "")

    async def post_events(involved: Mapping[str, Any], changes: list[Transition]) -> None:
        done = posted.setdefault((uid, name), set())
        new = [t for t in changes if t not in done]
        done.update(new)
        await asyncio.gather(*(post_event(involved, t) for t in new))

    started = time.monotonic()
    try:
        outcome = await reconcile(client, body, config, cache=cache, post_events=post_events)
    except NotFoundError:
        posted.pop((uid, name), None)
        # Deleted under us (a write found nothing): forget it now rather than when the watch says so,
        # so no later event of its children brings it back.
        cache.evict(SERVED_MODEL, body)
        log.info("[%s/%s] gone (a write answered 404): forgotten", namespace, name)
        return
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
    if outcome.written or not outcome.transitions:
        posted.pop((uid, name), None)
    if outcome.written:
        STATUS_WRITES_TOTAL.inc()
        log.info("[%s/%s] status: phase %s", namespace, name, outcome.status.get("phase"))
    if outcome.pruned:
        log.info("[%s/%s] pruned %s", namespace, name, ", ".join(outcome.pruned))
    if outcome.invalid_spec and outcome.invalid_spec.startswith(SECRET_NOT_ALLOWED):
        # Fixed outside the spec (the Secret's owner annotates it, nothing the operator watches): look
        # again every SECRET_RECHECK_S while it is refused.
        _controller.enqueue(namespace, name, after=SECRET_RECHECK_S)
    if outcome.recheck_after is not None:
        # A LeaderWorkerSet's status behind its pods: no watch brings its update (reconcile.GROUP_RECHECK_S).
        _controller.enqueue(namespace, name, after=outcome.recheck_after)
    if outcome.apply_error:
        raise ApplyFailedError(outcome.apply_error)
