"""Where the probe connects: override parsing and in-cluster resolution from Service/EndpointSlices (pure)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from servedmodel.probe.endpoints import (
    normalise_base_url,
    parse_override,
    ready_pod_urls,
    resolve_external,
    resolve_managed,
    service_url,
)
from servedmodel.probe.schedule import next_delay


@pytest.mark.parametrize(
    ("value", "ns", "name", "want"),
    [
        (None, "ai", "qwen", None),
        ("", "ai", "qwen", None),
        ("http://127.0.0.1:8000", "ai", "qwen", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "x", "y", "http://127.0.0.1:8000"),
        ("ai/qwen=http://127.0.0.1:1, ai/llama=http://127.0.0.1:2", "ai", "llama", "http://127.0.0.1:2"),
        ("ai/qwen=http://127.0.0.1:1", "other", "qwen", None),
    ],
)
def test_parse_override(value: str | None, ns: str, name: str, want: str | None) -> None:
    assert parse_override(value, ns, name) == want


def slice_(endpoints: list[dict[str, Any]], port_name: str = "http", port: int = 8000) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "qwen-engine-abc", "labels": {"kubernetes.io/service-name": "qwen-engine"}},
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def test_ready_pods_only_and_deduplicated() -> None:
    slices = [
        slice_(
            [
                {"addresses": ["10.0.0.5"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.6"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.7"], "conditions": {"ready": True, "terminating": True}},
                {"addresses": ["10.0.0.8"]},  # unset ready counts as ready
            ]
        ),
        slice_([{"addresses": ["10.0.0.5"], "conditions": {"ready": True}}]),
    ]
    assert ready_pod_urls(slices) == ["http://10.0.0.5:8000", "http://10.0.0.8:8000"]


def test_ipv6_addresses_are_bracketed_and_named_port_wins() -> None:
    sl = slice_([{"addresses": ["fd00::5"], "conditions": {"ready": True}}])
    sl["ports"] = [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8080}]
    assert ready_pod_urls([sl]) == ["http://[fd00::5]:8080"]


def test_no_slices_no_pods() -> None:
    assert ready_pod_urls([]) == []
    assert ready_pod_urls([slice_([])]) == []


def test_managed_target_chats_through_the_service_and_scrapes_pods() -> None:
    svc = {
        "metadata": {"name": "qwen-engine", "namespace": "ai"},
        "spec": {"ports": [{"name": "http", "port": 8000, "targetPort": "http"}]},
    }
    t = resolve_managed(svc, [slice_([{"addresses": ["10.0.0.5"], "conditions": {"ready": True}}])])
    assert t.base_url == "http://qwen-engine.ai.svc:8000"
    assert t.metrics_urls == ("http://10.0.0.5:8000",)
    assert service_url({"metadata": {"name": "s", "namespace": "n"}, "spec": {"ports": [{"port": 80}]}}) == (
        "http://s.n.svc:80"
    )


def test_external_target_and_normalisation() -> None:
    t = resolve_external("https://qwen.example.com/v1")
    assert (t.base_url, t.metrics_urls, t.mode) == (
        "https://qwen.example.com",
        ("https://qwen.example.com",),
        "external",
    )
    assert normalise_base_url(" http://h:1/ ") == "http://h:1"


@pytest.mark.parametrize(
    ("failures", "lo", "hi"),
    [(0, 54, 66), (1, 54, 66), (2, 108, 132), (3, 216, 264), (4, 216, 264), (50, 216, 264)],
)
def test_next_delay_jitters_and_backs_off_bounded(failures: int, lo: float, hi: float) -> None:
    rng = random.Random(7)
    delays = [next_delay(60, failures, rng) for _ in range(200)]
    assert all(lo <= d <= hi for d in delays)
    assert len(set(delays)) > 100  # jittered, not constant
