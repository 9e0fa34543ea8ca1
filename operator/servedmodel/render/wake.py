"""Wake from zero: KEDA's HTTP add-on (http.keda.sh/v1alpha1) in front of a model that
spec.autoscaling.scaleToZero lets KEDA scale to 0. Pure: no I/O.

At zero vLLM's series vanish, so no Prometheus trigger can ever turn active again. The add-on's
interceptor holds a request for the model's host, its external scaler reports the held request to KEDA
through an `external-push` trigger, KEDA scales the Deployment 0 -> 1, and the interceptor forwards once
the Service has ready endpoints (after the probe opened the readiness gate).

One ScaledObject (ours, render/autoscaling.py) carries both the Prometheus triggers and the add-on's
trigger, so a single autoscaler owns the Deployment's replicas; the HTTPScaledObject `<name>` only routes
(the annotation below tells the add-on's operator, where one runs, not to make a second ScaledObject).
"""

from __future__ import annotations

from typing import Final

from servedmodel.api import ServedModel, names
from servedmodel.api.base import Obj

from .meta import child_metadata

HTTP_ADD_ON_API: Final = "http.keda.sh/v1alpha1"
SKIP_SCALED_OBJECT: Final = "httpscaledobject.keda.sh/skip-scaledobject-creation"
# The trigger type and metadata keys the add-on's own operator writes (pkg/k8s/scaledobject.go, v0.12.0).
EXTERNAL_PUSH: Final = "external-push"
WAKE_TRIGGER_NAME: Final = "http-requests"


def http_scaled_object_name(name: str) -> str:
    return name


def hosts(cr: ServedModel) -> list[str]:
    """The Host headers the interceptor routes to this model: the Service's in-cluster names, and the
    Route's host where spec.expose sets one (what clients outside the cluster send; the Route or ingress
    that carries it to the interceptor is the cluster's, docs/operations.md)."""
    namespace = cr.metadata.namespace or "default"
    svc = names.service_name(cr.name)
    out = [f"{svc}.{namespace}", f"{svc}.{namespace}.svc", f"{svc}.{namespace}.svc.cluster.local"]
    expose = cr.spec.expose
    if expose.route and expose.host is not None:
        out.append(expose.host)
    return out


def wake_trigger(cr: ServedModel, scaler_address: str) -> Obj:
    """The ScaledObject trigger KEDA asks IsActive: active while the interceptor holds or serves a request."""
    return {
        "type": EXTERNAL_PUSH,
        "name": WAKE_TRIGGER_NAME,
        "metadata": {"httpScaledObject": http_scaled_object_name(cr.name), "scalerAddress": scaler_address},
    }


def http_scaled_object(cr: ServedModel) -> Obj:
    """Routing for the interceptor; replicas stay the ScaledObject's (skip-scaledobject-creation)."""
    auto = cr.spec.autoscaling
    assert auto is not None
    meta = child_metadata(cr, http_scaled_object_name(cr.name), {SKIP_SCALED_OBJECT: "true"})
    return {
        "apiVersion": HTTP_ADD_ON_API,
        "kind": "HTTPScaledObject",
        "metadata": meta,
        "spec": {
            "hosts": hosts(cr),
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": names.deployment_name(cr.name),
                "service": names.service_name(cr.name),
                "port": names.ENGINE_PORT,
            },
            "replicas": {"min": 0, "max": auto.max_replicas},
        },
    }
