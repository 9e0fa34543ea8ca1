"""Memory of the probe's Prometheus series per ServedModel: the operator's ProbeMetrics (its per-model
histograms, counters and gauges kept by prober/series.LabeledHistogram, LabeledCounter, LabeledGauge)
beside the same families as prometheus_client's own Histogram, Counter and Gauge, in one run, measured
with tracemalloc after N models each recorded one probe and one cold start of seven stages.

    .venv/bin/python bench/series_memory.py -n 1000

Never a test: it prints a table (markdown with --markdown) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.utils import INF

from servedmodel.prober.series import Registry
from servedmodel.prober.telemetry import ProbeMetrics

STAGES = ("scheduled", "initialized", "containerStarted", "containersReady", "engineHealthy", "firstToken")


def fill(metrics: ProbeMetrics, n: int) -> None:
    """What one probe cycle and one start record per ServedModel (as ProbeMetrics.record/record_start do)."""
    for i in range(n):
        ns, name = "bench", f"sm-{i:05d}"
        metrics.ttft.labels(ns, name).observe(0.02)
        metrics.tpot.labels(ns, name).observe(0.004)
        metrics.e2e.labels(ns, name).observe(0.1)
        metrics.serving.labels(ns, name).set(1)
        metrics.cycles.labels(ns, name, "success").inc()
        metrics.status_writes.labels(ns, name).inc()
        metrics.ttft_p95.labels(ns, name).set(0.02)
        metrics.pod_probes.labels(ns, name, "Serving").inc()
        metrics.gate_writes.labels(ns, name, "True").inc()
        metrics.stalled.labels(ns, name).set(0)
        metrics.kv_pressure.labels(ns, name).set(0)
        for stage in (*STAGES, "total"):
            metrics.cold_start.labels(ns, name, stage).observe(3.0)


COUNTERS = ("failures", "cycles", "status_writes", "pod_probes", "pod_transitions", "gate_writes")
GAUGES = ("serving", "ttft_p95", "stalled", "kv_pressure")


def as_prometheus_client(registry: CollectorRegistry) -> ProbeMetrics:
    """ProbeMetrics with its per-model families as prometheus_client's own (what they were before)."""
    metrics = ProbeMetrics(registry)
    for attr in ("ttft", "tpot", "e2e", "cold_start", "wake", *COUNTERS, *GAUGES):
        ours = getattr(metrics, attr)
        registry.unregister(ours)
        theirs: Histogram | Counter | Gauge
        if attr in COUNTERS:
            theirs = Counter(ours.name, ours.documentation, ours.labelnames, registry=registry)
        elif attr in GAUGES:
            theirs = Gauge(ours.name, ours.documentation, ours.labelnames, registry=registry)
        else:
            bounds = [b for b in ours.bounds if b != INF]
            theirs = Histogram(
                ours.name, ours.documentation, ours.labelnames, buckets=bounds, registry=registry
            )
        setattr(metrics, attr, theirs)
    return metrics


def whole_text(registry: CollectorRegistry) -> bytes:
    """The exposition in one piece: ours joined, prometheus_client's generate_latest."""
    if isinstance(registry, Registry):
        return b"".join(registry.exposition_chunks())
    return generate_latest(registry)


def scrape_peak_mib(registry: CollectorRegistry, streamed: bool) -> float:
    """The most one scrape holds at once (tracemalloc's peak over what the registry already holds): the
    whole text (`whole_text`), or the pieces of Registry.exposition_chunks, each let go once counted (as
    the operator's server sends them)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    if streamed and isinstance(registry, Registry):
        sent = sum(len(piece) for piece in registry.exposition_chunks())
    else:
        sent = len(whole_text(registry))
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    assert sent > 0
    return peak / 2**20


def measure(
    make: Callable[[CollectorRegistry], ProbeMetrics], n: int, ours: bool
) -> tuple[float, float, int, float, float]:
    """(KiB per model, scrape ms, exposition bytes, scrape peak MiB whole, streamed) for N models: ours on
    the operator's Registry and its exposition, theirs on prometheus_client's registry and
    generate_latest (whole only)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    registry = Registry() if ours else CollectorRegistry()
    metrics = make(registry)
    fill(metrics, n)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    t0 = time.perf_counter()
    text = whole_text(registry)
    scrape_ms = (time.perf_counter() - t0) * 1000
    size = len(text)
    del text
    whole = scrape_peak_mib(registry, streamed=False)
    return used / n / 1024, scrape_ms, size, whole, scrape_peak_mib(registry, streamed=ours)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=1000, help="ServedModels (default 1000)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    ours = measure(ProbeMetrics, args.n, ours=True)
    theirs = measure(as_prometheus_client, args.n, ours=False)
    rows = [
        (
            "probe series per ServedModel, KiB (tracemalloc)",
            f"{theirs[0]:.1f}",
            f"{ours[0]:.1f}",
            f"{theirs[0] / ours[0]:.1f}x",
        ),
        (f"at N = {args.n:,}, MB", f"{theirs[0] * args.n / 1024:.1f}", f"{ours[0] * args.n / 1024:.1f}", ""),
        (
            "one scrape (generate_latest / exposition_chunks joined), ms",
            f"{theirs[1]:.0f}",
            f"{ours[1]:.0f}",
            f"{theirs[1] / ours[1]:.1f}x",
        ),
        ("exposition, MB", f"{theirs[2] / 1e6:.1f}", f"{ours[2] / 1e6:.1f}", ""),
        (
            "one scrape's peak, whole text, MiB (tracemalloc)",
            f"{theirs[3]:.1f}",
            f"{ours[3]:.1f}",
            f"{theirs[3] / ours[3]:.1f}x",
        ),
        (
            "one scrape's peak as served (ours: exposition_chunks), MiB",
            f"{theirs[4]:.1f}",
            f"{ours[4]:.1f}",
            f"{theirs[4] / ours[4]:.1f}x",
        ),
    ]
    header = ("figure", "prometheus_client", "prober/series.py (ours)", "ratio")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        for row in (header, *rows):
            print(f"{row[0]:<55} {row[1]:>18} {row[2]:>24} {row[3]:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
