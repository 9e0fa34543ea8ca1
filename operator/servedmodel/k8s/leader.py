"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's semantics (leaderelection.go).

- A candidate tries every `retry_period_s` (jittered up to 1.2 times) to take the Lease: it may when the
  Lease does not exist, has no holder (released), or its record has not changed for `lease_duration_s`
  as measured on the candidate's own clock since it last saw the record change (no clock is compared
  between machines). The write is a PUT carrying the resourceVersion read: two candidates never both win.
- The leader renews every `retry_period_s`; if no renewal succeeded for `renew_deadline_s` it stops
  leading (before the Lease can lapse for the others: renew_deadline < lease_duration). As client-go's
  fast path, a renewal is one PUT over the Lease this process last wrote; a GET only when that is refused.
- Each try, a candidate's or a renewal, is bounded by `try_timeout_s`: half the renew deadline, at least
  1 s (controller-runtime's Lease client timeout), so one hung request leaves time for another try
  instead of using up the whole renew deadline.
- On shutdown the leader releases the Lease (holder "", leaseDurationSeconds 1), so a follower takes over
  at its next try instead of after a whole lease duration.

`run(on_started, on_stopped)` loops for as long as the process lives: candidate → leader → (lost) →
candidate. The callbacks start and stop the leader's work (handlers/startup.py: the workers and the
probe); the informers keep running either way, so a follower's cache is warm when it takes over.
The operator runs `run` on an event loop of its own thread and the callbacks on the main loop
(probe/loop.calling): the clock that judges the renew deadline, and the renewals, never wait for the
workers' loop (client-go's elector is goroutines that the Go scheduler preempts; one asyncio loop is not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from servedmodel.api.base import Obj

from .client import ApiError, ConflictError, KubeClient

log = logging.getLogger(__name__)

LEASE_API: Final = "coordination.k8s.io/v1"
JITTER: Final = 1.2


def try_timeout(renew_deadline_s: float) -> float:
    """Seconds one Lease request may take with this renew deadline: half of it, at least 1 s."""
    return max(1.0, renew_deadline_s / 2)


def _micro_time(t: datetime | None = None) -> str:
    """metav1.MicroTime as the API server writes it."""
    return (t or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaderElector:
    client: KubeClient
    namespace: str
    name: str
    identity: str
    lease_duration_s: float = 12.0
    renew_deadline_s: float = 8.0
    retry_period_s: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    leading: bool = False
    transitions: int = 0  # times this process became the leader
    requests: int = 0  # API requests for the Lease (a fixed cost: one per retry period while leading)
    _observed: tuple[Any, ...] | None = None  # the Lease's last seen record
    _observed_at: float = 0.0  # when it was last seen to change (our clock)
    _lease: Obj | None = None

    def __post_init__(self) -> None:
        if not self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("leader election needs retry period < renew deadline < lease duration")

    @property
    def try_timeout_s(self) -> float:
        """The most one try may take: controller-runtime gives its Lease client max(1 s, RenewDeadline/2)
        "to keep a single hung request from forcing a leader loss" (pkg/leaderelection)."""
        return try_timeout(self.renew_deadline_s)

    async def run(
        self, on_started: Callable[[], Awaitable[None]], on_stopped: Callable[[], Awaitable[None]]
    ) -> None:
        """Candidate, leader, candidate again ...; cancelled: stop leading and release the Lease."""
        try:
            while True:
                await self._acquire()
                self.leading = True
                self.transitions += 1
                log.info("leader election: %s leads (Lease %s/%s)", self.identity, self.namespace, self.name)
                renewing = asyncio.create_task(self._renew(), name="lease-renewal")
                try:
                    # The Lease is renewed from the moment it is taken, beside the leader's start: a start
                    # that waits for a busy loop must not hold the first renewals back.
                    await on_started()
                    await renewing
                finally:
                    renewing.cancel()
                    await asyncio.gather(renewing, return_exceptions=True)
                    self.leading = False
                    await on_stopped()
                log.warning(
                    "leader election: %s lost the Lease %s/%s", self.identity, self.namespace, self.name
                )
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.release())

    async def _acquire(self) -> None:
        while not await self._try(self.try_timeout_s):  # noqa: ASYNC110 - polling the API is the protocol
            await asyncio.sleep(self.retry_period_s * self.rng.uniform(1.0, JITTER))

    async def _try(self, timeout_s: float) -> bool:
        """One try within `timeout_s`; a try that runs out is a failed one."""
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when a cancel lands as
        # the try completes, and the cancelled leader then renews on for ever.
        try:
            async with asyncio.timeout(timeout_s):
                return await self.try_acquire_or_renew()
        except TimeoutError:
            log.info("leader election: a try for the Lease took over %.1f s; trying again", timeout_s)
            return False

    async def _renew(self) -> None:
        """Renew until a renewal has not succeeded for renew_deadline_s; then return (leadership lost)."""
        last_ok = self.clock()
        wait = self.retry_period_s
        while True:
            await asyncio.sleep(wait)
            started = self.clock()
            left = self.renew_deadline_s - (started - last_ok)
            ok = await self._try(max(0.1, min(self.try_timeout_s, left)))
            if ok:
                last_ok, wait = self.clock(), self.retry_period_s
            elif self.clock() - last_ok >= self.renew_deadline_s:
                self.leading = False  # at once: /readyz and the metrics say so before the work has stopped
                return
            else:
                # Retries tick from each try's start, as client-go's PollImmediate: after a try that ran out
                # (4 s of the default 8) the next goes at once, with what is left, instead of a retry
                # period later at the deadline.
                wait = max(0.0, self.retry_period_s - (self.clock() - started))

    async def try_acquire_or_renew(self) -> bool:
        """One try (client-go's tryAcquireOrRenew): True when this process holds the Lease after it."""
        now = datetime.now(UTC)
        if await self._renew_from_last_write(now):
            return True
        self.requests += 1
        try:
            lease = await self.client.get(LEASE_API, "leases", self.namespace, self.name)
        except ApiError as e:
            log.debug("leader election: reading the Lease failed: %s", e)
            return False
        spec_new = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration_s)),
            "renewTime": _micro_time(now),
        }
        if lease is None:
            body = {
                "apiVersion": LEASE_API,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**spec_new, "acquireTime": _micro_time(now), "leaseTransitions": 0},
            }
            self.requests += 1
            try:
                self._lease = await self.client.create(body)
            except ApiError as e:
                log.debug("leader election: creating the Lease failed: %s", e)
                return False
            self._saw(self._lease)
            return True
        spec = lease.get("spec") or {}
        self._saw(lease)
        holder = spec.get("holderIdentity") or ""
        if holder and holder != self.identity:
            # Held by another, and renewed within its duration as far as we have seen: not ours to take,
            # even if we were leading (client-go's IsLeader is the observed record's holder; a leader whose
            # Lease was taken stops at its renew deadline instead of writing over the new holder).
            duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
            if self.clock() < self._observed_at + duration:
                return False
        new_spec = dict(spec)
        new_spec.update(spec_new)
        if holder != self.identity:
            new_spec["acquireTime"] = _micro_time(now)
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        body = {**lease, "spec": new_spec}
        self.requests += 1
        try:
            self._lease = await self.client.replace(body)
        except ConflictError:
            return False  # another candidate wrote first
        except ApiError as e:
            log.debug("leader election: updating the Lease failed: %s", e)
            return False
        self._saw(self._lease)
        return True

    async def _renew_from_last_write(self, now: datetime) -> bool:
        """client-go's fast path: a leader whose lease is still valid on its clock PUTs its renewal over the
        Lease it last wrote (that write's resourceVersion), one request instead of a GET and a PUT. Any
        refusal (409: someone wrote since) falls back to reading the Lease."""
        lease = self._lease
        if not self.leading or lease is None or self.clock() >= self._observed_at + self.lease_duration_s:
            return False
        spec = dict(lease.get("spec") or {})
        if spec.get("holderIdentity") != self.identity:
            return False
        spec["leaseDurationSeconds"] = max(1, round(self.lease_duration_s))
        spec["renewTime"] = _micro_time(now)
        self.requests += 1
        try:
            self._lease = await self.client.replace({**lease, "spec": spec})
        except ApiError as e:
            log.info("leader election: renewing over the last write failed (%s); reading the Lease", e)
            return False
        self._saw(self._lease)
        return True

    def _saw(self, lease: Obj) -> None:
        spec = lease.get("spec") or {}
        record = (
            spec.get("holderIdentity"),
            spec.get("renewTime"),
            spec.get("acquireTime"),
            spec.get("leaseTransitions"),
            spec.get("leaseDurationSeconds"),
        )
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()

    def holder(self) -> str | None:
        """Who held the Lease when this process last read it."""
        holder = (self._observed or (None,))[0]
        return str(holder) if holder else None

    async def release(self) -> bool:
        """Give the Lease up if this process holds it (holder "", 1 s): followers take over at once."""
        lease = self._lease
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return False
        spec = dict(lease.get("spec") or {})
        spec.update({"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": _micro_time()})
        try:
            async with asyncio.timeout(5.0):
                self._lease = await self.client.replace({**lease, "spec": spec})
        except (ApiError, TimeoutError) as e:
            log.warning("leader election: releasing the Lease failed: %s", e)
            return False
        log.info("leader election: %s released the Lease %s/%s", self.identity, self.namespace, self.name)
        return True
