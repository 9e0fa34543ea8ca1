"""k8s/leader.py against the real API server's Lease: one leader at a time, a holder that stops renewing
loses it to a candidate after one lease duration (as measured on the candidate's clock), a released
Lease is taken at the candidate's next try. In process, with short durations; tests/cluster/test_faults.py
does the same with two operator processes and SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from cluster_support import until

import controlplane
from servedmodel.k8s import KubeClient, load_identity
from servedmodel.k8s.leader import LeaderElector

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
        await asyncio.gather(run_a, return_exceptions=True)
        waited = await until(lambda: b.leading, LEASE + 5.0)
        assert waited >= LEASE - 2 * RETRY * 1.2 - 0.5, waited  # not before a's lease could have lapsed
        assert terms == ["a", "b"]
        # b stops gracefully: it releases, and a fresh candidate takes the Lease at its first try.
        run_b.cancel()
        await asyncio.gather(run_b, return_exceptions=True)
        c = elector(ca, namespace, "c")
        assert await c.try_acquire_or_renew()
        lease = await ca.get("coordination.k8s.io/v1", "leases", namespace, "test-lease")
        assert lease is not None
        assert lease["spec"]["holderIdentity"] == "c"
        assert lease["spec"]["leaseTransitions"] == 2  # a → b → c


async def _no_release() -> bool:
    return False
