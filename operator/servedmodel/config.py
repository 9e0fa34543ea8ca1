"""Operator-wide settings, read once from the environment (SERVEDMODEL_*) or CLI flags.

Kept apart from the CR: these are the cluster admin's choices (images, ports, where the probe
connects), not the model owner's.
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .access import DEFAULT_ALLOWED_TARGETS, AllowList

VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
# vLLM's own x86_64 CPU build of the same release (docker/Dockerfile.cpu), for resources.gpus: 0.
VLLM_CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.33.0"
SIMULATOR_IMAGE = "quay.io/servedmodel/simulator:v0.1.0"
OPERATOR_IMAGE = "quay.io/servedmodel/operator:v0.1.0"
FIELD_MANAGER = "servedmodel-operator"
PROBE_FIELD_MANAGER = "servedmodel-probe"


class OperatorConfig(BaseSettings):
    """What the operator needs to know that no ServedModel says."""

    model_config = SettingsConfigDict(env_prefix="SERVEDMODEL_", extra="ignore")

    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch; empty means the whole cluster."
    )
    vllm_image: str = Field(default=VLLM_IMAGE, description="Default engine image for engine.kind=vllm.")
    vllm_cpu_image: str = Field(
        default=VLLM_CPU_IMAGE,
        description="Default engine image for engine.kind=vllm with resources.gpus 0 (vLLM's CPU backend).",
    )
    simulator_image: str = Field(
        default=SIMULATOR_IMAGE, description="Default engine image for engine.kind=simulator."
    )
    field_manager: str = Field(default=FIELD_MANAGER, description="Server-side apply field manager.")
    probe_field_manager: str = Field(
        default=PROBE_FIELD_MANAGER,
        description="Field manager of the probe's status fields (status.probe and its conditions).",
    )
    endpoint_override: str | None = Field(
        default=None,
        description=(
            "Send probes here instead of resolving the engine in-cluster: either one base URL for every "
            "ServedModel, or 'namespace/name=URL' pairs separated by commas. Used by `make dev` and the "
            "tests, whose fake (kwok) pods have addresses that exist nowhere: while it is set, an engine pod "
            "it does not map is not probed at all."
        ),
    )
    probe_concurrency: int = Field(
        default=32,
        ge=1,
        le=1024,
        description=(
            "Probe cycles the operator runs at once, over all ServedModels; a due cycle waits for a free "
            "slot (earliest due first), and namespaces get max-min fair shares of the slots, sized from "
            "their demand (servedmodel_probe_slots_demanded: when it passes this, starts run late)."
        ),
    )
    probe_max_pods_per_cycle: int = Field(
        default=8,
        ge=1,
        le=256,
        description=(
            "Engine pods of one ServedModel probed per cycle (in parallel, each at its own address); with "
            "more replicas the cycles rotate through them, so each pod is probed every "
            "ceil(replicas / this) intervals."
        ),
    )
    metrics_port: int = Field(
        default=8090, ge=0, le=65535, description="Port of the operator's /metrics; 0 = off."
    )
    health_port: int = Field(
        default=8091,
        ge=0,
        le=65535,
        description=(
            "Port of the operator's own liveness endpoint (kopf's /healthz, for the operator Deployment's "
            "livenessProbe; not the engine's health probes nor the request-path probe); 0 = off."
        ),
    )
    # The control loop (controller.py, docs/architecture-reconcile.md).
    workers: int = Field(
        default=32,
        ge=1,
        le=256,
        description="Concurrent reconciles (work-queue workers); a pass mostly waits on the API server.",
    )
    max_inflight_requests: int = Field(
        default=64, ge=1, le=1024, description="Kubernetes API requests the operator's client has in flight."
    )
    resync_interval: float = Field(
        default=600.0,
        ge=0,
        description="Seconds between safety resyncs that enqueue every ServedModel (cache reads); 0 = off.",
    )
    backoff_base: float = Field(default=0.5, gt=0, description="First retry delay of a failed reconcile, s.")
    backoff_cap: float = Field(
        default=300.0, gt=0, description="Longest retry delay of a reconcile that keeps failing, s."
    )
    api_timeout: float = Field(
        default=30.0, gt=0, description="Read timeout of one Kubernetes API request, s (connect: 5 s)."
    )
    # Security (docs/operations.md, "Security model"; servedmodel.access).
    allowed_targets: str = Field(
        default=DEFAULT_ALLOWED_TARGETS,
        description=(
            "Hosts an external endpoint (spec.endpoint) or a Prometheus URL (spec.probe.metricsSource."
            "prometheus.url) may name, comma-separated: exact host names, '*.suffix' wildcards, and CIDRs "
            "(which admit IP literals only; names are not resolved). Anything else is refused with "
            "TargetNotAllowed. Default: in-cluster Service names."
        ),
    )
    allow_insecure_tls: bool = Field(
        default=False,
        description=(
            "Honour spec.probe.metricsSource.prometheus.insecureSkipVerify. Off: a ServedModel that sets it "
            "is refused (InsecureTLSNotAllowed) instead of sending its token over unverified TLS."
        ),
    )
    metrics_auth: bool = Field(
        default=True,
        description=(
            "Serve /metrics only to callers whose bearer token passes a TokenReview and whose user may "
            "`get` the non-resource URL /metrics (SubjectAccessReview; ClusterRole "
            "servedmodel-metrics-reader). Off only for local development."
        ),
    )
    metrics_auth_cache_seconds: float = Field(
        default=60.0,
        ge=0,
        le=3600,
        description="How long an allow decision of /metrics is reused (a denial: at most 10 s).",
    )

    @field_validator("allowed_targets")
    @classmethod
    def _parse_targets(cls, value: str) -> str:
        AllowList.parse(value)  # a bad entry fails at start-up, naming it
        return value

    @property
    def target_allow_list(self) -> AllowList:
        return AllowList.parse(self.allowed_targets)

    # Watches and leader election (k8s/informer.py, k8s/leader.py, docs/operations.md).
    relist_interval: float = Field(
        default=1800.0,
        ge=0,
        description=(
            "Seconds between full relists of every watched kind (jittered), the backstop behind the watches; "
            "a 410 relists at once whatever this says; 0 = only on 410."
        ),
    )
    leader_election: bool = Field(
        default=True,
        description=(
            "Elect one leader among the operator's replicas on a coordination.k8s.io Lease: only the leader "
            "reconciles and probes; followers keep their caches warm."
        ),
    )
    leader_election_namespace: str | None = Field(
        default=None,
        description="Namespace of the Lease; default: the operator's own (in-cluster) or the kubeconfig's.",
    )
    leader_election_id: str | None = Field(
        default=None,
        description=(
            "Name of the Lease; default servedmodel-operator, suffixed with a hash of the watched namespaces "
            "when the operator watches only some (operators over different namespaces do not compete)."
        ),
    )
    lease_duration: float = Field(
        default=12.0,
        gt=0,
        description=(
            "Seconds a follower waits on a Lease that is not renewed (client-go's default is 15; 12 keeps a "
            "failover within 15 s at the median, measured by bench/operator_faults.py)."
        ),
    )
    renew_deadline: float = Field(
        default=8.0,
        gt=0,
        description="Seconds the leader keeps trying to renew before it stops leading (< lease_duration).",
    )
    retry_period: float = Field(
        default=2.0, gt=0, description="Seconds between tries to take or renew the Lease."
    )
    keda_http_scaler_address: str = Field(
        default="keda-add-ons-http-external-scaler.keda:9090",
        description=(
            "host:port of KEDA HTTP add-on's external scaler (its gRPC service; the Helm chart's default "
            "name in namespace keda): the wake-up trigger of autoscaling.scaleToZero. Empty: no wake-up."
        ),
    )
    probe_sharding: bool = Field(
        default=False,
        description=(
            "Every replica probes a share of the ServedModels (rendezvous hashing over the live replicas, "
            "each holding a Lease of its own) instead of the leader probing all; reconciles stay the "
            "leader's. Probe capacity grows with replicas; a replica's death moves its share within one "
            "lease duration."
        ),
    )
