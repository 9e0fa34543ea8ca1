"""spec of a ServedModel: what to serve, on what, and how to reach and watch it.

Rules that hold within one field live in the field (bounds, patterns, enums); rules across fields are
CEL (x-kubernetes-validations) so the API server rejects them at the door, and the same rules are
repeated as pydantic validators so a spec that slipped past an older CRD becomes an InvalidSpec condition.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)

from .adapters import MAX_ADAPTERS, AdapterSpec
from .autoscaling import ServedModelAutoscaling
from .base import ApiModel, cel
from .inference_pool import InferencePoolSpec
from .probe import ProbeSpec, RolloutSpec

# Kubernetes' resource.Quantity pattern (as controller-gen writes it).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# An HF repo id (`org/name` or a bare legacy `name`) or `pvc://<claim>[/<path>]`.
MODEL_PATTERN = (
    r"^(([A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[A-Za-z0-9_.][A-Za-z0-9_./-]*)?)$"
)
# An OpenAI-compatible server's base URL: scheme, host[:port], and at most /v1 (the probe appends the
# routes it calls). No credentials, path, query or fragment of the author's choosing: the operator sends
# the API key there (servedmodel.access repeats the rule, with the host allow-list, at probe time).
URL_PATTERN = r"^https?://[^\s/?#@]+(/|/v1/?)?$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_STARTUP_TIMEOUT_SECONDS = 1800
# vLLM's CPU backend keeps its KV cache in host memory: VLLM_CPU_KVCACHE_SPACE GiB (resources.gpus: 0).
DEFAULT_CPU_KV_CACHE_SPACE_GIB = 4
# Env the operator derives from secret references; a literal value would put a secret in the pod spec.
SECRET_ENV = ("HF_TOKEN", "VLLM_API_KEY")

# spec.workers' rules (CEL and pydantic say the same).
WORKERS_NEED_GPUS = (
    "workers needs GPUs: vLLM's multi-node serving runs pipeline stages on GPUs, resources.gpus 0 (vLLM "
    "on CPU) is one pod"
)
WORKERS_NO_AUTOSCALING = (
    "workers is not supported with autoscaling (scale to zero included): the autoscaler scales a "
    "Deployment, a multi-node group is a LeaderWorkerSet; set replicas instead"
)
WORKERS_NO_ADAPTERS = (
    "workers is not supported with adapters: the operator loads LoRA adapters pod by pod, a multi-node "
    "group's workers serve no API to load them into"
)
WORKERS_NO_INFERENCE_POOL = (
    "workers is not supported with inferencePool: the pool would select the workers, which serve no "
    "requests; route to the leader's Service instead"
)

EngineKind = Literal["vllm", "simulator"]
Dtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
AccessMode = Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]


def _number_to_str(value: object) -> object:
    # YAML `memory: 1024` arrives as an int; a Quantity is the string form of it.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_number_to_str),
    StringConstraints(pattern=QUANTITY_PATTERN),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
# Kubernetes shapes that are not worth retyping here; the API server keeps them as given.
Opaque = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


class SecretKeyRef(ApiModel):
    """A key of a Secret in the ServedModel's namespace; the value is never copied anywhere."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Secret name.")
    key: str = Field(min_length=1, max_length=253, description="Key inside the Secret's data.")


class ConfigMapKeyRef(ApiModel):
    """A key of a ConfigMap in the ServedModel's namespace."""

    name: str = Field(
        min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="ConfigMap name."
    )
    key: str = Field(min_length=1, max_length=253, description="Key inside the ConfigMap's data.")


class EnvVar(ApiModel):
    """An environment variable of the engine container (Kubernetes' EnvVar)."""

    name: str = Field(min_length=1, max_length=256, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str | None = Field(default=None, max_length=32768, description="Literal value.")
    value_from: Opaque | None = Field(
        default=None,
        description="Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef).",
    )


class EngineSpec(ApiModel):
    """The inference engine: vLLM (`vllm serve`) or the CPU simulator, and its serving arguments."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.maxNumBatchedTokens) || !has(self.maxModelLen) || "
                    "!has(self.enableChunkedPrefill) || self.enableChunkedPrefill || "
                    "self.maxNumBatchedTokens >= self.maxModelLen",
                    "engine.maxNumBatchedTokens must be at least engine.maxModelLen when chunked prefill is "
                    "off (enableChunkedPrefill: false), or no full-length prompt could ever be scheduled",
                    ".maxNumBatchedTokens",
                ),
            ]
        }
    )

    kind: EngineKind = Field(
        default="vllm",
        description="vllm: `vllm serve` on GPUs; simulator: the CPU engine simulator (same API, no GPU).",
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description=(
            "Container image. Default: the operator's pinned image for the kind "
            "(vllm/vllm-openai:v0.33.0 for vllm, the servedmodel simulator image for simulator)."
        ),
    )
    max_model_len: int | None = Field(
        default=None, ge=16, le=16_777_216, description="--max-model-len: context length (prompt + output)."
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, le=65_536, description="--max-num-seqs: most sequences in one running batch."
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=16, le=16_777_216, description="--max-num-batched-tokens: token budget of one step."
    )
    enable_chunked_prefill: bool | None = Field(
        default=None,
        description="--enable-chunked-prefill / --no-enable-chunked-prefill; unset: vLLM's default (on).",
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="--gpu-memory-utilization: share of GPU memory vLLM may use (0 < x <= 1; vLLM: 0.92).",
    )
    cpu_kv_cache_space_gib: int | None = Field(
        default=None,
        alias="cpuKVCacheSpaceGiB",
        ge=1,
        le=4096,
        description=(
            "CPU serving (resources.gpus: 0) only: GiB of host memory for vLLM's KV cache "
            f"(VLLM_CPU_KVCACHE_SPACE; default {DEFAULT_CPU_KV_CACHE_SPACE_GIB}). The memory request must "
            "cover it plus the weights."
        ),
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="--tensor-parallel-size: GPUs one replica shards the model over."
    )
    enable_prefix_caching: bool | None = Field(
        default=None,
        description="--enable-prefix-caching / --no-enable-prefix-caching; unset keeps vLLM's default (on).",
    )
    dtype: Dtype | None = Field(default=None, description="--dtype of weights and activations.")
    chat_template: ConfigMapKeyRef | None = Field(
        default=None,
        description=(
            "ConfigMap key holding a Jinja chat template, mounted and passed as --chat-template; a change of "
            "its content rolls the pods (a digest in the pod template). Label the ConfigMap "
            "inference.servedmodel.io/chat-template (any value) so the operator watches it and an edit rolls "
            "the pods at once; an unlabelled one is read when the ServedModel is next reconciled."
        ),
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key with the API key: vLLM's VLLM_API_KEY (guards /v1); the probe sends it too.",
    )
    extra_args: list[Annotated[str, StringConstraints(max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        description="More `vllm serve` arguments, after the derived ones (not --port, --host, --api-key).",
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.all(a, !a.startsWith('--api-key'))",
                    "engine.extraArgs must not carry --api-key: a secret in args is visible to anyone who "
                    "can read the Deployment; use engine.apiKeySecretRef",
                ),
                cel(
                    "self.all(a, !a.startsWith('--port') && !a.startsWith('--host'))",
                    "engine.extraArgs must not set --port or --host: the operator serves on port 8000 (http)",
                ),
            ]
        },
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment variables of the engine container (override the operator's by name).",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": [
                cel(
                    "self.all(e, !(e.name in ['HF_TOKEN', 'VLLM_API_KEY']) || !has(e.value))",
                    "engine.env must not hold HF_TOKEN or VLLM_API_KEY as a literal value: use "
                    "hfTokenSecretRef / engine.apiKeySecretRef (or valueFrom.secretKeyRef)",
                ),
                cel(
                    "self.all(e, e.name != 'VLLM_PORT')",
                    "engine.env must not set VLLM_PORT: vLLM reads it as its internal port",
                ),
            ],
        },
    )
    startup_timeout_seconds: int = Field(
        default=DEFAULT_STARTUP_TIMEOUT_SECONDS,
        ge=60,
        le=86_400,
        description=(
            "Budget of the startupProbe on /health: download, load and compile may take this long before "
            "liveness starts counting (default 30 minutes)."
        ),
    )
    shm_size: Quantity | None = Field(
        default=None, description="sizeLimit of the memory-backed /dev/shm (tensor parallel needs it)."
    )
    run_as_user: int | None = Field(
        default=None,
        ge=1,
        le=2_147_483_647,
        description=(
            "UID for the engine container. Leave unset on OpenShift (restricted-v2 assigns one); set it on "
            "plain Kubernetes when the image's user is root, as runAsNonRoot is always on."
        ),
    )

    @model_validator(mode="after")
    def _cross_fields(self) -> EngineSpec:
        if (
            self.enable_chunked_prefill is False
            and self.max_num_batched_tokens is not None
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "engine.maxNumBatchedTokens must be at least engine.maxModelLen when chunked prefill is off"
            )
        for arg in self.extra_args:
            if arg.startswith("--api-key"):
                raise ValueError("engine.extraArgs must not carry --api-key; use engine.apiKeySecretRef")
            if arg.startswith(("--port", "--host")):
                raise ValueError("engine.extraArgs must not set --port or --host")
        for var in self.env:
            if var.name in SECRET_ENV and var.value is not None:
                raise ValueError(f"engine.env must not hold {var.name} as a literal value")
            if var.name == "VLLM_PORT":
                raise ValueError("engine.env must not set VLLM_PORT")
        if len({v.name for v in self.env}) != len(self.env):
            raise ValueError("engine.env names must be unique")
        return self


class ResourceList(ApiModel):
    """CPU and memory quantities."""

    cpu: Quantity | None = Field(default=None, description="CPU, e.g. 4 or 500m.")
    memory: Quantity | None = Field(default=None, description="Memory, e.g. 32Gi.")


class ResourcesSpec(ApiModel):
    """GPUs and CPU/memory of one engine replica."""

    gpus: int = Field(
        default=1,
        ge=0,
        le=64,
        description=(
            "GPUs per replica (a multiple of engine.tensorParallelSize); 0 serves vLLM on CPU (vLLM's CPU "
            "image, no GPU request); ignored by the simulator."
        ),
    )
    gpu_resource_name: str = Field(
        default=DEFAULT_GPU_RESOURCE,
        min_length=1,
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$",
        description="Extended resource name of the GPU, e.g. nvidia.com/gpu or amd.com/gpu.",
    )
    requests: ResourceList | None = Field(default=None, description="CPU/memory requests.")
    limits: ResourceList | None = Field(default=None, description="CPU/memory limits.")


class WorkersSpec(ApiModel):
    """One engine replica across several pods: a LeaderWorkerSet group (leader + workers)."""

    size: int = Field(
        ge=2,
        le=64,
        description=(
            "Pods per group, the leader included (the LeaderWorkerSet's size): vLLM runs its pipeline "
            "parallel stages one per pod (--pipeline-parallel-size), engine.tensorParallelSize GPUs each."
        ),
    )
    resources: ResourcesSpec | None = Field(
        default=None,
        description=(
            "Each worker pod's GPUs, CPU and memory when they differ from the leader's (spec.resources); "
            "unset: the leader's."
        ),
    )


class CacheSpec(ApiModel):
    """Weight cache (HF_HOME) on a PVC: a new claim (size, storageClassName, accessModes) or existingClaim."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.existingClaim) || "
                    "(!has(self.size) && !has(self.storageClassName) && !has(self.accessModes))",
                    "cache.existingClaim excludes cache.size, cache.storageClassName and cache.accessModes",
                    ".existingClaim",
                ),
                cel(
                    "has(self.existingClaim) || has(self.size)",
                    "cache needs either cache.size (a new claim) or cache.existingClaim",
                ),
            ]
        }
    )

    size: Quantity | None = Field(default=None, description="Size of the new claim, e.g. 100Gi.")
    storage_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="StorageClass of the new claim; unset uses the cluster default.",
    )
    access_modes: list[AccessMode] | None = Field(
        default=None,
        min_length=1,
        max_length=4,
        description="Access modes of the new claim; default ReadWriteOnce.",
    )
    existing_claim: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Use this PVC (in the same namespace) instead of creating <name>-cache.",
    )

    @model_validator(mode="after")
    def _claim_or_size(self) -> CacheSpec:
        if self.existing_claim is not None and (
            self.size is not None or self.storage_class_name is not None or self.access_modes is not None
        ):
            raise ValueError(
                "cache.existingClaim excludes cache.size, cache.storageClassName and cache.accessModes"
            )
        if self.existing_claim is None and self.size is None:
            raise ValueError("cache needs either cache.size or cache.existingClaim")
        return self


class ExposeSpec(ApiModel):
    """How clients outside the cluster reach the model (OpenShift Route, when that API exists)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!has(self.host) || self.route", "expose.host needs expose.route: true", ".host"),
            ]
        }
    )

    route: bool = Field(
        default=True, description="Create an OpenShift Route to the Service when route.openshift.io exists."
    )
    host: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Route host; unset lets the router generate one.",
    )
    tls: bool = Field(
        default=True, description="Edge TLS termination on the Route (HTTP redirected to HTTPS)."
    )

    @model_validator(mode="after")
    def _host_needs_route(self) -> ExposeSpec:
        if self.host is not None and not self.route:
            raise ValueError("expose.host needs expose.route: true")
        return self


class MonitoringSpec(ApiModel):
    """Prometheus scraping of the engine's /metrics."""

    service_monitor: bool = Field(
        default=True, description="Create a ServiceMonitor when monitoring.coreos.com exists."
    )


class Toleration(ApiModel):
    """A pod toleration (Kubernetes' Toleration)."""

    key: str | None = Field(default=None, max_length=316, description="Taint key; empty matches all keys.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (default)."
    )
    value: str | None = Field(default=None, max_length=63, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated before eviction."
    )


# Fields that make a Deployment; with spec.endpoint (external mode) none of them may be set.
DEPLOYMENT_FIELDS = (
    "resources",
    "cache",
    "hfTokenSecretRef",
    "nodeSelector",
    "tolerations",
    "affinity",
    "priorityClassName",
    "runtimeClassName",
    "expose",
    "monitoring",
    "autoscaling",
    "inferencePool",
    "workers",
)
ENGINE_DEPLOYMENT_FIELDS = (
    "image",
    "maxModelLen",
    "maxNumSeqs",
    "maxNumBatchedTokens",
    "enableChunkedPrefill",
    "gpuMemoryUtilization",
    "cpuKVCacheSpaceGiB",
    "enablePrefixCaching",
    "dtype",
    "chatTemplate",
    "shmSize",
    "runAsUser",
)
ENGINE_DEPLOYMENT_LISTS = ("extraArgs", "env")


def _external_rule() -> str:
    top = " && ".join(f"!has(self.{f})" for f in DEPLOYMENT_FIELDS)
    return f"!has(self.endpoint) || ({top})"


def _external_engine_rule() -> str:
    scalars = [f"!has(self.engine.{f})" for f in ENGINE_DEPLOYMENT_FIELDS]
    lists = [f"(!has(self.engine.{f}) || size(self.engine.{f}) == 0)" for f in ENGINE_DEPLOYMENT_LISTS]
    return f"!has(self.endpoint) || !has(self.engine) || ({' && '.join(scalars + lists)})"


class ServedModelSpec(ApiModel):
    """What to serve and how. With `endpoint` set the operator deploys nothing and only probes it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    # The first clause avoids a modulus by zero when tensorParallelSize is already invalid.
                    "(has(self.engine) && self.engine.tensorParallelSize < 1) || "
                    "(has(self.resources) ? self.resources.gpus : 1) % "
                    "(has(self.engine) ? self.engine.tensorParallelSize : 1) == 0",
                    "resources.gpus must be a multiple of engine.tensorParallelSize",
                    ".resources.gpus",
                ),
                cel(
                    "!has(self.engine) || !has(self.engine.gpuMemoryUtilization) || "
                    "!has(self.resources) || self.resources.gpus >= 1 || self.engine.kind != 'vllm'",
                    "engine.gpuMemoryUtilization needs GPUs: with resources.gpus 0 vLLM serves on CPU "
                    "(size its KV cache with engine.cpuKVCacheSpaceGiB)",
                    ".engine.gpuMemoryUtilization",
                ),
                cel(
                    "!has(self.engine) || !has(self.engine.cpuKVCacheSpaceGiB) || "
                    "(has(self.resources) && self.resources.gpus == 0)",
                    "engine.cpuKVCacheSpaceGiB applies to CPU serving only (resources.gpus: 0)",
                    ".engine.cpuKVCacheSpaceGiB",
                ),
                cel(
                    _external_rule(),
                    "endpoint (external mode) deploys nothing: "
                    + ", ".join(DEPLOYMENT_FIELDS)
                    + " must not be set",
                    ".endpoint",
                ),
                cel(
                    _external_engine_rule(),
                    "endpoint (external mode) deploys nothing: engine may only set kind, tensorParallelSize "
                    "and apiKeySecretRef",
                    ".endpoint",
                ),
                cel(
                    # replicas has a schema default (1), so an unset replicas reads as 1 here; the rule also
                    # holds for `kubectl scale` (the scale subresource validates the whole object).
                    "!has(self.endpoint) || !has(self.replicas) || self.replicas == 1",
                    "endpoint (external mode) deploys nothing: replicas must not be set (there are no engine "
                    "replicas to scale; scale the external server itself)",
                    ".replicas",
                ),
                cel(
                    # A transition rule (oldSelf): runs on updates only, so also on the scale subresource.
                    "!has(self.autoscaling) || !has(oldSelf.autoscaling) || "
                    "self.replicas == oldSelf.replicas",
                    "spec.replicas belongs to the autoscaler while spec.autoscaling is set (kubectl scale sm "
                    "has no effect): change spec.autoscaling.minReplicas/maxReplicas, or remove "
                    "spec.autoscaling to scale by hand",
                    ".replicas",
                ),
                cel(
                    "!has(self.endpoint) || !has(self.adapters) || size(self.adapters) == 0",
                    "endpoint (external mode) deploys nothing: adapters must not be set (the operator loads "
                    "adapters only into the engines it starts)",
                    ".adapters",
                ),
                cel(
                    "!has(self.adapters) || !has(self.servedModelName) || "
                    "self.adapters.all(a, a.name != self.servedModelName)",
                    "adapters[].name must differ from servedModelName: vLLM refuses an adapter named as "
                    "its base model",
                    ".adapters",
                ),
                cel(
                    "!has(self.workers) || !has(self.engine) || self.engine.kind != 'vllm' || "
                    "(has(self.resources) ? self.resources.gpus : 1) >= 1",
                    WORKERS_NEED_GPUS,
                    ".workers",
                ),
                cel(
                    "!has(self.workers) || !has(self.workers.resources) || self.workers.resources.gpus % "
                    "(has(self.engine) ? self.engine.tensorParallelSize : 1) == 0",
                    "workers.resources.gpus must be a multiple of engine.tensorParallelSize (each pod runs "
                    "one pipeline stage of tensorParallelSize GPUs)",
                    ".workers.resources.gpus",
                ),
                cel(
                    "!has(self.workers) || !has(self.autoscaling)",
                    WORKERS_NO_AUTOSCALING,
                    ".workers",
                ),
                cel(
                    "!has(self.workers) || !has(self.adapters) || size(self.adapters) == 0",
                    WORKERS_NO_ADAPTERS,
                    ".workers",
                ),
                cel(
                    "!has(self.workers) || !has(self.inferencePool)",
                    WORKERS_NO_INFERENCE_POOL,
                    ".workers",
                ),
                cel(
                    "!has(self.revision) || !self.model.startsWith('pvc://')",
                    "revision applies to Hugging Face models, not pvc:// models",
                    ".revision",
                ),
            ]
        }
    )

    model: str = Field(
        min_length=1,
        max_length=512,
        pattern=MODEL_PATTERN,
        description="Hugging Face repo id (e.g. Qwen/Qwen2.5-7B-Instruct) or pvc://<claim>/<path>.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        pattern=r"^[A-Za-z0-9_.\-/]+$",
        description="HF revision: branch, tag or commit (--revision).",
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        pattern=r"^[^\s]+$",
        description=(
            "Name clients send as `model` (--served-model-name). Default: the model id for Hugging Face "
            "models (vLLM's own default), the last path segment (or claim) for pvc://."
        ),
    )
    endpoint: str | None = Field(
        default=None,
        max_length=2048,
        pattern=URL_PATTERN,
        description=(
            "Base URL of an existing OpenAI-compatible server (e.g. http://qwen.ai.svc:8000; a path only "
            "/v1, no query). When set, the operator deploys nothing and only probes it (external mode). Its "
            "host must be in the operator's allow-list (SERVEDMODEL_ALLOWED_TARGETS; default in-cluster "
            "Service names), or the probe refuses it (TargetNotAllowed)."
        ),
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="The inference engine and its arguments."
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description=(
            "Engine replicas (the scale subresource: kubectl scale sm NAME). Ignored, and frozen, while "
            "spec.autoscaling is set: the autoscaler owns the Deployment's replicas then."
        ),
    )
    autoscaling: ServedModelAutoscaling | None = Field(
        default=None,
        description=(
            "Scale replicas on vLLM's queue, batch and KV cache, or the probe's TTFT p95, through KEDA "
            "(when keda.sh exists) or a HorizontalPodAutoscaler (prometheus-adapter's custom metrics)."
        ),
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="GPUs, CPU and memory per replica."
    )
    workers: WorkersSpec | None = Field(
        default=None,
        description=(
            "Serve each replica across `size` pods (multi-node): a LeaderWorkerSet "
            "(leaderworkerset.x-k8s.io/v1, LWS must be installed) instead of a Deployment; the leader runs "
            "vLLM's API server, the workers join it (vLLM's multi-node mode), the Service and the probe go "
            "to the leader, and the readiness gate holds the whole group."
        ),
    )
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63)]] | None = Field(
        default=None, description="Node labels the engine pods must match."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32, description="Tolerations of the engine pods (e.g. for GPU node taints)."
    )
    affinity: Opaque | None = Field(default=None, description="Kubernetes Affinity of the engine pods.")
    priority_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PriorityClass of the engine pods.",
    )
    runtime_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="RuntimeClass of the engine pods (e.g. nvidia).",
    )
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key with a Hugging Face token, given to the engine as HF_TOKEN."
    )
    cache: CacheSpec | None = Field(
        default=None,
        description="Weight cache PVC mounted as HF_HOME; unset uses an emptyDir (lost on restart).",
    )
    expose: ExposeSpec = Field(default_factory=ExposeSpec, description="External exposure (OpenShift Route).")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, description="Prometheus scraping.")
    probe: ProbeSpec = Field(
        default_factory=ProbeSpec, description="Request-path probe with real chat requests."
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="New engine revisions through the readiness gate: the deadline, automatic rollback.",
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description=(
            "LoRA adapters served beside the base model, each under its own name: the engine starts with "
            "--enable-lora, the operator loads them on every replica at run time and probes each one "
            "(status.probe.adapters)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    inference_pool: InferencePoolSpec | None = Field(
        default=None,
        description=(
            "Route through the Gateway API Inference Extension: an InferencePool (and optionally an "
            "InferenceObjective) over the engine pods, rendered when inference.networking.k8s.io/v1 exists. "
            "The endpoint picker routes only to Ready pods, and an engine pod is Ready only once the probe's "
            "chat succeeded on it (the readiness gate)."
        ),
    )

    @model_validator(mode="after")
    def _cross_fields(self) -> ServedModelSpec:
        if self.resources.gpus % self.engine.tensor_parallel_size:
            raise ValueError("resources.gpus must be a multiple of engine.tensorParallelSize")
        eng = self.engine
        if self.resources.gpus < 1 and eng.kind == "vllm" and eng.gpu_memory_utilization is not None:
            raise ValueError(
                "engine.gpuMemoryUtilization needs GPUs: with resources.gpus 0 vLLM serves on CPU "
                "(size its KV cache with engine.cpuKVCacheSpaceGiB)"
            )
        if eng.cpu_kv_cache_space_gib is not None and self.resources.gpus != 0:
            raise ValueError("engine.cpuKVCacheSpaceGiB applies to CPU serving only (resources.gpus: 0)")
        if self.revision is not None and self.model.startswith("pvc://"):
            raise ValueError("revision applies to Hugging Face models, not pvc:// models")
        if self.workers is not None:
            self._check_workers(self.workers)
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"adapters[].name must be unique: {', '.join(twice)} more than once")
        if self.resolved_served_model_name in names:
            raise ValueError(
                f"adapters[].name must differ from the served model name {self.resolved_served_model_name}"
            )
        if self.endpoint is not None and self.adapters:
            raise ValueError("endpoint (external mode) deploys nothing: adapters must not be set")
        if self.endpoint is not None and self.replicas != 1:
            raise ValueError(
                "endpoint (external mode) deploys nothing: replicas must not be set (there are no engine "
                "replicas to scale)"
            )
        if self.endpoint is not None:
            set_fields = {name: getattr(self, name) for name in self.model_fields_set if name != "engine"}
            deploy = {
                alias
                for alias in DEPLOYMENT_FIELDS
                if (attr := _attr(alias)) in set_fields and set_fields[attr] is not None
            }
            eng = self.engine
            deploy |= {
                f"engine.{alias}"
                for alias in ENGINE_DEPLOYMENT_FIELDS
                if getattr(eng, _attr(alias)) is not None
            }
            deploy |= {f"engine.{alias}" for alias in ENGINE_DEPLOYMENT_LISTS if getattr(eng, _attr(alias))}
            if deploy:
                raise ValueError(
                    "endpoint (external mode) deploys nothing: "
                    + ", ".join(sorted(deploy))
                    + " must not be set"
                )
        return self

    def _check_workers(self, workers: WorkersSpec) -> None:
        """The rules of spec.workers the CEL above repeats (an older CRD may have let them through)."""
        if self.engine.kind == "vllm" and self.resources.gpus < 1:
            raise ValueError(WORKERS_NEED_GPUS)
        if workers.resources is not None and workers.resources.gpus % self.engine.tensor_parallel_size:
            raise ValueError("workers.resources.gpus must be a multiple of engine.tensorParallelSize")
        if self.autoscaling is not None:
            raise ValueError(WORKERS_NO_AUTOSCALING)
        if self.adapters:
            raise ValueError(WORKERS_NO_ADAPTERS)
        if self.inference_pool is not None:
            raise ValueError(WORKERS_NO_INFERENCE_POOL)

    @property
    def external(self) -> bool:
        """External mode: probe spec.endpoint, deploy nothing."""
        return self.endpoint is not None

    @property
    def resolved_served_model_name(self) -> str:
        """What clients send as `model`: servedModelName, or what vLLM would call it."""
        if self.served_model_name:
            return self.served_model_name
        if self.model.startswith("pvc://"):
            claim, _, path = self.model.removeprefix("pvc://").partition("/")
            last = path.rstrip("/").rsplit("/", 1)[-1]
            return last or claim
        return self.model


def _attr(alias: str) -> str:
    """camelCase wire name → snake_case attribute (explicit aliases such as cpuKVCacheSpaceGiB too)."""
    for model in (ServedModelSpec, EngineSpec):
        for name, info in model.model_fields.items():
            if info.alias == alias:
                return name
    return "".join("_" + c.lower() if c.isupper() else c for c in alias)
