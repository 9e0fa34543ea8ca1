"""vLLM 0.33's /metrics, series for series: names, types, labels and buckets of vllm/v1/metrics/loggers.py.

Its own CollectorRegistry (so a test process can hold several simulators, and `_created` series appear as
with vLLM's single API server). Gauges are set from the scheduler at every step, so they tell the truth
at scrape time; request histograms are observed when a request finishes, like vLLM's output processor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)

if TYPE_CHECKING:
    from servedmodel.sim.engine import Engine, Request, StepPlan

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                               5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
# prometheus-fastapi-instrumentator's defaults, as vLLM's API server exposes them.
HTTP_DURATION_BUCKETS = (0.1, 0.5, 1.0)
HTTP_DURATION_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5,
                               4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of one value, in one pass (prometheus_client's observe, unrolled)."""
    try:
        histogram._sum.inc(value * count)
        for i, bound in enumerate(histogram._upper_bounds):
            if value <= bound:
                histogram._buckets[i].inc(count)
                return
    except AttributeError:  # a prometheus_client without these internals: the slow, public way
        for _ in range(count):
            histogram.observe(value)


# --sim-metric-names old: the names vLLM used before 0.9's renames (reference: vllm-0.33.md), which the
# probe still reads as aliases and GIE's endpoint picker, by default, does not.
OLD_METRIC_NAMES: dict[str, str] = {
    "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "vllm:inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
}


class SimMetrics:
    """The registry and every series; implements the engine's Observer."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_config: dict[str, str],
        max_loras: int | None = None,
        renames: Mapping[str, str] | None = None,
    ) -> None:
        """`renames` (--sim-metric-names, --sim-rename-metric): series exposed under another name, as an
        engine image that renamed a metric would (names as declared, counters without _total)."""
        self.registry = reg = CollectorRegistry()
        renamed = dict(renames or {})

        def rn(name: str) -> str:
            return renamed.get(name, name)

        # prometheus_client's default collectors, as on vLLM's global registry (this process's figures)
        for collector in (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR):
            reg.register(collector)
        ln = ["model_name", "engine"]
        lv = (model_name, "0")
        token_buckets = build_1_2_5_buckets(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(rn(name), doc, ln, registry=reg).labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(rn(name), doc, ln, registry=reg).labels(*lv)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(rn(name), doc, ln, buckets=buckets, registry=reg).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge(
            rn("vllm:num_requests_waiting_by_reason"),
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
            "blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting.",
            [*ln, "reason"],
            registry=reg,
        )
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        self.waiting_deferred = by_reason.labels(*lv, "deferred")
        sleep = Gauge(
            rn("vllm:engine_sleep_state"),
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*ln, "sleep_state"],
            registry=reg,
        )
        sleep.labels(*lv, "awake").set(1)
        sleep.labels(*lv, "weights_offloaded").set(0)
        sleep.labels(*lv, "discard_all").set(0)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
            "number of queried tokens.",
        )
        counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
            "number of cached tokens.",
        )
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        # Model FLOPs utilization estimates: no model runs here, so they stay 0 (as on vLLM-CPU)
        for what in ("flops", "read_bytes", "write_bytes"):
            noun = {"flops": "floating point operations", "read_bytes": "bytes read from memory"}.get(
                what, "bytes written to memory"
            )
            counter(
                f"vllm:estimated_{what}_per_gpu",
                f"Estimated number of {noun} per GPU (for Model Flops Utilization calculations).",
            )
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter(
            rn("vllm:prompt_tokens_by_source"),
            "Number of prompt tokens by source.",
            [*ln, "source"],
            registry=reg,
        )
        self.prompt_by_source = {s: by_source.labels(*lv, s) for s in PROMPT_TOKEN_SOURCES}
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        cached_by_source = Counter(
            rn("vllm:prompt_tokens_cached_by_source"),
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            [*ln, "source"],
            registry=reg,
        )
        self.cached_by_source = {s: cached_by_source.labels(*lv, s) for s in CACHE_HIT_SOURCES}
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            rn("vllm:request_success"),
            "Count of successfully processed requests.",
            [*ln, "finished_reason"],
            registry=reg,
        )
        self.success = {r: success.labels(*lv, r) for r in FINISH_REASONS}
        rejections = Counter(
            rn("vllm:admission_rejections"),
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=reg,
        )
        for reason in ADMISSION_REASONS:
            rejections.labels(model_name, reason)

        self.h_prompt = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.h_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.h_iteration = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.h_max_gen = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.h_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.h_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.h_ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.h_itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.h_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.h_e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        # Time spent in each phase of a request, named after vLLM's request states.
        self.h_queue, self.h_inference, self.h_prefill, self.h_decode = (
            histogram(
                f"vllm:request_{phase}_time_seconds",
                f"Histogram of time spent in {state} phase for request.",
                REQUEST_LATENCY_BUCKETS,
            )
            for phase, state in (
                ("queue", "WAITING"),
                ("inference", "RUNNING"),
                ("prefill", "PREFILL"),
                ("decode", "DECODE"),
            )
        )
        self.h_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.h_prefill_kv = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        info = Gauge(
            rn("vllm:cache_config_info"),
            "Information of the LLMEngine CacheConfig",
            [*sorted(cache_config), "engine"],
            registry=reg,
        )
        info.labels(**cache_config, engine="0").set(1)

        http_requests = Counter(
            "http_requests_total", "Total number of requests by method, status and handler.",
            ["handler", "method", "status"], registry=reg,
        )  # fmt: skip
        http_duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. "
            "Made to be only used if aggregation by handler is important.",
            ["handler", "method"],
            buckets=HTTP_DURATION_BUCKETS,
            registry=reg,
        )
        self.http_requests = http_requests
        self.http_duration = http_duration
        self.http_duration_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile "
            "calculations. ",
            buckets=HTTP_DURATION_HIGHR_BUCKETS,
            registry=reg,
        )
        self.http_request_size = Summary(
            "http_request_size_bytes",
            "Content length of incoming requests by handler. Only value of header is respected. "
            "Otherwise ignored. No percentile calculated. ",
            ["handler"],
            registry=reg,
        )
        self.http_response_size = Summary(
            "http_response_size_bytes",
            "Content length of outgoing responses by handler. Only value of header is respected. "
            "Otherwise ignored. No percentile calculated. ",
            ["handler"],
            registry=reg,
        )
        # Only with --enable-lora; no model_name or engine label. Each step sets the series of that step's
        # adapters to the current time; earlier label sets stay, as in vLLM's registry.
        self.lora_info: Gauge | None = None
        self.max_loras = str(max_loras)
        if max_loras is not None:
            self.lora_info = Gauge(
                rn("vllm:lora_requests_info"),
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=reg,
            )
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0

    # -- Observer ------------------------------------------------------------------------------------
    def on_step(
        self, engine: Engine, plan: StepPlan, generated: list[Request], first_tokens: list[Request]
    ) -> None:
        snap_running = len(engine.running)
        self.running.set(snap_running)
        self.set_waiting(engine)
        if self.lora_info is not None:
            self.observe_loras(engine)
        self.kv_usage.set(engine.kv.usage)
        if engine.num_preemptions != self._last_preemptions:
            self.preemptions.inc(engine.num_preemptions - self._last_preemptions)
            self._last_preemptions = engine.num_preemptions
        if engine.prefix_queries != self._last_queries:
            self.prefix_queries.inc(engine.prefix_queries - self._last_queries)
            self._last_queries = engine.prefix_queries
        if engine.prefix_hits != self._last_hits:
            hits = engine.prefix_hits - self._last_hits
            self.prefix_hits.inc(hits)
            self.cached_by_source["device"].inc(hits)
            self._last_hits = engine.prefix_hits
        if generated:
            self.generation_tokens.inc(len(generated))
        self.h_iteration.observe(plan.num_prefill_tokens + len(generated))
        for req in first_tokens:
            # vLLM counts a request's whole prompt when its prefill completes (cached tokens included).
            prompt_len = len(req.prompt_ids)
            self.prompt_tokens.inc(prompt_len)
            self.prompt_by_source["local_compute"].inc(prompt_len - req.num_cached_tokens)
            self.prompt_by_source["local_cache_hit"].inc(req.num_cached_tokens)
            self.prompt_cached.inc(req.num_cached_tokens)
            self.h_max_gen.observe(req.max_tokens)
            self.h_n.observe(1)
            if req.first_token is not None:
                self.h_ttft.observe(req.first_token - req.arrival)
        # One inter-token gap per generated token; the gaps of a step are nearly all equal (previous step
        # end to this one), so they are counted per distinct value.
        gaps: dict[float, int] = {}
        for req in generated:
            prev, last = req.prev_token, req.last_token
            if prev is not None and last is not None:
                gap = last - prev
                gaps[gap] = gaps.get(gap, 0) + 1
        for gap, count in gaps.items():
            observe_many(self.h_itl, gap, count)

    def set_waiting(self, engine: Engine) -> None:
        self.waiting.set(len(engine.waiting))
        self.waiting_capacity.set(len(engine.waiting) - len(engine.deferred))
        self.waiting_deferred.set(len(engine.deferred))

    def observe_loras(self, engine: Engine) -> None:
        """vLLM's LoRARequestStates: the adapters with running and with waiting requests, in order."""
        running: dict[str, None] = {}
        waiting: dict[str, None] = {}
        for req in engine.requests.values():
            if req.lora_name is not None:
                (running if req.state == "running" else waiting)[req.lora_name] = None
        if self.lora_info is not None:
            self.lora_info.labels(self.max_loras, ",".join(waiting), ",".join(running)).set_to_current_time()

    def on_finished(self, engine: Engine, request: Request) -> None:
        self.running.set(len(engine.running))
        self.set_waiting(engine)
        self.kv_usage.set(engine.kv.usage)
        reason = request.finish_reason or "abort"
        self.success[reason if reason in self.success else "abort"].inc()
        if request.first_scheduled is None or request.first_token is None or request.last_token is None:
            return
        e2e = request.last_token - request.arrival
        self.h_e2e.observe(e2e)
        self.h_queue.observe(request.first_scheduled - request.queued)
        self.h_prefill.observe(request.first_token - request.first_scheduled)
        self.h_inference.observe(request.last_token - request.first_scheduled)
        self.h_decode.observe(request.last_token - request.first_token)
        self.h_preemptions.observe(request.num_preemptions)
        self.h_prefill_kv.observe(len(request.prompt_ids) - request.num_cached_tokens)
        self.h_prompt.observe(len(request.prompt_ids))
        self.h_generation.observe(request.completion_tokens)
        n = request.completion_tokens
        self.h_tpot.observe((request.last_token - request.first_token) / (n - 1) if n > 1 else 0.0)
        if request.max_tokens_param:
            self.h_max_tokens.observe(request.max_tokens_param)

    def observe_http(
        self, handler: str, method: str, status: int, seconds: float, req_bytes: int = 0, resp_bytes: int = 0
    ) -> None:
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()
        self.http_duration.labels(handler, method).observe(seconds)
        self.http_duration_highr.observe(seconds)
        self.http_request_size.labels(handler).observe(req_bytes)
        self.http_response_size.labels(handler).observe(resp_bytes)

    def render(self, names: Sequence[str] = ()) -> bytes:
        """The exposition; with `names`, only the samples of those names (prometheus_client's name[])."""
        return generate_latest(self.registry.restricted_registry(names) if names else self.registry)
