"""spec.adapters through the prober, against three simulators on loopback (one per engine pod, LoRA on,
runtime loading allowed): every declared adapter loaded on every replica and probed with its own TTFT,
a broken adapter (a rank over --max-lora-rank, a path with nothing there) named in AdaptersServing while
the base model keeps serving, a removed adapter unloaded everywhere and gone from status, and a replica
that restarted (a fresh engine behind the pod) given its adapters again. Adapters are real PEFT folders
(hack/lora_adapters.py); the API server is the recorder of replica_support."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from replica_support import Cluster, pod, scheduler, served_model

from loopback import SIM_ARGS
from lora_adapters import write_adapter
from servedmodel.sim.process import SimulatorProcess

PODS = ("qwen-7d9f-a", "qwen-7d9f-b", "qwen-7d9f-c")
LORA_ARGS = [*SIM_ARGS, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
TINY = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(TINY))
    return {
        "sql": write_adapter(root / "model", root / "sql", rank=8, seed=1),
        "poet": write_adapter(root / "model", root / "poet", rank=8, seed=2),
        "wide": write_adapter(root / "model", root / "wide", rank=32, seed=3),
    }


@pytest.fixture
def sims() -> Iterator[list[SimulatorProcess]]:
    with (
        SimulatorProcess(LORA_ARGS, env=RUNTIME, ready_timeout=60) as a,
        SimulatorProcess(LORA_ARGS, env=RUNTIME, ready_timeout=60) as b,
        SimulatorProcess(LORA_ARGS, env=RUNTIME, ready_timeout=60) as c,
    ):
        yield [a, b, c]


def listed(sim: SimulatorProcess) -> dict[str, str]:
    """The adapters a simulator lists in /v1/models: name -> root."""
    data = httpx.get(f"{sim.base_url}/v1/models", timeout=10).json()["data"]
    return {c["id"]: c["root"] for c in data if c["parent"]}


def answered(sim: SimulatorProcess, handler: str) -> float:
    """Requests to `handler` the simulator answered 2xx (its http_requests_total)."""
    text = httpx.get(f"{sim.base_url}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "http_requests"
        for s in f.samples
        if s.name == "http_requests_total"
        and s.labels.get("handler") == handler
        and s.labels.get("status") == "2xx"
    )


def loads(sim: SimulatorProcess) -> float:
    return answered(sim, "/v1/load_lora_adapter")


def write_override(path: Path, sims: list[SimulatorProcess]) -> None:
    path.write_text("\n".join(f"ns/qwen/{n}={s.base_url}" for n, s in zip(PODS, sims, strict=True)) + "\n")


def adapters_of(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {a["name"]: a for a in cluster.body["status"]["probe"].get("adapters") or []}


def test_adapters_loaded_probed_broken_unloaded_and_reloaded(
    sims: list[SimulatorProcess], folders: dict[str, Path], tmp_path: Path
) -> None:
    mapping = tmp_path / "override"
    write_override(mapping, sims)
    body = served_model(readinessGate=True, timeout=10)
    body["spec"]["adapters"] = [
        {"name": "sql", "source": str(folders["sql"]), "rank": 8},
        {"name": "poet", "source": str(folders["poet"])},
    ]
    cluster = Cluster(body, [pod(n, f"10.244.0.{i + 10}") for i, n in enumerate(PODS)])

    def respec(adapters: list[dict[str, Any]]) -> None:
        cluster.body["spec"]["adapters"] = adapters
        sched.track(cluster.body)

    sched = scheduler(cluster, f"@{mapping}")

    async def main() -> None:
        sched.track(body)
        try:
            # 1. both adapters loaded on all three replicas, each probed there with its own TTFT
            first = await sched.run_cycle(("ns", "qwen"))
            assert first.probed
            for sim in sims:
                assert await asyncio.to_thread(listed, sim) == {
                    "sql": str(folders["sql"]),
                    "poet": str(folders["poet"]),
                }
            probe = cluster.body["status"]["probe"]
            assert probe["adaptersServing"] == "2/2"
            for name in ("sql", "poet"):
                entry = adapters_of(cluster)[name]
                assert (entry["serving"], entry["reason"], entry["loaded"]) == ("True", "Serving", "3/3")
                assert [p["name"] for p in entry["pods"]] == list(PODS)
                assert all(p["serving"] == "True" and p["ttftMs"] > 0 for p in entry["pods"])
                assert entry["ttftMs"] > 0
            assert cluster.condition("AdaptersServing")["status"] == "True"
            assert cluster.condition("Serving")["status"] == "True"

            # a second cycle loads nothing again (they are listed) and probes them again, lightly: the
            # adapters' timed chats alone (their full paths' /tokenize is not sent again), as the base's.
            # A pod where the first cycle failed a check (its base's or an adapter's) walks the full path
            # again, rightly: on a loaded machine the simulator's stream can come in lumps (the
            # streaming check fails). Which did is what the path memos learned (none learns on a Fail).
            model = sched._models[("ns", "qwen")]
            clean = {
                pod: model.paths[pod].light
                and all(model.adapter_paths[f"{pod}/{a}"].light for a in ("sql", "poet"))
                for pod in PODS
            }
            # (all three failing would leave nothing light to see; and it would be what a broken memo
            # does, so that fails)
            assert any(clean.values()), "no pod's first cycle was learned from"
            before = [await asyncio.to_thread(answered, s, "/tokenize") for s in sims]
            chats = [await asyncio.to_thread(answered, s, "/v1/chat/completions") for s in sims]
            await sched.run_cycle(("ns", "qwen"))
            assert [await asyncio.to_thread(loads, s) for s in sims] == [2.0, 2.0, 2.0]
            tokenized = [await asyncio.to_thread(answered, s, "/tokenize") for s in sims]
            after = [await asyncio.to_thread(answered, s, "/v1/chat/completions") for s in sims]
            for name, b, t, c, a in zip(PODS, before, tokenized, chats, after, strict=True):
                if clean[name]:
                    assert (t - b, a - c) == (0.0, 3.0), name  # no /tokenize; base, sql, poet
                else:
                    assert t > b, name
            assert all(a["serving"] == "True" for a in adapters_of(cluster).values())

            # 2. a rank over the engine's --max-lora-rank and a path with no adapter: each named, with the
            # engine's own words, while the base model and the good adapters keep serving
            respec(
                [
                    *cluster.body["spec"]["adapters"],
                    {"name": "wide", "source": str(folders["wide"])},
                    {"name": "ghost", "source": str(tmp_path / "no-such-adapter")},
                ]
            )
            await sched.run_cycle(("ns", "qwen"))
            entries = adapters_of(cluster)
            assert cluster.body["status"]["probe"]["adaptersServing"] == "2/4"
            wide, ghost = entries["wide"], entries["ghost"]
            assert (wide["serving"], wide["reason"], wide["loaded"]) == ("False", "AdapterLoadFailed", "0/3")
            assert "LoRA rank 32 is greater than max_lora_rank 16" in wide["message"]
            assert (ghost["serving"], ghost["reason"]) == ("False", "AdapterNotFound")
            assert "Loading lora ghost failed: No adapter found" in ghost["message"]
            cond = cluster.condition("AdaptersServing")
            assert (cond["status"], cond["reason"]) == ("False", "AdaptersNotServing")
            assert "wide: AdapterLoadFailed" in cond["message"]
            assert "ghost: AdapterNotFound" in cond["message"]
            serving = cluster.condition("Serving")
            assert (serving["status"], serving["reason"]) == ("True", "ChatCompletionSucceeded")
            assert cluster.body["status"]["probe"]["serving"] == "3/3"
            assert entries["sql"]["serving"] == "True"
            warned = [e for e in cluster.events if e[0] == "ServedModel"]
            assert [e[2] for e in warned] == ["AdaptersNotServing"]  # one Warning, naming both
            assert "wide: AdapterLoadFailed" in warned[0][3]
            await sched.run_cycle(("ns", "qwen"))  # still broken: no second Event
            assert [e for e in cluster.events if e[0] == "ServedModel"] == warned

            # 3. poet and the broken ones removed from the spec: unloaded on every replica, gone from status
            respec([{"name": "sql", "source": str(folders["sql"]), "rank": 8}])
            await sched.run_cycle(("ns", "qwen"))
            for sim in sims:
                assert await asyncio.to_thread(listed, sim) == {"sql": str(folders["sql"])}
            assert list(adapters_of(cluster)) == ["sql"]
            assert cluster.body["status"]["probe"]["adaptersServing"] == "1/1"
            assert cluster.condition("AdaptersServing")["status"] == "True"

            # 4. replica b restarted: a fresh engine behind the pod, no adapter loaded; the next cycle
            # loads sql there again and probes it
            async with SimulatorProcess(LORA_ARGS, env=RUNTIME, ready_timeout=60) as fresh:
                restarted = [sims[0], fresh, sims[2]]
                write_override(mapping, restarted)
                cluster.pods[PODS[1]]["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 1}]
                assert await asyncio.to_thread(listed, fresh) == {}
                await sched.run_cycle(("ns", "qwen"))
                assert await asyncio.to_thread(listed, fresh) == {"sql": str(folders["sql"])}
                assert [await asyncio.to_thread(loads, s) for s in restarted] == [2.0, 1.0, 2.0]
                sql = adapters_of(cluster)["sql"]
                assert (sql["serving"], sql["loaded"]) == ("True", "3/3")
                assert all(p["serving"] == "True" for p in sql["pods"])

            # 5. no adapters left: the fields and the condition leave the status
            write_override(mapping, sims)
            respec([])
            await sched.run_cycle(("ns", "qwen"))
            assert "adapters" not in cluster.body["status"]["probe"]
            last = cluster.writes[-1][2]
            assert "adapters" not in last["probe"]
            assert "AdaptersServing" not in [c["type"] for c in last["conditions"]]
        finally:
            await sched.stop()

    asyncio.run(main())
