"""servedmodel.k8s.KubeClient against the real kube-apiserver (TLS with the kubeconfig's CA and token).

Includes the contract the probe relies on: two field managers server-side applying /status of one
ServedModel keep each other's conditions (status.conditions is a list-map keyed by type).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

import controlplane
from servedmodel.api import API_GROUP_VERSION, PLURAL
from servedmodel.config import FIELD_MANAGER, PROBE_FIELD_MANAGER
from servedmodel.k8s import ConflictError, KubeClient, load_identity

pytestmark = pytest.mark.cluster


@pytest.fixture
async def client(control_plane: controlplane.ControlPlane) -> AsyncIterator[KubeClient]:
    async with KubeClient(load_identity(str(control_plane.kubeconfig))) as c:
        yield c


def configmap(name: str, namespace: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "k8s-client-test"}},
        "data": data,
    }


async def test_apply_get_list_delete(client: KubeClient, namespace: str) -> None:
    applied = await client.apply(configmap("a", namespace, {"k": "1"}), "test-manager")
    assert applied["data"] == {"k": "1"}
    again = await client.apply(configmap("a", namespace, {"k": "1"}), "test-manager")
    assert again["metadata"]["resourceVersion"] == applied["metadata"]["resourceVersion"]  # no-op apply
    await client.apply(configmap("b", namespace, {"k": "2"}), "test-manager")

    got = await client.get("v1", "configmaps", namespace, "a")
    assert got is not None
    assert [m["manager"] for m in got["metadata"]["managedFields"]] == ["test-manager"]
    listed = await client.list(
        "v1", "configmaps", namespace, label_selector="app=k8s-client-test", page_size=1
    )
    assert sorted(o["metadata"]["name"] for o in listed) == ["a", "b"]  # two pages

    assert await client.delete("v1", "configmaps", namespace, "a") is True
    assert await client.delete("v1", "configmaps", namespace, "a") is False
    assert await client.get("v1", "configmaps", namespace, "a") is None


async def test_conflicts_without_force(client: KubeClient, namespace: str) -> None:
    await client.apply(configmap("c", namespace, {"k": "1"}), "owner")
    with pytest.raises(ConflictError) as err:
        await client.apply(configmap("c", namespace, {"k": "2"}), "intruder", force=False)
    assert err.value.status == 409
    assert "conflict" in err.value.message.lower()
    taken = await client.apply(configmap("c", namespace, {"k": "2"}), "intruder", force=True)
    assert taken["data"] == {"k": "2"}


async def test_discovery(client: KubeClient) -> None:
    assert await client.discover("apps/v1") is True
    assert await client.discover(API_GROUP_VERSION) is True
    assert await client.discover("route.openshift.io/v1") is False
    assert client.resource(API_GROUP_VERSION, "ServedModel").plural == PLURAL


async def test_two_managers_share_status(
    client: KubeClient, control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    # An external-mode ServedModel: no operator runs here, so only the two writers below touch status.
    cr = {
        "apiVersion": API_GROUP_VERSION,
        "kind": "ServedModel",
        "metadata": {"name": "shared"},
        "spec": {"model": "Qwen/Qwen2.5-0.5B-Instruct", "endpoint": "http://127.0.0.1:9/"},
    }
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(cr))

    def cond(type_: str, status: str, reason: str) -> dict[str, Any]:
        return {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": "",
            "lastTransitionTime": "2026-11-29T18:00:00Z",
        }

    await client.apply_status(
        API_GROUP_VERSION,
        PLURAL,
        namespace,
        "shared",
        {"phase": "Ready", "conditions": [cond("Ready", "True", "ExternalEndpoint")]},
        FIELD_MANAGER,
    )
    await client.apply_status(
        API_GROUP_VERSION,
        PLURAL,
        namespace,
        "shared",
        {"conditions": [cond("Serving", "False", "ConnectionRefused")]},
        PROBE_FIELD_MANAGER,
    )
    # The reconciler writes again, with only its own conditions: the probe's stay.
    obj = await client.apply_status(
        API_GROUP_VERSION,
        PLURAL,
        namespace,
        "shared",
        {"phase": "Degraded", "conditions": [cond("Ready", "False", "Whatever")]},
        FIELD_MANAGER,
    )
    status = obj["status"]
    assert status["phase"] == "Degraded"
    assert {c["type"]: c["reason"] for c in status["conditions"]} == {
        "Ready": "Whatever",
        "Serving": "ConnectionRefused",
    }
    managers = {m["manager"] for m in obj["metadata"]["managedFields"] if m.get("subresource") == "status"}
    assert managers == {FIELD_MANAGER, PROBE_FIELD_MANAGER}


async def test_label_selected_list_and_events(client: KubeClient, namespace: str) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "engine",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/instance": "m1"},
        },
        "spec": {"selector": {"app": "nothing"}, "ports": [{"name": "http", "port": 8000}]},
    }
    other = {**service, "metadata": {"name": "other", "namespace": namespace, "labels": {"x": "y"}}}
    await client.apply(service, "test-manager")
    await client.apply(other, "test-manager")
    selected = await client.list(
        "v1", "services", namespace, label_selector={"app.kubernetes.io/instance": "m1"}
    )
    assert [s["metadata"]["name"] for s in selected] == ["engine"]  # the selector went to the API server

    svc = await client.get("v1", "services", namespace, "engine")
    assert svc is not None
    await client.create_event(
        {"apiVersion": "v1", "kind": "Service", "metadata": svc["metadata"]},
        type="Normal",
        reason="Tested",
        message="an event from the k8s client",
    )
    events = await client.list("v1", "events", namespace, field_selector="involvedObject.name=engine")
    assert [(e["type"], e["reason"]) for e in events if e["reason"] == "Tested"] == [("Normal", "Tested")]
