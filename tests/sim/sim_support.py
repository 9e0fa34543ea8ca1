"""Helpers of the simulator's tests (a module of its own: conftest.py is not importable by name)."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from servedmodel.sim.process import SimulatorProcess

BASE_ARGS = ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen", "--max-model-len", "2048"]


def set_faults(sim: SimulatorProcess, **faults: Any) -> dict[str, Any]:
    r = httpx.post(f"{sim.base_url}/admin/faults", json=faults, timeout=5)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def client(sim: SimulatorProcess, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key="unused", timeout=30, max_retries=0, **kw)


def aclient(sim: SimulatorProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{sim.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


def ground_truth(sim: SimulatorProcess, limit: int = 1000) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = httpx.get(
        f"{sim.base_url}/debug/requests", params={"limit": limit}, timeout=5
    ).json()
    return rows


def engine_state(sim: SimulatorProcess) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{sim.base_url}/debug/engine", timeout=5).json()
    return out
