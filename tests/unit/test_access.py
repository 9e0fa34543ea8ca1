"""servedmodel.access: the Secret opt-in rule and the outbound allow-list (pure), and the spec patterns
that repeat the URL rule at the API server's door."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from servedmodel.access import (
    ALLOW_ANNOTATION,
    SECRET_NOT_ALLOWED,
    TARGET_NOT_ALLOWED,
    AllowList,
    allowed_servedmodels,
    redact,
    secret_refusal,
    target_refusal,
)
from servedmodel.api import ServedModel, ServedModelSpec
from servedmodel.config import OperatorConfig
from servedmodel.render import RenderContext, RenderError, render

FIELD = "spec.engine.apiKeySecretRef"
DEFAULT = AllowList.parse(OperatorConfig().allowed_targets)


def secret(annotations: dict[str, str] | None = None, name: str = "db-credentials") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "team-a"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": {"password": "aHVudGVyMg=="}}


@pytest.mark.parametrize(
    ("annotations", "allowed"),
    [
        ({ALLOW_ANNOTATION: "qwen"}, True),
        ({ALLOW_ANNOTATION: "llama, qwen ,mistral"}, True),
        ({ALLOW_ANNOTATION: "*"}, True),
        ({ALLOW_ANNOTATION: "qwen-2"}, False),  # names, not prefixes
        ({ALLOW_ANNOTATION: ""}, False),
        ({"inference.servedmodel.io/allow-use": "true"}, False),  # only the one annotation counts
        ({}, False),
        (None, False),
    ],
)
def test_a_secret_is_used_only_where_its_annotation_names_the_servedmodel(
    annotations: dict[str, str] | None, allowed: bool
) -> None:
    refusal = secret_refusal(secret(annotations), "qwen", FIELD)
    assert (refusal is None) is allowed
    if refusal is not None:
        assert refusal.reason == SECRET_NOT_ALLOWED
        # Names the Secret, the field, the ServedModel and the annotation to set; never the value.
        for part in ("Secret db-credentials", FIELD, "ServedModel qwen", ALLOW_ANNOTATION):
            assert part in refusal.message
        assert "aHVudGVyMg" not in refusal.message
        assert "hunter2" not in refusal.message


def test_a_label_is_not_consent() -> None:
    s = secret()
    s["metadata"]["labels"] = {ALLOW_ANNOTATION: "qwen"}
    assert secret_refusal(s, "qwen", FIELD) is not None


def test_allowed_servedmodels_parses_the_list() -> None:
    assert allowed_servedmodels({ALLOW_ANNOTATION: " a,b ,, c "}) == {"a", "b", "c"}
    assert allowed_servedmodels({ALLOW_ANNOTATION: 3}) == frozenset()


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://qwen.ai.svc:8000", True),
        ("http://qwen.ai.svc.cluster.local:8000/v1", True),
        ("https://vllm-qwen.inference.svc.cluster.local/", True),
        ("http://QWEN.AI.SVC.:8000", True),  # case and a trailing dot do not matter
        ("http://svc:8000", False),  # '*.svc' needs a label before .svc
        ("http://evil.example:8000", False),
        ("http://qwen.ai.svc.evil.example", False),
        ("http://127.0.0.1:9000", False),  # loopback is the operator's own pod
        ("http://169.254.169.254/", False),  # cloud metadata
        ("http://[::1]:8000", False),
        ("http://10.0.0.7:8000", False),
        ("http://2130706433:8000", False),  # 127.0.0.1 as a number: a name, and not an allowed one
    ],
)
def test_the_default_allow_list_admits_in_cluster_service_names_only(url: str, ok: bool) -> None:
    refusal = target_refusal(url, DEFAULT, "spec.endpoint", base_path_only=True)
    assert (refusal is None) is ok, refusal
    if refusal is not None:
        assert refusal.reason == TARGET_NOT_ALLOWED
        assert refusal.message.startswith("spec.endpoint ")
        assert "SERVEDMODEL_ALLOWED_TARGETS" in refusal.message


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://qwen.ai.svc:8000/collect", "path"),
        ("http://qwen.ai.svc:8000/collect?from=tenant", "query"),
        ("http://qwen.ai.svc:8000/v1?x=1", "query"),
        ("http://qwen.ai.svc:8000/#frag", "query or fragment"),
        ("http://user:pw@qwen.ai.svc:8000", "credentials"),
        ("ftp://qwen.ai.svc", "http and https"),
        ("file:///etc/passwd", "http and https"),
        ("http://qwen.ai.svc:port", "not a URL"),
    ],
)
def test_an_endpoint_is_a_base_url_and_nothing_more(url: str, why: str) -> None:
    refusal = target_refusal(url, DEFAULT, "spec.endpoint", base_path_only=True)
    assert refusal is not None
    assert why in refusal.message
    assert "pw@" not in refusal.message


def test_a_prometheus_url_may_have_a_path_prefix_but_no_query() -> None:
    field = "spec.probe.metricsSource.prometheus.url"
    assert target_refusal("https://thanos.mon.svc:9091/prom", DEFAULT, field, base_path_only=False) is None
    refusal = target_refusal("https://thanos.mon.svc:9091/api?x=1", DEFAULT, field, base_path_only=False)
    assert refusal is not None
    assert field in refusal.message


def test_cidrs_admit_ip_literals_and_hosts_match_exactly() -> None:
    allow = AllowList.parse("127.0.0.1, 10.1.0.0/16, prometheus.example.com, *.models.example, fd00::/8")
    assert allow.admits("127.0.0.1")
    assert not allow.admits("127.0.0.2")
    assert allow.admits("10.1.200.3")
    assert not allow.admits("10.2.0.1")
    assert allow.admits("prometheus.example.com")
    assert not allow.admits("a.prometheus.example.com")
    assert allow.admits("qwen.models.example")
    assert not allow.admits("models.example")
    assert allow.admits("[fd00::1]")
    assert not allow.admits("localhost")  # a name is never resolved to match a CIDR


@pytest.mark.parametrize("entry", ["*", "a*.svc", "10.0.0.0/33", "http://x/"])
def test_a_bad_allow_list_entry_fails_at_start_up(entry: str) -> None:
    with pytest.raises(ValueError, match="allowed targets"):
        AllowList.parse(entry)
    with pytest.raises(ValidationError):
        OperatorConfig(allowed_targets=entry)


def test_the_operator_config_reads_the_allow_list_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SERVEDMODEL_ALLOWED_TARGETS", "*.svc,127.0.0.1")
    monkeypatch.setenv("SERVEDMODEL_ALLOW_INSECURE_TLS", "true")
    monkeypatch.setenv("SERVEDMODEL_METRICS_AUTH", "false")
    config = OperatorConfig()
    assert config.target_allow_list.admits("127.0.0.1")
    assert config.allow_insecure_tls is True
    assert config.metrics_auth is False
    defaults = OperatorConfig.model_fields
    assert defaults["metrics_auth"].default is True
    assert defaults["allow_insecure_tls"].default is False


def test_redact_replaces_every_secret() -> None:
    assert redact("Bearer sk-1 and sk-1 again", ["sk-1", ""]) == "Bearer [redacted] and [redacted] again"


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://127.0.0.1:9000/collect?from=tenant",
        "http://qwen.ai.svc:8000/collect",
        "http://qwen.ai.svc:8000/v1/chat/completions",
        "http://user@qwen.ai.svc:8000",
    ],
)
def test_the_spec_refuses_an_endpoint_with_a_path_query_or_credentials(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="endpoint"):
        ServedModelSpec.model_validate({"model": "Qwen/Qwen2.5-7B-Instruct", "endpoint": endpoint})


@pytest.mark.parametrize(
    "endpoint", ["http://qwen.ai.svc:8000", "https://qwen.example.com/", "http://h:1/v1"]
)
def test_the_spec_keeps_base_urls(endpoint: str) -> None:
    ServedModelSpec.model_validate({"model": "Qwen/Qwen2.5-7B-Instruct", "endpoint": endpoint})


def test_the_spec_refuses_a_prometheus_url_with_a_query() -> None:
    source = {"type": "prometheus", "prometheus": {"url": "http://p.mon.svc:9090/?x=1"}}
    with pytest.raises(ValidationError, match="url"):
        ServedModelSpec.model_validate(
            {"model": "Qwen/Qwen2.5-7B-Instruct", "probe": {"metricsSource": source}}
        )


def keda_model(**prometheus: Any) -> ServedModel:
    auto = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targets": {"waitingRequestsPerReplica": 2},
        "prometheus": prometheus,
    }
    return ServedModel.model_validate(
        {
            "metadata": {"name": "qwen", "namespace": "ai", "uid": "u1"},
            "spec": {"model": "Qwen/Qwen2.5-7B-Instruct", "autoscaling": auto},
        }
    )


def test_keda_sends_the_token_only_to_an_allowed_prometheus() -> None:
    """KEDA queries spec.autoscaling.prometheus.url with the namespace's token on the author's word: the
    reconciler's render holds it to the operator's allow-list and TLS rule (an InvalidSpec naming it)."""
    ctx = RenderContext.from_config(OperatorConfig(), has_keda_api=True)
    token = {"bearerTokenSecretRef": {"name": "db-credentials", "key": "password"}}
    allowed = render(keda_model(url="https://thanos-querier.openshift-monitoring.svc:9092", **token), ctx)
    assert [o["kind"] for o in allowed][-2:] == ["TriggerAuthentication", "ScaledObject"]
    with pytest.raises(RenderError) as info:
        render(keda_model(url="http://collector.evil.example:9090", **token), ctx)
    assert info.value.field == "spec.autoscaling.prometheus.url"
    assert TARGET_NOT_ALLOWED in info.value.reason
    with pytest.raises(RenderError) as info:
        render(keda_model(url="https://thanos.mon.svc:9092", insecureSkipVerify=True), ctx)
    assert info.value.field == "spec.autoscaling.prometheus.insecureSkipVerify"
    lenient = RenderContext.from_config(OperatorConfig(allow_insecure_tls=True), has_keda_api=True)
    render(keda_model(url="https://thanos.mon.svc:9092", insecureSkipVerify=True), lenient)
