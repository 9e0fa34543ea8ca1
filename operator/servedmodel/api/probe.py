"""spec.probe and status.probe: the request-path probe's settings and what it measured.

Latency vocabulary (clients disagree; every field below says which one it uses):
- TTFT: request sent → first content token received (client) / arrival → first token (server).
- TPOT: per request, (e2e - TTFT) / (completion_tokens - 1) — vLLM's and `vllm bench serve`'s
  definition (GuideLLM 0.8 calls this `inter_token_latency_ms`).
- ITL: every gap between two streamed tokens, one sample per token gap (vLLM's
  `inter_token_latency_seconds` histogram); the status reports their p50/p95 within one probe.
- A stream delivered in one lump (coalesced) has no real TTFT/TPOT/ITL: they are not written, and the
  streaming check says so with the figures.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .adapters import AdapterProbe
from .base import ApiModel

DEFAULT_PROBE_PROMPT = (
    "Repeat these words exactly, separated by spaces: one two three four five six seven eight"
)
DEFAULT_PROBE_STOP = ["five"]
# The pod condition of the readiness gate (spec.probe.readinessGate): set by the operator on each pod.
READINESS_GATE_CONDITION = "inference.servedmodel.io/serving"

# http(s)://host[:port][/path]: no credentials, query or fragment (servedmodel.access repeats it).
PROMETHEUS_URL_PATTERN = r"^https?://[^\s/?#@]+(/[^\s?#]*)?$"

CheckResultValue = Literal["Pass", "Fail", "Skipped"]
ProbeResultValue = Literal["Success", "Failure"]


class ProbeMessage(ApiModel):
    """One chat message of the probe request (OpenAI chat format)."""

    role: Literal["system", "user", "assistant"] = Field(description="Chat role of the message.")
    content: str = Field(min_length=1, max_length=8192, description="Text of the message.")


class SecretKeyRef(ApiModel):
    """A key of a Secret in the ServedModel's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")
    key: str = Field(min_length=1, max_length=253, description="Key inside the Secret's data.")


class PrometheusSource(ApiModel):
    """Prometheus to query when metricsSource.type is prometheus (e.g. OpenShift's Thanos querier)."""

    url: str = Field(
        min_length=1,
        max_length=2048,
        pattern=PROMETHEUS_URL_PATTERN,
        description=(
            "Base URL of the Prometheus HTTP API, e.g. https://thanos-querier.openshift-monitoring.svc:9091 "
            "(no credentials, query or fragment). Its host must be in the operator's allow-list "
            "(SERVEDMODEL_ALLOWED_TARGETS), or the probe refuses it (TargetNotAllowed)."
        ),
    )
    bearer_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a bearer token (Authorization: Bearer); never logged or written.",
    )
    insecure_skip_verify: bool = Field(
        default=False,
        description=(
            "Skip TLS certificate verification of the Prometheus URL. Honoured only where the cluster admin "
            "allows it (SERVEDMODEL_ALLOW_INSECURE_TLS); otherwise the probe refuses the source "
            "(InsecureTLSNotAllowed)."
        ),
    )


class MetricsSource(ApiModel):
    """Where the probe reads the engine's counters, histograms and scheduler gauges."""

    type: Literal["pods", "prometheus"] = Field(
        default="pods",
        description=(
            "pods: scrape /metrics of every ready engine pod (external mode: the endpoint's /metrics); "
            "prometheus: query PromQL filtered by model_name and namespace."
        ),
    )
    prometheus: PrometheusSource | None = Field(
        default=None, description="Prometheus connection; required when type is prometheus."
    )


class ProbeSLO(ApiModel):
    """Latency objectives; LatencySLOMet is True when the rolling-window p95 of each set one is within it."""

    ttft_ms: float | None = Field(
        default=None, gt=0, description="Objective for TTFT p95 (request sent → first content token), ms."
    )
    tpot_ms: float | None = Field(
        default=None,
        gt=0,
        description="Objective for TPOT p95 ((e2e - TTFT)/(completion tokens - 1), vLLM's), ms.",
    )
    e2e_ms: float | None = Field(
        default=None, gt=0, description="Objective for end-to-end p95 (request sent → [DONE]), ms."
    )


class ProbeSpec(ApiModel):
    """How the operator probes the request path with real chat requests."""

    enabled: bool = Field(default=True, description="Send probe requests; false stops probing.")
    interval: int = Field(
        default=60,
        ge=5,
        le=86400,
        description="Seconds between probe cycles (jittered by up to 10% so many models' probes spread out).",
    )
    timeout: float = Field(
        default=30.0, ge=1, le=600, description="Overall limit of one probe cycle's chat request, seconds."
    )
    connect_timeout: float = Field(default=5.0, ge=0.1, le=120, description="TCP/TLS connect limit, seconds.")
    first_byte_timeout: float = Field(
        default=20.0,
        ge=0.1,
        le=600,
        description="Limit from request sent to response headers, and between streamed chunks, seconds.",
    )
    messages: list[ProbeMessage] = Field(
        default_factory=lambda: [ProbeMessage(role="user", content=DEFAULT_PROBE_PROMPT)],
        min_length=1,
        max_length=16,
        description="Chat messages of the probe request; the default prompt hits the default stop.",
    )
    max_tokens: int = Field(
        default=16,
        ge=2,
        le=4096,
        description="max_completion_tokens of the probe request (at least 2 for a TPOT).",
    )
    stop: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PROBE_STOP),
        max_length=4,
        description=(
            "Stop strings of the probe request; the stop check expects finish_reason stop and the "
            "string absent from the output. Empty skips the stop check."
        ),
    )
    check_limits: bool = Field(
        default=True,
        description="Send a prompt longer than max_model_len and expect vLLM's 400 (door validates limits).",
    )
    window: int = Field(
        default=20, ge=1, le=100, description="Number of recent successful probes in the rolling p50/p95."
    )
    max_in_flight: int = Field(
        default=1,
        ge=1,
        le=8,
        description=(
            "Probe chat requests sent concurrently per cycle; 1 keeps one probe request in flight per model. "
            "With more, client latencies are the median over the cycle's requests."
        ),
    )
    metrics_source: MetricsSource = Field(
        default_factory=MetricsSource,
        description="Where engine metrics (server phases, scheduler) come from.",
    )
    slo: ProbeSLO | None = Field(
        default=None, description="Latency objectives; when set, the LatencySLOMet condition is maintained."
    )
    readiness_gate: bool = Field(
        default=True,
        description=(
            "Gate each engine pod's readiness on this probe (on by default; false opts out): the pod "
            "template carries the readiness gate inference.servedmodel.io/serving and the operator sets "
            "that pod condition from each pod's probe, so a pod that answers /health but fails a real chat "
            "completion leaves the Service's endpoints (after failureThreshold failed cycles), and a new "
            "pod receives traffic only after a real generation succeeded. Pods then wait for the operator "
            "to probe them (see docs/operations.md). Not rendered while enabled is false: nothing would "
            "open the gate."
        ),
    )
    failure_threshold: int = Field(
        default=3,
        ge=1,
        le=100,
        description=(
            "Readiness gate: failed probes of a pod in a row, each of the engine's own making, before the "
            "gate closes and the pod leaves the Service (the kubelet's failureThreshold). Failures of the "
            "operator's own making (a Secret it cannot read, its connection pool exhausted) never close "
            "it: they set ProbeUnreliable."
        ),
    )
    success_threshold: int = Field(
        default=1,
        ge=1,
        le=100,
        description=(
            "Readiness gate: successful probes of a pod in a row before a closed (or new) pod's gate "
            "opens (the kubelet's successThreshold)."
        ),
    )


class ClientLatency(ApiModel):
    """Latencies measured by the probe client on the wire (monotonic clock), milliseconds."""

    ttft_ms: float | None = Field(
        default=None, description="TTFT: request sent → first content token received, ms (client side)."
    )
    tpot_ms: float | None = Field(
        default=None,
        description=(
            "TPOT, vLLM's definition: (e2e to last token - TTFT) / (completion tokens - 1), ms. "
            "GuideLLM calls this inter_token_latency."
        ),
    )
    itl_p50_ms: float | None = Field(
        default=None,
        description="ITL p50: median gap between streamed tokens (a chunk of k tokens: k gaps), ms.",
    )
    itl_p95_ms: float | None = Field(
        default=None,
        description="ITL p95: 95th percentile gap between streamed tokens, ms.",
    )
    e2e_ms: float | None = Field(default=None, description="End to end: request sent → [DONE] received, ms.")
    headers_ms: float | None = Field(
        default=None,
        description="Request sent → response headers, ms: the door (validate, template, tokenize, admit).",
    )


class ServerLatency(ApiModel):
    """Server-side phase times from deltas of vLLM's histograms (_sum/_count) around the probe, ms."""

    queue_ms: float | None = Field(
        default=None, description="Queue: arrival → scheduled (request_queue_time)."
    )
    prefill_ms: float | None = Field(
        default=None, description="Prefill: scheduled → first token (request_prefill_time)."
    )
    decode_ms: float | None = Field(
        default=None, description="Decode: first → last token (request_decode_time)."
    )
    inference_ms: float | None = Field(
        default=None, description="Inference = prefill + decode (request_inference_time)."
    )
    ttft_ms: float | None = Field(
        default=None, description="Server TTFT: arrival → first token (time_to_first_token)."
    )
    handoff_ms: float | None = Field(
        default=None,
        description=(
            "API server → engine hand-off: server TTFT - queue - prefill (vLLM stamps arrival in the API "
            "server, queueing in the engine process), ms."
        ),
    )
    tpot_ms: float | None = Field(
        default=None,
        description="Server TPOT, vLLM's definition (request_time_per_output_token), mean over the window.",
    )
    e2e_ms: float | None = Field(default=None, description="Server end to end (e2e_request_latency).")
    requests: int | None = Field(
        default=None,
        ge=0,
        description="Requests that finished in the probe window (request_success_total delta).",
    )
    isolated: bool | None = Field(
        default=None,
        description=(
            "True when the probe's were the only requests finishing in the window; false means the server "
            "figures are window averages over other traffic too."
        ),
    )


class SchedulerSnapshot(ApiModel):
    """vLLM's scheduler gauges at probe time, summed over engine pods (KV cache usage: the maximum)."""

    running: int | None = Field(
        default=None, ge=0, description="Requests in the running batch (num_requests_running)."
    )
    waiting: int | None = Field(
        default=None, ge=0, description="Requests in the waiting queue (num_requests_waiting)."
    )
    kv_cache_usage: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="KV cache usage 0..1 (kv_cache_usage_perc, formerly gpu_cache_usage_perc); highest pod.",
    )


class ProbeUsage(ApiModel):
    """usage of the probe's chat completion (stream_options.include_usage)."""

    prompt_tokens: int | None = Field(default=None, ge=0, description="usage.prompt_tokens: ingredients in.")
    completion_tokens: int | None = Field(
        default=None, ge=0, description="usage.completion_tokens: bites out."
    )
    total_tokens: int | None = Field(default=None, ge=0, description="usage.total_tokens.")
    cached_prompt_tokens: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Prompt tokens served from the prefix cache instead of prefilled: "
            "usage.prompt_tokens_details.cached_tokens where served, else the delta of "
            "vllm:prompt_tokens_cached_total over an isolated window."
        ),
    )


class ProbeCounters(ApiModel):
    """The engine's token counters at probe time (summed over pods) and rates since the previous probe."""

    prompt_tokens_total: float | None = Field(default=None, ge=0, description="vllm:prompt_tokens_total.")
    generation_tokens_total: float | None = Field(
        default=None, ge=0, description="vllm:generation_tokens_total."
    )
    prompt_tokens_per_second: float | None = Field(
        default=None, ge=0, description="Prefill tokens per second since the previous probe (all traffic)."
    )
    generation_tokens_per_second: float | None = Field(
        default=None, ge=0, description="Generated tokens per second since the previous probe (all traffic)."
    )


class ProbeWindow(ApiModel):
    """Rolling p50/p95 over the last N successful probes; recent* lists are state that survives restarts."""

    samples: int = Field(default=0, ge=0, description="Number of probes in the window.")
    ttft_p50_ms: float | None = Field(default=None, description="p50 of client TTFT over the window, ms.")
    ttft_p95_ms: float | None = Field(default=None, description="p95 of client TTFT over the window, ms.")
    tpot_p50_ms: float | None = Field(default=None, description="p50 of client TPOT (vLLM's definition), ms.")
    tpot_p95_ms: float | None = Field(default=None, description="p95 of client TPOT (vLLM's definition), ms.")
    e2e_p50_ms: float | None = Field(default=None, description="p50 of client end to end, ms.")
    e2e_p95_ms: float | None = Field(default=None, description="p95 of client end to end, ms.")
    recent_ttft_ms: list[float] = Field(
        default_factory=list, max_length=100, description="Client TTFT of the last probes, oldest first, ms."
    )
    recent_tpot_ms: list[float] = Field(
        default_factory=list, max_length=100, description="Client TPOT of the last probes that have one, ms."
    )
    recent_e2e_ms: list[float] = Field(
        default_factory=list, max_length=100, description="Client end to end of the last probes, ms."
    )


class ProbeCheck(ApiModel):
    """Outcome of one request-path check."""

    result: CheckResultValue = Field(description="Pass, Fail or Skipped.")
    reason: str = Field(description="CamelCase reason, e.g. RoleMarkersPresent, PromptTokensMismatch.")
    message: str = Field(default="", description="Human-readable details.")


class ProbeChecks(ApiModel):
    """Request-path checks of the last probe."""

    template: ProbeCheck | None = Field(
        default=None,
        description="/tokenize renders the model family's role markers; count = usage.prompt_tokens.",
    )
    limits: ProbeCheck | None = Field(
        default=None, description="A prompt longer than max_model_len gets vLLM's 400 at the door."
    )
    stop: ProbeCheck | None = Field(
        default=None,
        description=(
            "The server honours stop strings: the probe's own, or one learned from the model's answer "
            "(the same request again must end there with finish_reason stop and that stop_reason)."
        ),
    )
    usage: ProbeCheck | None = Field(
        default=None,
        description="usage is present, adds up, and matches the token counters' deltas when isolated.",
    )
    streaming: ProbeCheck | None = Field(
        default=None,
        description=(
            "Tokens arrived as generated, not in one lump (then client TTFT/TPOT/ITL are not written)."
        ),
    )


class PodProbe(ApiModel):
    """One engine pod's own probe (its address, not the Service's): Serving, latencies, scheduler gauges."""

    name: str = Field(max_length=253, description="Pod name.")
    serving: Literal["True", "False", "Unknown"] = Field(
        description="True when this pod's last probe completed a real chat request."
    )
    reason: str = Field(
        max_length=128,
        description="CamelCase reason: Serving, or why not (StreamStalled, EngineStalled, ...).",
    )
    message: str | None = Field(default=None, max_length=512, description="Details of the pod's last probe.")
    endpoint: str | None = Field(default=None, max_length=2048, description="Base URL the pod was probed at.")
    ttft_ms: float | None = Field(default=None, description="Client TTFT of the pod's last probe, ms.")
    tpot_ms: float | None = Field(default=None, description="Client TPOT of the pod's last probe, ms.")
    e2e_ms: float | None = Field(default=None, description="Client end to end of the pod's last probe, ms.")
    running: int | None = Field(default=None, ge=0, description="The pod's num_requests_running.")
    waiting: int | None = Field(default=None, ge=0, description="The pod's num_requests_waiting.")
    kv_cache_usage: float | None = Field(
        default=None, ge=0, le=1, description="The pod's KV cache usage 0..1 (kv_cache_usage_perc)."
    )
    last_probe_time: str | None = Field(default=None, description="RFC 3339 time the pod was last probed.")
    consecutive_failures: int = Field(
        default=0, ge=0, description="Failed probes of this pod in a row, of the engine's own making."
    )
    consecutive_successes: int = Field(default=0, ge=0, description="Successful probes of this pod in a row.")


class RolloutSpec(ApiModel):
    """What the operator does with a new engine revision whose pods do not pass their readiness gate."""

    progress_deadline_seconds: int = Field(
        default=600,
        ge=10,
        le=86400,
        description=(
            "How long a new revision may stay Proving (some of its pods' gates closed) before it is "
            "Blocked. Count the engine's start-up in it: a pod not yet probed counts as not passed."
        ),
    )
    automatic_rollback: bool = Field(
        default=True,
        description=(
            "Roll a Blocked revision back: the engine Deployment gets the pod template of the last "
            "revision that was Proven (from its ReplicaSet), spec stays as written, Degraded says "
            "RolledBack until the spec changes. False: the rollout stays where it stopped."
        ),
    )
    max_latency_regression: float = Field(
        default=1.5,
        ge=1.0,
        le=100.0,
        description=(
            "A new revision's pod keeps its gate closed (LatencyRegression) while its probe's TTFT or "
            "TPOT is more than this many times the median of the last proven revision's serving pods "
            "probed in the same cycle (and more than 20 ms TTFT / 5 ms TPOT above it: below that it is "
            "noise). No such pod in the cycle (a single replica replaced in place): not compared."
        ),
    )


class RolloutStatus(ApiModel):
    """The newest revision of the engine pods (their pod-template-hash) proving itself: a pod of it
    takes traffic only once its readiness gate opened, after a full request path passed, checks included."""

    revision: str = Field(
        max_length=63,
        description="The newest engine pods' revision (label inference.servedmodel.io/revision).",
    )
    state: Literal["Proving", "Proven", "Blocked", "RolledBack"] = Field(
        description=(
            "Proven: every pod of the revision passed its gate; Proving: some have not yet; Blocked: "
            "Proving past spec.rollout.progressDeadlineSeconds; RolledBack: the pods are the last proven "
            "revision's again, blockedRevision remembered until the spec changes."
        )
    )
    since: str | None = Field(default=None, description="RFC 3339 time this revision was first seen Proving.")
    blocked_revision: str | None = Field(
        default=None, max_length=63, description="The revision that was Blocked (rolled back while it stays)."
    )
    blocked_message: str | None = Field(
        default=None, max_length=1024, description="Why it was Blocked: its failing pod, reason and message."
    )
    passed: int = Field(ge=0, description="Pods of the revision whose readiness gate is open.")
    total: int = Field(ge=0, description="Pods of the revision that exist.")
    failing_pod: str | None = Field(default=None, max_length=253, description="A pod of it not passed yet.")
    failing_reason: str | None = Field(
        default=None,
        max_length=128,
        description=(
            "Why that pod's gate is closed: the probe's failure reason, ChecksFailed, "
            "SuccessThresholdNotMet, or NotProbedYet."
        ),
    )
    message: str | None = Field(default=None, max_length=1024, description="That pod's gate message.")
    last_proven_revision: str | None = Field(
        default=None, max_length=63, description="The newest revision that was Proven (this one once it is)."
    )
    fingerprint: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "How this revision's chat template renders spec.probe.messages: sha256:<16 hex>/<token "
            "count> over the token ids of /tokenize, taken from its first pod probed."
        ),
    )
    last_proven_fingerprint: str | None = Field(
        default=None,
        max_length=64,
        description="The last proven revision's fingerprint (a new one that differs: TemplateChanged).",
    )


def rollout_verdict(rollout: object) -> tuple[object, ...]:
    """What the reconciler acts on in status.rollout (reconcile.rollback): a change of it reconciles."""
    r = rollout if isinstance(rollout, dict) else {}
    return tuple(r.get(k) for k in ("blockedRevision", "lastProvenRevision", "blockedMessage"))


class ProbeStatus(ApiModel):
    """What the last probe cycle measured, plus the rolling window."""

    last_probe_time: str | None = Field(default=None, description="RFC 3339 time the last probe cycle ended.")
    result: ProbeResultValue | None = Field(default=None, description="Success or Failure of the last probe.")
    reason: str | None = Field(
        default=None,
        description="CamelCase reason, e.g. Serving, ConnectionRefused, DNSFailure, ModelNotServed.",
    )
    message: str | None = Field(default=None, description="Human-readable details of the last probe.")
    endpoint: str | None = Field(default=None, description="Base URL the chat request was sent to.")
    model: str | None = Field(default=None, description="Served model name probed (from /v1/models).")
    max_model_len: int | None = Field(default=None, ge=0, description="max_model_len reported by /v1/models.")
    finish_reason: str | None = Field(
        default=None, description="finish_reason of the probe's chat completion."
    )
    consecutive_failures: int = Field(
        default=0, ge=0, description="Failed probes in a row; drives the probe's backoff."
    )
    metrics_pods: int | None = Field(
        default=None, ge=0, description="Engine pods (or endpoints) whose metrics were read."
    )
    client: ClientLatency | None = Field(default=None, description="Client-side latencies of the last probe.")
    server: ServerLatency | None = Field(
        default=None, description="Server-side phase times around the last probe."
    )
    scheduler: SchedulerSnapshot | None = Field(default=None, description="Scheduler gauges at probe time.")
    usage: ProbeUsage | None = Field(default=None, description="Token usage of the probe's chat completion.")
    counters: ProbeCounters | None = Field(default=None, description="Engine token counters and rates.")
    window: ProbeWindow | None = Field(default=None, description="Rolling p50/p95 over recent probes.")
    checks: ProbeChecks | None = Field(default=None, description="Request-path checks of the last probe.")
    serving: str | None = Field(
        default=None,
        max_length=32,
        description="Serving replicas / probed replicas, e.g. 2/3 (managed mode), for the Serving column.",
    )
    adapters: list[AdapterProbe] | None = Field(
        default=None,
        max_length=64,
        description="Each declared LoRA adapter (spec.adapters): the pods it is loaded on and its own probe.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    adapters_serving: str | None = Field(
        default=None,
        max_length=32,
        description="Adapters whose own probe served / adapters declared, e.g. 2/3, for the Adapters column.",
    )
    pods: list[PodProbe] | None = Field(
        default=None,
        # spec.replicas' maximum: a shorter list made every probe write of a larger model 422.
        max_length=1024,
        description=(
            "Each engine pod's own probe, by name (managed mode). The top-level figures are the aggregate "
            "over the pods probed in the last cycle: client latencies the median of the serving pods, "
            "scheduler gauges summed (KV cache usage: the highest pod)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
