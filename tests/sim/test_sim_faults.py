"""Fault injection, each kind, switched at run time through /admin/faults (and one by flag)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from sim_support import BASE_ARGS, client, ground_truth, set_faults

from servedmodel.sim.process import SimulatorProcess

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Count: one two three four five"}]}
STREAM = {**CHAT, "stream": True, "max_tokens": 20, "ignore_eos": True}


def test_error_rate_and_status(faults: SimulatorProcess) -> None:
    set_faults(faults, error_rate=1.0, error_status=503)
    with pytest.raises(openai.APIStatusError) as info:
        client(faults).chat.completions.create(**CHAT)  # type: ignore[call-overload]
    assert info.value.status_code == 503
    assert info.value.body["code"] == 503  # type: ignore[index]
    set_faults(faults, error_rate=0.0)
    assert client(faults).chat.completions.create(**CHAT).choices[0].finish_reason == "stop"  # type: ignore[call-overload]


def test_stall_after_tokens_keeps_connection_silent(faults: SimulatorProcess) -> None:
    set_faults(faults, stall_after_tokens=2)
    # Tokens come every 2 ms; 3 s of silence is the stall, not a busy machine's late token.
    timeout = httpx.Timeout(10.0, read=3.0)
    received: list[str] = []
    with (
        httpx.Client(timeout=timeout) as h,
        h.stream("POST", f"{faults.base_url}/v1/chat/completions", json=STREAM) as resp,
        pytest.raises(httpx.ReadTimeout),
    ):
        received.extend(line for line in resp.iter_lines() if line.startswith("data: "))
    contents = [json.loads(x[6:])["choices"][0]["delta"].get("content") for x in received]
    assert contents[0] == ""  # role chunk, then two tokens, then silence
    assert len(received) == 3
    assert "data: [DONE]" not in received


def test_drop_after_tokens_cuts_the_stream(faults: SimulatorProcess) -> None:
    set_faults(faults, drop_after_tokens=2)
    received: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.Client(timeout=10) as h,
        h.stream("POST", f"{faults.base_url}/v1/chat/completions", json=STREAM) as resp,
    ):
        received.extend(line for line in resp.iter_lines() if line.startswith("data: "))
    assert "data: [DONE]" not in received


def test_first_byte_delay(faults: SimulatorProcess) -> None:
    set_faults(faults, first_byte_delay_ms=600)
    sent = time.monotonic()
    r = client(faults).chat.completions.create(**CHAT, max_tokens=2)  # type: ignore[call-overload]
    elapsed_ms = (time.monotonic() - sent) * 1000
    row = next(x for x in ground_truth(faults) if x["request_id"] == r.id)
    assert elapsed_ms >= 600
    # The server's own truth does not contain the delay: it happens before the engine sees the request.
    assert row["e2e_ms"] < elapsed_ms - 500


def test_malformed_chunk(faults: SimulatorProcess) -> None:
    set_faults(faults, malformed_chunk_rate=1.0)
    r = httpx.post(f"{faults.base_url}/v1/chat/completions", json=STREAM, timeout=10)
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]
    bad = 0
    for e in events:
        try:
            json.loads(e)
        except json.JSONDecodeError:
            bad += 1
    assert bad >= 1
    with pytest.raises((json.JSONDecodeError, openai.APIError)):
        for _ in client(faults).chat.completions.create(**{**CHAT, "stream": True}):  # type: ignore[call-overload]
            pass


def test_dead_engine(faults: SimulatorProcess) -> None:
    set_faults(faults, dead=True)
    assert httpx.get(f"{faults.base_url}/health", timeout=5).status_code == 503
    r = httpx.post(f"{faults.base_url}/v1/chat/completions", json=CHAT, timeout=5)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    set_faults(faults, dead=False)
    assert httpx.get(f"{faults.base_url}/health", timeout=5).status_code == 200


def test_engine_death_fails_streams_in_flight(faults: SimulatorProcess) -> None:
    body = {**STREAM, "max_tokens": 1500}
    lines: list[str] = []

    def read() -> None:
        with (
            httpx.Client(timeout=20) as h,
            h.stream("POST", f"{faults.base_url}/v1/chat/completions", json=body) as r,
        ):
            lines.extend(x for x in r.iter_lines() if x.startswith("data: "))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 10
    while not httpx.get(f"{faults.base_url}/debug/engine", timeout=5).json()["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    set_faults(faults, dead=True)
    reader.join(timeout=20)
    assert not reader.is_alive()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])
    assert error["error"]["code"] == 500


def chunk_times(sim: SimulatorProcess, body: dict[str, object]) -> list[tuple[float, dict[str, object]]]:
    out: list[tuple[float, dict[str, object]]] = []
    with httpx.stream("POST", f"{sim.base_url}/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append((time.monotonic(), json.loads(line[len("data: ") :])))
    return out


def test_coalesce_delivers_the_stream_in_one_lump(faults: SimulatorProcess) -> None:
    set_faults(faults, coalesce=True)
    got = chunk_times(faults, {**STREAM, "stream_options": {"include_usage": True}})
    assert len(got) == 1 + 20 + 1  # role, one chunk per token, usage: all there, all at the end
    truth = ground_truth(faults)[-1]
    # nothing reached the client before the engine's last token (shared monotonic clock)
    assert got[0][0] >= truth["last_token"]


def test_chunk_tokens_puts_several_tokens_in_a_chunk(faults: SimulatorProcess) -> None:
    set_faults(faults, chunk_tokens=4)
    body = {**STREAM, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    got = chunk_times(faults, body)
    counts = [e["usage"]["completion_tokens"] for _, e in got if e["choices"]]  # type: ignore[index]
    assert counts == [0, 4, 8, 12, 16, 20]
    with pytest.raises(httpx.HTTPStatusError):
        set_faults(faults, chunk_tokens=0)


def test_ignore_stop(faults: SimulatorProcess) -> None:
    set_faults(faults, ignore_stop=True)
    r = client(faults).chat.completions.create(**CHAT, stop=["four"])  # type: ignore[call-overload]
    assert "four" in (r.choices[0].message.content or "")
    assert (r.choices[0].model_extra or {}).get("stop_reason") is None


def test_template_swap_at_run_time(faults: SimulatorProcess) -> None:
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    set_faults(faults, chat_template="llama3")
    ids = httpx.post(f"{faults.base_url}/tokenize", json=msgs, timeout=5).json()["tokens"]
    text = httpx.post(f"{faults.base_url}/detokenize", json={"tokens": ids}, timeout=5).json()["prompt"]
    assert "<|im_start|>" not in text
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
    set_faults(faults, chat_template=None)
    ids = httpx.post(f"{faults.base_url}/tokenize", json=msgs, timeout=5).json()["tokens"]
    assert ids[0] == 151644


def rendered(sim: SimulatorProcess) -> str:
    """The prompt text the current chat template makes of CHAT's messages."""
    ids = httpx.post(f"{sim.base_url}/tokenize", json={"messages": CHAT["messages"]}, timeout=5).json()[
        "tokens"
    ]
    text: str = httpx.post(f"{sim.base_url}/detokenize", json={"tokens": ids}, timeout=5).json()["prompt"]
    return text


def test_reset_restores_the_default_template(faults: SimulatorProcess) -> None:
    chatml = rendered(faults)
    assert chatml.startswith("<|im_start|>system")
    set_faults(faults, chat_template="llama3")
    assert rendered(faults).startswith("<|begin_of_text|>")
    assert set_faults(faults, reset=True)["chat_template"] is None
    assert rendered(faults) == chatml


def test_rejected_change_leaves_faults_and_template_as_they_were(faults: SimulatorProcess) -> None:
    set_faults(faults, chat_template="llama3")
    r = httpx.post(
        f"{faults.base_url}/admin/faults", json={"error_rate": 0.5, "chat_template": "no-such"}, timeout=5
    )
    assert r.status_code == 400
    now = httpx.get(f"{faults.base_url}/admin/faults", timeout=5).json()
    assert (now["error_rate"], now["chat_template"]) == (0.0, "llama3")
    assert rendered(faults).startswith("<|begin_of_text|>")


def test_admin_rejects_unknown_settings(faults: SimulatorProcess) -> None:
    r = httpx.post(f"{faults.base_url}/admin/faults", json={"explode": True}, timeout=5)
    assert r.status_code == 400
    assert "explode" in r.json()["error"]["message"]
    assert httpx.get(f"{faults.base_url}/admin/faults", timeout=5).json()["error_rate"] == 0.0


def test_faults_by_flag_and_plain_template_file(tmp_path: object) -> None:
    args = [*BASE_ARGS, "--sim-error-rate", "1", "--sim-error-status", "429", "--chat-template", "plain"]
    with SimulatorProcess(args, ready_timeout=60) as sim:
        with pytest.raises(openai.RateLimitError):
            client(sim).chat.completions.create(**CHAT)  # type: ignore[call-overload]
        plain = "user: Count: one two three four five\nassistant: "
        assert rendered(sim) == plain
        # A reset restores the template given at start-up (--chat-template), not the model's default.
        set_faults(sim, chat_template="llama3")
        assert rendered(sim).startswith("<|begin_of_text|>")
        assert set_faults(sim, reset=True)["error_rate"] == 0.0
        assert rendered(sim) == plain
        assert client(sim).chat.completions.create(**CHAT).choices[0].finish_reason == "stop"  # type: ignore[call-overload]
