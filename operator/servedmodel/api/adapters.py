"""spec.adapters and status.probe.adapters: LoRA adapters served beside the base model, each one probed.

An adapter's source is where vLLM loads it from: `hf://<org>/<name>` (vLLM downloads it into HF_HOME on
the weight-cache volume), `cache://<path>` (a folder on the weight-cache volume, mounted at /cache) or an
absolute path inside the engine container. The engine gets --enable-lora, --max-loras and
--max-lora-rank from the list (render/), and the prober loads and unloads the adapters at run time
through vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter on every replica, then sends each one
the probe's chat request with `model: <adapter>`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .base import ApiModel, cel
from .names import CACHE_MOUNT

# A name clients send as `model`: letters, digits, '.', '_', '-' (no '/': it is no repo id).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$"
# hf://org/name, cache://relative/path, or /an/absolute/path (no '..' segment, no whitespace).
ADAPTER_SOURCE_PATTERN = (
    r"^(hf://([A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*"
    r"|cache://[A-Za-z0-9_.][A-Za-z0-9_./-]*"
    r"|/[A-Za-z0-9_.][A-Za-z0-9_./-]*)$"
)
# vLLM's LoRAConfig.max_lora_rank is one of these; the operator rounds the largest declared rank up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16  # vLLM's default, when no adapter declares a rank
MAX_ADAPTERS = 64


class AdapterSpec(ApiModel):
    """One LoRA adapter of the base model, served under its own name."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!self.source.matches('(^|/)[.][.](/|$)')",
                    "adapters[].source must not climb out of its root with a '..' segment",
                    ".source",
                )
            ]
        }
    )

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=ADAPTER_NAME_PATTERN,
        description="Name clients send as `model` to use the adapter (vLLM's lora_name).",
    )
    source: str = Field(
        min_length=1,
        max_length=1024,
        pattern=ADAPTER_SOURCE_PATTERN,
        description=(
            "Where vLLM loads it from: hf://<org>/<name> (downloaded into HF_HOME on the weight cache), "
            "cache://<path> (a folder on the weight-cache volume, /cache/<path>) or an absolute path in the "
            "engine container."
        ),
    )
    rank: int | None = Field(
        default=None,
        ge=1,
        le=512,
        description=(
            "The adapter's LoRA rank (its adapter_config.json `r`). The engine's --max-lora-rank is the "
            f"largest declared rank rounded up to one vLLM accepts ({DEFAULT_MAX_LORA_RANK} when none is "
            "declared); an adapter of a larger rank fails to load and is reported by name."
        ),
    )

    @model_validator(mode="after")
    def _no_parent_segment(self) -> AdapterSpec:
        if ".." in self.source.split("://", 1)[-1].split("/"):
            raise ValueError("adapters[].source must not climb out of its root with a '..' segment")
        return self

    @property
    def lora_path(self) -> str:
        """The lora_path vLLM gets: the repo id, the folder on the cache volume, or the path itself."""
        if self.source.startswith("hf://"):
            return self.source.removeprefix("hf://")
        if self.source.startswith("cache://"):
            return f"{CACHE_MOUNT}/{self.source.removeprefix('cache://').strip('/')}"
        return self.source


def max_loras(adapters: list[AdapterSpec]) -> int:
    """--max-loras: every declared adapter may share a batch; the count rounded up to a power of two, so
    adding an adapter changes the engine's arguments (a new revision, a rolling restart) only when the
    count passes one (1, 2, 4, 8, ...)."""
    return 1 << max(0, len(adapters) - 1).bit_length()


def max_lora_rank(adapters: list[AdapterSpec]) -> int:
    """--max-lora-rank: the smallest rank vLLM accepts that holds every declared rank."""
    declared = max((a.rank for a in adapters if a.rank is not None), default=DEFAULT_MAX_LORA_RANK)
    return next(r for r in VLLM_LORA_RANKS if r >= declared)


class AdapterPod(ApiModel):
    """One engine pod's view of one adapter: loaded there, and its own probe's outcome."""

    name: str = Field(max_length=253, description="Pod name.")
    serving: Literal["True", "False", "Unknown"] = Field(
        description="True when the adapter's chat request completed on this pod."
    )
    reason: str = Field(max_length=128, description="CamelCase reason: Serving, or why not.")
    ttft_ms: float | None = Field(default=None, description="Client TTFT of the adapter's probe here, ms.")
    tpot_ms: float | None = Field(default=None, description="Client TPOT of the adapter's probe here, ms.")


class AdapterProbe(ApiModel):
    """One declared adapter: where it is loaded, whether its own request path serves, how fast."""

    name: str = Field(max_length=128, description="The adapter's name (spec.adapters[].name).")
    serving: Literal["True", "False", "Unknown"] = Field(
        description="True when the adapter's own chat request completed on every pod that was probed."
    )
    reason: str = Field(
        max_length=128,
        description="CamelCase reason: Serving, or why not (AdapterLoadFailed, a probe failure reason).",
    )
    message: str | None = Field(
        default=None, max_length=1024, description="Details (the engine's own words)."
    )
    loaded: str | None = Field(
        default=None, max_length=32, description="Pods that list it in /v1/models / pods probed, e.g. 2/3."
    )
    ttft_ms: float | None = Field(
        default=None, description="Client TTFT of its probe, the median over pods, ms."
    )
    tpot_ms: float | None = Field(
        default=None, description="Client TPOT of its probe, the median over pods, ms."
    )
    pods: list[AdapterPod] | None = Field(
        default=None,
        max_length=1024,
        description="The pods that have it loaded, each with its own probe of the adapter.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
