"""The watch-fed cache's index by ServedModel (the instance label) and its Pod projection."""

from __future__ import annotations

from typing import Any

from servedmodel.k8s.cache import Cache
from servedmodel.probe.endpoints import pod_base_url

INSTANCE = "app.kubernetes.io/instance"


def pod(name: str, instance: str | None, rv: int = 1, namespace: str = "a") -> dict[str, Any]:
    labels = {"app.kubernetes.io/component": "engine"}
    if instance is not None:
        labels[INSTANCE] = instance
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "resourceVersion": str(rv)},
        "spec": {
            "nodeName": "kwok-gpu-0",
            "readinessGates": [{"conditionType": "inference.servedmodel.io/serving"}],
            "containers": [
                {
                    "name": "engine",
                    "image": "vllm/vllm-openai:v0.33.0",
                    "args": ["--model", "Qwen/Qwen2.5-7B-Instruct"] * 20,
                    "env": [{"name": f"E{i}", "value": "x" * 50} for i in range(20)],
                    "ports": [{"name": "http", "containerPort": 8123}],
                }
            ],
            "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "c"}}],
        },
        "status": {"podIP": "10.244.0.7", "phase": "Running"},
    }


def names(objs: list[dict[str, Any]]) -> list[str]:
    return [o["metadata"]["name"] for o in objs]


def test_list_by_instance_reads_that_models_objects_and_follows_label_changes() -> None:
    c = Cache()
    for i in range(5):
        c.upsert("Pod", pod(f"m{i}-x", f"m{i}"))
    c.upsert("Pod", pod("m1-y", "m1"))
    c.upsert("Pod", pod("m1-other-ns", "m1", namespace="b"))
    c.upsert("Pod", pod("unlabelled", None))
    assert names(c.list("Pod", "a", labels={INSTANCE: "m1"})) == ["m1-x", "m1-y"]
    # The other labels still filter inside the instance's group.
    assert c.list("Pod", "a", labels={INSTANCE: "m1", "app.kubernetes.io/component": "router"}) == []
    # A relabelled object moves to its new group; a removed one leaves its group.
    c.upsert("Pod", pod("m1-y", "m2", rv=2))
    assert names(c.list("Pod", "a", labels={INSTANCE: "m1"})) == ["m1-x"]
    assert names(c.list("Pod", "a", labels={INSTANCE: "m2"})) == ["m1-y", "m2-x"]
    c.apply_event("Pod", "DELETED", pod("m1-x", "m1"))
    assert c.list("Pod", "a", labels={INSTANCE: "m1"}) == []
    # A stale event changes neither the store nor the index.
    assert not c.upsert("Pod", pod("m1-y", "m1", rv=1))
    assert names(c.list("Pod", "a", labels={INSTANCE: "m2"})) == ["m1-y", "m2-x"]
    # Without the instance label, every object of the namespace is considered.
    assert len(c.list("Pod", "a")) == 6
    assert names(c.list("Pod", None, labels={INSTANCE: "m1"})) == ["m1-other-ns"]


def test_pods_keep_only_what_the_operator_reads() -> None:
    c = Cache()
    c.upsert("Pod", pod("p", "m"))
    stored = c.get("Pod", "a", "p")
    assert stored is not None
    container = stored["spec"]["containers"][0]
    assert set(container) == {"name", "image", "ports"}
    assert "volumes" not in stored["spec"]
    assert stored["spec"]["readinessGates"] == [{"conditionType": "inference.servedmodel.io/serving"}]
    assert pod_base_url(stored) == "http://10.244.0.7:8123"  # the engine's port is still found
    assert stored["status"] == {"podIP": "10.244.0.7", "phase": "Running"}
    # Other kinds keep their spec whole (the reconciler compares a Deployment's with what it renders).
    deployment = {**pod("d", "m"), "kind": "Deployment"}
    c.upsert("Deployment", deployment)
    assert c.get("Deployment", "a", "d") == deployment


def sm(name: str, uid: str, rv: int, namespace: str = "a") -> dict[str, Any]:
    return {
        "kind": "ServedModel",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": str(rv)},
    }


def test_relist_replaces_what_the_cache_holds() -> None:
    """A relist after a watch gap is the only news of the deletes made in it: what the list lacks goes,
    and each change comes back as a Delta (the informer enqueues the owners)."""
    cache = Cache()
    for i in range(4):
        cache.apply_event("ServedModel", "ADDED", sm(f"m{i}", f"u{i}", 10 + i))
    deltas = cache.replace("ServedModel", [sm("m0", "u0", 10), sm("m1", "u1", 20), sm("m9", "u9", 21)], "30")
    assert cache.keys("ServedModel") == [("a", "m0"), ("a", "m1"), ("a", "m9")]
    got = sorted((d.type, d.obj["metadata"]["name"]) for d in deltas)
    assert got == [("ADDED", "m9"), ("DELETED", "m2"), ("DELETED", "m3"), ("MODIFIED", "m1")]


def test_relist_keeps_a_write_newer_than_the_list_and_scopes_to_its_namespace() -> None:
    cache = Cache()
    cache.upsert("ServedModel", sm("late", "u1", 50))  # written through after the list's snapshot
    cache.apply_event("ServedModel", "ADDED", sm("other", "u2", 5, namespace="b"))
    cache.replace("ServedModel", [], "40", namespace="a")
    assert cache.keys("ServedModel") == [("a", "late"), ("b", "other")]
    cache.replace("ServedModel", [], "60")
    assert cache.keys("ServedModel") == []


def test_relist_of_a_recreated_name_reports_delete_then_add() -> None:
    cache = Cache()
    cache.apply_event("ServedModel", "ADDED", sm("m", "old", 5))
    deltas = cache.replace("ServedModel", [sm("m", "new", 9)], "10")
    assert [(d.type, d.obj["metadata"]["uid"]) for d in deltas] == [("DELETED", "old"), ("ADDED", "new")]


def test_deleted_compares_uid() -> None:
    """delete + recreate of one name: the new object's write-through can land before the old DELETED."""
    cache = Cache()
    cache.apply_event("ServedModel", "ADDED", sm("m", "old", 5))
    cache.upsert("ServedModel", sm("m", "new", 8))
    assert not cache.apply_event("ServedModel", "DELETED", sm("m", "old", 7))
    assert (cache.get("ServedModel", "a", "m") or {})["metadata"]["uid"] == "new"


def test_a_late_write_through_never_resurrects() -> None:
    cache = Cache()
    cache.apply_event("ServedModel", "ADDED", sm("m", "u", 5))
    cache.apply_event("ServedModel", "DELETED", sm("m", "u", 6))
    assert not cache.upsert("ServedModel", sm("m", "u", 7))  # the status write's answer, arriving late
    assert cache.get("ServedModel", "a", "m") is None
    assert cache.upsert("ServedModel", sm("m", "u2", 8))  # a new object of that name is welcome


def test_evict_forgets_and_tombstones() -> None:
    cache = Cache()
    cache.apply_event("ServedModel", "ADDED", sm("m", "u", 5))
    assert cache.evict("ServedModel", sm("m", "u", 5))
    assert cache.get("ServedModel", "a", "m") is None
    assert not cache.upsert("ServedModel", sm("m", "u", 9))


def test_a_late_404_for_the_old_object_leaves_the_recreated_one() -> None:
    # Delete + recreate of one name: the new object's ADDED event is in the cache before the old one's
    # status write comes back 404. The eviction names the old uid; the new object stays (it did not:
    # test_faults.py's delete + recreate x100 once ended with the API holding one ServedModel and the
    # operator's cache none, so nothing reconciled or probed it).
    cache = Cache()
    cache.apply_event("ServedModel", "ADDED", sm("m", "old", 5))
    cache.apply_event("ServedModel", "ADDED", sm("m", "new", 7))
    assert not cache.evict("ServedModel", sm("m", "old", 5))
    got = cache.get("ServedModel", "a", "m")
    assert got is not None
    assert got["metadata"]["uid"] == "new"
    cache.apply_event("ServedModel", "DELETED", sm("m", "old", 8))  # the watch catches up: still there
    assert cache.get("ServedModel", "a", "m") is not None
    assert not cache.upsert("ServedModel", sm("m", "old", 6))  # the old one's late answer stays out


def test_the_event_of_a_state_written_through_is_stored_and_routed_once_for_a_routed_kind() -> None:
    """The probe writes status every cycle; its answer is written through (and routed by on_written).
    The watch event of that same state (equal resourceVersion) is then no change for such a kind; for a
    kind whose events route what its write's answers carried in (a child), it is still a change. An
    older event is stale for both, a newer one a change."""
    cache = Cache()
    cache.routed_on_write = {"ServedModel"}
    routed: list[tuple[str, Any, Any]] = []
    cache.on_written = lambda kind, old, new: routed.append((kind, old, new))
    for kind in ("ServedModel", "Pod"):
        first = pod("m", "m", rv=5) | {"kind": kind}
        assert cache.apply_event(kind, "ADDED", first)
        assert cache.upsert(kind, pod("m", "m", rv=7) | {"kind": kind})  # our write's answer
        stored = cache.get(kind, "a", "m")
        assert not cache.upsert(kind, pod("m", "m", rv=7) | {"kind": kind})  # a write that changed nothing
        assert not cache.apply_event(kind, "MODIFIED", pod("m", "m", rv=6) | {"kind": kind})  # stale
        assert cache.apply_event(kind, "MODIFIED", pod("m", "m", rv=7) | {"kind": kind}) == (kind == "Pod")
        if kind == "ServedModel":
            assert cache.get(kind, "a", "m") is stored  # not slimmed and stored again
        assert cache.apply_event(kind, "MODIFIED", pod("m", "m", rv=8) | {"kind": kind})
    assert [(kind, old["metadata"]["resourceVersion"]) for kind, old, _ in routed] == [
        ("ServedModel", "5"),
        ("Pod", "5"),
    ]


def pulled(name: str, about: str, rv: int = 1, namespace: str = "a") -> dict[str, Any]:
    return {
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(rv), "uid": f"e-{name}"},
        "involvedObject": {"kind": "Pod", "name": f"pod-{about}", "uid": about},
        "reason": "Pulled",
    }


def test_events_are_found_by_the_uid_of_what_they_are_about() -> None:
    """An object's Events without a scan of all of them (the prober reads a pod's Pulled Event when its
    start ends): the index follows upserts, a relist that drops one, and a delete."""
    cache = Cache()
    cache.replace("Event", [pulled("p1.a", "u1"), pulled("p1.b", "u1"), pulled("p2.a", "u2")], "5")
    assert names(cache.events_about("u1")) == ["p1.a", "p1.b"]
    assert names(cache.events_about("u2")) == ["p2.a"]
    assert cache.events_about("u3") == []
    # a newer copy of one replaces it in the index, not beside it
    cache.apply_event("Event", "MODIFIED", pulled("p1.a", "u1", rv=6))
    assert [e["metadata"]["resourceVersion"] for e in cache.events_about("u1")] == ["6", "1"]
    # a relist without p1.b (expired during a watch gap) drops it from the index too
    cache.replace("Event", [pulled("p1.a", "u1", rv=6), pulled("p2.a", "u2")], "7")
    assert names(cache.events_about("u1")) == ["p1.a"]
    cache.apply_event("Event", "DELETED", pulled("p2.a", "u2"))
    assert cache.events_about("u2") == []
    assert cache._by_involved.keys() == {"u1"}  # nothing left behind for a pod whose Events are gone
    # other kinds are not indexed by what they are about
    cache.upsert("Pod", {**pod("x", "m"), "involvedObject": {"uid": "u9"}}, written=False)
    assert cache.events_about("u9") == []
