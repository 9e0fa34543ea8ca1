"""ServedModel → the Kubernetes objects that serve it. Pure: no I/O, same input → equal dicts (and
byte-identical YAML/JSON), so server-side apply sees no change on resync.

Children (all owned by the ServedModel, controller=true):
  PersistentVolumeClaim `<name>-cache`   when spec.cache has a size (not existingClaim)
  Deployment            `<name>`         vllm serve (or the simulator) on port 8000 named http
  LeaderWorkerSet       `<name>`         instead of the Deployment with spec.workers (render/workers.py),
                                         when leaderworkerset.x-k8s.io exists
  Service               `<name>-engine`  never `vllm` (see api/names.py)
  Route                 `<name>`         edge TLS, only when route.openshift.io exists and expose.route
  ServiceMonitor        `<name>`         only when monitoring.coreos.com exists and monitoring.serviceMonitor
  HPA / ScaledObject    `<name>`         with spec.autoscaling (render/autoscaling.py; KEDA when discovered)
  InferencePool (+ InferenceObjective) `<pool>`  with spec.inferencePool, when inference.networking.k8s.io
                                         exists (render/inference_pool.py)
External mode (spec.endpoint) renders nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from servedmodel.access import AllowList
from servedmodel.api import ServedModel, names
from servedmodel.api.base import Obj
from servedmodel.api.crd import dump_yaml
from servedmodel.api.names import CACHE_MOUNT
from servedmodel.api.probe import READINESS_GATE_CONDITION
from servedmodel.api.spec import DEFAULT_CPU_KV_CACHE_SPACE_GIB, ResourcesSpec
from servedmodel.config import SIMULATOR_IMAGE, VLLM_CPU_IMAGE, VLLM_IMAGE, OperatorConfig

from .args import (
    CHAT_TEMPLATE_DIR,
    CHAT_TEMPLATE_FILE,
    MODEL_MOUNT,
    RUNTIME_LORA_ENV,
    engine_args,
    model_location,
)
from .autoscaling import autoscaler_objects
from .chat_template import CHAT_TEMPLATE_DIGEST_ANNOTATION
from .errors import RenderError
from .inference_pool import inference_pool_objects, pool_labels
from .meta import child_metadata
from .workers import leader_worker_set

HOME_MOUNT = "/home/engine"
HEALTH_PATH = "/health"
STARTUP_PERIOD_SECONDS = 10
# Long completions stream for minutes; the OpenShift router's default 30 s would cut them.
ROUTE_TIMEOUT = "600s"
COMMANDS = {"vllm": ["vllm", "serve"], "simulator": ["servedmodel", "sim"]}


@dataclass(frozen=True)
class RenderContext:
    """What rendering needs besides the CR: default images and the optional APIs discovered in the cluster."""

    vllm_image: str = VLLM_IMAGE
    vllm_cpu_image: str = VLLM_CPU_IMAGE
    simulator_image: str = SIMULATOR_IMAGE
    has_route_api: bool = False
    has_service_monitor_api: bool = False
    # keda.sh/v1alpha1 exists: spec.autoscaling renders a ScaledObject instead of an HPA.
    has_keda_api: bool = False
    # http.keda.sh/v1alpha1 (KEDA's HTTP add-on) exists and where its external scaler listens
    # (SERVEDMODEL_KEDA_HTTP_SCALER_ADDRESS): scaleToZero renders the wake-up (render/wake.py).
    has_http_add_on_api: bool = False
    http_scaler_address: str | None = None
    # inference.networking.k8s.io/v1 (InferencePool) and inference.networking.x-k8s.io/v1alpha2
    # (InferenceObjective) exist: spec.inferencePool renders them.
    has_inference_pool_api: bool = False
    has_inference_objective_api: bool = False
    # leaderworkerset.x-k8s.io/v1 exists: spec.workers renders a LeaderWorkerSet.
    has_lws_api: bool = False
    # A digest of the chat template ConfigMap's key (chat_template.template_digest; the reconciler
    # reads the ConfigMap): when it changes the pod template changes, so a new template rolls the pods.
    chat_template_digest: str | None = None
    # The operator's outbound allow-list (SERVEDMODEL_ALLOWED_TARGETS) and SERVEDMODEL_ALLOW_INSECURE_TLS:
    # a KEDA ScaledObject sends the Prometheus token to its serverAddress, so that URL is held to the same
    # rule as the probe's (servedmodel.access). None: not checked (pure rendering; the reconciler always
    # passes the config's, through from_config).
    allowed_targets: AllowList | None = None
    allow_insecure_tls: bool = False

    @classmethod
    def from_config(
        cls,
        config: OperatorConfig,
        *,
        has_route_api: bool = False,
        has_service_monitor_api: bool = False,
        has_keda_api: bool = False,
        has_http_add_on_api: bool = False,
        has_inference_pool_api: bool = False,
        has_inference_objective_api: bool = False,
        has_lws_api: bool = False,
        chat_template_digest: str | None = None,
    ) -> RenderContext:
        return cls(
            vllm_image=config.vllm_image,
            vllm_cpu_image=config.vllm_cpu_image,
            simulator_image=config.simulator_image,
            has_route_api=has_route_api,
            has_service_monitor_api=has_service_monitor_api,
            has_keda_api=has_keda_api,
            has_http_add_on_api=has_http_add_on_api,
            http_scaler_address=config.keda_http_scaler_address,
            has_inference_pool_api=has_inference_pool_api,
            has_inference_objective_api=has_inference_objective_api,
            has_lws_api=has_lws_api,
            chat_template_digest=chat_template_digest,
            allowed_targets=config.target_allow_list,
            allow_insecure_tls=config.allow_insecure_tls,
        )


def _secret_env(name: str, secret: str, key: str) -> Obj:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


# CPU serving without requests given: one core for the engine, one for the API server, and memory for
# the KV cache plus ~6 GiB (API server + EngineCore + Worker of a 0.5B model measured 6.9 GB with 1 GiB of
# KV cache on vLLM-CPU 0.32; docs/vllm.md).
CPU_SERVING_CPU_REQUEST = "2"
CPU_SERVING_MEMORY_OVERHEAD_GIB = 6


def cpu_serving(cr: ServedModel) -> bool:
    """vLLM on CPU: engine.kind vllm with resources.gpus 0 (vLLM's CPU image, no GPU request)."""
    return cr.spec.engine.kind == "vllm" and cr.spec.resources.gpus == 0


def cpu_kv_cache_space_gib(cr: ServedModel) -> int:
    return cr.spec.engine.cpu_kv_cache_space_gib or DEFAULT_CPU_KV_CACHE_SPACE_GIB


def engine_env(cr: ServedModel) -> list[Obj]:
    """Operator env (HOME and caches on writable volumes, secrets by reference), then spec.engine.env
    overriding by name; sorted by name."""
    spec = cr.spec
    env: dict[str, Obj] = {
        "HOME": {"name": "HOME", "value": HOME_MOUNT},
        "HF_HOME": {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
        "XDG_CACHE_HOME": {"name": "XDG_CACHE_HOME", "value": CACHE_MOUNT},
    }
    if model_location(spec)[1] is not None and not any(a.source.startswith("hf://") for a in spec.adapters):
        # Weights are on a PVC (and no adapter comes from the Hub): never reach out to the Hub.
        env["HF_HUB_OFFLINE"] = {"name": "HF_HUB_OFFLINE", "value": "1"}
    if spec.adapters:
        env[RUNTIME_LORA_ENV] = {"name": RUNTIME_LORA_ENV, "value": "True"}
    if spec.hf_token_secret_ref is not None:
        ref = spec.hf_token_secret_ref
        env["HF_TOKEN"] = _secret_env("HF_TOKEN", ref.name, ref.key)
    if spec.engine.api_key_secret_ref is not None:
        ref = spec.engine.api_key_secret_ref
        env["VLLM_API_KEY"] = _secret_env("VLLM_API_KEY", ref.name, ref.key)
    if cpu_serving(cr):
        space = str(cpu_kv_cache_space_gib(cr))
        env["VLLM_CPU_KVCACHE_SPACE"] = {"name": "VLLM_CPU_KVCACHE_SPACE", "value": space}
    for var in spec.engine.env:
        entry: Obj = {"name": var.name}
        if var.value is not None:
            entry["value"] = var.value
        if var.value_from is not None:
            entry["valueFrom"] = var.value_from
        env[var.name] = entry
    return [env[k] for k in sorted(env)]


def _health_probe(period: int, timeout: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": names.ENGINE_PORT_NAME, "scheme": "HTTP"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def kubelet_probes(cr: ServedModel) -> dict[str, Obj]:
    """The kubelet's health probes of the engine container, on vLLM's /health (not the operator's
    request-path probe, spec.probe): startupProbe covers download + load + compile
    (spec.engine.startupTimeoutSeconds, default 30 min); readiness and liveness only start after it,
    with thresholds that tolerate a busy engine."""
    budget = cr.spec.engine.startup_timeout_seconds
    return {
        "startupProbe": _health_probe(STARTUP_PERIOD_SECONDS, 5, math.ceil(budget / STARTUP_PERIOD_SECONDS)),
        "readinessProbe": _health_probe(10, 5, 3),
        "livenessProbe": _health_probe(30, 10, 5),
    }


def container_security_context(cr: ServedModel) -> Obj:
    """OpenShift restricted-v2: no fixed UID (unless spec.engine.runAsUser), non-root, nothing extra."""
    ctx: Obj = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if cr.spec.engine.run_as_user is not None:
        ctx["runAsUser"] = cr.spec.engine.run_as_user
    return ctx


def _resources(cr: ServedModel) -> Obj:
    return container_resources(cr, cr.spec.resources)


def container_resources(cr: ServedModel, res: ResourcesSpec) -> Obj:
    """An engine container's resources from `res` (spec.resources, or spec.workers.resources for the
    workers of a multi-node group), with the engine kind's GPU and CPU-serving rules."""
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    for src, dst in ((res.requests, requests), (res.limits, limits)):
        if src is not None:
            if src.cpu is not None:
                dst["cpu"] = src.cpu
            if src.memory is not None:
                dst["memory"] = src.memory
    if cr.spec.engine.kind == "vllm" and res.gpus > 0:
        # Extended resources: requests must equal limits; both set so nothing is left to defaulting.
        requests[res.gpu_resource_name] = str(res.gpus)
        limits[res.gpu_resource_name] = str(res.gpus)
    if cpu_serving(cr):
        # Never BestEffort: the KV cache lives in this memory. A limit alone makes the API server use
        # it as the request, so a default is only added where neither is given.
        if "cpu" not in requests and "cpu" not in limits:
            requests["cpu"] = CPU_SERVING_CPU_REQUEST
        if "memory" not in requests and "memory" not in limits:
            requests["memory"] = f"{cpu_kv_cache_space_gib(cr) + CPU_SERVING_MEMORY_OVERHEAD_GIB}Gi"
    out: Obj = {}
    if limits:
        out["limits"] = dict(sorted(limits.items()))
    if requests:
        out["requests"] = dict(sorted(requests.items()))
    return out


def _volumes(cr: ServedModel) -> tuple[list[Obj], list[Obj]]:
    """(volumes, volumeMounts), each sorted by name."""
    spec = cr.spec
    cache = spec.cache
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    if cache is None:
        volumes.append({"name": "cache", "emptyDir": {}})
    else:
        claim = cache.existing_claim or names.cache_claim_name(cr.name)
        volumes.append({"name": "cache", "persistentVolumeClaim": {"claimName": claim}})
    mounts.append({"name": "cache", "mountPath": CACHE_MOUNT})
    if spec.engine.chat_template is not None:
        ref = spec.engine.chat_template
        volumes.append(
            {
                "name": "chat-template",
                "configMap": {"name": ref.name, "items": [{"key": ref.key, "path": CHAT_TEMPLATE_FILE}]},
            }
        )
        mounts.append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_DIR, "readOnly": True})
    volumes.append({"name": "home", "emptyDir": {}})
    mounts.append({"name": "home", "mountPath": HOME_MOUNT})
    _, model_claim = model_location(spec)
    if model_claim is not None:
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": model_claim, "readOnly": True}}
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if spec.engine.kind == "vllm":
        # NCCL (tensor parallel) and PyTorch workers share memory via /dev/shm; the default 64Mi is too small.
        shm: Obj = {"medium": "Memory"}
        if spec.engine.shm_size is not None:
            shm["sizeLimit"] = spec.engine.shm_size
        volumes.append({"name": "shm", "emptyDir": shm})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    volumes.append({"name": "tmp", "emptyDir": {}})
    mounts.append({"name": "tmp", "mountPath": "/tmp"})
    return volumes, mounts


def _check(cr: ServedModel) -> None:
    model, claim = model_location(cr.spec)
    if claim is not None and ".." in model.split("/"):
        raise RenderError("spec.model", "a pvc:// path must not contain '..'")


def _pod_metadata(cr: ServedModel, ctx: RenderContext) -> Obj:
    labels = {**names.standard_labels(cr.name, cr.spec.engine.kind), **pool_labels(cr)}
    meta: Obj = {"labels": dict(sorted(labels.items()))}
    if cr.spec.engine.chat_template is not None and ctx.chat_template_digest:
        meta["annotations"] = {CHAT_TEMPLATE_DIGEST_ANNOTATION: ctx.chat_template_digest}
    return meta


def deployment(cr: ServedModel, ctx: RenderContext) -> Obj:
    spec = cr.spec
    eng = spec.engine
    kind = eng.kind
    default_image = ctx.simulator_image
    if kind == "vllm":
        default_image = ctx.vllm_cpu_image if cpu_serving(cr) else ctx.vllm_image
    volumes, mounts = _volumes(cr)
    container: Obj = {
        "name": names.ENGINE_CONTAINER,
        "image": eng.image or default_image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(COMMANDS[kind]),
        "args": engine_args(spec),
        "ports": [{"name": names.ENGINE_PORT_NAME, "containerPort": names.ENGINE_PORT, "protocol": "TCP"}],
        "env": engine_env(cr),
        "resources": _resources(cr),
        **kubelet_probes(cr),
        "securityContext": container_security_context(cr),
        "volumeMounts": mounts,
    }
    pod_spec: Obj = {
        # No <SERVICE>_PORT variables: a Service named vllm anywhere in the namespace would break vLLM.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
    }
    if spec.probe.readiness_gate and spec.probe.enabled:
        # Ready only once the operator's probe of this very pod completed a real chat request (with the
        # probe off nothing would open the gate: new pods would never be Ready).
        pod_spec["readinessGates"] = [{"conditionType": READINESS_GATE_CONDITION}]
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(spec.node_selector.items()))
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    if spec.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.runtime_class_name
    # With spec.autoscaling the autoscaler owns replicas: leaving the field out of the apply is what
    # stops the operator fighting it (the reconciler hands the field over first, see reconcile.py).
    replicas: Obj = {} if spec.autoscaling is not None else {"replicas": spec.replicas}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(cr, names.deployment_name(cr.name)),
        "spec": {
            **replicas,
            "selector": {"matchLabels": names.selector_labels(cr.name)},
            # A new pod must not wait for GPUs the old one holds: replace, don't surge.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            # Rollouts may take as long as the startup budget before the Deployment calls it stuck.
            "progressDeadlineSeconds": eng.startup_timeout_seconds + 600,
            "revisionHistoryLimit": 3,
            "template": with_revision({"metadata": _pod_metadata(cr, ctx), "spec": pod_spec}),
        },
    }


def template_revision(template: Mapping[str, Any]) -> str:
    """The revision of a rendered pod template: a digest of it without its own revision label. Only
    ever computed from what the operator renders (what the API server returns has defaults filled in):
    the objects it made carry the label, and are known by it."""
    meta = dict(template.get("metadata") or {})
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k != names.REVISION_LABEL}
    body = {**template, "metadata": {**meta, "labels": labels}}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:10]


def with_revision(template: Obj) -> Obj:
    """`template` labelled with its revision."""
    meta = dict(template.get("metadata") or {})
    labels = {**(meta.get("labels") or {}), names.REVISION_LABEL: template_revision(template)}
    return {**template, "metadata": {**meta, "labels": dict(sorted(labels.items()))}}


def service(cr: ServedModel) -> Obj:
    # A multi-node group serves from its leader only (the workers run no API server).
    selector = (
        names.leader_selector_labels(cr.name)
        if cr.spec.workers is not None
        else names.selector_labels(cr.name)
    )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(cr, names.service_name(cr.name)),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {
                    "name": names.ENGINE_PORT_NAME,
                    "port": names.ENGINE_PORT,
                    "targetPort": names.ENGINE_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def cache_claim(cr: ServedModel) -> Obj | None:
    cache = cr.spec.cache
    if cache is None or cache.existing_claim is not None or cache.size is None:
        return None
    spec: Obj = {
        "accessModes": list(cache.access_modes or ["ReadWriteOnce"]),
        "resources": {"requests": {"storage": cache.size}},
        "volumeMode": "Filesystem",
    }
    if cache.storage_class_name is not None:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": child_metadata(cr, names.cache_claim_name(cr.name)),
        "spec": spec,
    }


def route(cr: ServedModel) -> Obj:
    expose = cr.spec.expose
    spec: Obj = {}
    if expose.host is not None:
        spec["host"] = expose.host
    spec["to"] = {"kind": "Service", "name": names.service_name(cr.name), "weight": 100}
    spec["port"] = {"targetPort": names.ENGINE_PORT_NAME}
    if expose.tls:
        spec["tls"] = {"termination": "edge", "insecureEdgeTerminationPolicy": "Redirect"}
    spec["wildcardPolicy"] = "None"
    return {
        "apiVersion": "route.openshift.io/v1",
        "kind": "Route",
        "metadata": child_metadata(
            cr, names.route_name(cr.name), {"haproxy.router.openshift.io/timeout": ROUTE_TIMEOUT}
        ),
        "spec": spec,
    }


def service_monitor(cr: ServedModel) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(cr, names.service_monitor_name(cr.name)),
        "spec": {
            "selector": {"matchLabels": names.selector_labels(cr.name)},
            "endpoints": [
                {"port": names.ENGINE_PORT_NAME, "path": "/metrics", "scheme": "http", "interval": "30s"}
            ],
        },
    }


def render(cr: ServedModel, ctx: RenderContext) -> list[Obj]:
    """Every child of the ServedModel in apply order (PVC, Deployment, Service, Route, ServiceMonitor).

    Raises RenderError for a spec the schema let through that cannot be rendered.
    """
    if cr.spec.external:
        return []
    _check(cr)
    objects: list[Obj] = []
    claim = cache_claim(cr)
    if claim is not None:
        objects.append(claim)
    engine = deployment(cr, ctx)
    if cr.spec.workers is not None:
        # A LeaderWorkerSet where its API exists; without it nothing runs the engine, and the reconciler
        # says why (LeaderWorkerSetMissing).
        workers = cr.spec.workers
        worker_resources = None if workers.resources is None else container_resources(cr, workers.resources)
        objects += [leader_worker_set(cr, engine, worker_resources)] if ctx.has_lws_api else []
    else:
        objects.append(engine)
    objects.append(service(cr))
    if ctx.has_route_api and cr.spec.expose.route:
        objects.append(route(cr))
    if ctx.has_service_monitor_api and cr.spec.monitoring.service_monitor:
        objects.append(service_monitor(cr))
    objects += autoscaler_objects(
        cr,
        has_keda_api=ctx.has_keda_api,
        allowed_targets=ctx.allowed_targets,
        allow_insecure_tls=ctx.allow_insecure_tls,
        has_http_add_on_api=ctx.has_http_add_on_api,
        http_scaler_address=ctx.http_scaler_address,
    )
    objects += inference_pool_objects(
        cr,
        has_inference_pool_api=ctx.has_inference_pool_api,
        has_inference_objective_api=ctx.has_inference_objective_api,
    )
    return objects


def to_yaml(objects: list[Obj]) -> str:
    """Multi-document YAML of rendered objects, deterministic (what `kubectl apply -f` takes)."""
    return "---\n".join(dump_yaml(obj) for obj in objects)
