"""Where the probe connects: override parsing and external-mode targets (pure); per-pod targets are
tests/unit/test_replicas.py's and the scheduler's."""

from __future__ import annotations

import random

import pytest

from servedmodel.probe.endpoints import (
    normalise_base_url,
    parse_override,
    pod_base_url,
    resolve_external,
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


def test_ipv6_pod_addresses_are_bracketed_and_the_named_port_wins() -> None:
    pod = {
        "spec": {
            "containers": [
                {
                    "ports": [
                        {"name": "metrics", "containerPort": 9000},
                        {"name": "http", "containerPort": 8080},
                    ]
                }
            ]
        },
        "status": {"podIP": "fd00::5"},
    }
    assert pod_base_url(pod) == "http://[fd00::5]:8080"
    assert pod_base_url({"status": {}}) is None


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
