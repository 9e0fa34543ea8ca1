"""Names and labels of a ServedModel's children, shared by render (which creates them) and status
(which writes the scale subresource's label selector).

The Service is `<name>-engine`, never `vllm`: Kubernetes injects `<SERVICE>_PORT=tcp://…` into pods of
the namespace and vLLM refuses to start when it finds `VLLM_PORT` in that shape. The pod template also
turns service links off, so no other Service's name can do the same.
"""

from __future__ import annotations

ENGINE_PORT = 8000
# The engine pod's vLLM container (render writes it, the probe's startup timeline reads its status).
ENGINE_CONTAINER = "engine"
# The weight-cache volume (a PVC or an emptyDir) in the engine container: HF_HOME is under it, and
# spec.adapters' cache:// sources are folders on it.
CACHE_MOUNT = "/cache"
ENGINE_PORT_NAME = "http"
MANAGED_BY = "servedmodel-operator"
PART_OF = "servedmodel"
ENGINE_LABEL = "inference.servedmodel.io/engine"
# On the engine pod template: a digest of the rest of the template, so the probe can tell a new revision's
# pods from the old ones' and the reconciler knows which revision it renders (the Deployment controller's
# pod-template-hash cannot be computed outside Go).
REVISION_LABEL = "inference.servedmodel.io/revision"
# On the engine Deployment while it runs the last proven revision instead of the spec's (reconcile.rollback):
# the blocked revision it was rolled back from. The probe keeps status.rollout's blockedRevision while it is
# there; a Deployment applied from the spec again (fixed or reverted) has none.
ROLLED_BACK_FROM_ANNOTATION = "inference.servedmodel.io/rolled-back-from"
# On the engine pods of a ServedModel with spec.inferencePool: the pool's name. The InferencePool's
# selector is this one label, so several ServedModels can be members of one pool.
INFERENCE_POOL_LABEL = "inference.servedmodel.io/inference-pool"


def deployment_name(name: str) -> str:
    """The engine Deployment is named after the ServedModel."""
    return name


def service_name(name: str) -> str:
    """`<name>-engine`: ends in -engine, so it can never be `vllm`."""
    return f"{name}-engine"


def cache_claim_name(name: str) -> str:
    """The operator-made weight cache PVC (when spec.cache has no existingClaim)."""
    return f"{name}-cache"


def route_name(name: str) -> str:
    return name


def service_monitor_name(name: str) -> str:
    return name


def selector_labels(name: str) -> dict[str, str]:
    """Pod selector: stable across every spec change (a Deployment's selector is immutable)."""
    return {
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/name": "servedmodel",
    }


def selector_string(name: str) -> str:
    """selector_labels as the string the scale subresource's labelSelectorPath (.status.selector) wants."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def standard_labels(name: str, engine_kind: str) -> dict[str, str]:
    """Selector labels plus managed-by, part-of and the engine kind (which may change, so not a selector)."""
    labels = {
        **selector_labels(name),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": PART_OF,
        ENGINE_LABEL: engine_kind,
    }
    return dict(sorted(labels.items()))


# LeaderWorkerSet (spec.workers): the labels its controller puts on a group's pods (sigs.k8s.io/lws
# api/leaderworkerset/v1). worker-index "0" is the leader; group-index says which group a pod is in.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LEADER_WORKER_INDEX = "0"


def leader_worker_set_name(name: str) -> str:
    """The LeaderWorkerSet of spec.workers is named after the ServedModel, as the Deployment is."""
    return name


def leader_selector_labels(name: str) -> dict[str, str]:
    """The leaders of a ServedModel's groups (the Service's selector with spec.workers)."""
    return {**selector_labels(name), LWS_WORKER_INDEX_LABEL: LEADER_WORKER_INDEX}
