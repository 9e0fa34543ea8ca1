"""List + watch into the cache, with client-go's reflector semantics: what the control loop's picture of
the cluster rests on.

One `Informer` per (kind, namespace or cluster, label selector):

1. **List** the kind (paged) and `Cache.replace` what the cache holds of it with the answer: objects the
   list lacks are deleted there too (a relist after a watch gap is the only way to learn of deletes made
   during the gap). Every change the relist made goes to the handler, so the owners of what vanished are
   enqueued. Only then is the informer `synced` (client-go's HasSynced): the workers and the probe start
   after every informer synced once.
2. **Watch** from the list's resourceVersion, with bookmarks, each event into the cache and to the
   handler; a stream the server ends (after `watch_timeout_s`) is resumed from the last resourceVersion.
3. **410 Gone** (the resourceVersion was compacted away, or the API server restarted with a newer
   watch cache): relist at once. Any other error — refused connections, 5xx, a stream cut mid-way, an
   API server away for minutes — is retried with capped, jittered exponential backoff for as long as
   the process lives, resuming from the last resourceVersion (a 410 then sends it to a relist). The
   process never exits because the API server was away; `/readyz` names the watch that is down.
4. A full relist every `relist_interval_s` (jittered; 0 = never) is the backstop for anything missed.

Why not kopf's watches (which fed the cache before): kopf reports a relist's objects as events but not
that a relist happened, so nothing could prune what the new list lacks (deleted models stayed cached and
probed); it has no HasSynced; and a non-410 error outlasting its retries ended the operator. The
comparison is in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from servedmodel.api.base import Obj

from .cache import Cache, slim
from .client import ApiError, GoneError, KubeClient

log = logging.getLogger(__name__)

# (event type, the cached object before, after): ADDED (before None), MODIFIED, DELETED (after None).
Handler = Callable[[str, Obj | None, Obj | None], None]

WATCH_TIMEOUT_S: Final = 300.0  # the server ends a watch after this; resumed from the last resourceVersion
BACKOFF_BASE_S: Final = 0.8  # client-go's reflector: 800 ms doubling ...
BACKOFF_CAP_S: Final = 30.0  # ... to 30 s


@dataclass(frozen=True)
class Watched:
    """A kind the operator watches: where it lives and which of its objects (a label selector, a field
    selector)."""

    api_version: str
    plural: str
    kind: str
    label_selector: str | None = None
    field_selector: str | None = None


@dataclass
class Informer:
    """One list+watch loop of `watched` (in `namespace`, or cluster-wide) into `cache`; see the module."""

    client: KubeClient
    watched: Watched
    cache: Cache
    handler: Handler
    namespace: str | None = None
    relist_interval_s: float = 0.0
    # Cluster-wide watches of a namespace glob: only namespaces it matches are cached.
    namespace_filter: Callable[[str], bool] | None = None
    watch_timeout_s: float = WATCH_TIMEOUT_S
    backoff_base_s: float = BACKOFF_BASE_S
    backoff_cap_s: float = BACKOFF_CAP_S
    rng: random.Random = field(default_factory=random.Random)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    last_error: str | None = None
    relists: int = 0
    errors: int = 0
    _rv: str = ""

    @property
    def name(self) -> str:
        where = self.namespace or "*"
        return f"{self.watched.kind}/{where}"

    async def run(self) -> None:
        """Forever (until cancelled): list, watch, relist on 410 or on the backstop's interval."""
        failures = 0
        while True:
            try:
                await self._list()
                failures = 0
                await self._watch_until_relist()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a list that failed: back off and list again
                failures += 1
                await self._failed("list", e, failures)

    async def _list(self) -> None:
        w = self.watched
        items, rv = await self.client.list_at(
            w.api_version,
            w.plural,
            self.namespace,
            label_selector=w.label_selector,
            field_selector=w.field_selector,
            each=functools.partial(slim, kind=w.kind),  # page by page, not the whole list at once
        )
        if self.namespace_filter is not None:
            keep = self.namespace_filter
            items = [o for o in items if keep(str((o.get("metadata") or {}).get("namespace") or ""))]
        deltas = self.cache.replace(w.kind, items, rv, self.namespace)
        self.relists += 1
        self._rv = rv
        if self.synced.is_set():
            log.info("relisted %s at resourceVersion %s: %d changed", self.name, rv, len(deltas))
        self.synced.set()
        self.last_error = None
        for d in deltas:
            self._notify(d.type, d.old, d.new)

    async def _watch_until_relist(self) -> None:
        """Watch from the last resourceVersion; return when a relist is due (410, or the interval)."""
        relist_at = (
            time.monotonic() + self.relist_interval_s * self.rng.uniform(0.9, 1.1)
            if self.relist_interval_s > 0
            else float("inf")
        )
        failures = 0
        while time.monotonic() < relist_at:
            w = self.watched
            timeout = min(self.watch_timeout_s, max(1.0, relist_at - time.monotonic()))
            try:
                async for type_, obj in self.client.watch(
                    w.api_version,
                    w.plural,
                    self.namespace,
                    resource_version=self._rv,
                    label_selector=w.label_selector,
                    field_selector=w.field_selector,
                    timeout_s=timeout,
                ):
                    failures = 0
                    self.last_error = None
                    self._event(type_, obj)
            except GoneError as e:
                log.info("watch of %s: %s; relisting", self.name, e.message or "410 Gone")
                return
            except (ApiError, ValueError) as e:  # refused, unreachable, cut mid-way, a garbled line
                failures += 1
                await self._failed("watch", e, failures)

    def _event(self, type_: str, obj: Obj) -> None:
        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if type_ == "BOOKMARK":
            self._rv = rv or self._rv
            return
        meta = obj.get("metadata") or {}
        kind = self.watched.kind
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if self.namespace_filter is not None and not self.namespace_filter(key[0]):
            self._rv = rv or self._rv
            return
        old = self.cache.get(kind, *key)
        obj.setdefault("apiVersion", self.watched.api_version)
        obj.setdefault("kind", kind)
        changed = self.cache.apply_event(kind, type_, obj)
        self._rv = rv or self._rv
        if changed:
            self._notify(type_, old, self.cache.get(kind, *key) if type_ != "DELETED" else None)

    def _notify(self, type_: str, old: Obj | None, new: Obj | None) -> None:
        try:
            self.handler(type_, old, new)
        except Exception:  # a handler's bug must not stop the watch
            log.exception("handler of %s failed on a %s event", self.name, type_)

    async def _failed(self, what: str, e: Exception, failures: int) -> None:
        self.errors += 1
        self.last_error = f"{what}: {e}"
        delay = min(self.backoff_cap_s, self.backoff_base_s * 2 ** min(failures - 1, 16))
        delay *= self.rng.uniform(0.8, 1.2)
        # The first failure and then every tenth at WARNING: an API server away for minutes is a
        # handful of lines, not one per retry.
        level = logging.WARNING if failures == 1 or failures % 10 == 0 else logging.DEBUG
        log.log(
            level, "%s of %s failed (attempt %d, retry in %.1fs): %s", what, self.name, failures, delay, e
        )
        await asyncio.sleep(delay)


@dataclass
class Informers:
    """The operator's informers, run as tasks; `synced()` once every one listed once."""

    informers: list[Informer]
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        for inf in self.informers:
            self._tasks.append(asyncio.create_task(inf.run(), name=f"informer-{inf.name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def wait_synced(self) -> None:
        await asyncio.gather(*(inf.synced.wait() for inf in self.informers))

    def not_ready(self) -> list[str]:
        """Why /readyz says no: each informer not yet synced, or whose watch is down, with its error."""
        out = []
        for inf in self.informers:
            if not inf.synced.is_set():
                out.append(f"{inf.name}: not synced" + (f" ({inf.last_error})" if inf.last_error else ""))
            elif inf.last_error is not None:
                out.append(f"{inf.name}: {inf.last_error}")
        return out

    def stats(self) -> dict[str, Any]:
        return {inf.name: {"relists": inf.relists, "errors": inf.errors} for inf in self.informers}
