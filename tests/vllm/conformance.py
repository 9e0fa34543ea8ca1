"""The requests of the side-by-side conformance test (test_conformance.py), sent alike to the simulator
and to real vLLM, and a field-by-field JSON diff.

`capture(base_url, model)` answers every request and returns one JSON document: the keys are the areas
of the conformance table in docs/simulator.md (`models`, `tokenize/<case>`, `stream/<case>`,
`error/<case>`, `metrics`). `diff(sim, vllm)` walks two such documents and names every difference as
`<path> (<kind>)`; kinds: value, type, missing in sim, extra in sim, shape.

What varies from request to request on one server (ids, timestamps) is normalised before comparing;
it says nothing about the simulator.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT = httpx.Timeout(120.0, connect=10.0)

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# /tokenize cases: the default system prompt, multi-turn, unicode, long.
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "default-system-prompt": [{"role": "user", "content": "Say hello in five words."}],
    "multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
    "unicode": [{"role": "user", "content": "Wie geht's? 😀 你好 — naïve café, ℝ², 🤖🧪 \t tabs\n\nlines"}],
    "long": [{"role": "user", "content": " ".join(f"word{i} and more text" for i in range(600))}],
}
GEN_PROMPT = [{"role": "user", "content": "Count: one two three four five six seven eight nine ten"}]
ERROR_BODY_KEYS = ("message", "type", "param", "code")


def normalise(doc: Any) -> Any:
    """Per-request values -> their shape: ids keep their prefix, timestamps become "<int>"."""
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for k, v in doc.items():
            if k == "created" and isinstance(v, int):
                out[k] = "<int>"
            elif k == "id" and isinstance(v, str):
                out[k] = re.sub(r"-[0-9a-zA-Z_-]+$", "-<id>", v)
            else:
                out[k] = normalise(v)
        return out
    if isinstance(doc, list):
        return [normalise(v) for v in doc]
    return doc


def _events(r: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _stream(client: httpx.Client, base: str, body: dict[str, Any]) -> dict[str, Any]:
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        content_type = r.headers.get("content-type")
        events = _events(r)
    chunks = [e for e in events if isinstance(e, dict)]
    token_chunks = [c for c in chunks[1:] if c.get("choices")]
    counts = [c["usage"]["completion_tokens"] for c in token_chunks if "usage" in c]
    finish = token_chunks[-1]["choices"][0] if token_chunks else {}
    usage_chunk = chunks[-1] if chunks and not chunks[-1].get("choices") else None
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in token_chunks)
    # continuous usage: how many tokens each chunk added. vLLM writes one chunk per engine step, but an API
    # server that lags its engine merges the request's waiting outputs into one chunk (v1's
    # RequestOutputCollector): a CI run with three engines on 2 cores got 10 chunks for 12 tokens, one of
    # 3. So the shape compared is the chunks one per step would make (a merged chunk counts as its
    # tokens) and each chunk's tokens clipped at 1 (0: a chunk without a token, which neither sends).
    added = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    return {
        "content_type": content_type,
        "first_chunk": normalise(chunks[0]) if chunks else None,
        "tokens_per_chunk": sorted({min(d, 1) for d in added}),
        "chunks": len(token_chunks) + sum(d - 1 for d in added if d > 1),
        "content_chunk_shape": normalise(_shape(token_chunks[0])) if len(token_chunks) > 1 else None,
        "finish_chunk_shape": normalise(_shape(token_chunks[-1])) if token_chunks else None,
        "finish_reason": finish.get("finish_reason"),
        "stop_reason": finish.get("stop_reason"),
        "usage_chunk": normalise(_shape(usage_chunk)) if usage_chunk is not None else None,
        "done": events[-1] == "[DONE]" if events else False,
        "text": text,
    }


def _shape(doc: Any) -> Any:
    """Keys and value types, in order (a text's content is not compared here)."""
    if isinstance(doc, dict):
        return {k: _shape(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_shape(v) for v in doc]
    if isinstance(doc, str):
        return "<str>"
    if isinstance(doc, bool) or doc is None:
        return doc
    return f"<{type(doc).__name__}>"


def _error(client: httpx.Client, base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(f"{base}/v1/chat/completions", json=body)
    try:
        err = r.json().get("error", r.json())
    except ValueError:
        err = {"body": r.text[:300]}
    return {"status": r.status_code, **{k: err.get(k) for k in ERROR_BODY_KEYS}}


def metric_families(text: str) -> dict[str, Any]:
    """Family name -> type, label names, and for histograms the bucket bounds."""
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        labels: set[str] = set()
        bounds: set[float] = set()
        for s in fam.samples:
            labels.update(k for k in s.labels if k != "le")
            if s.name.endswith("_bucket") and "le" in s.labels:
                bounds.add(float(s.labels["le"]))
        entry: dict[str, Any] = {"type": fam.type, "labels": sorted(labels)}
        if fam.type == "histogram":
            entry["buckets"] = sorted(bounds)
        out[fam.name] = entry
    return out


def capture(base: str, model: str, max_model_len: int) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
        models = c.get(f"{base}/v1/models").json()
        doc["models"] = normalise(models)
        doc["version"] = c.get(f"{base}/version").json()
        for name, messages in CONVERSATIONS.items():
            tok = c.post(
                f"{base}/tokenize", json={"model": model, "messages": messages, "return_token_strs": True}
            ).json()
            doc[f"tokenize/{name}"] = tok
        tok = c.post(f"{base}/tokenize", json={"model": model, "prompt": "Hello, world!"}).json()
        doc["tokenize/prompt"] = tok
        gen = {
            "model": model,
            "messages": GEN_PROMPT,
            "temperature": 0,
            "seed": 1234,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        doc["stream/length"] = _stream(c, base, {**gen, "max_tokens": 12})
        # a stop string that never comes: its possible start is held back, chunks carry "" meanwhile
        doc["stream/held-back"] = _stream(c, base, {**gen, "max_tokens": 12, "stop": ["@@@@@@@@"]})
        # a stop string the answer does contain (learned from it): finish_reason stop, stop_reason it
        text = doc["stream/length"]["text"]
        stop = _stop_from(text)
        learned = _stream(c, base, {**gen, "max_tokens": 12, "stop": [stop]})
        learned["text"] = "<elided>" if learned["text"] == text[: text.find(stop)] else learned["text"]
        learned["stop_reason"] = (
            "<the stop string>" if learned["stop_reason"] == stop else learned["stop_reason"]
        )
        learned["chunks"] = "<as many as the answer had before the stop string>"
        doc["stream/learned-stop"] = learned
        full = c.post(f"{base}/v1/chat/completions", json={**gen, "stream": False, "stream_options": None,
                      "max_tokens": 4}).json()  # fmt: skip
        doc["chat/full"] = normalise(_shape(full))
        plain = {"model": model, "messages": GEN_PROMPT, "max_tokens": 4}
        doc["error/unknown-model"] = _error(c, base, {**plain, "model": "nope"})
        filler = " hello" * (max_model_len + 16)
        doc["error/oversized-prompt"] = _error(
            c, base, {**plain, "messages": [{"role": "user", "content": filler}]}
        )
        doc["error/max-tokens-over-max-model-len"] = _error(
            c, base, {**plain, "max_tokens": max_model_len + 1}
        )
        doc["error/stream-options-without-stream"] = _error(
            c, base, {**plain, "stream_options": {"include_usage": True}}
        )
        metrics = c.get(f"{base}/metrics")
        doc["metrics"] = metric_families(metrics.text)
        # The probe's filtered scrape (probe/client.PodMetrics): which route answers name[] with those
        # samples alone, and which sends everything whatever is asked.
        for route in ("/metrics", "/metrics/"):
            r = c.get(f"{base}{route}?name[]=vllm:num_requests_running&name[]=vllm:request_success_total")
            names = {line.split("{")[0].split(" ")[0] for line in r.text.splitlines() if line[:1] not in "#"}
            doc[f"metrics-query{route}"] = {
                "status": r.status_code,
                "samples": sorted(names) if len(names) <= 4 else "everything",
            }
    return doc


def _stop_from(text: str) -> str:
    from servedmodel.probe.checks import pick_stop_string

    picked = pick_stop_string(text)
    return picked[0] if picked else text[-1:]


def diff(sim: Any, vllm: Any, path: str = "") -> list[str]:
    """Every difference, as `<path> (<kind>)`."""
    if isinstance(sim, dict) and isinstance(vllm, dict):
        out: list[str] = []
        for k in vllm:
            p = f"{path}.{k}" if path else k
            if k not in sim:
                out.append(f"{p} (missing in sim)")
            else:
                out.extend(diff(sim[k], vllm[k], p))
        out.extend(
            f"{path}.{k} (extra in sim)" if path else f"{k} (extra in sim)" for k in sim if k not in vllm
        )
        return out
    if isinstance(sim, list) and isinstance(vllm, list):
        if len(sim) != len(vllm):
            return (
                [f"{path} (shape)"]
                if any(isinstance(v, dict | list) for v in [*sim, *vllm])
                else [f"{path} (value)"]
            )
        out = []
        for i, (a, b) in enumerate(zip(sim, vllm, strict=True)):
            out.extend(diff(a, b, f"{path}[{i}]"))
        return out
    if type(sim) is not type(vllm) and not (isinstance(sim, int | float) and isinstance(vllm, int | float)):
        return [f"{path} (type)"]
    return [] if sim == vllm else [f"{path} (value)"]
