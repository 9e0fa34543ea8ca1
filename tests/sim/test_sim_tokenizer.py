"""The simulator's tokenizers and chat templates, without a server."""

from __future__ import annotations

import pytest

from servedmodel.sim.templates import ChatTemplate, default_template_name, resolve_source
from servedmodel.sim.tokenizer import IncrementalDetokenizer, QwenTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def qwen() -> QwenTokenizer:
    return QwenTokenizer()


def test_qwen25_ids_and_added_tokens(qwen: QwenTokenizer) -> None:
    assert qwen.encode("<|im_start|>user\nhello<|im_end|>") == [151644, 872, 198, 14990, 151645]
    assert qwen.encode("<think>") == [151667]
    assert qwen.eos_token_id == 151645
    assert qwen.decode([151644, 14990, 151645], skip_special_tokens=True) == "hello"
    assert qwen.token_str(1879) == "Ġworld"


def test_qwen36_uses_its_own_vocabulary() -> None:
    tok = load_tokenizer(None, "Qwen/Qwen3.6-27B")
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>")
    assert ids[0] == 248045
    assert ids[-1] == tok.eos_token_id == 248046
    assert load_tokenizer(None, "Qwen/Qwen3-8B").eos_token_id == 151645


def test_incremental_detokenizer_never_splits_a_character(qwen: QwenTokenizer) -> None:
    text = "龘😀\U0001d518"
    ids = qwen.encode(text)
    assert len(ids) > 3  # these characters span tokens
    detok = IncrementalDetokenizer(qwen.special_ids)
    pieces = [detok.add(qwen, i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens carried only part of a character


def test_templates_by_name_and_family() -> None:
    assert default_template_name("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5"
    assert default_template_name("Qwen/Qwen3.6-27B") == "qwen3"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    assert ChatTemplate("qwen2.5").render(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        ChatTemplate("qwen3").render(msgs[1:], add_generation_prompt=False)
        == "<|im_start|>user\nU<|im_end|>\n"
    )
    assert ChatTemplate("plain").render(msgs) == "system: S\nuser: U\nassistant: "
    with pytest.raises(ValueError, match="neither"):
        resolve_source("no-such-template")
