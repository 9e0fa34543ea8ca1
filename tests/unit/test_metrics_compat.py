"""probe/compat.judge on expositions: the simulator's (vLLM 0.33 names, the older names, a rename map,
LoRA on and off) and hand-written ones with a wrong type or a LoRA series without its labels; and
compat_condition's verdict over pods."""

from __future__ import annotations

import pytest

from servedmodel.probe.compat import compat_condition, judge
from servedmodel.sim.metrics import OLD_METRIC_NAMES, SimMetrics

NOW = "2026-12-04T17:00:00Z"


def exposition(renames: dict[str, str] | None = None, max_loras: int | None = None) -> str:
    return SimMetrics("qwen", 4096, {}, max_loras, renames=renames).render().decode()


def test_vllm_names_are_compatible() -> None:
    verdict = judge(exposition(), adapters=False)
    assert verdict.ok
    assert verdict.aliases == ()


def test_older_names_serve_the_probe_not_the_picker() -> None:
    verdict = judge(exposition(OLD_METRIC_NAMES), adapters=False)
    assert verdict.missing == (
        "vllm:kv_cache_usage_perc (only the older vllm:gpu_cache_usage_perc: the probe reads it, the picker "
        "does not)",
    )
    assert verdict.aliases == ("vllm:time_per_output_token_seconds for vllm:inter_token_latency_seconds",)


@pytest.mark.parametrize(
    ("renamed", "named"),
    [
        ("vllm:num_requests_waiting", "vllm:num_requests_waiting (gauge, read by the endpoint picker)"),
        ("vllm:request_success", "vllm:request_success (counter, read by the probe)"),
        (
            "vllm:time_to_first_token_seconds",
            "vllm:time_to_first_token_seconds (histogram, read by the probe)",
        ),
    ],
)
def test_a_renamed_series_is_named(renamed: str, named: str) -> None:
    assert judge(exposition({renamed: "acme:renamed"}), adapters=False).missing == (named,)


def test_lora_series_wanted_only_with_adapters() -> None:
    assert judge(exposition(max_loras=2), adapters=True).ok
    missing = judge(exposition(), adapters=True).missing
    assert missing == ("vllm:lora_requests_info (gauge, read by the endpoint picker)",)
    assert judge(exposition(), adapters=False).ok


def test_wrong_type_and_missing_labels() -> None:
    base = exposition()
    counter = base.replace(
        "# TYPE vllm:num_requests_waiting gauge", "# TYPE vllm:num_requests_waiting counter"
    )
    assert judge(counter, adapters=False).missing == (
        "vllm:num_requests_waiting is a counter, the endpoint picker reads a gauge",
    )
    lora = base + '# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{max_lora="2"} 1.0\n'
    assert judge(lora, adapters=True).missing == (
        "vllm:lora_requests_info without label(s) running_lora_adapters, waiting_lora_adapters "
        "(read by the endpoint picker)",
    )


def test_condition_over_pods() -> None:
    good, old = judge(exposition(), adapters=False), judge(exposition(OLD_METRIC_NAMES), adapters=False)
    cond = compat_condition({"a": good, "b": old}, ["a", "b"], [], 3, NOW)
    assert (cond["status"], cond["reason"], cond["observedGeneration"]) == ("False", "SeriesMissing", 3)
    assert cond["message"].startswith("pod b is missing vllm:kv_cache_usage_perc")
    # a pod not judged yet: Unknown until it is
    assert compat_condition({"a": good}, ["a", "b"], [], 3, NOW)["status"] == "Unknown"
    done = compat_condition({"a": good, "b": good}, ["a", "b"], [cond], 3, NOW)
    assert (done["status"], done["reason"]) == ("True", "SeriesPresent")
