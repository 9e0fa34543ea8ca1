"""A new generation that lands under the operator's own status write is reconciled, on the real API server.

The race (seen in a fresh-clone CI run: `autoscaling` applied while the first pass wrote `phase: Ready`,
no HPA in 120 s, nothing in the operator's log): a pass reads generation 1 from the cache, the user applies
generation 2, the pass's status write is answered with the whole object as it is now — generation 2 —
and that answer is written through into the cache (reconcile.finish). The user's watch event arrives after
it, older than what the cache holds, and is ignored; the status write's own event equals it and routes as
no change. Nothing enqueued the ServedModel: its new spec waited for the resync (10 minutes).

Here the watch is made late on purpose (its real events held while the writes happen, then delivered), the
status write is reconcile.finish's own, and the informer, cache and router are the operator's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml
from cluster_support import served_model, until

import controlplane
from servedmodel import watches
from servedmodel.config import OperatorConfig
from servedmodel.controller import Controller
from servedmodel.k8s import Cache, KubeClient, load_identity
from servedmodel.k8s.informer import Informer
from servedmodel.reconcile import finish

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]


class LateWatch(KubeClient):
    """The operator's client, whose watch events wait at `gate` (a loaded API server or operator: the
    events are the API server's own, only later)."""

    gate: asyncio.Event

    async def watch(self, *args: Any, **kwargs: Any) -> AsyncIterator[tuple[str, Obj]]:  # type: ignore[override]
        async for event in super().watch(*args, **kwargs):
            await self.gate.wait()
            yield event


class Enqueued(Controller):
    """The controller's enqueue, recorded; no workers (the test plays the pass)."""

    def __init__(self) -> None:
        async def never(key: tuple[str, str]) -> None:
            raise AssertionError("no worker runs here")

        super().__init__(never, list, workers=1, resync_interval_s=0)
        self.keys: list[tuple[str, str]] = []

    def enqueue(self, namespace: str, name: str, *, after: float = 0.0) -> None:
        self.keys.append((namespace, name))


async def test_a_generation_applied_under_a_status_write_is_enqueued(
    control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    cp, name = control_plane, "raced"
    async with LateWatch(load_identity(str(cp.kubeconfig))) as client:
        client.gate = asyncio.Event()
        client.gate.set()
        cache, controller = Cache(), Enqueued()
        routes = watches.handlers(cache, controller)  # as handlers/startup.py wires them
        informer = Informer(
            client, watches.WATCHES[0], cache, routes[watches.SERVED_MODEL], namespace=namespace
        )
        assert informer.watched.kind == watches.SERVED_MODEL
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 30)
            await asyncio.to_thread(
                cp.kubectl, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(served_model(name))
            )

            def cached() -> Obj | None:
                return cache.get(watches.SERVED_MODEL, namespace, name)

            await until(cached, 30, "generation 1 in the cache")
            assert controller.keys == [(namespace, name)]  # its ADDED
            body = cached()
            assert body is not None
            assert body["metadata"]["generation"] == 1

            # The pass has read generation 1. From here the watch is late.
            client.gate.clear()
            patch = json.dumps({"spec": {"replicas": 2}})
            await asyncio.to_thread(
                cp.kubectl, "patch", "servedmodel", name, "-n", namespace, "--type=merge", "-p", patch
            )
            wrote, _ = await finish(
                client, cache, OperatorConfig(), body, {"phase": "Pending", "observedGeneration": 1}, None
            )
            assert wrote
            answered = cache.get(watches.SERVED_MODEL, namespace, name)
            assert answered is not None
            assert answered["metadata"]["generation"] == 2  # the answer carries the user's change

            # The watch catches up: the patch's event (older than the answer) and the write's (equal).
            client.gate.set()
            rv = int(answered["metadata"]["resourceVersion"])
            await until(lambda: int(informer._rv or 0) >= rv, 30, "the watch past the status write")
            assert controller.keys.count((namespace, name)) == 2, (
                "generation 2 was never enqueued: its event came after the status write's answer"
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
