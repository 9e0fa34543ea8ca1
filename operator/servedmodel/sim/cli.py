"""`servedmodel sim`: flags named as `vllm serve`'s (so the operator builds one argument list for both),
plus `--sim-*` knobs for the step-time model, output length, startup delay and faults."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
from typing import Any

from servedmodel.sim.engine import EngineConfig
from servedmodel.sim.faults import Faults
from servedmodel.sim.lora import MAX_LORA_RANKS, LoraConfig, lora_module, runtime_updating_allowed
from servedmodel.sim.metrics import OLD_METRIC_NAMES
from servedmodel.sim.server import SimSettings, serve

log = logging.getLogger("servedmodel.sim")
DEFAULT_MODEL = "Qwen/Qwen2.5-7B-Instruct"

# vLLM flags the simulator accepts and ignores: (flag, takes a value).
IGNORED_FLAGS: tuple[tuple[str, bool], ...] = (
    ("--gpu-memory-utilization", True),
    ("--tensor-parallel-size", True),
    ("--pipeline-parallel-size", True),
    # vLLM's multi-node mode (spec.workers' LeaderWorkerSet): a simulator stands in for each pod of the
    # group and serves its HTTP on a worker too (--headless), so the probe can check every worker.
    ("--nnodes", True),
    ("--node-rank", True),
    ("--master-addr", True),
    ("--headless", False),
    ("--dtype", True),
    ("--revision", True),
    ("--download-dir", True),
    ("--trust-remote-code", False),
    ("--disable-log-stats", False),
    ("--enable-log-requests", False),
    ("--kv-cache-dtype", True),
    ("--swap-space", True),
    ("--enforce-eager", False),
    ("--uvicorn-log-level", True),
    ("--load-format", True),
)


def human_int(value: str) -> int:
    """vLLM's human-readable ints: 8k = 8000, 8K = 8192, 1m = 1000000, 1M = 1048576; plain ints too.

    `auto` and -1 (vLLM: the model's own limit) mean the simulated model's 32768.
    """
    if value.strip() in ("auto", "-1"):
        return EngineConfig().max_model_len
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", value)
    if not match:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}")
    number, suffix = float(match.group(1)), match.group(2)
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    return int(number * scale)


def metric_rename(value: str) -> tuple[str, str]:
    """NAME=NEW of --sim-rename-metric."""
    name, sep, new = value.partition("=")
    if not sep or not name or not new:
        raise argparse.ArgumentTypeError(f"expected NAME=NEW, got {value!r}")
    return name, new


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    parser.add_argument(
        "model", nargs="?", default=None, help=f"model name or path (default {DEFAULT_MODEL})"
    )
    # `vllm serve` also takes the model as --model (the positional wins when both are given, as there)
    parser.add_argument("--model", dest="model_flag", default=None, help="the model, as a flag")
    parser.add_argument(
        "--served-model-name", nargs="+", action="extend", default=[], help="names clients may use"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-model-len", type=human_int, default=d.max_model_len, help="context length (8k, 32K)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=human_int, default=None, help="per-step token budget"
    )
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks,
                        help="KV cache capacity in blocks (what GPU memory would decide)")  # fmt: skip
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--chat-template", default=None, help="Jinja file, inline Jinja, or qwen2.5|qwen3|llama3|plain"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="directory with a HF tokenizer.json (default: Qwen's BPE)"
    )
    parser.add_argument("--api-key", default=None, help="guards /v1 (default: $VLLM_API_KEY)")
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens (prefix-cache hits)",
    )
    parser.add_argument("--seed", type=int, default=0)
    lora = parser.add_argument_group("LoRA (vLLM's LoRAConfig flags)")
    lora.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve LoRA adapters (loading at run time also needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )
    lora.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch")
    lora.add_argument("--max-lora-rank", type=int, default=16, choices=MAX_LORA_RANKS, help="largest rank")
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="adapters cached (>= --max-loras)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=lora_module,
        default=[],
        help="adapters loaded at start: name=path or JSON {name, path, base_model_name}",
    )
    for flag, takes_value in IGNORED_FLAGS:
        if takes_value:
            parser.add_argument(flag, default=None, help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
    sim = parser.add_argument_group("simulator")
    sim.add_argument(
        "--sim-step-base-ms", type=float, default=d.step_base_ms, help="fixed cost of one engine step"
    )
    sim.add_argument(
        "--sim-prefill-token-ms", type=float, default=d.prefill_token_ms, help="cost per prefill token"
    )
    sim.add_argument(
        "--sim-running-seq-ms", type=float, default=d.running_seq_ms, help="cost per sequence in the batch"
    )
    sim.add_argument(
        "--sim-noise", type=float, default=d.noise, help="relative std-dev of step time (seeded)"
    )
    sim.add_argument(
        "--sim-handoff-ms",
        type=float,
        default=d.handoff_ms,
        help="API server -> engine hand-off: in TTFT and e2e, not in queue time (vLLM-CPU: ~3 ms)",
    )
    sim.add_argument("--sim-mean-output-tokens", type=int, default=d.mean_output_tokens)
    sim.add_argument(
        "--sim-startup-delay", type=float, default=0.0, help="seconds /health answers 503 after start"
    )
    sim.add_argument("--sim-error-rate", type=float, default=0.0)
    sim.add_argument("--sim-error-status", type=int, default=500)
    sim.add_argument("--sim-stall-after-tokens", type=int, default=None)
    sim.add_argument("--sim-drop-after-tokens", type=int, default=None)
    sim.add_argument("--sim-first-byte-delay-ms", type=float, default=0.0)
    sim.add_argument("--sim-malformed-chunk-rate", type=float, default=0.0)
    sim.add_argument("--sim-dead", action="store_true", help="start with a dead engine")
    sim.add_argument("--sim-ignore-stop", action="store_true", help="ignore stop strings (a broken server)")
    sim.add_argument(
        "--sim-metric-names",
        choices=("vllm", "old"),
        default="vllm",
        help="/metrics names: vLLM 0.33's, or the older gpu_cache_usage_perc/time_per_output_token ones",
    )
    sim.add_argument(
        "--sim-rename-metric",
        action="append",
        type=metric_rename,
        default=[],
        metavar="NAME=NEW",
        help="expose a series under another name (as declared: counters without _total); repeatable",
    )
    sim.add_argument("--log-level", default="INFO")


# EngineConfig's fields that vLLM's own flags set (--max-model-len ...); the simulator's timing flags and
# the faults' flags are --sim-<field> of EngineConfig's and Faults' fields (--sim-step-base-ms ...).
ENGINE_FLAGS = ("max_model_len", "max_num_seqs", "block_size", "num_gpu_blocks", "seed")


def sim_flags(args: argparse.Namespace, config: type[EngineConfig] | type[Faults]) -> dict[str, Any]:
    """The fields of `config` that a --sim-<field> flag sets, from those flags."""
    names = (f.name for f in dataclasses.fields(config))
    return {name: getattr(args, f"sim_{name}") for name in names if hasattr(args, f"sim_{name}")}


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    chunked = bool(args.enable_chunked_prefill)
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = 8192 if chunked else max(args.max_model_len, 2048)
    engine = EngineConfig(
        max_num_batched_tokens=batched,
        enable_prefix_caching=bool(args.enable_prefix_caching),
        enable_chunked_prefill=chunked,
        **{name: getattr(args, name) for name in ENGINE_FLAGS},
        **sim_flags(args, EngineConfig),
    )
    faults = Faults(**sim_flags(args, Faults))
    model = args.model or args.model_flag or DEFAULT_MODEL
    return SimSettings(
        model=model,
        served_model_names=list(args.served_model_name),
        host=args.host,
        port=args.port,
        engine=engine,
        chat_template=args.chat_template,
        tokenizer=args.tokenizer,
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
        enable_prompt_tokens_details=bool(args.enable_prompt_tokens_details),
        startup_delay_s=args.sim_startup_delay,
        faults=faults,
        lora=(
            LoraConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras) if args.enable_lora else None
        ),
        lora_modules=list(args.lora_modules),
        runtime_lora_updating=runtime_updating_allowed(),
        metric_renames={
            **(OLD_METRIC_NAMES if args.sim_metric_names == "old" else {}),
            **dict(args.sim_rename_metric),
        },
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for flag, _ in IGNORED_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            log.info("ignoring %s=%s (no GPU here)", flag, value)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    return asyncio.run(_run(settings))


async def _run(settings: SimSettings) -> int:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel if task is not None else lambda: None)
    try:
        await serve(settings)
    except asyncio.CancelledError:
        log.info("stopped")
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    finally:
        with contextlib.suppress(Exception):
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    return 0
