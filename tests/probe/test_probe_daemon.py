"""The probe scheduler (servedmodel.prober) without kopf: its pure pieces, and whole cycles against the
simulator on loopback. The Kubernetes side is a recorder of the scheduler's reads and writes (the real
API server is in tests/cluster/test_probe_cluster.py)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import replica_support
from probe_support import set_faults
from replica_support import Cluster

from servedmodel.api.spec import ServedModelSpec
from servedmodel.api.status import ServedModelStatus
from servedmodel.k8s.cache import Cache
from servedmodel.probe.client import ProbeOutcome
from servedmodel.probe.compose import previous_probe_status, status_patch
from servedmodel.probe.errors import ENGINE_UNHEALTHY, ProbeFailure
from servedmodel.prober import ProbeScheduler, first_due
from servedmodel.prober.cycle import Model
from servedmodel.sim.process import SimulatorProcess

MANAGED = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "resources": {"gpus": 1}}
EXTERNAL = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "endpoint": "http://127.0.0.1:8000"}


def test_patch_holds_only_the_probes_fields() -> None:
    now = datetime(2026, 11, 29, 19, 0, tzinfo=UTC)
    out = ProbeOutcome(endpoint="http://127.0.0.1:1", started=now, ended=now)
    out.failure = ProbeFailure(ENGINE_UNHEALTHY, "GET /health: 503")
    spec = ServedModelSpec.model_validate({**MANAGED, "probe": {"slo": {"ttftMs": 100}}})
    reconciler_conditions = [{"type": "Ready", "status": "True", "reason": "Available", "message": ""}]
    new, patch = status_patch(out, spec.probe, {"phase": "Ready", "conditions": reconciler_conditions}, 4)
    assert set(patch) == {"probe", "conditions"}
    assert [c["type"] for c in patch["conditions"]] == ["Serving", "TemplateOK", "LatencySLOMet"]
    assert patch["conditions"][0]["reason"] == ENGINE_UNHEALTHY
    assert all(c["observedGeneration"] == 4 for c in patch["conditions"])
    assert new.consecutive_failures == 1
    # what the scheduler applies validates against the CR's status model (the CRD is generated from it)
    ServedModelStatus.model_validate(patch)
    # a previous status.probe from an older schema is ignored, not fatal
    _, again = status_patch(out, spec.probe, {"probe": {"unknownField": 1}}, 4)
    assert again["probe"]["consecutiveFailures"] == 1


def test_previous_status_falls_back_to_the_last_write() -> None:
    """The watch may not have delivered the scheduler's last write yet: the window still grows."""
    t1 = datetime(2026, 11, 29, 19, 0, tzinfo=UTC)
    t2 = datetime(2026, 11, 29, 19, 1, tzinfo=UTC)
    spec = ServedModelSpec.model_validate(MANAGED)
    fail1 = ProbeOutcome(endpoint="x", started=t1, ended=t1, failure=ProbeFailure(ENGINE_UNHEALTHY, "503"))
    first, first_patch = status_patch(fail1, spec.probe, {}, 1)
    fail2 = ProbeOutcome(endpoint="x", started=t2, ended=t2, failure=ProbeFailure(ENGINE_UNHEALTHY, "503"))
    stale_body: dict[str, Any] = {}
    second, second_patch = status_patch(fail2, spec.probe, stale_body, 1, first_patch)
    assert second.consecutive_failures == 2
    # the last write is parsed back from the patch as it was composed
    assert previous_probe_status({}, first_patch) == first
    # the body's own status.probe wins once the watch has delivered as new a write (or newer)
    assert previous_probe_status({"probe": second_patch["probe"]}, first_patch) == second
    # an older write than the body's is not continued from, nor a body from an older schema
    assert previous_probe_status({"probe": first_patch["probe"]}, second_patch) == second
    assert previous_probe_status({"probe": {"unknownField": 1}}, first_patch) == first
    assert previous_probe_status({"probe": {"unknownField": 1}}, None) is None


def test_the_scheduler_keeps_its_last_write_once() -> None:
    """A ServedModel's status.probe is held as the cache's body and the scheduler's last patch, not
    also as a parsed ProbeStatus (~12 KB per ServedModel: 120 MB at 10,000); the patch as its JSON
    (~2.6 KB against ~11.9 KB as a dict)."""
    held = {f.name: str(f.type) for f in dataclasses.fields(Model)}
    assert held.get("last_patch_json") == "bytes | None"
    assert not [name for name, kind in held.items() if "ProbeStatus" in kind]


def test_first_due_spreads_new_models_and_keeps_the_spread_after_a_restart() -> None:
    rng = random.Random(7)
    wall = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    fresh = [first_due(100.0, 60, None, wall, rng) for _ in range(1000)]
    assert min(fresh) >= 100.0
    assert max(fresh) <= 106.0  # within the first 10 % of the interval
    assert len({round(d, 3) for d in fresh}) > 900  # not one instant
    # probed 20 s before the restart: next cycle 40 s from now, as it would have been
    last = (wall - timedelta(seconds=20)).isoformat().replace("+00:00", "Z")
    assert first_due(100.0, 60, last, wall, rng) == pytest.approx(140.0)
    # the operator was down for longer than an interval: anywhere in the next one
    stale = (wall - timedelta(seconds=600)).isoformat().replace("+00:00", "Z")
    restarted = [first_due(100.0, 60, stale, wall, rng) for _ in range(1000)]
    assert min(restarted) >= 100.0
    assert max(restarted) <= 160.0
    assert max(restarted) - min(restarted) > 50


def external(name: str, url: str, **probe: Any) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": name, "namespace": "ns", "generation": 1, "uid": f"uid-{name}"},
        "spec": {
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "servedModelName": "qwen",
            "endpoint": url,
            "probe": {"interval": 5, "checkLimits": False, **probe},
        },
    }


def scheduler(kube: Cluster, **config: Any) -> tuple[ProbeScheduler, list[tuple[str, str]]]:
    """The scheduler, and the (namespace, name) keys it asks the reconciler to look at again."""
    enqueued: list[tuple[str, str]] = []
    sched = replica_support.scheduler(
        kube, enqueue=lambda ns, name: enqueued.append((ns, name)), seed=1, **config
    )
    return sched, enqueued


def test_cycle_writes_once_and_enqueues_when_serving_changes(faults: SimulatorProcess) -> None:
    async def main() -> None:
        kube = Cluster()
        body = external("a", faults.base_url)
        kube.objects[("ns", "a")] = body
        sched, enqueued = scheduler(kube)
        sched.track(body)
        try:  # cycles driven by the test; the scheduling loop is not started
            first = await sched.run_cycle(("ns", "a"))
            assert first.probed
            assert first.written
            assert enqueued == [("ns", "a")]
            assert len(kube.writes) == 1
            patch = kube.writes[0][2]
            assert patch["probe"]["result"] == "Success"
            assert sched._models[("ns", "a")].last_patch() == patch  # held as JSON, decoded the same
            assert 4.5 <= first.next_delay_s <= 5.5  # the interval, jittered ±10 %
            # the next success changes figures (one write) but not Serving: nothing enqueued
            second = await sched.run_cycle(("ns", "a"))
            assert second.written
            assert enqueued == [("ns", "a")]
            assert len(kube.writes) == 2
            # the engine dies: Serving turns False, the reconciler is asked to look again
            await asyncio.to_thread(set_faults, faults, dead=True)
            third = await sched.run_cycle(("ns", "a"))
            assert third.written
            assert kube.writes[-1][2]["conditions"][0]["reason"] == ENGINE_UNHEALTHY
            assert enqueued == [("ns", "a"), ("ns", "a")]
            # failing again: this model backs off (two intervals), Serving unchanged, nothing enqueued
            fourth = await sched.run_cycle(("ns", "a"))
            assert 9.0 <= fourth.next_delay_s <= 11.0
            assert len(enqueued) == 2
        finally:
            await sched.stop()

    asyncio.run(main())


def test_nothing_written_when_disabled_deleting_or_gone(faults: SimulatorProcess) -> None:
    async def main() -> None:
        kube = Cluster()
        sched, enqueued = scheduler(kube)
        try:
            off = external("off", faults.base_url, enabled=False)
            kube.objects[("ns", "off")] = off
            sched.track(off)
            result = await sched.run_cycle(("ns", "off"))
            assert (result.probed, result.skipped, result.next_delay_s) == (False, "disabled", 5.0)

            going = external("going", faults.base_url)
            going["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
            sched.track(going)
            assert ("ns", "going") not in sched.tracked()  # a deletionTimestamp forgets it

            gone = external("gone", faults.base_url)
            sched.track(gone)  # tracked from an event, but the API server no longer has it
            result = await sched.run_cycle(("ns", "gone"))
            assert result.probed
            assert not result.written
            assert ("ns", "gone") not in sched.tracked()
        finally:
            await sched.stop()
        assert kube.writes == []
        assert enqueued == []

    asyncio.run(main())


def test_models_fire_spread_out_under_the_concurrency_cap(faults: SimulatorProcess) -> None:
    """Twenty models with a cap of 3: never more than 3 cycles at once, every model probed, each written
    once per cycle, and stop() leaves no task behind."""

    async def main() -> None:
        kube = Cluster()
        sched, _ = scheduler(kube, probe_concurrency=3)
        in_flight: list[int] = []
        real = sched.run_cycle

        async def counting(key: tuple[str, str]) -> Any:
            in_flight.append(int(sched.metrics.in_flight._value.get()))
            return await real(key)

        sched.run_cycle = counting  # type: ignore[method-assign]
        names = [f"m{i:02d}" for i in range(20)]
        for n in names:
            body = external(n, faults.base_url)
            kube.objects[("ns", n)] = body
            sched.track(body)
        await sched.start()
        try:
            for _ in range(300):
                if {w[1] for w in kube.writes} >= set(names):
                    break
                await asyncio.sleep(0.1)
        finally:
            await sched.stop()
        assert {w[1] for w in kube.writes} == set(names)
        assert max(in_flight) <= 3
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert leftover == []

    asyncio.run(main())


def test_stop_cancels_a_cycle_in_flight_and_nothing_is_written(faults: SimulatorProcess) -> None:
    async def main() -> None:
        kube = Cluster()
        await asyncio.to_thread(set_faults, faults, first_byte_delay_ms=10_000)
        body = external("slow", faults.base_url)
        kube.objects[("ns", "slow")] = body
        sched, _ = scheduler(kube)
        sched.track(body)
        await sched.start()
        for _ in range(100):  # the first cycle runs within 10 % of the 5 s interval
            if sched.metrics.in_flight._value.get() >= 1:
                break
            await asyncio.sleep(0.05)
        assert sched.metrics.in_flight._value.get() == 1
        await asyncio.wait_for(sched.stop(), timeout=5)
        assert kube.writes == []
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(main())


def test_scheduler_follows_the_watch_fed_cache(faults: SimulatorProcess) -> None:
    """Fed by the controller's cache (no kopf, no track() calls): a ServedModel in the cache is probed and
    its status written through into the cache; removed from the cache, it is forgotten."""

    async def main() -> None:
        kube = Cluster()
        cache = Cache()
        body = external("cached", faults.base_url)
        body["metadata"]["resourceVersion"] = "1"
        kube.objects[("ns", "cached")] = body
        cache.apply_event("ServedModel", None, body)
        sched = replica_support.scheduler(kube, cache=cache, seed=2)
        await sched.start()
        try:
            for _ in range(100):  # the first cycle runs within 10 % of the 5 s interval
                if kube.writes:
                    break
                await asyncio.sleep(0.05)
            assert [w[1] for w in kube.writes] == ["cached"]
            cached = cache.get("ServedModel", "ns", "cached")
            assert cached is not None
            assert cached["status"]["probe"]["result"] == "Success"  # written through
            # the cache's copy is the only one: the scheduler's Model keeps no body beside it
            assert sched._models[("ns", "cached")].body is None
            cache.remove("ServedModel", "ns", "cached")
            for _ in range(300):  # the loop looks at the cache at least every IDLE_TICK_S (5 s)
                if not sched.tracked():
                    break
                await asyncio.sleep(0.05)
            assert sched.tracked() == []
        finally:
            await sched.stop()

    asyncio.run(main())


class EventsNotListed(Cluster):
    """A cluster whose Events must not be listed: the prober has them from the Events watch's cache."""

    async def list(self, api_version: str, plural: str, namespace: str | None = None, **kw: Any) -> list[Any]:
        assert plural != "events", f"Events listed: {kw}"
        return await super().list(api_version, plural, namespace, **kw)


def test_a_pods_pulled_event_comes_from_the_watch_fed_cache_not_a_list() -> None:
    """A pod's start that ended reads its Pulled Event (status.startup's imagePulled) from the cache the
    Events watch feeds (watches.py): a list per start read every Event of the namespace from etcd. Without
    that watch (no cache, or one not fed Events) the prober lists them."""

    def event(name: str, about: str) -> dict[str, Any]:
        return {
            "kind": "Event",
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": "3"},
            "involvedObject": {"kind": "Pod", "uid": about, "fieldPath": "spec.containers{engine}"},
            "reason": "Pulled",
        }

    async def main() -> None:
        cache = Cache()
        cache.replace("Event", [event("a.1", "pod-a"), event("b.1", "pod-b")], "3")
        watched = replica_support.scheduler(EventsNotListed(), cache=cache).runner
        assert [e["metadata"]["name"] for e in await watched._pulled("ns", "pod-a")] == ["a.1"]
        assert await watched._pulled("ns", "pod-c") == []

        listed: list[dict[str, Any]] = []

        class Listing(Cluster):
            async def list(
                self, api_version: str, plural: str, namespace: str | None = None, **kw: Any
            ) -> Any:
                listed.append({"plural": plural, "namespace": namespace, **kw})
                return [event("a.1", "pod-a")]

        unwatched = replica_support.scheduler(Listing(), cache=Cache()).runner
        assert [e["metadata"]["name"] for e in await unwatched._pulled("ns", "pod-a")] == ["a.1"]
        assert listed == [
            {"plural": "events", "namespace": "ns", "field_selector": {"involvedObject.uid": "pod-a"}}
        ]

    asyncio.run(main())


class StatusWrites(Cluster):
    """A cluster that records how each status write was made: its answer read into the cache first
    ("through") or left to the watch ("unread")."""

    def __init__(self) -> None:
        super().__init__()
        self.ways: list[str] = []

    async def apply_status(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.ways.append("through")
        return await Cluster.apply_status(self, *args, **kwargs)

    async def apply_status_unread(self, *args: Any, encoded: bytes | None = None, **kwargs: Any) -> None:
        self.ways.append("unread")
        assert encoded is None or json.loads(encoded) == args[4]  # the status, as the client would send it
        await Cluster.apply_status(self, *args, **kwargs)


def test_a_write_the_reconciler_reads_goes_through_the_cache_the_others_are_left_to_the_watch(
    faults: SimulatorProcess,
) -> None:
    """Where a watch feeds the cache, a cycle that changes only figures leaves its write's answer
    undecoded (the write comes back as its watch event); one that changes Serving, which the reconciler
    reads, puts the answer into the cache before it enqueues the reconciler, so that pass reads it."""

    async def main() -> None:
        kube = StatusWrites()
        cache = Cache()
        body = external("m", faults.base_url)
        body["metadata"]["resourceVersion"] = "1"
        kube.objects[("ns", "m")] = body
        cache.apply_event("ServedModel", None, body)  # a watch feeds ServedModels (Cache.tracks)
        sched, enqueued = scheduler(kube, cache=cache)
        sched.track(body)

        def cached() -> dict[str, Any]:
            obj = cache.get("ServedModel", "ns", "m")
            assert obj is not None
            return obj

        await sched.run_cycle(("ns", "m"))  # Serving: none -> True
        assert kube.ways == ["through"]
        assert enqueued == [("ns", "m")]
        assert serving_of(cached()) == "True"
        first = cached()["status"]["probe"]["lastProbeTime"]

        await sched.run_cycle(("ns", "m"))  # only the figures change
        assert kube.ways == ["through", "unread"]
        assert enqueued == [("ns", "m")]
        assert cached()["status"]["probe"]["lastProbeTime"] == first  # left to the watch
        written = kube.objects[("ns", "m")]
        assert written["status"]["probe"]["lastProbeTime"] > first  # but written
        cache.apply_event("ServedModel", "MODIFIED", copy.deepcopy(written))  # its watch event

        set_faults(faults, dead=True)
        await sched.run_cycle(("ns", "m"))  # Serving: True -> False
        assert kube.ways == ["through", "unread", "through"]
        assert enqueued == [("ns", "m"), ("ns", "m")]
        assert serving_of(cached()) == "False"  # in the cache before the reconciler runs

    asyncio.run(main())


def serving_of(obj: dict[str, Any]) -> str | None:
    return next((c["status"] for c in obj["status"]["conditions"] if c["type"] == "Serving"), None)
