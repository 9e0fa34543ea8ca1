"""Pure: vLLM's /metrics text -> a snapshot of the counters, histogram sums/counts and scheduler gauges
the probe needs; snapshots of several pods add up; two snapshots give the window's deltas.

Metric renames across vLLM versions are tolerated: each quantity lists its names, newest first, and the
first one present wins.

A probe cycle scrapes every engine twice, so what a scrape costs is paid twice a cycle per pod (issue 21).
`METRICS_QUERY` asks the server for just the samples the snapshot uses (`?name[]=…`, which
prometheus_client's exposition apps — vLLM's /metrics among them — answer with those samples alone: about
30 lines instead of 600), and `parse_metrics` reads only the sample lines of those names with a small
parser of the exposition's sample syntax (tests/probe/test_probe_metrics.py holds it to
prometheus_client's parser on the simulator's and real texts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import quote

# Counters (scraped names end in _total), summed over every series of the model.
COUNTERS: dict[str, tuple[str, ...]] = {
    "request_success": ("vllm:request_success_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    # requests evicted from the KV cache and recomputed (KVCachePressure, probe/replicas.py)
    "preemptions": ("vllm:num_preemptions_total",),
    # prompt tokens served from the prefix cache (0.32+), else the older hit counter (also in tokens)
    "prompt_tokens_cached": ("vllm:prompt_tokens_cached_total", "vllm:prefix_cache_hits_total"),
}

# Histograms: phase -> candidate base names; the probe uses _sum and _count.
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "queue": ("vllm:request_queue_time_seconds",),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
    "inference": ("vllm:request_inference_time_seconds",),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "ttft": ("vllm:time_to_first_token_seconds",),
    # per request (e2e - ttft)/(n - 1); before 0.9 only the per-token histogram existed
    "tpot": ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds"),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}

# Gauges: name -> candidates. running/waiting add up over pods, KV cache usage takes the highest pod.
GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
MAX_GAUGES = frozenset({"kv_cache_usage"})


@dataclass(frozen=True)
class Histo:
    sum: float
    count: float


@dataclass(frozen=True)
class MetricsSnapshot:
    """One model's figures at one moment, over `sources` pods (or one Prometheus query)."""

    counters: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Histo] = field(default_factory=dict)
    gauges: Mapping[str, float] = field(default_factory=dict)
    sources: int = 1

    def __add__(self, other: MetricsSnapshot) -> MetricsSnapshot:
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0.0) + v
        histos = dict(self.histograms)
        for k, h in other.histograms.items():
            old = histos.get(k)
            histos[k] = h if old is None else Histo(old.sum + h.sum, old.count + h.count)
        gauges = dict(self.gauges)
        for k, v in other.gauges.items():
            if k in gauges:
                gauges[k] = max(gauges[k], v) if k in MAX_GAUGES else gauges[k] + v
            else:
                gauges[k] = v
        return MetricsSnapshot(counters, histos, gauges, self.sources + other.sources)


def combine(snapshots: Iterable[MetricsSnapshot]) -> MetricsSnapshot | None:
    out: MetricsSnapshot | None = None
    for s in snapshots:
        out = s if out is None else out + s
    return out


def parse_metrics(text: str, model_name: str | None = None) -> MetricsSnapshot:
    """Parse exposition text; with model_name, keep only series whose model_name label matches
    (series without the label, like an old engine's, are kept). Raises ValueError for a sample line of
    a wanted name that does not parse."""
    values: dict[str, float] = {}
    wanted = _WANTED
    for line in text.splitlines():
        if not line.startswith("vllm:") or line.split("{", 1)[0].split(" ", 1)[0] not in wanted:
            continue  # comments, buckets, other series: most of an unfiltered scrape
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"unparsable sample line {line[:120]!r}")
        name, labels, value = m.group(1), m.group(2), m.group(3)
        if model_name is not None and labels:
            label = _MODEL_LABEL.search(labels)
            if label is not None and _unescape(label.group(1)) != model_name:
                continue
        values[name] = values.get(name, 0.0) + _value(value, line)
    return snapshot_from_values(values)


# A sample line: name, an optional label set (name="value" pairs; a value may hold '}' and escaped
# quotes), the value; an optional timestamp follows.
_SAMPLE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{\s*(?:[a-zA-Z_]\w*\s*=\s*"(?:[^"\\]|\\.)*"\s*,?\s*)*\})?[ \t]+(\S+)'
)
_MODEL_LABEL = re.compile(r'[{,]\s*model_name\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value)


def _value(text: str, line: str) -> float:
    try:
        return float(text)  # also "NaN", "+Inf", "-Inf", as the exposition writes them
    except ValueError:
        raise ValueError(f"sample value {text!r} is not a number in {line[:120]!r}") from None


def snapshot_from_values(values: Mapping[str, float], sources: int = 1) -> MetricsSnapshot:
    """Pick the quantities the probe uses out of {sample name: value summed over series}."""
    counters: dict[str, float] = {}
    for key, names in COUNTERS.items():
        for n in names:
            if n in values:
                counters[key] = values[n]
                break
    histos: dict[str, Histo] = {}
    for key, names in HISTOGRAMS.items():
        for n in names:
            if f"{n}_sum" in values and f"{n}_count" in values:
                histos[key] = Histo(values[f"{n}_sum"], values[f"{n}_count"])
                break
    gauges: dict[str, float] = {}
    for key, names in GAUGES.items():
        for n in names:
            if n in values:
                gauges[key] = values[n]
                break
    return MetricsSnapshot(counters, histos, gauges, sources)


def wanted_sample_names() -> list[str]:
    """Every sample name the snapshot can use (the Prometheus source queries these)."""
    names: list[str] = []
    for cands in COUNTERS.values():
        names.extend(cands)
    for cands in HISTOGRAMS.values():
        for n in cands:
            names.extend((f"{n}_sum", f"{n}_count"))
    for cands in GAUGES.values():
        names.extend(cands)
    return list(dict.fromkeys(names))


_WANTED = frozenset(wanted_sample_names())
# The scrape's query: only these samples, where the server honours name[] (others send everything, and
# parse_metrics picks the same lines out of it).
METRICS_QUERY = "?" + "&".join(f"name[]={quote(n, safe='')}" for n in sorted(_WANTED))


@dataclass(frozen=True)
class WindowDelta:
    """What changed between the scrape before and the scrape after the probe."""

    counters: Mapping[str, float]
    phases_ms: Mapping[str, float]  # mean per request in the window, ms
    reset: bool  # a counter went down (pod restarted): deltas unknown
    # observations per histogram in the window: what weights phases_ms when windows are pooled
    # (bench/probe_vs_vllm_bench.py sums vLLM's view over many probe cycles)
    phase_counts: Mapping[str, float] = field(default_factory=dict)


def delta(before: MetricsSnapshot, after: MetricsSnapshot) -> WindowDelta:
    counters: dict[str, float] = {}
    reset = False
    for k, v in after.counters.items():
        if k in before.counters:
            d = v - before.counters[k]
            if d < 0:
                reset = True
                continue
            counters[k] = d
    phases: dict[str, float] = {}
    counts: dict[str, float] = {}
    for k, h in after.histograms.items():
        b = before.histograms.get(k)
        if b is None:
            continue
        dc, ds = h.count - b.count, h.sum - b.sum
        if dc < 0:  # counts only grow; a sum may legally shrink (a negative observation)
            reset = True
            continue
        counts[k] = dc
        if dc > 0:
            phases[k] = ds / dc * 1000.0
    if reset:
        return WindowDelta({}, {}, True)
    return WindowDelta(counters, phases, False, counts)
