"""MetricsCompatible through the prober, against three simulators on loopback (one per engine pod): one
with vLLM 0.33's /metrics names, one with the older names (--sim-metric-names old: gpu_cache_usage_perc,
time_per_output_token_seconds), one with vllm:num_requests_waiting renamed (--sim-rename-metric). The
condition names each pod and the series the endpoint picker would miss, while every pod keeps serving;
an engine is judged once per incarnation (a pod remapped to another engine keeps its verdict until its
containers restart), and a restarted one is judged again. The API server is replica_support's recorder."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from replica_support import Cluster, pod, scheduler, served_model

from loopback import SIM_ARGS
from servedmodel.sim.process import SimulatorProcess

PODS = ("qwen-7d9f-a", "qwen-7d9f-b", "qwen-7d9f-c")


@pytest.fixture
def sims() -> Iterator[list[SimulatorProcess]]:
    with (
        SimulatorProcess(SIM_ARGS, ready_timeout=60) as a,
        SimulatorProcess([*SIM_ARGS, "--sim-metric-names", "old"], ready_timeout=60) as b,
        SimulatorProcess(
            [*SIM_ARGS, "--sim-rename-metric", "vllm:num_requests_waiting=vllm:queue_size"], ready_timeout=60
        ) as c,
    ):
        yield [a, b, c]


def map_pods(path: Path, sims: list[SimulatorProcess]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(f"ns/qwen/{n}={s.base_url}" for n, s in zip(PODS, sims, strict=True)) + "\n")
    tmp.replace(path)


def test_metrics_compatible_names_the_missing_series_per_pod(
    sims: list[SimulatorProcess], tmp_path: Path
) -> None:
    mapping = tmp_path / "override"
    map_pods(mapping, sims)
    body = served_model(readinessGate=True, timeout=10)
    cluster = Cluster(body, [pod(n, f"10.244.0.{i + 10}") for i, n in enumerate(PODS)])
    sched = scheduler(cluster, f"@{mapping}")

    async def main() -> None:
        sched.track(body)
        try:
            first = await sched.run_cycle(("ns", "qwen"))
            assert first.probed
            # Every pod serves: the probe reads the older names as aliases, and needs no waiting gauge.
            assert cluster.body["status"]["probe"]["serving"] == "3/3"
            compat = cluster.condition("MetricsCompatible")
            assert (compat["status"], compat["reason"]) == ("False", "SeriesMissing")
            message = compat["message"]
            assert f"pod {PODS[1]} is missing vllm:kv_cache_usage_perc (only the older " in message
            assert "vllm:gpu_cache_usage_perc: the probe reads it, the picker does not)" in message
            assert (
                f"pod {PODS[2]} is missing vllm:num_requests_waiting (gauge, read by the endpoint picker)"
                in message
            )
            assert PODS[0] not in message

            # The same pods on the good engine: no new verdict (judged once per incarnation).
            map_pods(mapping, [sims[0]] * 3)
            await sched.run_cycle(("ns", "qwen"))
            assert cluster.condition("MetricsCompatible")["message"] == message

            # Their containers restart: judged again, now on vLLM 0.33's names.
            for name in PODS[1:]:
                cluster.pods[name]["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 1}]
            await sched.run_cycle(("ns", "qwen"))
            compat = cluster.condition("MetricsCompatible")
            assert (compat["status"], compat["reason"]) == ("True", "SeriesPresent")
            assert compat["message"] == (
                "3 pod(s) expose every series the endpoint picker and the probe read (vLLM 0.33 names)"
            )
        finally:
            await sched.stop()

    asyncio.run(main())
