"""What a ServedModel event enqueues (servedmodel/watches.py): the probe's per-cycle writes do not
reconcile; what the reconciler reads does; a child event never brings back a ServedModel the cache
no longer has."""

from __future__ import annotations

from typing import Any

from servedmodel.controller import Controller
from servedmodel.k8s import Cache
from servedmodel.watches import handlers, leader_keys, reconciler_inputs, route


def body(serving: dict[str, Any] | None = None, *, generation: int = 1, ttft: float = 0.1) -> dict[str, Any]:
    conds = [{"type": "Serving", **serving}] if serving else []
    return {
        "metadata": {"name": "m", "namespace": "a", "uid": "u", "generation": generation},
        "status": {"phase": "Ready", "probe": {"ttftSeconds": ttft}, "conditions": conds},
    }


def test_probe_figures_and_a_healthy_servings_message_do_not_reconcile() -> None:
    ok = {"status": "True", "reason": "ChatCompleted"}
    assert reconciler_inputs(body({**ok, "message": "TTFT 0.101 s"}, ttft=0.1)) == reconciler_inputs(
        body({**ok, "message": "TTFT 0.250 s"}, ttft=0.25)
    )


def test_what_the_reconciler_reads_does() -> None:
    failing = {"status": "False", "reason": "ProbeFailed"}
    assert reconciler_inputs(body({**failing, "message": "HTTP 500"})) != reconciler_inputs(
        body({**failing, "message": "HTTP 503"})
    )  # the Degraded message quotes it
    ok = {"status": "True", "reason": "ChatCompleted", "message": "x"}
    assert reconciler_inputs(body(ok)) != reconciler_inputs(body({**ok, "status": "False"}))
    assert reconciler_inputs(body(ok)) != reconciler_inputs(body(ok, generation=2))


def recording_controller() -> tuple[Controller, list[tuple[str, str]]]:
    """A Controller (never started) whose enqueues are recorded in the list returned with it."""
    enqueued: list[tuple[str, str]] = []

    async def reconcile(key: tuple[str, str]) -> None:
        return None

    controller = Controller(reconcile, list, workers=1, resync_interval_s=0)
    controller.enqueue = lambda ns, name, after=0.0: enqueued.append((ns, name))  # type: ignore[method-assign]
    return controller, enqueued


async def test_a_child_event_of_a_forgotten_owner_enqueues_nothing() -> None:
    controller, enqueued = recording_controller()
    cache = Cache()
    child = {
        "metadata": {
            "name": "m",
            "namespace": "a",
            "ownerReferences": [{"kind": "ServedModel", "name": "m", "uid": "u", "controller": True}],
        }
    }
    route("Deployment", cache, controller)("DELETED", child, None)
    assert enqueued == []
    cache.apply_event("ServedModel", "ADDED", body())
    route("Deployment", cache, controller)("DELETED", child, None)
    assert enqueued == [("a", "m")]


def test_a_write_answer_carrying_a_new_generation_enqueues_and_our_own_status_does_not() -> None:
    """Cache.on_written (watches.on_written): a status write answered with the user's newer spec hides
    that spec's watch event (older than the answer, then one equal to it), so the answer is routed."""
    controller, enqueued = recording_controller()
    cache = Cache()
    routed = handlers(cache, controller)["ServedModel"]  # the cache's on_written wired too

    def at(rv: int, generation: int, phase: str) -> dict[str, Any]:
        b = body(generation=generation)
        b["metadata"]["resourceVersion"] = str(rv)
        b["status"]["phase"] = phase
        return b

    def event(obj: dict[str, Any]) -> None:  # as k8s/informer.py feeds the cache and the router
        old = cache.get("ServedModel", "a", "m")
        if cache.apply_event("ServedModel", "MODIFIED", obj):
            routed("MODIFIED", old, cache.get("ServedModel", "a", "m"))

    event(at(10, 1, "Progressing"))
    enqueued.clear()
    cache.upsert("ServedModel", at(11, 1, "Ready"))  # our own status write: nothing else in it
    event(at(11, 1, "Ready"))
    assert enqueued == []

    cache.upsert("ServedModel", at(13, 2, "Ready"))  # answered with generation 2 (the user's, rv 12)
    assert enqueued == [("a", "m")]
    event(at(12, 2, "Ready"))  # the user's event, late: older than the cache, ignored
    event(at(13, 2, "Ready"))  # the write's own: equal, no change
    assert enqueued == [("a", "m")]


def test_a_new_leader_looks_at_the_unsettled_first() -> None:
    """leader_keys: the queue is FIFO, so a model mid-creation must not wait behind no-op passes over the
    settled ones; the order is otherwise the cache's."""
    cache = Cache()
    cache.track("ServedModel")

    def sm(name: str, *, generation: int, observed: int | None, phase: str | None) -> dict[str, Any]:
        status = {"observedGeneration": observed, "phase": phase} if observed is not None else {}
        return {
            "metadata": {"name": name, "namespace": "a", "uid": name, "generation": generation},
            "status": status,
        }

    cache.upsert("ServedModel", sm("ready-1", generation=1, observed=1, phase="Ready"))
    cache.upsert("ServedModel", sm("new", generation=1, observed=None, phase=None))
    cache.upsert("ServedModel", sm("ready-2", generation=2, observed=2, phase="Ready"))
    cache.upsert("ServedModel", sm("edited", generation=3, observed=2, phase="Ready"))
    cache.upsert("ServedModel", sm("degraded", generation=1, observed=1, phase="Degraded"))
    assert [name for _, name in leader_keys(cache)] == ["degraded", "edited", "new", "ready-1", "ready-2"]
