"""spec.autoscaling's pure pieces: what render makes of it (HPA or KEDA), the replicas hand-over decision,
status.autoscaling from an HPA's status, and the probe's conditions at zero."""

from __future__ import annotations

from typing import Any

import pytest

from servedmodel import scaling
from servedmodel.api import ServedModel
from servedmodel.render import RenderContext, RenderError, render
from servedmodel.render.autoscaling import hpa_metrics, keda_triggers, quantity
from servedmodel.status import Managed, Observed, Subject, compute_status, status_changed

AUTO = {"minReplicas": 1, "maxReplicas": 4, "targets": {"waitingRequestsPerReplica": 2}}
PROM = {"url": "http://prometheus.monitoring.svc:9090"}


def model(**spec: Any) -> ServedModel:
    body = {"model": "Qwen/Qwen2.5-7B-Instruct", **spec}
    return ServedModel.model_validate(
        {"metadata": {"name": "qwen", "namespace": "ai", "uid": "u1"}, "spec": body}
    )


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in objects]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(2, "2"), (2.0, "2"), (0.8, "800m"), (0.85, "850m"), (1.5, "1500m"), (0.0001, "1m")],
)
def test_quantity(value: float, expected: str) -> None:
    assert quantity(value) == expected


def test_without_autoscaling_the_deployment_keeps_spec_replicas() -> None:
    objects = render(model(replicas=3), RenderContext())
    assert kinds(objects) == ["Deployment", "Service"]
    assert objects[0]["spec"]["replicas"] == 3


def test_hpa_path_leaves_replicas_to_the_autoscaler() -> None:
    objects = render(model(replicas=3, autoscaling=AUTO), RenderContext())
    assert kinds(objects) == ["Deployment", "Service", "HorizontalPodAutoscaler"]
    assert "replicas" not in objects[0]["spec"]
    hpa = objects[2]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    assert "behavior" not in hpa["spec"]  # unset windows: the HPA's defaults
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "u1"


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        ({"waitingRequestsPerReplica": 4}, [("Pods", "vllm_num_requests_waiting", "AverageValue", "4")]),
        ({"runningRequestsPerReplica": 24}, [("Pods", "vllm_num_requests_running", "AverageValue", "24")]),
        ({"kvCacheUsage": 0.8}, [("Pods", "vllm_kv_cache_usage_perc", "AverageValue", "800m")]),
        ({"probeTtftP95Ms": 750}, [("Object", "servedmodel_probe_ttft_p95_seconds", "Value", "750m")]),
    ],
)
def test_hpa_metric_per_target(targets: dict[str, float], expected: list[tuple[str, str, str, str]]) -> None:
    cr = model(autoscaling={**AUTO, "targets": targets})
    assert cr.spec.autoscaling is not None
    got = []
    for m in hpa_metrics(cr, cr.spec.autoscaling.targets):
        src = m["pods"] if m["type"] == "Pods" else m["object"]
        target = src["target"]
        got.append(
            (
                m["type"],
                src["metric"]["name"],
                target["type"],
                target.get("averageValue", target.get("value")),
            )
        )
    assert got == expected


def test_probe_ttft_is_an_object_metric_on_the_served_model() -> None:
    cr = model(autoscaling={**AUTO, "targets": {"probeTtftP95Ms": 800}})
    assert cr.spec.autoscaling is not None
    (metric,) = hpa_metrics(cr, cr.spec.autoscaling.targets)
    assert metric["object"]["describedObject"] == {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "name": "qwen",
    }


def test_keda_path_scaled_object_and_trigger_authentication() -> None:
    prom = {**PROM, "bearerTokenSecretRef": {"name": "tok", "key": "token"}}
    auto = {**AUTO, "scaleToZero": True, "cooldownSeconds": 300, "prometheus": prom}
    objects = render(model(autoscaling=auto), RenderContext(has_keda_api=True))
    assert kinds(objects) == ["Deployment", "Service", "TriggerAuthentication", "ScaledObject"]
    assert "replicas" not in objects[0]["spec"]
    auth, so = objects[2], objects[3]
    assert auth["metadata"]["name"] == "qwen-prometheus"
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "bearerToken", "name": "tok", "key": "token"}]
    spec = so["spec"]
    assert (spec["idleReplicaCount"], spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 1, 4)
    assert spec["cooldownPeriod"] == 300
    (trigger,) = spec["triggers"]
    assert trigger["authenticationRef"] == {"kind": "TriggerAuthentication", "name": "qwen-prometheus"}
    meta = trigger["metadata"]
    assert (
        meta["query"]
        == 'sum(vllm:num_requests_waiting{namespace="ai",model_name="Qwen/Qwen2.5-7B-Instruct"})'
    )
    assert (meta["threshold"], meta["authModes"], meta["namespace"]) == ("2", "bearer", "ai")
    assert trigger["metricType"] == "AverageValue"


def test_keda_ca_goes_to_the_trigger_authentication() -> None:
    prom = {**PROM, "caSecretRef": {"name": "tok", "key": "service-ca.crt"}}
    objects = render(model(autoscaling={**AUTO, "prometheus": prom}), RenderContext(has_keda_api=True))
    auth, so = objects[2], objects[3]
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "ca", "name": "tok", "key": "service-ca.crt"}]
    trigger = so["spec"]["triggers"][0]
    assert trigger["authenticationRef"]["name"] == "qwen-prometheus"
    assert "authModes" not in trigger["metadata"]  # a CA alone is no auth mode


def test_keda_without_a_token_has_no_trigger_authentication() -> None:
    objects = render(model(autoscaling={**AUTO, "prometheus": PROM}), RenderContext(has_keda_api=True))
    assert kinds(objects) == ["Deployment", "Service", "ScaledObject"]
    assert "authenticationRef" not in objects[2]["spec"]["triggers"][0]
    assert "authModes" not in objects[2]["spec"]["triggers"][0]["metadata"]


def test_keda_falls_back_to_the_probes_prometheus_and_else_names_the_field() -> None:
    probe = {"metricsSource": {"type": "prometheus", "prometheus": {"url": "http://thanos:9091"}}}
    objects = render(model(autoscaling=AUTO, probe=probe), RenderContext(has_keda_api=True))
    assert objects[-1]["spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://thanos:9091"
    with pytest.raises(RenderError) as info:
        render(model(autoscaling=AUTO), RenderContext(has_keda_api=True))
    assert info.value.field == "spec.autoscaling.prometheus"


def test_keda_ttft_trigger_is_a_value_active_only_above_target_and_escapes_labels() -> None:
    cr = model(
        servedModelName='we"ird',
        autoscaling={**AUTO, "targets": {"probeTtftP95Ms": 1500}, "prometheus": PROM},
    )
    assert cr.spec.autoscaling is not None
    (trigger,) = keda_triggers(cr, cr.spec.autoscaling.prometheus)  # type: ignore[arg-type]
    assert trigger["metricType"] == "Value"
    assert (trigger["metadata"]["threshold"], trigger["metadata"]["activationThreshold"]) == ("1.5", "1.5")
    assert 'exported_namespace="ai"' in trigger["metadata"]["query"]
    cr = model(servedModelName='we"ird', autoscaling={**AUTO, "prometheus": PROM})
    assert cr.spec.autoscaling is not None
    (trigger,) = keda_triggers(cr, cr.spec.autoscaling.prometheus)  # type: ignore[arg-type]
    assert 'model_name="we\\"ird"' in trigger["metadata"]["query"]


def test_external_mode_renders_no_autoscaler() -> None:
    # The schema forbids it; a body that slipped past an older CRD renders nothing all the same.
    assert render(model(endpoint="http://x:8000"), RenderContext(has_keda_api=True)) == []


def _dep(managers: list[str], replicas: int = 3) -> dict[str, Any]:
    fields = [
        {"manager": m, "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}} for m in managers
    ]
    fields.append({"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {"f:status": {}}})
    return {
        "metadata": {"name": "qwen", "namespace": "ai", "managedFields": fields},
        "spec": {"replicas": replicas},
    }


@pytest.mark.parametrize(
    ("managers", "needed"),
    [
        (["servedmodel-operator"], True),  # dropping it would reset the Deployment to 1
        (["servedmodel-operator", scaling.HANDOVER_MANAGER], False),
        (["kube-controller-manager"], False),  # the HPA owns it already
        ([], False),  # nobody (created without replicas): dropping changes nothing
    ],
)
def test_needs_handover(managers: list[str], needed: bool) -> None:
    assert scaling.needs_handover(_dep(managers), "servedmodel-operator") is needed


def test_handover_object_keeps_the_live_value() -> None:
    assert scaling.handover_object(_dep(["servedmodel-operator"], 5)) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "ai"},
        "spec": {"replicas": 5},
    }


def test_handover_object_is_conditional_on_what_was_read() -> None:
    """An HPA that rescales between the read and the apply must not be undone: the apply carries the
    resourceVersion read, so the API server refuses it (409) instead."""
    live = _dep(["servedmodel-operator"], 5)
    live["metadata"]["resourceVersion"] = "4711"
    assert scaling.handover_object(live)["metadata"]["resourceVersion"] == "4711"


def _hpa(current: int, desired: int, last: str | None, **conds: tuple[str, str]) -> dict[str, Any]:
    status: dict[str, Any] = {"currentReplicas": current, "desiredReplicas": desired}
    if last:
        status["lastScaleTime"] = last
    status["conditions"] = [
        {"type": t, "status": s, "reason": r, "message": f"{r} says"} for t, (s, r) in conds.items()
    ]
    return {"status": status}


def _auto(hpa: dict[str, Any] | None, previous: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    cr = model(autoscaling={**AUTO, **kw})
    dep = {"spec": {"replicas": 2}, "status": {"replicas": 2}}
    return scaling.autoscaling_status(
        cr.spec,
        autoscaler="HorizontalPodAutoscaler",
        hpa_name="qwen",
        hpa=hpa,
        deployment=dep,
        previous=previous,
    )


def test_status_records_a_rescale_once_with_from_and_to() -> None:
    active = {"ScalingActive": ("True", "ValidMetricFound"), "AbleToScale": ("True", "SucceededRescale")}
    first = _auto(_hpa(1, 3, "2026-12-01T10:00:00Z", **active))
    assert first["lastScale"] == {"time": "2026-12-01T10:00:00Z", "fromReplicas": 1, "toReplicas": 3}
    assert (first["currentReplicas"], first["desiredReplicas"]) == (1, 3)
    assert first["reason"] == "ValidMetricFound"
    # the next HPA sync: current caught up; the same rescale keeps its fromReplicas
    second = _auto(_hpa(3, 3, "2026-12-01T10:00:00Z", **active), previous=first)
    assert second["lastScale"] == first["lastScale"]
    # a rescale seen only after it happened: from is what was reported before
    third = _auto(_hpa(1, 1, "2026-12-01T10:05:00Z", **active), previous=second)
    assert third["lastScale"] == {"time": "2026-12-01T10:05:00Z", "fromReplicas": 3, "toReplicas": 1}
    assert _auto(_hpa(1, 3, "2026-12-01T10:00:00Z", **active)) == first  # deterministic: no write churn


def test_status_tells_the_failing_condition_first() -> None:
    hpa = _hpa(
        2,
        2,
        None,
        AbleToScale=("True", "ReadyForNewScale"),
        ScalingActive=("False", "FailedGetPodsMetric"),
        ScalingLimited=("True", "TooManyReplicas"),
    )
    assert _auto(hpa)["reason"] == "FailedGetPodsMetric"
    limited = _hpa(
        4, 4, None, ScalingActive=("True", "ValidMetricFound"), ScalingLimited=("True", "TooManyReplicas")
    )
    assert _auto(limited)["reason"] == "TooManyReplicas"


def test_status_without_an_hpa_and_scale_to_zero_without_keda() -> None:
    assert _auto(None)["reason"] == scaling.HPA_MISSING
    out = _auto(_hpa(1, 1, None, ScalingActive=("True", "ValidMetricFound")), scaleToZero=True)
    assert out["reason"] == "ValidMetricFound"
    assert "scaleToZero needs KEDA" in out["message"]


def test_status_at_zero_and_the_reconcilers_conditions() -> None:
    cr = model(autoscaling={**AUTO, "scaleToZero": True, "prometheus": PROM})
    dep = {"metadata": {"generation": 2}, "spec": {"replicas": 0}, "status": {"observedGeneration": 2}}
    auto = scaling.autoscaling_status(
        cr.spec, autoscaler="KEDA", hpa_name="keda-hpa-qwen", hpa=None, deployment=dep, previous=None
    )
    assert auto["reason"] == scaling.SCALED_TO_ZERO
    assert "KEDA" in auto["message"]
    subject = Subject("qwen", "ai", 1, None, "2026-12-01T10:00:00Z")
    out = compute_status(subject, Managed(Observed(deployment=dep), "qwen", None, auto))
    assert out["autoscaling"] == auto
    ready = next(c for c in out["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ScaledToZero")
    assert "KEDA" in ready["message"]
    assert scaling.scaled_to_zero(cr.spec, {"autoscaling": auto, "readyReplicas": 0})
    assert not scaling.scaled_to_zero(model().spec, {"autoscaling": auto})


def test_status_changed_sees_status_autoscaling() -> None:
    before = {"autoscaling": {"desiredReplicas": 1}}
    assert status_changed(before, {"autoscaling": {"desiredReplicas": 3}})
    assert not status_changed(before, {"autoscaling": {"desiredReplicas": 1}})


def test_probe_conditions_at_zero_keep_the_others() -> None:
    existing = [
        {
            "type": "Serving",
            "status": "True",
            "reason": "ChatCompletionSucceeded",
            "lastTransitionTime": "t0",
        },
        {"type": "TemplateOK", "status": "True", "reason": "Pass", "lastTransitionTime": "t0"},
        {"type": "Ready", "status": "True", "reason": "x"},  # the reconciler's: not the probe's to write
    ]
    out = scaling.scaled_to_zero_conditions(existing, 3, "t1")
    assert [(c["type"], c["status"], c["reason"]) for c in out] == [
        ("Serving", "Unknown", "ScaledToZero"),
        ("TemplateOK", "True", "Pass"),
    ]
    assert out[0]["lastTransitionTime"] == "t1"
