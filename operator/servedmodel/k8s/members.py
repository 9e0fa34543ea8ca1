"""Who else is running: one coordination.k8s.io/v1 Lease per operator replica, and a stable share of the
work for each (rendezvous hashing), so probing grows with replicas instead of waiting on one.

Each replica renews a Lease of its own (named after its holder identity, labelled with the group) every
`retry_period_s`, and lists the group's Leases as often. A member is live while its Lease's record keeps
changing: as in leader election, it is judged on this replica's clock (a Lease whose record has not
changed for `lease_duration_s` since this replica last saw it change is dead), never by comparing clocks
between machines. A replica that stops deletes its Lease, so the others take its share at their next
list; one that dies loses it after one lease duration.

`owns(key)`: rendezvous (highest random weight) hashing of the key over the live members — every
replica computes the same owner from the same member list, and a member's arrival or departure moves
only the keys it gains or held (about 1/N of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from .client import ApiError, KubeClient

log = logging.getLogger(__name__)

LEASE_API: Final = "coordination.k8s.io/v1"
GROUP_LABEL: Final = "inference.servedmodel.io/operator-group"
# A member's Lease unchanged this many lease durations is a dead replica's (SIGKILL leaves it): deleted.
FORGET_AFTER: Final = 10


def _weight(member: str, key: str) -> bytes:
    return hashlib.sha256(f"{member}\x00{key}".encode()).digest()


def owner(members: list[str], key: str) -> str | None:
    """The member that owns `key` (rendezvous hashing); None with no member."""
    return max(members, key=lambda m: _weight(m, key)) if members else None


@dataclass
class Membership:
    client: KubeClient
    namespace: str
    group: str
    identity: str
    lease_duration_s: float = 12.0
    retry_period_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, tuple[object, float, str]] = field(
        default_factory=dict
    )  # identity → (record, at, Lease)
    _members: list[str] = field(default_factory=list)
    _own: dict[str, Any] | None = None
    changes: int = 0  # times the member list changed

    @property
    def lease_name(self) -> str:
        return f"{self.group}-member-{hashlib.sha256(self.identity.encode()).hexdigest()[:12]}"

    def members(self) -> list[str]:
        """The live members, sorted (this replica among them once its Lease exists)."""
        return list(self._members)

    def owns(self, key: str) -> bool:
        """Whether this replica owns `key`. Before the first list it owns nothing (no double work)."""
        return owner(self._members, key) == self.identity

    async def run(self) -> None:
        """Renew this replica's Lease and refresh the member list, every retry period, until cancelled;
        on cancellation delete the Lease (the others take its share at once)."""
        try:
            while True:
                with contextlib.suppress(ApiError):
                    await self._renew()
                with contextlib.suppress(ApiError):
                    for dead in self._refresh(await self._list()):
                        await self.client.delete(LEASE_API, "leases", self.namespace, dead)
                await asyncio.sleep(self.retry_period_s)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._leave())

    async def _renew(self) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration_s)),
            "renewTime": now,
        }
        if self._own is None:
            body = {
                "apiVersion": LEASE_API,
                "kind": "Lease",
                "metadata": {
                    "name": self.lease_name,
                    "namespace": self.namespace,
                    "labels": {GROUP_LABEL: self.group},
                },
                "spec": {**spec, "acquireTime": now},
            }
            try:
                self._own = await self.client.create(body)
                return
            except ApiError as e:
                if e.status != 409:
                    raise
                self._own = await self.client.get(LEASE_API, "leases", self.namespace, self.lease_name)
                if self._own is None:
                    return
        own = dict(self._own)
        own["spec"] = {**(own.get("spec") or {}), **spec}
        try:
            self._own = await self.client.replace(own)
        except ApiError:
            self._own = None  # read it again next time
            raise

    async def _list(self) -> list[dict[str, Any]]:
        return await self.client.list(
            LEASE_API, "leases", self.namespace, label_selector=f"{GROUP_LABEL}={self.group}"
        )

    def _refresh(self, leases: list[dict[str, Any]]) -> list[str]:
        """Update the member list from the group's Leases; returns the names of dead members' Leases."""
        now = self.clock()
        present: set[str] = set()
        for lease in leases:
            spec, meta = lease.get("spec") or {}, lease.get("metadata") or {}
            assert isinstance(spec, dict)
            assert isinstance(meta, dict)
            holder = str(spec.get("holderIdentity") or "")
            if not holder:
                continue
            present.add(holder)
            record = (spec.get("renewTime"), spec.get("leaseDurationSeconds"))
            seen = self._seen.get(holder)
            if seen is None or seen[0] != record:
                self._seen[holder] = (record, now, str(meta.get("name") or ""))
        for gone in set(self._seen) - present:
            del self._seen[gone]
        live = sorted(
            h
            for h, (_r, at, _n) in self._seen.items()
            if h == self.identity or now - at < self.lease_duration_s
        )
        if self.identity not in present:
            live = [h for h in live if h != self.identity]
        if live != self._members:
            log.info("operator replicas: %s", ", ".join(live) or "none")
            self._members = live
            self.changes += 1
        limit = FORGET_AFTER * self.lease_duration_s
        return [name for h, (_r, at, name) in self._seen.items() if h != self.identity and now - at > limit]

    async def _leave(self) -> None:
        if self._own is None:
            return
        try:
            async with asyncio.timeout(5.0):
                await self.client.delete(LEASE_API, "leases", self.namespace, self.lease_name)
        except (ApiError, TimeoutError) as e:
            log.warning("deleting this replica's Lease failed: %s", e)
