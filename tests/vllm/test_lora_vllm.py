"""LoRA adapters on real vLLM (its CPU build, the tiny Qwen2.5) with real random PEFT adapters written
offline for that model by hack/lora_adapters.py: the simulator answers the adapter routes, /v1/models,
chat and /metrics as vLLM does (the same requests to both, compared after normalising ids and times),
and the prober's adapter sync (prober/adapters.sync_pod) loads two adapters, probes each with its own
TTFT, unloads one, and reports a broken one (a rank over --max-lora-rank, a path with nothing there)
while the base model keeps serving. One vLLM engine, started and stopped by this module."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conformance import GEN_PROMPT, diff, metric_families, normalise

from lora_adapters import write_adapter
from servedmodel.api import ServedModelSpec
from servedmodel.probe.client import run_probe
from servedmodel.probe.endpoints import resolve_override
from servedmodel.prober.adapters import sync_pod
from servedmodel.sim.process import SimulatorProcess
from vllm_server import VLLMServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "probe"))
from replica_support import Cluster, pod, scheduler, served_model  # tests/probe's recorder

pytestmark = [pytest.mark.vllm, pytest.mark.own_engines, pytest.mark.timeout(900)]

LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def adapters(qwen25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Rank-8 `sql` and `poet`, rank-16 `wide`, `empty` (a config, no weights) and `biased` (bias "all")
    for the tiny Qwen."""
    root = tmp_path_factory.mktemp("loras")
    out = {
        "sql": write_adapter(qwen25_dir, root / "sql", rank=8, seed=1),
        "poet": write_adapter(qwen25_dir, root / "poet", rank=8, seed=2),
        "wide": write_adapter(qwen25_dir, root / "wide", rank=16, seed=3),
        "empty": write_adapter(qwen25_dir, root / "empty", rank=8, seed=4),
        "biased": write_adapter(qwen25_dir, root / "biased", rank=8, seed=5),
    }
    (out["empty"] / "adapter_model.safetensors").unlink()
    config = json.loads((out["biased"] / "adapter_config.json").read_text())
    (out["biased"] / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    return out


@pytest.fixture(scope="module")
def lora_vllm(start_vllm: Any) -> VLLMServer:
    server: VLLMServer = start_vllm("qwen2.5", extra_args=LORA_FLAGS, env=RUNTIME)
    return server


@pytest.fixture(scope="module")
def lora_sim(qwen25_dir: Path) -> Iterator[SimulatorProcess]:
    args = [
        str(qwen25_dir),
        "--served-model-name",
        "qwen",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        *LORA_FLAGS,
    ]
    with SimulatorProcess(args, env=RUNTIME, ready_timeout=60) as sim:
        yield sim


def _answer(r: httpx.Response) -> dict[str, Any]:
    """Status and body: the JSON body normalised, else the text."""
    try:
        body: Any = normalise(r.json())
    except ValueError:
        body = r.text
    return {"status": r.status_code, "body": body}


def capture_lora(base: str, adapters: dict[str, Path]) -> dict[str, Any]:
    """The adapter routes, /v1/models, chat on adapters and /metrics, in one fixed order."""
    doc: dict[str, Any] = {}
    with httpx.Client(base_url=base, timeout=120, trust_env=False) as c:

        def load(name: str, path: str | Path, **extra: Any) -> dict[str, Any]:
            return _answer(
                c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})
            )

        doc["metrics/before"] = metric_families(c.get("/metrics").text).get("vllm:lora_requests_info")
        doc["load/sql"] = load("sql", adapters["sql"])
        doc["load/sql-again"] = load("sql", adapters["sql"])
        doc["load/base-name"] = load("qwen", adapters["sql"])
        doc["load/empty-name"] = load("", adapters["sql"])
        doc["load/missing-field"] = _answer(c.post("/v1/load_lora_adapter", json={"lora_name": "x"}))
        doc["load/missing-path"] = load("ghost", adapters["sql"].parent / "nothing-here")
        doc["load/hub-id-offline"] = load("ghost", "someone/not-downloaded")
        doc["load/rank-over-max"] = load("wide", adapters["wide"])
        doc["load/no-tensors"] = load("empty", adapters["empty"])
        doc["load/bias"] = load("biased", adapters["biased"])
        doc["load/poet"] = load("poet", adapters["poet"])
        doc["load/poet-in-place"] = load("poet", adapters["sql"], load_inplace=True)
        doc["models"] = normalise(c.get("/v1/models").json())
        chat = {"messages": GEN_PROMPT, "max_tokens": 4, "temperature": 0}
        full = c.post("/v1/chat/completions", json={**chat, "model": "sql"}).json()
        doc["chat/sql"] = {
            "model": full["model"],
            "keys": list(full),
            "usage": full["usage"]["completion_tokens"],
        }
        with c.stream("POST", "/v1/chat/completions", json={**chat, "model": "poet", "stream": True}) as r:
            models = {
                line.split('"model":"')[1].split('"')[0] for line in r.iter_lines() if '"model":"' in line
            }
        doc["stream/poet"] = sorted(models)
        doc["tokenize/sql"] = c.post("/tokenize", json={"model": "sql", "prompt": "hello"}).json()
        doc["metrics/after"] = metric_families(c.get("/metrics").text).get("vllm:lora_requests_info")
        doc["unload/poet"] = _answer(c.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}))
        doc["unload/ghost"] = _answer(c.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"}))
        gone = c.post("/v1/chat/completions", json={**chat, "model": "poet"})
        doc["chat/unloaded"] = _answer(gone)
        doc["models/after"] = [card["id"] for card in c.get("/v1/models").json()["data"]]
        c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})  # as it was, for the next test
    return doc


def test_simulator_serves_adapters_as_vllm_does(
    lora_vllm: VLLMServer, lora_sim: SimulatorProcess, adapters: dict[str, Path]
) -> None:
    real = capture_lora(lora_vllm.base_url, adapters)
    simulated = capture_lora(lora_sim.base_url, adapters)
    differences = diff(simulated, real)
    detail = dict.fromkeys(differences[:1], (simulated, real))
    assert not differences, f"{differences}\n{detail}"
    # what the comparison rests on, on both
    for doc in (real, simulated):
        assert doc["load/sql"] == {"status": 200, "body": "Success: LoRA adapter 'sql' added successfully."}
        cards = {c["id"]: c for c in doc["models"]["data"]}
        assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("qwen", str(adapters["sql"]))
        assert (cards["poet"]["parent"], cards["poet"]["root"]) == ("qwen", str(adapters["sql"]))  # in place
        assert doc["chat/sql"]["model"] == "sql"
        assert doc["stream/poet"] == ["poet"]
        assert doc["load/rank-over-max"]["status"] == 500
        assert "Adapter bias is not supported." in doc["load/bias"]["body"]["error"]["message"]
        assert doc["metrics/after"]["labels"] == [
            "max_lora",
            "running_lora_adapters",
            "waiting_lora_adapters",
        ]
        assert doc["models/after"] == ["qwen", "sql"]


def test_prober_loads_probes_unloads_and_reports_broken_adapters_on_vllm(
    lora_vllm: VLLMServer, adapters: dict[str, Path]
) -> None:
    base = lora_vllm.base_url

    def spec(*names: str, extra: list[dict[str, Any]] | None = None) -> ServedModelSpec:
        declared = [{"name": n, "source": str(adapters[n])} for n in names]
        return ServedModelSpec.model_validate(
            {
                "model": "Qwen/Qwen2.5-0.5B-Instruct",
                "servedModelName": "qwen",
                "probe": {"timeout": 60, "firstByteTimeout": 60},
                "adapters": [*declared, *(extra or [])],
            }
        )

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            # two adapters loaded, each probed on its own request path with its own TTFT
            both = await sync_pod(http, base, spec("sql", "poet"), "engine-0")
            assert (both.loaded, both.unloaded) == (["sql", "poet"], [])
            for name in ("sql", "poet"):
                entry = both.adapters[name]
                assert entry.serving, (name, entry.why, entry.outcome and entry.outcome.failure)
                assert entry.outcome is not None
                assert entry.outcome.figures is not None
                assert entry.outcome.figures.ttft_ms is not None
                assert entry.outcome.figures.ttft_ms > 0
                assert entry.outcome.model == name
            # poet removed from the spec: unloaded; sql stays loaded (nothing loaded again)
            one = await sync_pod(http, base, spec("sql"), "engine-0")
            assert (one.loaded, one.unloaded) == ([], ["poet"])
            listed = (await http.get(f"{base}/v1/models")).json()["data"]
            assert [c["id"] for c in listed] == ["qwen", "sql"]
            # a rank over --max-lora-rank 8 and a path with nothing there: named, in vLLM's words
            broken = await sync_pod(
                http,
                base,
                spec(
                    "sql", "wide", extra=[{"name": "ghost", "source": str(adapters["sql"].parent / "none")}]
                ),
                "engine-0",
            )
            wide, ghost = broken.adapters["wide"], broken.adapters["ghost"]
            assert (wide.loaded, wide.why) == (False, "AdapterLoadFailed")
            assert "LoRA rank 16 is greater than max_lora_rank 8" in wide.message
            assert (ghost.loaded, ghost.why) == (False, "AdapterNotFound")
            assert broken.adapters["sql"].serving
            # and the base model keeps serving
            base_spec = spec("sql").probe
            out = await run_probe(http, resolve_override(base), base_spec, model="qwen")
            assert out.ok, out.failure
            await http.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "sql"})

    asyncio.run(main())


def test_status_names_each_adapter_on_vllm(lora_vllm: VLLMServer, adapters: dict[str, Path]) -> None:
    """The prober's whole cycle (scheduler, compose, the status write to a recorder) on real vLLM: two
    adapters serving with their own TTFT in status.probe.adapters; then one removed (unloaded, gone from
    the status) and a rank-16 one added on an engine of --max-lora-rank 8 (AdaptersServing names it)
    while the base model's Serving stays True."""
    body = served_model(timeout=60, firstByteTimeout=60)
    body["spec"]["adapters"] = [{"name": n, "source": str(adapters[n])} for n in ("sql", "poet")]
    cluster = Cluster(body, [pod("qwen-0", "10.244.0.10")])
    sched = scheduler(cluster, f"ns/qwen/qwen-0={lora_vllm.base_url}")

    def entries() -> dict[str, dict[str, Any]]:
        return {a["name"]: a for a in cluster.body["status"]["probe"].get("adapters") or []}

    async def main() -> None:
        sched.track(body)
        try:
            await sched.run_cycle(("ns", "qwen"))
            probe = cluster.body["status"]["probe"]
            assert probe["adaptersServing"] == "2/2", probe.get("adapters")
            for name in ("sql", "poet"):
                entry = entries()[name]
                assert (entry["serving"], entry["loaded"]) == ("True", "1/1")
                assert entry["ttftMs"] > 0
                assert entry["pods"][0]["ttftMs"] == entry["ttftMs"]

            body["spec"]["adapters"] = [{"name": n, "source": str(adapters[n])} for n in ("sql", "wide")]
            sched.track(cluster.body)
            await sched.run_cycle(("ns", "qwen"))
            async with httpx.AsyncClient(timeout=30) as http:
                listed = (await http.get(f"{lora_vllm.base_url}/v1/models")).json()["data"]
            assert [c["id"] for c in listed] == ["qwen", "sql"]
            assert set(entries()) == {"sql", "wide"}
            assert cluster.body["status"]["probe"]["adaptersServing"] == "1/2"
            wide = entries()["wide"]
            assert (wide["serving"], wide["reason"]) == ("False", "AdapterLoadFailed")
            assert "LoRA rank 16 is greater than max_lora_rank 8" in wide["message"]
            cond = cluster.condition("AdaptersServing")
            assert (cond["status"], cond["reason"]) == ("False", "AdapterLoadFailed")
            assert cluster.condition("Serving")["status"] == "True"
        finally:
            await sched.stop()

    asyncio.run(main())
    httpx.post(f"{lora_vllm.base_url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=30)
