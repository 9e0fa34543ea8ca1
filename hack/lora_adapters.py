#!/usr/bin/env python3
"""Write random PEFT LoRA adapters for a model folder, offline: adapter_config.json + safetensors.

    .venv/bin/python hack/lora_adapters.py MODEL_DIR OUT_DIR [--rank 8] [--seed 0]

The shapes come from the model's config.json (hidden_size, num_attention_heads, num_key_value_heads,
head_dim, intermediate_size, num_hidden_layers): for each layer and each of the attention and MLP
projections a `lora_A` [rank, in] and a `lora_B` [out, rank], named as PEFT saves them
(`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`). The tensors are float32 with
small seeded random values, written in the safetensors format by hand (an 8-byte header length, the
JSON header, the raw little-endian data), so neither torch nor safetensors is needed to make one. vLLM
loads them as it loads an adapter trained with PEFT; the simulator reads only the config.
"""

from __future__ import annotations

import argparse
import array
import json
import random
import struct
import sys
from pathlib import Path
from typing import Any

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection a LoRA targets, from a Qwen/Llama config."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_tensors(
    config: dict[str, Any], rank: int, seed: int, scale: float = 0.01
) -> dict[str, tuple[list[int], array.array[float]]]:
    """Every lora_A/lora_B tensor of a random adapter: name -> (shape, float32 values)."""
    rng = random.Random(seed)
    shapes = projection_shapes(config)
    out: dict[str, tuple[list[int], array.array[float]]] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for proj in (*ATTENTION, *MLP):
            block = "self_attn" if proj in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            fan_in, fan_out = shapes[proj]
            for part, shape in (("lora_A", [rank, fan_in]), ("lora_B", [fan_out, rank])):
                values = array.array("f", (rng.uniform(-scale, scale) for _ in range(shape[0] * shape[1])))
                out[f"{prefix}.{part}.weight"] = (shape, values)
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], array.array[float]]]) -> None:
    """The safetensors layout: u64 header size, JSON header (dtype, shape, data_offsets), the data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        if sys.byteorder != "little":
            values = array.array("f", values)
            values.byteswap()
        data = values.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def adapter_config(base_model: str, rank: int, alpha: int | None = None) -> dict[str, Any]:
    """PEFT's adapter_config.json, the fields vLLM reads (PEFTHelper) and PEFT writes for a LoRA."""
    return {
        "base_model_name_or_path": base_model,
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_modules": [*ATTENTION, *MLP],
        "use_rslora": False,
        "use_dora": False,
    }


def write_adapter(model_dir: Path, out_dir: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """A random adapter for the model in `model_dir` (its config.json), written to `out_dir`."""
    config = json.loads((model_dir / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config(str(model_dir), rank), indent=2))
    write_safetensors(out_dir / "adapter_model.safetensors", adapter_tensors(config, rank, seed))
    return out_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_adapter(args.model_dir, args.out_dir, rank=args.rank, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
