"""When the control loop applies children (reconcile.why_apply / differs) and when it defers a status
write (deployment_lagging): pure decisions, checked without an API server."""

from __future__ import annotations

from typing import Any

from servedmodel.k8s import Cache
from servedmodel.reconcile import deployment_lagging, differs, why_apply
from servedmodel.status import Observed


def deployment(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "m", "namespace": "a", "labels": {"app": "x"}},
        "spec": {
            "replicas": 1,
            "template": {"spec": {"containers": [{"name": "engine", "ports": [{"containerPort": 8000}]}]}},
            **spec,
        },
    }


def body(generation: int = 2, observed: int = 2, degraded_reason: str = "AsExpected") -> dict[str, Any]:
    return {
        "metadata": {"name": "m", "namespace": "a", "generation": generation},
        "status": {
            "observedGeneration": observed,
            "conditions": [{"type": "Degraded", "status": "False", "reason": degraded_reason}],
        },
    }


def test_server_defaults_are_not_a_difference() -> None:
    live = deployment()
    live["metadata"]["uid"] = "u"
    live["spec"]["template"]["spec"]["containers"][0]["ports"][0]["protocol"] = "TCP"
    live["spec"]["strategy"] = {"type": "RollingUpdate"}
    live["status"] = {"replicas": 1}
    assert not differs(deployment(), live)


def test_a_changed_value_or_list_is_a_difference() -> None:
    assert differs(deployment(replicas=2), deployment())
    shorter = deployment()
    shorter["spec"]["template"]["spec"]["containers"] = []
    assert differs(deployment(), shorter)
    assert differs({"a": True}, {"a": 1})
    assert not differs({"a": 1}, {"a": 1.0})


def test_why_apply() -> None:
    cache = Cache()
    desired = [deployment()]
    # Nothing fed: only the generation decides.
    assert why_apply(body(), desired, cache) is None
    assert why_apply(body(generation=3), desired, cache) == "new generation"
    assert why_apply(body(degraded_reason="ApplyFailed"), desired, cache) == "the last apply failed"
    cache.track("Deployment")
    assert why_apply(body(), desired, cache) == "Deployment/m missing"
    cache.upsert("Deployment", deployment())
    assert why_apply(body(), desired, cache) is None
    cache.upsert("Deployment", deployment(replicas=3))
    assert why_apply(body(), desired, cache) == "Deployment/m changed"


def test_deployment_lagging() -> None:
    dep = deployment()
    dep["metadata"]["generation"] = 3
    dep["status"] = {"observedGeneration": 2}
    assert deployment_lagging(Observed(deployment=dep))
    dep["status"]["observedGeneration"] = 3
    assert not deployment_lagging(Observed(deployment=dep))
    assert not deployment_lagging(Observed())


def test_secrets_handed_on_are_keda_s_and_a_custom_image_s() -> None:
    """The Secrets a ServedModel's children hand to code the operator does not vouch for need their
    owner's opt-in: KEDA's TriggerAuthentication always, the engine's env only under an image the admin
    did not configure."""
    from servedmodel.config import OperatorConfig
    from servedmodel.reconcile import parse, secrets_handed_on

    config = OperatorConfig()
    spec: dict[str, Any] = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "resources": {"gpus": 1},
        "hfTokenSecretRef": {"name": "hf", "key": "token"},
        "engine": {"apiKeySecretRef": {"name": "key", "key": "k"}},
    }
    body = {"apiVersion": "inference.servedmodel.io/v1alpha1", "kind": "ServedModel", "spec": spec}
    body["metadata"] = {"name": "m", "namespace": "a"}
    assert secrets_handed_on(parse(body), config, []) == []  # the admin's vLLM image
    spec["engine"]["image"] = config.vllm_image
    assert secrets_handed_on(parse(body), config, []) == []
    spec["engine"]["image"] = "registry.example.com/mine:1"
    assert secrets_handed_on(parse(body), config, []) == [
        ("spec.engine.apiKeySecretRef", "key"),
        ("spec.hfTokenSecretRef", "hf"),
    ]
    del spec["engine"]["image"]
    spec["autoscaling"] = {
        "maxReplicas": 2,
        "targets": {"waitingRequestsPerReplica": 4},
        "prometheus": {
            "url": "https://thanos-querier.openshift-monitoring.svc:9091",
            "bearerTokenSecretRef": {"name": "tok", "key": "token"},
            "caSecretRef": {"name": "tok", "key": "ca.crt"},
        },
    }
    assert secrets_handed_on(parse(body), config, []) == []  # no KEDA: no TriggerAuthentication rendered
    assert secrets_handed_on(parse(body), config, [{"kind": "TriggerAuthentication"}]) == [
        ("spec.autoscaling.prometheus.bearerTokenSecretRef", "tok"),
        ("spec.autoscaling.prometheus.caSecretRef", "tok"),
    ]
