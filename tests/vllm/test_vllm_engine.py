"""The generated tiny Qwen folders as real vLLM serves them: tokenizer, chat templates, the model card.

The tokenizer tests need no server (the folders are checked against Qwen's own tiktoken vocabulary);
the rest ask the session's vLLM servers.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

import vllm_models
from servedmodel.sim.tokenizer import QwenTokenizer
from vllm_server import VLLMServer

# A vLLM start is 30-120 s on this shared machine; the first test of a server pays for it.
pytestmark = pytest.mark.timeout(900)

REFERENCE = [{"role": "user", "content": "Say hello in five words."}]
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SAMPLES = [
    "Hello, world!",
    "Say hello in five words.",
    "日本語のテキスト 🤖 émoji  \n\n  spaces\t\ttabs 12345 don't",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_tokenizer_json_encodes_as_qwens_vocabulary(family: str) -> None:
    folder = vllm_models.ensure_model(family)
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    qwen = QwenTokenizer()
    for text in SAMPLES:
        assert hf.encode(text, add_special_tokens=False).ids == qwen.encode(text), text
    assert hf.encode("Hello, world!", add_special_tokens=False).ids == [9707, 11, 1879, 0]
    added = 22 if family == "qwen2.5" else 26
    assert hf.get_vocab_size(with_added_tokens=True) == 151643 + added
    assert hf.token_to_id("<|im_end|>") == 151645
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM" if family == "qwen2.5" else "Qwen3ForCausalLM"]
    assert config["vocab_size"] == 151936


def test_model_folders_are_cached_and_regenerated_apart(tmp_path: Path) -> None:
    first = vllm_models.ensure_model("qwen2.5", root=tmp_path)
    mtime = (first / "tokenizer.json").stat().st_mtime_ns
    assert vllm_models.ensure_model("qwen2.5", root=tmp_path) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a work folder was left behind"


def _tokenize(server: VLLMServer, **body: object) -> dict[str, object]:
    r = httpx.post(
        f"{server.base_url}/tokenize", json={"model": server.served_model_name, **body}, timeout=30
    )
    r.raise_for_status()
    doc: dict[str, object] = r.json()
    return doc


def _text(doc: dict[str, object]) -> str:
    """vLLM's token strings (GPT-2 byte alphabet: Ġ a space, Ċ a newline) joined back into text."""
    return "".join(doc["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")  # type: ignore[arg-type]


@pytest.mark.vllm
def test_qwen25_tokenizes_like_the_real_model(vllm_qwen25: VLLMServer, qwen25_dir: Path) -> None:
    doc = _tokenize(vllm_qwen25, messages=REFERENCE, return_token_strs=True)
    assert doc["count"] == 35  # as real Qwen2.5-Instruct counts it
    rendered = _text(doc)
    assert rendered == (
        f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nSay hello in five words.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _tokenize(vllm_qwen25, prompt="Hello, world!")["tokens"] == [9707, 11, 1879, 0]
    card = httpx.get(f"{vllm_qwen25.base_url}/v1/models", timeout=30).json()["data"][0]
    assert (card["id"], card["root"], card["max_model_len"]) == ("qwen", str(qwen25_dir), 4096)
    assert httpx.get(f"{vllm_qwen25.base_url}/version", timeout=30).json()["version"].startswith("0.32")


@pytest.mark.vllm
def test_qwen3_thinks_by_default_and_has_no_system_prompt(vllm_qwen3: VLLMServer) -> None:
    default = _tokenize(vllm_qwen3, messages=REFERENCE, return_token_strs=True)
    text = _text(default)
    assert text == "<|im_start|>user\nSay hello in five words.<|im_end|>\n<|im_start|>assistant\n"
    off = _tokenize(
        vllm_qwen3,
        messages=REFERENCE,
        chat_template_kwargs={"enable_thinking": False},
        return_token_strs=True,
    )
    # enable_thinking=false pre-fills an empty think block: <think> "\n\n" </think> "\n\n"
    assert off["tokens"][-4:] == [151667, 271, 151668, 271]  # type: ignore[index]
    assert off["count"] == default["count"] + 4
    # An earlier turn's reasoning is dropped; the assistant turn after the last query keeps its own.
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nr1\n</think>\n\nx"},
        {"role": "user", "content": "b"},
    ]
    doc = _tokenize(vllm_qwen3, messages=turns, return_token_strs=True)
    text = _text(doc)
    assert "r1" not in text
    assert "<|im_start|>assistant\nx<|im_end|>" in text
