"""scaleToZero's wake-up (render/wake.py): KEDA's HTTP add-on objects, and the status note without it."""

from __future__ import annotations

from typing import Any

from servedmodel import scaling
from servedmodel.api import ServedModel
from servedmodel.config import OperatorConfig
from servedmodel.render import RenderContext, render
from servedmodel.render.wake import SKIP_SCALED_OBJECT

AUTO = {"minReplicas": 1, "maxReplicas": 4, "targets": {"waitingRequestsPerReplica": 2}}
PROM = {"url": "http://prometheus.monitoring.svc:9090"}
SCALER = "keda-add-ons-http-external-scaler.keda:9090"
WAKE = RenderContext(has_keda_api=True, has_http_add_on_api=True, http_scaler_address=SCALER)


def model(expose: dict[str, Any] | None = None, **auto: Any) -> ServedModel:
    spec: dict[str, Any] = {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "autoscaling": {**AUTO, "prometheus": PROM, **auto},
    }
    if expose is not None:
        spec["expose"] = expose
    return ServedModel.model_validate(
        {"metadata": {"name": "qwen", "namespace": "ai", "uid": "u1"}, "spec": spec}
    )


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in objects]


def test_scale_to_zero_with_the_add_on_carries_the_wake_trigger_and_routes() -> None:
    objects = render(model(scaleToZero=True), WAKE)
    assert kinds(objects) == ["Deployment", "Service", "HTTPScaledObject", "ScaledObject"]
    httpso, so = objects[2], objects[3]
    assert httpso["metadata"]["annotations"] == {SKIP_SCALED_OBJECT: "true"}
    assert "qwen-engine.ai.svc" in httpso["spec"]["hosts"]
    ref = httpso["spec"]["scaleTargetRef"]
    assert (ref["name"], ref["service"], ref["port"]) == ("qwen", "qwen-engine", 8000)
    prom, wake = so["spec"]["triggers"]
    assert prom["type"] == "prometheus"
    assert wake == {
        "type": "external-push",
        "name": "http-requests",
        "metadata": {"httpScaledObject": "qwen", "scalerAddress": SCALER},
    }
    assert so["spec"]["idleReplicaCount"] == 0


def test_the_route_s_host_is_routed_to_the_model_too() -> None:
    """What a client outside the cluster sends (expose.host) wakes the model as the Service's names do."""
    service_names = ["qwen-engine.ai", "qwen-engine.ai.svc", "qwen-engine.ai.svc.cluster.local"]
    routed = render(model({"host": "qwen.apps.example.com"}, scaleToZero=True), WAKE)
    assert routed[2]["spec"]["hosts"] == [*service_names, "qwen.apps.example.com"]
    # no Route, or a host the router generates: the Service's names only
    for expose in ({"route": False}, {}):
        objects = render(model(expose, scaleToZero=True), WAKE)
        assert objects[2]["spec"]["hosts"] == service_names


def test_no_wake_without_scale_to_zero_the_api_or_the_address() -> None:
    for cr, ctx in (
        (model(), WAKE),
        (model(scaleToZero=True), RenderContext(has_keda_api=True, http_scaler_address=SCALER)),
        (model(scaleToZero=True), RenderContext(has_keda_api=True, has_http_add_on_api=True)),
        (model(scaleToZero=True), RenderContext(has_http_add_on_api=True, http_scaler_address=SCALER)),
    ):
        objects = render(cr, ctx)
        assert "HTTPScaledObject" not in kinds(objects)
        for o in objects:
            assert all(t.get("type") != "external-push" for t in o["spec"].get("triggers", []))


def test_the_scaler_address_is_operator_configuration() -> None:
    assert OperatorConfig().keda_http_scaler_address == SCALER
    ctx = RenderContext.from_config(
        OperatorConfig(keda_http_scaler_address="127.0.0.1:19090"),
        has_keda_api=True,
        has_http_add_on_api=True,
    )
    so = render(model(scaleToZero=True), ctx)[-1]
    assert so["spec"]["triggers"][-1]["metadata"]["scalerAddress"] == "127.0.0.1:19090"


def test_status_says_when_nothing_wakes_the_model() -> None:
    cr = model(scaleToZero=True)
    dep = {"spec": {"replicas": 0}, "status": {}}
    kw: dict[str, Any] = {"autoscaler": "KEDA", "hpa_name": "keda-hpa-qwen", "hpa": None, "previous": None}
    asleep = scaling.autoscaling_status(cr.spec, deployment=dep, wakes=False, **kw)
    assert asleep["reason"] == scaling.SCALED_TO_ZERO
    assert "nothing wakes the model from zero" in asleep["message"]
    awake = scaling.autoscaling_status(cr.spec, deployment={"spec": {"replicas": 1}}, wakes=False, **kw)
    assert awake["reason"] == scaling.HPA_MISSING
    assert "HTTP add-on" in awake["message"]
    woken = scaling.autoscaling_status(cr.spec, deployment=dep, wakes=True, **kw)
    assert "nothing wakes" not in woken["message"]
