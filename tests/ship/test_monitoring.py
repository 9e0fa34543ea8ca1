"""Alerts and dashboard: valid PromQL, alerts that fire when they should (promtool), and metric names
that exist — the operator's from its own registry, vLLM's from the engine simulator's /metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from required import absent

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
RULE_FILE = MONITORING / "prometheus_rule.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
PROMTOOL_CASES = Path(__file__).parent / "promtool" / "alerts_test.yaml"

# vLLM 0.33's metric families as scraped (counters with _total); docs in shared/reference/vllm-0.33.md.
VLLM_FAMILIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
}
METRIC = re.compile(r"\b((?:vllm:|servedmodel_)[a-zA-Z0-9_:]+)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def rule_groups() -> list[dict[str, Any]]:
    rule = yaml.safe_load(RULE_FILE.read_text())
    assert rule["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def family(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def used_metrics() -> set[str]:
    exprs = [r["expr"] for g in rule_groups() for r in g["rules"]] + dashboard_exprs()
    return {m for e in exprs for m in METRIC.findall(e)}


@pytest.fixture(scope="module")
def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        absent("promtool not installed (Debian package prometheus)")
    return exe


def run_promtool(promtool: str, cwd: Path, *args: str, timeout: float = 60) -> None:
    """`promtool ARGS` in `cwd`; fails the test with promtool's output unless it succeeds."""
    res = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.prometheus
def test_alerts_fire_when_they_should(promtool: str, tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    shutil.copy(PROMTOOL_CASES, tmp_path / "alerts_test.yaml")
    run_promtool(promtool, tmp_path, "check", "rules", "rules.yaml")
    run_promtool(promtool, tmp_path, "test", "rules", "alerts_test.yaml", timeout=120)


@pytest.mark.prometheus
def test_every_alert_has_a_promtool_case() -> None:
    cases = PROMTOOL_CASES.read_text()
    alerts = [r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r]
    assert len(alerts) == len(set(alerts))
    untested = [a for a in alerts if f'alertname="{a}"' not in cases]
    assert not untested, f"alerts without a promtool case: {untested}"


@pytest.mark.prometheus
def test_dashboard_queries_parse(promtool: str, tmp_path: Path) -> None:
    """Each panel query, Grafana variables filled in, parses as PromQL (as a recording rule)."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    filled = [e.replace("$__rate_interval", "5m").replace('"$', '"').replace("$", "") for e in exprs]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"panel:{i}", "expr": e} for i, e in enumerate(filled)],
            }
        ]
    }
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(rules))
    run_promtool(promtool, tmp_path, "check", "rules", "dashboard.yaml")


def test_dashboard_shape() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "servedmodel-request-path"
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "namespace", "servedmodel", "model"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    # Panel types the OpenShift console renders as well as Grafana.
    assert {p["type"] for p in dash["panels"]} <= {"graph", "singlestat", "table", "row"}
    titles = " ".join(p["title"] for p in dash["panels"])
    for word in ("TTFT", "TPOT", "Scheduler", "KV cache", "Phases"):
        assert word in titles


def test_operator_metric_names_exist() -> None:
    """servedmodel_* names the rules and dashboard use are registered by the operator."""
    import servedmodel.handlers.prober  # noqa: F401  (registers the probe metrics)
    from servedmodel.handlers.metrics import REGISTRY

    # Families, not samples: a labelled histogram has no samples before its first observation.
    exported = set()
    for m in REGISTRY.collect():
        exported.add(m.name)
        if m.type == "counter":
            exported.add(f"{m.name}_total")
    used = {m for m in used_metrics() if m.startswith("servedmodel_")}
    assert used, "no operator metric used"
    missing = sorted(m for m in used if m not in exported and family(m) not in exported)
    assert not missing, f"not exported by the operator: {missing}"


def test_vllm_metric_names_are_vllm_033s() -> None:
    used = {m for m in used_metrics() if m.startswith("vllm:")}
    unknown = sorted(m for m in used if family(m) not in VLLM_FAMILIES)
    assert not unknown, f"not a vLLM 0.33 metric: {unknown}"
    assert "vllm:gpu_cache_usage_perc" not in used  # removed in vLLM; kv_cache_usage_perc replaces it


def test_vllm_metric_names_are_on_the_simulators_metrics() -> None:
    """The same names, scraped the way Prometheus would from the engine simulator's /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    from servedmodel.sim.metrics import SimMetrics

    text = SimMetrics("qwen", 4096, {"block_size": "16"}).render().decode()
    scraped = set()
    for fam in text_string_to_metric_families(text):
        scraped.add(fam.name)
        scraped.update(s.name for s in fam.samples)
    used = {m for m in used_metrics() if m.startswith("vllm:")}
    missing = sorted(m for m in used if m not in scraped and family(m) not in scraped)
    assert not missing, f"not on the simulator's /metrics: {missing}"
