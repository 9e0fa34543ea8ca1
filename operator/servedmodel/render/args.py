"""`vllm serve` arguments from a ServedModel spec. The simulator takes the same flags (it ignores the
GPU-only ones), so one builder serves both engine kinds."""

from __future__ import annotations

from servedmodel.api import ServedModelSpec
from servedmodel.api.adapters import max_lora_rank, max_loras
from servedmodel.api.names import ENGINE_PORT

from .errors import RenderError

MODEL_MOUNT = "/mnt/models"
CHAT_TEMPLATE_DIR = "/etc/servedmodel/chat-template"
CHAT_TEMPLATE_FILE = "template.jinja"
# Flags derived from spec fields; extraArgs repeating one would leave vLLM to pick the last silently.
DERIVED_FLAGS = {
    "--served-model-name": "spec.servedModelName",
    "--revision": "spec.revision",
    "--max-model-len": "spec.engine.maxModelLen",
    "--max-num-seqs": "spec.engine.maxNumSeqs",
    "--max-num-batched-tokens": "spec.engine.maxNumBatchedTokens",
    "--gpu-memory-utilization": "spec.engine.gpuMemoryUtilization",
    "--tensor-parallel-size": "spec.engine.tensorParallelSize",
    "--enable-prefix-caching": "spec.engine.enablePrefixCaching",
    "--no-enable-prefix-caching": "spec.engine.enablePrefixCaching",
    "--enable-chunked-prefill": "spec.engine.enableChunkedPrefill",
    "--no-enable-chunked-prefill": "spec.engine.enableChunkedPrefill",
    "--dtype": "spec.engine.dtype",
    "--chat-template": "spec.engine.chatTemplate",
    "--model": "spec.model",
}
# Derived from spec.adapters when it lists any (without adapters extraArgs may set them); --lora-modules
# beside it would load adapters the prober then unloads, as the spec does not list them.
LORA_FLAGS = ("--enable-lora", "--no-enable-lora", "--max-loras", "--max-lora-rank", "--lora-modules")
# The env that opens vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (the prober loads adapters).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def model_location(spec: ServedModelSpec) -> tuple[str, str | None]:
    """(the model argument, the PVC claim holding it or None for a Hugging Face repo id)."""
    if not spec.model.startswith("pvc://"):
        return spec.model, None
    claim, _, path = spec.model.removeprefix("pvc://").partition("/")
    path = path.strip("/")
    return (f"{MODEL_MOUNT}/{path}" if path else MODEL_MOUNT), claim


def _flag_name(arg: str) -> str:
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def engine_args(spec: ServedModelSpec) -> list[str]:
    """Positional model, then the derived flags in a fixed order, then spec.engine.extraArgs."""
    eng = spec.engine
    model, _ = model_location(spec)
    args = [model, "--served-model-name", spec.resolved_served_model_name, "--port", str(ENGINE_PORT)]
    if spec.revision is not None:
        args += ["--revision", spec.revision]
    if eng.max_model_len is not None:
        args += ["--max-model-len", str(eng.max_model_len)]
    if eng.max_num_seqs is not None:
        args += ["--max-num-seqs", str(eng.max_num_seqs)]
    if eng.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
    if eng.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", repr(eng.gpu_memory_utilization)]
    args += ["--tensor-parallel-size", str(eng.tensor_parallel_size)]
    if eng.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if eng.enable_prefix_caching else "--no-enable-prefix-caching")
    if eng.enable_chunked_prefill is not None:
        args.append(
            "--enable-chunked-prefill" if eng.enable_chunked_prefill else "--no-enable-chunked-prefill"
        )
    if eng.dtype is not None:
        args += ["--dtype", eng.dtype]
    if eng.chat_template is not None:
        args += ["--chat-template", f"{CHAT_TEMPLATE_DIR}/{CHAT_TEMPLATE_FILE}"]
    if spec.adapters:
        # One batch may hold every declared adapter; the rank holds the largest declared one. The adapters
        # themselves are loaded at run time by the prober (runtime loading), not with --lora-modules.
        args += ["--enable-lora", "--max-loras", str(max_loras(spec.adapters))]
        args += ["--max-lora-rank", str(max_lora_rank(spec.adapters))]
    for extra in eng.extra_args:
        flag = _flag_name(extra)
        if flag in DERIVED_FLAGS:
            raise RenderError(
                "spec.engine.extraArgs",
                f"{flag} is derived from {DERIVED_FLAGS[flag]}; set that field instead of passing the flag",
            )
        if spec.adapters and flag in LORA_FLAGS:
            raise RenderError(
                "spec.engine.extraArgs", f"{flag} is derived from spec.adapters; do not pass it as well"
            )
    return [*args, *eng.extra_args]
