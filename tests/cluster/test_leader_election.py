"""k8s/leader.py against the real API server's Lease: one leader at a time, a holder that stops renewing
loses it to a candidate after one lease duration (as measured on the candidate's clock), a released
Lease is taken at the candidate's next try. In process, with short durations; tests/cluster/test_faults.py
does the same with two operator processes and SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from cluster_support import until

import controlplane
from servedmodel.api.base import Obj
from servedmodel.config import OperatorConfig
from servedmodel.k8s import KubeClient, load_identity
from servedmodel.k8s.client import ConflictError
from servedmodel.k8s.leader import LeaderElector
from servedmodel.probe.loop import ProbeLoop, calling

pytestmark = pytest.mark.cluster

# Short, but not so short that a loaded CI machine's API answer misses the renew deadline: with 2 s a
# leader stepped down mid-test (it renewed nothing for 2 s) and took the Lease again, a correct loss that
# the test read as a second term.
LEASE, RENEW, RETRY = 6.0, 4.0, 0.5


@contextlib.asynccontextmanager
async def client(cp: controlplane.ControlPlane) -> AsyncIterator[KubeClient]:
    async with KubeClient(load_identity(cp.kubeconfig)) as c:
        yield c


def elector(c: KubeClient, namespace: str, identity: str) -> LeaderElector:
    return LeaderElector(
        c,
        namespace,
        "test-lease",
        identity,
        lease_duration_s=LEASE,
        renew_deadline_s=RENEW,
        retry_period_s=RETRY,
    )


async def test_one_leader_then_takeover_after_a_lease_duration(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    async with client(bare_control_plane) as ca, client(bare_control_plane) as cb:
        a, b = elector(ca, namespace, "a"), elector(cb, namespace, "b")
        terms: list[str] = []

        async def started(name: str) -> None:
            terms.append(name)

        async def stopped() -> None:
            return None

        run_a = asyncio.create_task(a.run(lambda: started("a"), stopped))
        await until(lambda: a.leading, 10.0)
        run_b = asyncio.create_task(b.run(lambda: started("b"), stopped))
        await asyncio.sleep(LEASE * 2)  # a renews throughout: b never leads
        assert a.leading
        assert not b.leading
        # a dies without releasing (as SIGKILL would): its renewals stop, the Lease stays a's.
        a.release = _no_release  # type: ignore[method-assign]
        run_a.cancel()
        await stopped_within(run_a)
        # A bounded wait, not a timing (a loaded machine stretches it; bench/operator_faults.py times the
        # failover): b leads at all once a's renewals stop ...
        waited = await until(lambda: b.leading, LEASE * 5, "b to take the Lease a stopped renewing")
        # ... and not before a's lease could have lapsed on b's clock (load only makes this later).
        assert waited >= LEASE - 2 * RETRY * 1.2 - 0.5, waited
        assert terms == ["a", "b"]
        # b stops gracefully: it releases, and a fresh candidate takes the Lease at its first try.
        run_b.cancel()
        await stopped_within(run_b)
        c = elector(ca, namespace, "c")
        assert await c.try_acquire_or_renew()
        lease = await ca.get("coordination.k8s.io/v1", "leases", namespace, "test-lease")
        assert lease is not None
        assert lease["spec"]["holderIdentity"] == "c"
        assert lease["spec"]["leaseTransitions"] == 2  # a → b → c


async def _no_release() -> bool:
    return False


async def stopped_within(task: asyncio.Task[None], within: float = 10.0) -> None:
    """The cancelled elector's task ended (a leader that ignores its cancel would renew for ever)."""
    done, _ = await asyncio.wait({task}, timeout=within)
    assert task in done, f"the elector did not stop within {within:.0f} s of its cancel"


class CancelOnRenew(KubeClient):
    """The real client; when `on_reply` is set, a PUT's answer schedules it before returning, so a cancel
    lands in the same turn of the loop as the renewal completes (what a shutdown does at worst)."""

    on_reply: Callable[[], Any] | None = None

    async def replace(self, obj: Obj) -> Obj:
        answer = await super().replace(obj)
        hook, self.on_reply = self.on_reply, None  # once
        if hook is not None:
            asyncio.get_running_loop().call_soon(hook)
        return answer


async def test_a_cancel_that_lands_as_a_renewal_completes_stops_the_leader(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """Python 3.11's asyncio.wait_for around the renewal returned its result to a task cancelled in that turn:
    the cancel was lost and the leader renewed on (a CI run hung 300 s here). The renewal is bounded by
    asyncio.timeout instead, which keeps a cancel."""
    async with CancelOnRenew(load_identity(bare_control_plane.kubeconfig)) as c:
        a = elector(c, namespace, "a")

        async def noop() -> None:
            return None

        run_a = asyncio.create_task(a.run(noop, noop))
        await until(lambda: a.leading, 10.0)
        renewals = a.requests
        await until(lambda: a.requests > renewals, 10.0, "a renewal")  # _renew's loop is running
        c.on_reply = run_a.cancel
        await stopped_within(run_a)
        assert run_a.cancelled()
        assert not a.leading
        lease = await c.get("coordination.k8s.io/v1", "leases", namespace, "test-lease")
        assert lease is not None
        assert lease["spec"]["holderIdentity"] == ""  # released on the way out


class HangOnce(KubeClient):
    """The real client; when `hang` is set, the next PUT is never answered (a request lost on the way, or
    an API server that took it and went quiet): it waits until the caller gives up on it."""

    hang = False
    hung = 0  # PUTs that hung and were given up

    async def replace(self, obj: Obj) -> Obj:
        if self.hang:
            self.hang = False
            try:
                await asyncio.Event().wait()
            finally:
                self.hung += 1
        return await super().replace(obj)


async def test_one_hung_renewal_does_not_cost_the_lease(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """A renewal whose PUT is never answered is given up after the try timeout (half the renew deadline, as
    controller-runtime's Lease client), and the next try renews in time. Bounded by what was left of the
    deadline instead, the one hung PUT used all of it and the leader stepped down."""
    # The operator's defaults (12/8/2): the hung try starts a retry period after the last renewal and is
    # given up 4 s later; the next goes at once with the 2 s left (a retry period later would be too late).
    defaults = OperatorConfig()
    renew = defaults.renew_deadline
    async with HangOnce(load_identity(bare_control_plane.kubeconfig)) as c:
        a = LeaderElector(
            c,
            namespace,
            "test-lease",
            "a",
            lease_duration_s=defaults.lease_duration,
            renew_deadline_s=renew,
            retry_period_s=defaults.retry_period,
        )
        assert a.try_timeout_s == renew / 2
        stepped_down: list[bool] = []

        async def started() -> None:
            return None

        async def stopped() -> None:
            stepped_down.append(True)

        run_a = asyncio.create_task(a.run(started, stopped))
        try:
            await until(lambda: a.leading, 10.0)
            renewals = a.requests
            await until(lambda: a.requests > renewals, 10.0, "a renewal")
            c.hang = True
            await until(lambda: c.hung == 1, renew + 5.0, "the hung PUT to be given up")
            renewals = a.requests
            await until(lambda: a.requests > renewals + 1, 10.0, "renewals after the hung one")
            await asyncio.sleep(renew)  # past the deadline the hung try would have used up
            assert a.leading
            assert not stepped_down
            assert a.transitions == 1
        finally:
            a.release = _no_release  # type: ignore[method-assign]
            run_a.cancel()
            await stopped_within(run_a)


async def test_a_main_loop_busy_past_the_renew_deadline_does_not_cost_the_lease(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """As the operator runs it (handlers/startup.py): the elector on a loop of its own thread, the leader's
    work on the main loop. The main thread then computes for longer than the renew deadline (a burst of
    watch events and reconciles at load, here a busy loop holding the GIL but for its hand-overs): the
    Lease is renewed all the while and the leader never steps down. On the main loop, nothing renewed it
    for those 10 s and the leader stepped down as soon as its loop ran again."""
    defaults = OperatorConfig()
    leases = ProbeLoop(name="test-leases")
    leases.start()
    c = KubeClient(load_identity(bare_control_plane.kubeconfig))  # used, and closed, on the leases' loop
    a = LeaderElector(
        c,
        namespace,
        "test-lease",
        "a",
        lease_duration_s=defaults.lease_duration,
        renew_deadline_s=defaults.renew_deadline,
        retry_period_s=defaults.retry_period,
    )
    main = asyncio.get_running_loop()
    stepped_down: list[bool] = []

    async def started() -> None:
        assert asyncio.get_running_loop() is main

    async def stopped() -> None:
        stepped_down.append(True)

    run_a = await leases.spawn(a.run(calling(main, started), calling(main, stopped)))
    try:
        await until(lambda: a.leading, 10.0)
        before, end = a.requests, time.monotonic() + defaults.renew_deadline + 2.0
        while time.monotonic() < end:  # the main loop runs nothing else until this ends
            pass
        renewed = a.requests - before
        await asyncio.sleep(0.5)  # a step-down's callback, had there been one, runs here
        assert renewed >= 3, f"{renewed} renewals while the main loop was busy"
        assert a.leading
        assert not stepped_down
        assert a.transitions == 1
    finally:
        await leases.cancel(run_a)  # stops leading through the main loop, releases the Lease
        await leases.stop([c.aclose])
    lease = await _read_lease(bare_control_plane, namespace)
    assert lease["spec"]["holderIdentity"] == ""  # released, from the leases' loop


async def _read_lease(cp: controlplane.ControlPlane, namespace: str) -> Obj:
    async with client(cp) as c:
        lease = await c.get("coordination.k8s.io/v1", "leases", namespace, "test-lease")
    assert lease is not None
    return lease


def sent(c: KubeClient) -> dict[str, int]:
    """Requests this client sent so far, by method and status ("PUT 200")."""
    return {f"{m} {code}": n for (m, code), n in c.requests.items()}


def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0)}


async def test_a_leader_renews_with_one_put_and_reads_the_lease_only_when_refused(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """client-go's fast path: while leading, a renewal is a PUT over the Lease it last wrote. Someone else's
    write makes that PUT a 409, and the leader reads the Lease and renews over it; a Lease another holder
    took is not written over: the leader stops at its renew deadline."""
    async with client(bare_control_plane) as ca, client(bare_control_plane) as other:
        a = elector(ca, namespace, "a")

        async def noop() -> None:
            return None

        run_a = asyncio.create_task(a.run(noop, noop))
        try:
            await until(lambda: a.leading, 10.0)
            before = sent(ca)
            await asyncio.sleep(RETRY * 8)  # several renewals
            quiet = since(before, sent(ca))
            assert set(quiet) == {"PUT 200"}, quiet  # no GET while nothing else wrote
            assert quiet["PUT 200"] >= 3, quiet

            # Another writer touches the Lease (an annotation): the next renewal's PUT is refused.
            await edit(other, namespace, lambda lease: lease["metadata"].update(annotations={"a": "b"}))
            before = sent(ca)
            renewed = await until(lambda: since(before, sent(ca)).get("PUT 200", 0) >= 1, 10.0, "a renewal")
            refused = since(before, sent(ca))
            assert refused.get("PUT 409") == 1, (refused, renewed)
            assert refused.get("GET 200") == 1, refused
            assert a.leading

            # Another holder takes the Lease (valid for LEASE s): a must not write over it.
            await edit(other, namespace, lambda lease: lease["spec"].update(holderIdentity="x"))
            await until(lambda: not a.leading, RENEW + 5.0, "a to step down at its renew deadline")
            lease = await other.get("coordination.k8s.io/v1", "leases", namespace, "test-lease")
            assert lease is not None
            assert lease["spec"]["holderIdentity"] == "x"
        finally:
            a.release = _no_release  # type: ignore[method-assign]
            run_a.cancel()
            await stopped_within(run_a)


async def edit(c: KubeClient, namespace: str, change: Callable[[Obj], Any]) -> None:
    """Read, change and write the Lease as a person's `kubectl edit` would: again on a 409 (the leader
    renewed in between)."""
    for _ in range(20):
        lease = await c.get("coordination.k8s.io/v1", "leases", namespace, "test-lease")
        assert lease is not None
        change(lease)
        try:
            await c.replace(lease)
            return
        except ConflictError:
            continue
    raise AssertionError("the Lease could not be edited in 20 tries")
