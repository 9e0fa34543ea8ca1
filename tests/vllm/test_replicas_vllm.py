"""EngineStalled from real vLLM's gauges: its EngineCore frozen (SIGSTOP) behind an API server that keeps
answering /health and /metrics, the probe scheduler probing it as one engine pod among simulators.

vLLM's scheduler gauges come from the engine core, so a hung core leaves them frozen and the counter
vllm:generation_tokens_total flat: the scheduler names the stall from that and from its own request that
got no token, and the pod counts as failing (it would leave the EndpointSlice with the readiness gate)
while the simulator replica keeps serving.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from vllm_server import VLLMServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "probe"))
from replica_support import Cluster, pod, scheduler, served_model  # tests/probe's helpers

from servedmodel.sim.process import SimulatorProcess

pytestmark = pytest.mark.vllm


def test_frozen_engine_core_is_engine_stalled_and_the_other_replica_serves(vllm_qwen25: VLLMServer) -> None:
    sim_args = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]
    with SimulatorProcess(sim_args, ready_timeout=60) as sim:
        body = served_model(readinessGate=True, firstByteTimeout=3, timeout=15)
        cluster = Cluster(body, [pod("qwen-real", "10.244.0.10"), pod("qwen-sim", "10.244.0.11")])
        override = f"ns/qwen/qwen-real={vllm_qwen25.base_url},ns/qwen/qwen-sim={sim.base_url}"

        async def main() -> None:
            sched = scheduler(cluster, override)
            sched.track(body)
            try:
                first = await sched.run_cycle(("ns", "qwen"))
                assert [r.serving for r in first.pods] == [True, True], [r.message for r in first.pods]
                assert cluster.condition("EngineStalled")["status"] == "False"
                vllm_qwen25.signal_engine(signal.SIGSTOP)
                try:
                    stalled = await sched.run_cycle(("ns", "qwen"))
                finally:
                    vllm_qwen25.signal_engine(signal.SIGCONT)
                real = next(r for r in stalled.pods if r.name == "qwen-real")
                assert real.reason == "EngineStalled", real.message
                assert real.outcome.failure is not None
                assert real.outcome.failure.reason in ("StreamStalled", "FirstByteTimeout")
                cond = cluster.condition("EngineStalled")
                assert cond["status"] == "True"
                # which rule names it depends on when the core froze: with the probe's request counted
                # as running ("flat ... while requests run") or before ("got no token"); both read the gauges
                assert cond["message"].startswith("pod qwen-real: ")
                assert "generation counter" in cond["message"]
                assert "running" in cond["message"]
                assert "waiting" in cond["message"]  # vLLM's own gauges in the message
                assert cluster.body["status"]["probe"]["serving"] == "1/2"
                assert cluster.condition("Serving")["reason"] == "ReplicasFailing"
                assert cluster.gate("qwen-real") == "False"
                assert cluster.gate("qwen-sim") == "True"
                # thawed: the next cycles see it generate again
                for _ in range(10):
                    again = await sched.run_cycle(("ns", "qwen"))
                    if all(r.serving for r in again.pods):
                        break
                    await asyncio.sleep(1)
                assert cluster.condition("EngineStalled")["status"] == "False"
                assert cluster.gate("qwen-real") == "True"
            finally:
                await sched.stop()

        asyncio.run(main())
