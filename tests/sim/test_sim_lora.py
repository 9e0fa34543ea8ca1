"""LoRA adapters on the simulator, as vLLM 0.33 serves them: --enable-lora and its limits, the load and
unload routes (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING) and their error bodies, /v1/models with
`parent` and `root`, chat on an adapter, and vllm:lora_requests_info. A real simulator process on
loopback; adapters are real PEFT folders written by hack/lora_adapters.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_support import BASE_ARGS, aclient, client, ground_truth, set_faults

from lora_adapters import write_adapter
from servedmodel.sim.process import SimulatorProcess

TINY_CONFIG = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 32,
}
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter folders: rank 8 (two of them), rank 32, one without weights, one with a bias."""
    root = tmp_path_factory.mktemp("adapters")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = {
        "sql": write_adapter(model, root / "sql", rank=8, seed=1),
        "poet": write_adapter(model, root / "poet", rank=8, seed=2),
        "wide": write_adapter(model, root / "wide", rank=32, seed=3),
        "empty": write_adapter(model, root / "empty", rank=8, seed=4),
        "biased": write_adapter(model, root / "biased", rank=8, seed=5),
    }
    (out["empty"] / "adapter_model.safetensors").unlink()
    cfg = json.loads((out["biased"] / "adapter_config.json").read_text())
    (out["biased"] / "adapter_config.json").write_text(json.dumps({**cfg, "bias": "all"}))
    return out


@pytest.fixture(scope="module")
def lora_sim(adapters: dict[str, Path]) -> Iterator[SimulatorProcess]:
    args = [
        *BASE_ARGS,
        "--sim-step-base-ms",
        "2",
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "16",
    ]
    with SimulatorProcess(args, env=RUNTIME, ready_timeout=60) as s:
        yield s


def load(sim: SimulatorProcess, name: str, path: str | Path, **extra: Any) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return httpx.post(f"{sim.base_url}/v1/load_lora_adapter", json=body, timeout=10)


def unload(sim: SimulatorProcess, name: str) -> httpx.Response:
    return httpx.post(f"{sim.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)


def models(sim: SimulatorProcess) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = httpx.get(f"{sim.base_url}/v1/models", timeout=10).json()["data"]
    return data


def error(resp: httpx.Response) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = resp.json()["error"]
    return resp.status_code, body


def lora_info(sim: SimulatorProcess) -> list[dict[str, str]]:
    text = httpx.get(f"{sim.base_url}/metrics", timeout=10).text
    out: list[dict[str, str]] = []
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:lora_requests_info":
            out += [dict(s.labels) for s in family.samples]
    return out


def test_load_list_chat_unload(lora_sim: SimulatorProcess, adapters: dict[str, Path]) -> None:
    resp = load(lora_sim, "sql", adapters["sql"])
    assert resp.status_code == 200
    assert resp.text == "Success: LoRA adapter 'sql' added successfully."
    try:
        cards = models(lora_sim)
        assert [c["id"] for c in cards] == ["qwen", "sql"]
        base, sql = cards
        assert (base["parent"], base["root"], base["max_model_len"]) == (
            None,
            "Qwen/Qwen2.5-7B-Instruct",
            2048,
        )
        # vLLM's ModelCard of an adapter: root = the path it was loaded from, parent = the base's name
        assert (sql["parent"], sql["root"], sql["max_model_len"]) == ("qwen", str(adapters["sql"]), None)
        assert (sql["object"], sql["owned_by"]) == ("model", "vllm")

        chat = client(lora_sim).chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "one two three"}], max_completion_tokens=4
        )
        assert chat.model == "sql"
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 4
        stream = client(lora_sim).chat.completions.create(
            model="sql",
            messages=[{"role": "user", "content": "one two three"}],
            max_completion_tokens=3,
            stream=True,
        )
        assert {chunk.model for chunk in stream} == {"sql"}
        tokenized = httpx.post(
            f"{lora_sim.base_url}/tokenize", json={"model": "sql", "prompt": "hello"}, timeout=10
        )
        assert tokenized.status_code == 200
    finally:
        resp = unload(lora_sim, "sql")
    assert resp.status_code == 200
    assert resp.text == "Success: LoRA adapter 'sql' removed successfully."
    assert [c["id"] for c in models(lora_sim)] == ["qwen"]
    gone = httpx.post(
        f"{lora_sim.base_url}/v1/chat/completions",
        json={"model": "sql", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert error(gone) == (
        404,
        {
            "message": "The model `sql` does not exist. Valid aliases: qwen.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        },
    )


def test_load_errors_as_vllm_answers_them(lora_sim: SimulatorProcess, adapters: dict[str, Path]) -> None:
    def refused(resp: httpx.Response, status: int, err_type: str, message: str) -> None:
        assert error(resp) == (status, {"message": message, "type": err_type, "param": None, "code": status})

    refused(
        load(lora_sim, "", adapters["sql"]),
        400,
        "InvalidUserInput",
        "Both 'lora_name' and 'lora_path' must be provided.",
    )
    refused(
        load(lora_sim, "qwen", adapters["sql"]),
        400,
        "InvalidUserInput",
        "The lora adapter 'qwen' conflicts with a served base model.",
    )
    # a path with no adapter: vLLM's LoRAAdapterNotFoundError, its path hidden by sanitize_message
    refused(
        load(lora_sim, "ghost", "/tmp/no/such/adapter"),
        404,
        "NotFoundError",
        "Loading lora ghost failed: No adapter found for <path>",
    )
    refused(
        load(lora_sim, "ghost", "someone/not-downloaded"),
        404,
        "NotFoundError",
        "Loading lora ghost failed: No adapter found for someone/not-downloaded",
    )
    # the engine's checks (PEFTHelper.validate_legal), a failed engine-core utility call: 500
    refused(
        load(lora_sim, "wide", adapters["wide"]),
        500,
        "InternalServerError",
        "Call to add_lora method failed: Worker failed with error 'LoRA rank 32 is greater than "
        "max_lora_rank 16.', please check the stack trace above for the root cause",
    )
    refused(
        load(lora_sim, "biased", adapters["biased"]),
        500,
        "InternalServerError",
        "Call to add_lora method failed: Worker failed with error 'Adapter bias is not supported.', "
        "please check the stack trace above for the root cause",
    )
    refused(
        load(lora_sim, "empty", adapters["empty"]),
        500,
        "InternalServerError",
        "Call to add_lora method failed: Worker failed with error '<path> doesn't contain tensors', "
        "please check the stack trace above for the root cause",
    )
    refused(unload(lora_sim, "ghost"), 404, "NotFoundError", "The lora adapter 'ghost' cannot be found.")
    assert [c["id"] for c in models(lora_sim)] == ["qwen"]  # nothing refused was listed

    assert load(lora_sim, "poet", adapters["poet"]).status_code == 200
    try:
        refused(
            load(lora_sim, "poet", adapters["sql"]),
            400,
            "InvalidUserInput",
            "The lora adapter 'poet' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True.",
        )
        assert load(lora_sim, "poet", adapters["sql"], load_inplace=True).status_code == 200
        assert [(c["id"], c["root"]) for c in models(lora_sim)] == [
            ("qwen", "Qwen/Qwen2.5-7B-Instruct"),
            ("poet", str(adapters["sql"])),
        ]
    finally:
        unload(lora_sim, "poet")
    missing = httpx.post(f"{lora_sim.base_url}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=10)
    assert (missing.status_code, missing.json()["error"]) == (
        400,
        {
            "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', 'msg': 'Field "
            "required', 'input': '<dict of 1 items>'}",
            "type": "Bad Request",
            "param": "body.lora_path",
            "code": 400,
        },
    )


async def test_max_loras_defers_a_second_adapter(
    lora_sim: SimulatorProcess, adapters: dict[str, Path]
) -> None:
    """--max-loras 1: while `sql` runs, a request on `poet` waits (deferred: the gauges say so) and runs
    only after sql ended; a base-model request is not held back."""
    assert load(lora_sim, "sql", adapters["sql"]).status_code == 200
    assert load(lora_sim, "poet", adapters["poet"]).status_code == 200
    set_faults(lora_sim, reset=True)
    oa = aclient(lora_sim)

    async def chat(model: str, tokens: int) -> str:
        out = await oa.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"{model} please"}],
            max_completion_tokens=tokens,
            extra_body={"ignore_eos": True},
        )
        return out.id

    async def until(seen: Callable[[], bool]) -> bool:
        for _ in range(4000):
            if await asyncio.to_thread(seen):
                return True
            await asyncio.sleep(0.002)
        return False

    both = {"max_lora": "1", "waiting_lora_adapters": "poet", "running_lora_adapters": "sql"}
    deferred = 'vllm:num_requests_waiting_by_reason{engine="0",model_name="qwen",reason="deferred"} 1.0'
    try:
        long_sql = asyncio.create_task(chat("sql", 2000))
        assert await until(lambda: any(s["running_lora_adapters"] == "sql" for s in lora_info(lora_sim)))
        poet = asyncio.create_task(chat("poet", 2))
        base = asyncio.create_task(chat("qwen", 2))
        assert await until(lambda: both in lora_info(lora_sim))
        assert await until(lambda: deferred in httpx.get(f"{lora_sim.base_url}/metrics", timeout=10).text)
        ids = await asyncio.gather(long_sql, poet, base)
        rows = await asyncio.to_thread(ground_truth, lora_sim, 3)
        sql_row, poet_row, base_row = ({r["request_id"]: r for r in rows}[i] for i in ids)
        assert poet_row["first_token"] > sql_row["last_token"]  # a step after sql's last, never beside it
        assert base_row["last_token"] < sql_row["last_token"]  # the base model ran beside sql
    finally:
        unload(lora_sim, "sql")
        unload(lora_sim, "poet")
        await oa.close()
    names = {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
    assert all(set(s) == names for s in lora_info(lora_sim))  # no model_name, no engine label


def test_runtime_routes_need_the_env(adapters: dict[str, Path]) -> None:
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist (404), adapters come only from
    --lora-modules, and without --enable-lora there is no lora_requests_info series."""
    modules = ["sql=" + str(adapters["sql"]), json.dumps({"name": "poet", "path": str(adapters["poet"])})]
    args = [*BASE_ARGS, "--enable-lora", "--lora-modules", *modules]
    with SimulatorProcess(args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}, ready_timeout=60) as sim:
        assert [(c["id"], c["parent"]) for c in models(sim)] == [
            ("qwen", None),
            ("sql", "qwen"),
            ("poet", "qwen"),
        ]
        assert load(sim, "wide", adapters["sql"]).status_code == 404
        assert unload(sim, "sql").status_code == 404
        assert "# TYPE vllm:lora_requests_info gauge" in httpx.get(f"{sim.base_url}/metrics", timeout=10).text
    with SimulatorProcess(list(BASE_ARGS), env=RUNTIME, ready_timeout=60) as plain:
        status, body = error(load(plain, "sql", adapters["sql"]))
        assert (status, body["message"]) == (
            500,
            "Call to add_lora method failed: Worker failed with error 'LoRA is not enabled. Use "
            "--enable-lora to enable LoRA.', please check the stack trace above for the root cause",
        )
        assert "vllm:lora_requests_info" not in httpx.get(f"{plain.base_url}/metrics", timeout=10).text


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--enable-lora", "--max-lora-rank", "12"], "invalid choice: 12"),
        (
            ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
            "max_cpu_loras (1) must be >= max_loras (2)",
        ),
        (["--lora-modules", "sql=/tmp/x"], "LoRA is not enabled"),
        (["--enable-lora", "--lora-modules", "{not json"], "Invalid JSON format for --lora-modules"),
    ],
)
def test_bad_lora_flags_stop_the_start(extra: list[str], says: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "servedmodel.sim", *BASE_ARGS, "--port", "0", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert says in proc.stderr
