"""The watch-fed cache and the work queue / controller (pure asyncio, no API server)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from servedmodel.controller import Backoff, Controller, Key, WorkQueue
from servedmodel.k8s.cache import Cache, owned_by


def obj(kind: str, name: str, ns: str = "a", rv: str = "1", **meta: Any) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": name, "namespace": ns, "resourceVersion": rv, **meta}}


# ---- cache ---------------------------------------------------------------------------------------


def test_cache_events_and_reads() -> None:
    c = Cache()
    assert not c.tracks("Pod")
    c.apply_event("Pod", None, obj("Pod", "p1", labels={"app.kubernetes.io/instance": "m"}))
    c.apply_event("Pod", "ADDED", obj("Pod", "p2", labels={"app.kubernetes.io/instance": "n"}))
    c.apply_event("Pod", "ADDED", obj("Pod", "p1", ns="b", labels={"app.kubernetes.io/instance": "m"}))
    assert c.tracks("Pod")
    assert c.get("Pod", "a", "p1") is not None
    assert [o["metadata"]["name"] for o in c.list("Pod", "a")] == ["p1", "p2"]
    assert len(c.list("Pod")) == 3
    assert [
        o["metadata"]["name"] for o in c.list("Pod", "a", labels={"app.kubernetes.io/instance": "m"})
    ] == ["p1"]
    assert len(c.list("Pod", labels={"app.kubernetes.io/instance": None})) == 3
    c.apply_event("Pod", "DELETED", obj("Pod", "p1"))
    assert c.get("Pod", "a", "p1") is None
    assert c.count("Pod") == 2


def test_cache_ignores_stale_versions_and_slims() -> None:
    c = Cache()
    fat = obj(
        "Deployment",
        "d",
        rv="10",
        managedFields=[{"manager": "x"}],
        annotations={"kubectl.kubernetes.io/last-applied-configuration": "{}", "keep": "1"},
    )
    assert c.upsert("Deployment", fat)
    stored = c.get("Deployment", "a", "d")
    assert stored is not None
    assert "managedFields" not in stored["metadata"]
    assert stored["metadata"]["annotations"] == {"keep": "1"}
    assert "managedFields" in fat["metadata"]  # the caller's object is not changed
    assert not c.apply_event("Deployment", "MODIFIED", obj("Deployment", "d", rv="9"))
    assert c.apply_event("Deployment", "MODIFIED", obj("Deployment", "d", rv="11"))
    assert c.get("Deployment", "a", "d")["metadata"]["resourceVersion"] == "11"  # type: ignore[index]


def test_owner_key_and_owned_by() -> None:
    ref = {"kind": "ServedModel", "name": "m", "uid": "u1", "controller": True}
    child = obj("Service", "m-engine", ownerReferences=[ref])
    assert Cache.owner_key(child) == ("a", "m")
    assert Cache.owner_key(obj("Pod", "p", labels={"app.kubernetes.io/instance": "m"})) == ("a", "m")
    assert Cache.owner_key(obj("Pod", "p")) is None
    assert owned_by(child, "u1")
    assert not owned_by(obj("Service", "other"), "u1")


# ---- queue ---------------------------------------------------------------------------------------


async def test_queue_deduplicates_and_requeues_dirty_keys() -> None:
    q = WorkQueue()
    assert q.add(("a", "m"))
    assert not q.add(("a", "m"))
    assert len(q) == 1
    key = await q.get()
    assert key == ("a", "m")
    q.add(("a", "m"))  # while in process: dirty, not queued twice
    assert len(q) == 0
    q.done(("a", "m"))
    assert len(q) == 1
    await q.close()
    assert await q.get() is None


async def test_add_after_earliest_wins() -> None:
    q = WorkQueue()
    q.add_after(("a", "m"), 5.0)
    q.add_after(("a", "m"), 0.01)
    q.add_after(("a", "m"), 10.0)
    assert q.delayed == 1
    assert await asyncio.wait_for(q.get(), 2.0) == ("a", "m")
    await q.close()


def test_backoff_grows_to_the_cap_and_forgets() -> None:
    b = Backoff(base_s=1.0, cap_s=8.0)
    delays = [b.next_delay(("a", "m")) for _ in range(6)]
    assert delays[0] == pytest.approx(1.0, rel=0.11)
    assert delays[3] == pytest.approx(8.0, rel=0.11)
    assert max(delays) <= 8.0 * 1.1
    b.forget(("a", "m"))
    assert b.failures(("a", "m")) == 0


async def test_controller_bounded_workers_one_pass_per_key_and_retries() -> None:
    running = 0
    peak = 0
    calls: dict[Key, int] = {}
    fail_once = {("a", "bad")}

    async def reconcile(key: Key) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        calls[key] = calls.get(key, 0) + 1
        await asyncio.sleep(0.01)
        running -= 1
        if key in fail_once:
            fail_once.discard(key)
            raise RuntimeError("boom")

    c = Controller(reconcile, list, workers=3, backoff_base_s=0.02, resync_interval_s=0)
    await c.start()
    for i in range(20):
        c.enqueue("a", f"m{i}")
        c.enqueue("a", f"m{i}")  # de-duplicated
    c.enqueue("a", "bad")
    for _ in range(200):
        if calls.get(("a", "bad"), 0) >= 2 and len(calls) == 21 and running == 0:
            break
        await asyncio.sleep(0.01)
    await c.stop()
    assert peak <= 3
    assert all(calls[("a", f"m{i}")] == 1 for i in range(20))
    assert calls[("a", "bad")] == 2  # failed, backed off, succeeded
    assert c.stats.failures == 1
    assert c.backoff.failures(("a", "bad")) == 0


async def test_resync_enqueues_every_key() -> None:
    seen: list[Key] = []

    async def reconcile(key: Key) -> None:
        seen.append(key)

    c = Controller(reconcile, lambda: [("a", "x"), ("b", "y")], workers=1, resync_interval_s=0.05)
    await c.start()
    for _ in range(100):
        if {("a", "x"), ("b", "y")} <= set(seen):
            break
        await asyncio.sleep(0.01)
    await c.stop()
    assert {("a", "x"), ("b", "y")} <= set(seen)
    assert c.stats.resyncs >= 1


async def test_controller_restarts_with_a_fresh_queue() -> None:
    """A replica that loses the Lease stops its workers; leading again starts them on a new queue
    (the closed one would refuse every key)."""
    seen: list[Key] = []

    async def reconcile(key: Key) -> None:
        seen.append(key)

    c = Controller(reconcile, list, workers=1, resync_interval_s=0)
    await c.start()
    c.enqueue("a", "first")
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.01)
    await c.stop()
    c.enqueue("a", "while-stopped")  # refused by the closed queue: the next term enqueues everything
    await c.start()
    c.enqueue("a", "second")
    for _ in range(100):
        if ("a", "second") in seen:
            break
        await asyncio.sleep(0.01)
    await c.stop()
    assert seen == [("a", "first"), ("a", "second")]
