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
