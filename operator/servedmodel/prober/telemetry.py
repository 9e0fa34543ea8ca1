"""The prober's own Prometheus series: what the operator exports about its probes (latencies, cycles,
status and readiness-gate writes, the two event loops' lag, GC pauses). Not the engine's /metrics, which
probe/metrics.py parses, nor the operator's other series (handlers/metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from servedmodel.api.startup import StartupTimeline
from servedmodel.probe.client import ProbeOutcome
from servedmodel.probe.report import publishable_figures
from servedmodel.probe.startup import TOTAL, stage_seconds

from .series import LabeledCounter, LabeledGauge, LabeledHistogram

# Cold starts and wakes: from a cached small model in seconds to a large one pulled and loaded in an hour.
COLD_START_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)


class ProbeMetrics:
    """The probe's operator metrics, on the registry the operator serves (no module globals)."""

    _LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["namespace", "name"]
        self.ttft = LabeledHistogram(
            "servedmodel_probe_ttft_seconds",
            "Probe TTFT (request sent -> first content token), seconds.",
            labels,
            buckets=self._LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = LabeledHistogram(
            "servedmodel_probe_tpot_seconds",
            "Probe TPOT, vLLM's definition ((e2e - TTFT)/(completion tokens - 1)), seconds.",
            labels,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.e2e = LabeledHistogram(
            "servedmodel_probe_e2e_seconds",
            "Probe end to end (request sent -> [DONE]), seconds.",
            labels,
            buckets=self._LATENCY_BUCKETS,
            registry=registry,
        )
        self.serving = LabeledGauge(
            "servedmodel_probe_serving", "1 when the last probe succeeded, else 0.", labels, registry=registry
        )
        self.failures = LabeledCounter(
            "servedmodel_probe_failures", "Failed probes by reason.", [*labels, "reason"], registry=registry
        )
        self.cycles = LabeledCounter(
            "servedmodel_probe", "Probe cycles run, by result.", [*labels, "result"], registry=registry
        )
        self.status_writes = LabeledCounter(
            "servedmodel_probe_status_writes",
            "Status writes of the probe (at most one per cycle).",
            labels,
            registry=registry,
        )
        # The autoscaling signal (spec.autoscaling.targets.probeTtftP95Ms): the rolling window's p95, which
        # Prometheus scrapes and prometheus-adapter / KEDA serve to the autoscaler (servedmodel.scaling).
        self.ttft_p95 = LabeledGauge(
            "servedmodel_probe_ttft_p95_seconds",
            "Probe TTFT p95 over the rolling window (status.probe.window.ttftP95Ms), seconds.",
            labels,
            registry=registry,
        )
        self.in_flight = Gauge(
            "servedmodel_probe_cycles_in_flight",
            "Probe cycles running now (bounded by the scheduler's concurrency).",
            registry=registry,
        )
        self.slots_demanded = Gauge(
            "servedmodel_probe_slots_demanded",
            "Probe slots the tracked ServedModels need, summed over namespaces (cycles started per second "
            "times cycle seconds, and a margin for bunched starts); above the concurrency, starts run late.",
            registry=registry,
        )
        self.scheduled = Gauge(
            "servedmodel_probe_scheduled_models",
            "ServedModels the probe scheduler tracks.",
            registry=registry,
        )
        self.loop_lag = Histogram(
            "servedmodel_event_loop_lag_seconds",
            "Event-loop lag (a short sleep's overshoot): loop=main (watches, reconciles, the scheduler), "
            "loop=probe (the probe's own loop, watched while probes run) or loop=leases (leader election "
            "and probe-sharding membership), seconds.",
            ["loop"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.gc_pause = Histogram(
            "servedmodel_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector, which stop every thread of the operator "
            "(the probe's loop included), by generation, seconds.",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.stalled_samples = Counter(
            "servedmodel_probe_stalled_samples",
            "Probe streams read while the probe's own loop was stalled, or in lumps its hold-ups account "
            "for (figures not published).",
            registry=registry,
        )
        self.lateness = Histogram(
            "servedmodel_probe_start_lateness_seconds",
            "How long a due probe cycle waited for a concurrency slot, seconds.",
            buckets=(0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=registry,
        )

        self.pod_probes = LabeledCounter(
            "servedmodel_probe_pod",
            "Probes of single engine pods, by reason (Serving, or why the pod failed).",
            [*labels, "reason"],
            registry=registry,
        )
        self.pod_transitions = LabeledCounter(
            "servedmodel_probe_pod_transitions",
            "Engine pods whose Serving changed, by new status and reason.",
            [*labels, "serving", "reason"],
            registry=registry,
        )
        self.gate_writes = LabeledCounter(
            "servedmodel_probe_readiness_gate_writes",
            "Readiness-gate condition writes on engine pods (pods/status), by status.",
            [*labels, "status"],
            registry=registry,
        )
        self.stalled = LabeledGauge(
            "servedmodel_probe_engine_stalled_pods",
            "Engine pods whose last probe found the engine stalled (EngineStalled).",
            labels,
            registry=registry,
        )
        self.kv_pressure = LabeledGauge(
            "servedmodel_probe_kv_cache_pressure_pods",
            "Engine pods whose last probe found KV cache pressure with preemptions rising.",
            labels,
            registry=registry,
        )
        self.cold_start = LabeledHistogram(
            "servedmodel_cold_start_seconds",
            "Engine pods' cold starts (status.startup), seconds: stage=total is pod creation to the probe's "
            "first real token; each other stage is how long that stage took (scheduled, initialized, "
            "imagePulled, containerStarted, containersReady, engineHealthy, firstToken), adding up to total.",
            [*labels, "stage"],
            buckets=COLD_START_BUCKETS,
            registry=registry,
        )
        self.wake = LabeledHistogram(
            "servedmodel_wake_seconds",
            "Wakes from zero (status.startup's wakeSeconds): KEDA's scale from 0 to the woken pod's first "
            "real token, seconds.",
            labels,
            buckets=COLD_START_BUCKETS,
            registry=registry,
        )

    def record_start(self, namespace: str, name: str, start: StartupTimeline) -> None:
        """One engine pod's cold start: each stage's seconds, and the total."""
        for stage, seconds in stage_seconds(start):
            self.cold_start.labels(namespace, name, stage).observe(seconds)
        if start.total_seconds is not None:
            self.cold_start.labels(namespace, name, TOTAL).observe(start.total_seconds)
        if start.wake_seconds is not None:
            self.wake.labels(namespace, name).observe(start.wake_seconds)

    def record(self, namespace: str, name: str, out: ProbeOutcome) -> None:
        self.cycles.labels(namespace, name, "success" if out.ok else "failure").inc()
        self.serving.labels(namespace, name).set(1 if out.ok else 0)
        if out.failure is not None:
            self.failures.labels(namespace, name, out.failure.reason).inc()
            return
        if out.stall_took_figures or out.lumped_by_prober:
            self.stalled_samples.inc()
        f = publishable_figures(out)  # not a lump, not read by a stalled prober: the engine's figures
        if f is not None:
            if f.ttft_ms is not None:
                self.ttft.labels(namespace, name).observe(f.ttft_ms / 1000)
            if f.tpot_ms is not None:
                self.tpot.labels(namespace, name).observe(f.tpot_ms / 1000)
            if f.e2e_ms is not None:
                self.e2e.labels(namespace, name).observe(f.e2e_ms / 1000)

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted ServedModel's series (every label set that starts with it): no ghosts."""
        for histogram in (self.ttft, self.tpot, self.e2e, self.cold_start, self.wake):
            histogram.remove_matching((namespace, name))
        for metric in (
            self.serving,
            self.failures,
            self.cycles,
            self.status_writes,
            self.pod_probes,
            self.pod_transitions,
            self.gate_writes,
            self.stalled,
            self.kv_pressure,
            self.ttft_p95,
        ):
            metric.remove_matching((namespace, name))
