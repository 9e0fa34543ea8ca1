"""Helpers of the replica scheduler tests (tests/probe, tests/vllm): a recorder of what the probe
scheduler reads from and writes to Kubernetes, fake engine pods, a managed ServedModel."""

from __future__ import annotations

import random
from typing import Any

from prometheus_client import CollectorRegistry

from servedmodel.api.probe import READINESS_GATE_CONDITION
from servedmodel.config import OperatorConfig
from servedmodel.k8s import NotFoundError
from servedmodel.probing import ProbeMetrics, ProbeScheduler


def pod(name: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {
            "phase": "Running",
            "podIP": ip,  # never contacted: the override maps each pod to its simulator
            "conditions": [{"type": "ContainersReady", "status": "True"}],
        },
    }


class Cluster:
    """What the scheduler reads (a ServedModel, its pods) and writes (status, pod conditions, Events)."""

    def __init__(self, body: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        self.body = body
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.status_writes: list[dict[str, Any]] = []
        self.gate_writes: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, str, str, str]] = []

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any:
        return self.body if plural == "servedmodels" and name == self.body["metadata"]["name"] else None

    async def list(self, api_version: str, plural: str, namespace: str | None = None, **kw: Any) -> list[Any]:
        assert plural == "pods"
        assert kw["label_selector"] == (
            "app.kubernetes.io/component=engine,app.kubernetes.io/instance=qwen,app.kubernetes.io/name=servedmodel"
        )
        return list(self.pods.values())

    async def apply_status(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        status: dict[str, Any],
        field_manager: str,
        *,
        force: bool = True,
    ) -> dict[str, Any]:
        assert field_manager == "servedmodel-probe"
        if plural == "pods":
            (cond,) = status["conditions"]
            self.gate_writes.append((name, cond))
            conds = [c for c in self.pods[name]["status"]["conditions"] if c["type"] != cond["type"]]
            self.pods[name]["status"]["conditions"] = [*conds, cond]
            return self.pods[name]
        if name != self.body["metadata"]["name"]:
            raise NotFoundError(404, "NotFound", name)
        self.status_writes.append(status)
        self.body["status"] = {**(self.body.get("status") or {}), **status}
        return self.body

    async def create_event(self, involved: dict[str, Any], *, type: str, reason: str, message: str) -> Any:
        self.events.append((involved["kind"], involved["metadata"]["name"], reason, message))
        return {}

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.body["status"]["conditions"] if c["type"] == type_)

    def gate(self, pod_name: str) -> str | None:
        conds = self.pods[pod_name]["status"]["conditions"]
        return next((c["status"] for c in conds if c["type"] == READINESS_GATE_CONDITION), None)


def served_model(**probe: Any) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": "qwen", "namespace": "ns", "generation": 2, "uid": "uid-qwen"},
        "spec": {
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "servedModelName": "qwen",
            "resources": {"gpus": 1},
            "probe": {"interval": 5, "checkLimits": False, **probe},
        },
        "status": {"phase": "Ready", "readyReplicas": 3},
    }


def scheduler(cluster: Cluster, override: str, **config: Any) -> ProbeScheduler:
    return ProbeScheduler(
        kube=cluster,
        config=OperatorConfig(endpoint_override=override, **config),
        metrics=ProbeMetrics(CollectorRegistry()),
        rng=random.Random(3),
    )
