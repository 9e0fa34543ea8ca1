"""spec.inferencePool → an InferencePool (inference.networking.k8s.io/v1) `<pool>` over the engine pods,
and with `objective` an InferenceObjective `<pool>` (inference.networking.x-k8s.io/v1alpha2). Pure.

The pool's selector is the one label every member pod carries (names.INFERENCE_POOL_LABEL, set on the
pod template by render/objects.py); the endpoint picker keeps only the Ready ones among them, and the
readiness gate holds an engine pod un-Ready until the probe's chat succeeded on it (api/inference_pool.py).
"""

from __future__ import annotations

from typing import Final

from servedmodel.api import ServedModel, names
from servedmodel.api.base import Obj

from .meta import child_metadata

INFERENCE_POOL_API: Final = "inference.networking.k8s.io/v1"
INFERENCE_OBJECTIVE_API: Final = "inference.networking.x-k8s.io/v1alpha2"


def pool_labels(cr: ServedModel) -> dict[str, str]:
    """The label the pod template gets for the pool (none without spec.inferencePool)."""
    pool = cr.spec.inference_pool
    if pool is None or cr.spec.external:
        return {}
    return {names.INFERENCE_POOL_LABEL: pool.pool_name(cr.name)}


def inference_pool(cr: ServedModel) -> Obj | None:
    pool = cr.spec.inference_pool
    if pool is None or not pool.create or pool.endpoint_picker_ref is None:
        return None
    ref = pool.endpoint_picker_ref
    name = pool.pool_name(cr.name)
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": child_metadata(cr, name),
        "spec": {
            "selector": {"matchLabels": {names.INFERENCE_POOL_LABEL: name}},
            "targetPorts": [{"number": names.ENGINE_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": ref.name,
                "port": {"number": ref.port},
                "failureMode": ref.failure_mode,
            },
        },
    }


def inference_objective(cr: ServedModel) -> Obj | None:
    pool = cr.spec.inference_pool
    if pool is None or not pool.create or pool.objective is None:
        return None
    name = pool.pool_name(cr.name)
    spec: Obj = {"poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}}
    if pool.objective.priority is not None:
        spec["priority"] = pool.objective.priority
    return {
        "apiVersion": INFERENCE_OBJECTIVE_API,
        "kind": "InferenceObjective",
        "metadata": child_metadata(cr, name),
        "spec": spec,
    }


def inference_pool_objects(
    cr: ServedModel, *, has_inference_pool_api: bool, has_inference_objective_api: bool
) -> list[Obj]:
    """The pool (when its API is discovered) and its objective (when both APIs are)."""
    if not has_inference_pool_api:
        return []
    out = [o for o in (inference_pool(cr),) if o is not None]
    if has_inference_objective_api and out:
        out += [o for o in (inference_objective(cr),) if o is not None]
    return out
