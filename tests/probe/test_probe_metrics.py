"""Parsing vLLM's /metrics (generated here by a real prometheus_client registry with vLLM 0.33's names,
labels and buckets), summing pods, window deltas, and metric renames across versions (pure)."""

from __future__ import annotations

from urllib.parse import parse_qs

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servedmodel.probe.metrics import (
    METRICS_QUERY,
    MetricsSnapshot,
    delta,
    parse_metrics,
    snapshot_from_values,
    wanted_sample_names,
)

PHASE_BUCKETS = [0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]


class FakeEngine:
    """vLLM 0.33's metric families for one or more models, in a real registry."""

    def __init__(self, old_names: bool = False) -> None:
        self.reg = CollectorRegistry()
        labels = ["model_name", "engine"]
        kv = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
        self.running = Gauge("vllm:num_requests_running", "running", labels, registry=self.reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=self.reg)
        self.kv = Gauge(kv, "kv", labels, registry=self.reg)
        self.success = Counter("vllm:request_success", "ok", [*labels, "finished_reason"], registry=self.reg)
        self.prompt = Counter("vllm:prompt_tokens", "p", labels, registry=self.reg)
        self.gen = Counter("vllm:generation_tokens", "g", labels, registry=self.reg)
        self.h: dict[str, Histogram] = {}
        phases = {
            "queue": "vllm:request_queue_time_seconds",
            "prefill": "vllm:request_prefill_time_seconds",
            "decode": "vllm:request_decode_time_seconds",
            "inference": "vllm:request_inference_time_seconds",
            "e2e": "vllm:e2e_request_latency_seconds",
        }
        for key, name in phases.items():
            self.h[key] = Histogram(name, key, labels, buckets=PHASE_BUCKETS, registry=self.reg)
        self.h["ttft"] = Histogram("vllm:time_to_first_token_seconds", "t", labels, registry=self.reg)
        if old_names:
            self.h["tpot"] = Histogram(
                "vllm:time_per_output_token_seconds", "x", labels, buckets=ITL_BUCKETS, registry=self.reg
            )
        else:
            self.h["tpot"] = Histogram(
                "vllm:request_time_per_output_token_seconds",
                "x",
                labels,
                buckets=ITL_BUCKETS,
                registry=self.reg,
            )
            self.h["itl"] = Histogram(
                "vllm:inter_token_latency_seconds", "i", labels, buckets=ITL_BUCKETS, registry=self.reg
            )

    def finish(
        self, model: str, *, prompt: int, gen: int, queue: float, prefill: float, decode: float
    ) -> None:
        lab = {"model_name": model, "engine": "0"}
        self.success.labels(**lab, finished_reason="stop").inc()
        self.prompt.labels(**lab).inc(prompt)
        self.gen.labels(**lab).inc(gen)
        self.h["queue"].labels(**lab).observe(queue)
        self.h["prefill"].labels(**lab).observe(prefill)
        self.h["decode"].labels(**lab).observe(decode)
        self.h["inference"].labels(**lab).observe(prefill + decode)
        self.h["e2e"].labels(**lab).observe(queue + prefill + decode)
        self.h["ttft"].labels(**lab).observe(queue + prefill)
        self.h["tpot"].labels(**lab).observe(decode / max(gen - 1, 1))
        if "itl" in self.h:
            for _ in range(gen - 1):
                self.h["itl"].labels(**lab).observe(decode / max(gen - 1, 1))

    def scheduler(self, model: str, running: int, waiting: int, kv: float) -> None:
        lab = {"model_name": model, "engine": "0"}
        self.running.labels(**lab).set(running)
        self.waiting.labels(**lab).set(waiting)
        self.kv.labels(**lab).set(kv)

    def text(self) -> str:
        return generate_latest(self.reg).decode()


def test_parse_filters_by_model_and_sums_finished_reasons() -> None:
    eng = FakeEngine()
    eng.finish("qwen", prompt=30, gen=5, queue=0.01, prefill=0.02, decode=0.2)
    eng.finish("other", prompt=100, gen=50, queue=1, prefill=1, decode=1)
    eng.success.labels(model_name="qwen", engine="0", finished_reason="length").inc()
    eng.scheduler("qwen", 3, 1, 0.25)
    snap = parse_metrics(eng.text(), "qwen")
    assert snap.counters == {"request_success": 2.0, "prompt_tokens": 30.0, "generation_tokens": 5.0}
    assert snap.gauges == {"running": 3.0, "waiting": 1.0, "kv_cache_usage": 0.25}
    assert snap.histograms["queue"].count == 1
    assert snap.histograms["queue"].sum == pytest.approx(0.01)
    assert set(snap.histograms) == {"queue", "prefill", "decode", "inference", "e2e", "ttft", "tpot", "itl"}


def test_window_delta_gives_phase_means_in_ms() -> None:
    eng = FakeEngine()
    eng.finish("qwen", prompt=10, gen=2, queue=0.5, prefill=0.5, decode=0.5)
    before = parse_metrics(eng.text(), "qwen")
    eng.finish("qwen", prompt=31, gen=4, queue=0.002, prefill=0.030, decode=0.060)
    after = parse_metrics(eng.text(), "qwen")
    d = delta(before, after)
    assert not d.reset
    assert d.counters == {"request_success": 1.0, "prompt_tokens": 31.0, "generation_tokens": 4.0}
    assert d.phases_ms["queue"] == pytest.approx(2.0)
    assert d.phases_ms["prefill"] == pytest.approx(30.0)
    assert d.phases_ms["decode"] == pytest.approx(60.0)
    assert d.phases_ms["ttft"] == pytest.approx(32.0)
    assert d.phases_ms["tpot"] == pytest.approx(20.0)


def test_counter_reset_marks_window_unknown() -> None:
    a, b = FakeEngine(), FakeEngine()
    a.finish("qwen", prompt=10, gen=2, queue=0.1, prefill=0.1, decode=0.1)
    a.finish("qwen", prompt=10, gen=2, queue=0.1, prefill=0.1, decode=0.1)
    b.finish("qwen", prompt=10, gen=2, queue=0.1, prefill=0.1, decode=0.1)  # the pod restarted
    d = delta(parse_metrics(a.text(), "qwen"), parse_metrics(b.text(), "qwen"))
    assert d.reset
    assert d.phases_ms == {}


def test_old_metric_names_are_accepted() -> None:
    eng = FakeEngine(old_names=True)
    eng.scheduler("qwen", 1, 0, 0.5)
    eng.finish("qwen", prompt=10, gen=3, queue=0.0, prefill=0.01, decode=0.04)
    snap = parse_metrics(eng.text(), "qwen")
    assert snap.gauges["kv_cache_usage"] == 0.5
    assert snap.histograms["tpot"].sum == pytest.approx(0.02)
    assert snap.histograms["itl"].sum == pytest.approx(0.02)  # the old per-token histogram serves both


def test_pods_add_up_and_kv_cache_takes_the_fullest() -> None:
    a, b = FakeEngine(), FakeEngine()
    a.scheduler("qwen", 2, 0, 0.1)
    b.scheduler("qwen", 4, 3, 0.7)
    a.finish("qwen", prompt=10, gen=2, queue=0.1, prefill=0.1, decode=0.1)
    b.finish("qwen", prompt=20, gen=3, queue=0.3, prefill=0.1, decode=0.1)
    snap = parse_metrics(a.text(), "qwen") + parse_metrics(b.text(), "qwen")
    assert snap.sources == 2
    assert snap.gauges == {"running": 6.0, "waiting": 3.0, "kv_cache_usage": 0.7}
    assert snap.counters["prompt_tokens"] == 30.0
    assert snap.histograms["queue"].count == 2
    assert snap.histograms["queue"].sum == pytest.approx(0.4)


def reference(text: str, model: str | None) -> MetricsSnapshot:
    """The same snapshot through prometheus_client's own parser: what parse_metrics must agree with."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = s.labels.get("model_name")
            if s.name.startswith("vllm:") and (model is None or label is None or label == model):
                values[s.name] = values.get(s.name, 0.0) + float(s.value)
    return snapshot_from_values(values)


@pytest.mark.parametrize("model", ["qwen", "other", None])
def test_the_parser_agrees_with_prometheus_clients_on_a_whole_scrape(model: str | None) -> None:
    eng = FakeEngine()
    eng.finish("qwen", prompt=30, gen=5, queue=0.01, prefill=0.02, decode=0.2)
    eng.finish("other", prompt=100, gen=50, queue=1, prefill=1, decode=1)
    eng.scheduler("qwen", 3, 1, 0.25)
    eng.scheduler("other", 1, 0, 0.5)
    text = eng.text()
    assert parse_metrics(text, model) == reference(text, model)


def test_label_values_with_braces_quotes_and_escapes_timestamps_and_special_values() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running running",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{model_name="a}b",engine="0"} 3',
            'vllm:num_requests_running{model_name="q\\"x\\\\y",engine="0"} 5 1700000000000',
            'vllm:num_requests_running{engine="0",model_name="qwen"} 7',
            'vllm:num_requests_waiting{engine="0", model_name="qwen"} +Inf',
            "vllm:kv_cache_usage_perc 0.5",
            'vllm:request_success_total{model_name="not_qwen",engine="0"} 100',
            'vllm:request_success_total{xmodel_name="qwen",model_name="qwen"} 2',
            "",
        ]
    )
    assert parse_metrics(text, 'q"x\\y').gauges["running"] == 5.0
    assert parse_metrics(text, "a}b").gauges["running"] == 3.0
    snap = parse_metrics(text, "qwen")
    assert snap == reference(text, "qwen")
    assert snap.gauges == {"running": 7.0, "waiting": float("inf"), "kv_cache_usage": 0.5}
    assert snap.counters == {"request_success": 2.0}


def test_an_unparsable_wanted_line_is_an_error_and_an_unwanted_one_is_ignored() -> None:
    assert parse_metrics('vllm:cache_config_info{x="1" 2\nvllm:num_requests_running 1\n').gauges == {
        "running": 1.0
    }
    with pytest.raises(ValueError, match="vllm:num_requests_running"):
        parse_metrics("vllm:num_requests_running{model_name=qwen} 1\n", "qwen")
    with pytest.raises(ValueError, match="not a number"):
        parse_metrics("vllm:num_requests_running one\n", "qwen")


def test_the_query_names_every_wanted_sample_and_a_registry_answers_it_with_those_alone() -> None:
    """prometheus_client's exposition (vLLM's /metrics is its ASGI app) answers ?name[]=… with only those
    samples: the buckets, _created series and other families stay on the server."""
    eng = FakeEngine()
    eng.finish("qwen", prompt=30, gen=5, queue=0.01, prefill=0.02, decode=0.2)
    eng.scheduler("qwen", 3, 1, 0.25)
    names = parse_qs(METRICS_QUERY.removeprefix("?"))["name[]"]
    assert sorted(names) == sorted(wanted_sample_names())
    whole = eng.text()
    only = generate_latest(eng.reg.restricted_registry(names)).decode()
    samples = [line for line in only.splitlines() if line and not line.startswith("#")]
    assert samples
    assert all(line.split("{")[0].split(" ")[0] in names for line in samples)
    assert len(only) < len(whole) / 4
    assert parse_metrics(only, "qwen") == parse_metrics(whole, "qwen")
