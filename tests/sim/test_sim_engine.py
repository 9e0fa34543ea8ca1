"""The pure engine on a fake clock: scheduling, chunked prefill, KV, preemption, prefix cache, stops."""

from __future__ import annotations

import asyncio

import pytest

from servedmodel.sim.engine import Engine, EngineConfig, EngineLoop, Request, eos_point
from servedmodel.sim.tokenizer import QwenTokenizer


@pytest.fixture(scope="module")
def tok() -> QwenTokenizer:
    return QwenTokenizer()


def make_engine(tok: QwenTokenizer, **overrides: object) -> Engine:
    cfg = EngineConfig(
        max_model_len=4096,
        step_base_ms=5.0,
        prefill_token_ms=0.1,
        running_seq_ms=0.5,
        **overrides,  # type: ignore[arg-type]
    )
    return Engine(cfg, tok)


def request(
    tok: QwenTokenizer, rid: str, prompt_len: int, out: int, *, text: str = "alpha beta", **kw: object
) -> Request:
    # Distinct prompts (first token differs) so prefix caching only shares what a test means to share.
    prompt = [1000 + (hash(rid) % 5000)] + [11] * (prompt_len - 1)
    return Request(
        rid,
        prompt,
        max_tokens=out,
        plan_cycle=tok.encode(text + " "),
        eos_token_id=tok.eos_token_id,
        ignore_eos=True,
        **kw,  # type: ignore[arg-type]
    )


def run(engine: Engine, now: float = 0.0, max_steps: int = 100_000) -> float:
    """Step until idle on a fake clock (each step ends exactly at its planned end); returns the final time."""
    for _ in range(max_steps):
        plan = engine.schedule(now)
        if plan is None:
            assert not engine.has_work, "work left that can never be scheduled"
            return now
        now = plan.end
        engine.complete(plan, now)
    raise AssertionError("engine did not drain")


def test_max_num_seqs_caps_running_and_fifo_queue(tok: QwenTokenizer) -> None:
    engine = make_engine(tok, max_num_seqs=4)
    reqs = [request(tok, f"r{i}", 20, 5) for i in range(16)]
    for r in reqs:
        engine.add(r)
    plan = engine.schedule(0.0)
    assert plan is not None
    assert len(engine.running) == 4
    assert len(engine.waiting) == 12
    assert [r.request_id for r, _ in plan.scheduled] == ["r0", "r1", "r2", "r3"]
    run(engine)
    assert engine.max_running == 4
    assert engine.max_waiting == 12
    # FIFO: admission order is arrival order.
    scheduled = [r.first_scheduled for r in reqs]
    assert scheduled == sorted(scheduled)
    assert all(r.finish_reason == "length" and r.completion_tokens == 5 for r in reqs)


def test_ttft_of_queued_request_is_queue_plus_prefill(tok: QwenTokenizer) -> None:
    engine = make_engine(tok, max_num_seqs=1)
    a, b = request(tok, "a", 100, 3), request(tok, "b", 100, 3)
    engine.add(a)
    engine.add(b)
    run(engine)
    gt = b.ground_truth()
    assert gt["queue_ms"] > 0
    assert gt["ttft_ms"] == pytest.approx(gt["queue_ms"] + gt["prefill_ms"], abs=1e-6)
    # b waits exactly as long as a runs: its prefill step and two decode steps.
    prefill_step = 5.0 + 0.1 * 100 + 0.5
    decode_step = 5.0 + 0.5
    assert gt["queue_ms"] == pytest.approx(prefill_step + 2 * decode_step, abs=1e-6)
    assert gt["prefill_ms"] == pytest.approx(prefill_step, abs=1e-6)


def test_request_arriving_after_a_step_began_joins_the_next_step(tok: QwenTokenizer) -> None:
    """Regression: steps run back to back on the schedule, so a step can be planned at a start earlier than
    the real time; a request that arrived after that start was admitted into it (negative queue time)."""
    engine = make_engine(tok)
    a = request(tok, "a", 20, 3)
    engine.add(a)
    plan = engine.schedule(0.0)
    assert plan is not None
    engine.complete(plan, plan.end + 0.004)  # the loop woke 4 ms late
    b = request(tok, "b", 20, 3, arrival=plan.end + 0.002)  # arrived while the loop was late
    engine.add(b)
    nxt = engine.schedule(plan.end)  # the next step starts where the last one was due to end
    assert nxt is not None
    assert [r.request_id for r, _ in nxt.scheduled] == ["a"]
    assert b.first_scheduled is None
    engine.complete(nxt, nxt.end)
    run(engine, nxt.end)
    assert b.first_scheduled == nxt.end
    assert b.ground_truth()["queue_ms"] >= 0

    # Idle engine: nothing can start before the request is there; at its arrival it is admitted.
    assert b.last_token is not None
    c = request(tok, "c", 20, 3, arrival=b.last_token + 0.010)
    engine.add(c)
    assert engine.schedule(c.arrival - 0.001) is None
    run(engine, c.arrival)
    gt = c.ground_truth()
    assert gt["queue_ms"] == 0.0
    assert gt["ttft_ms"] == pytest.approx(5.0 + 0.1 * 20 + 0.5, abs=1e-6)


def test_prefill_time_grows_by_per_token_cost(tok: QwenTokenizer) -> None:
    times = []
    for n in (100, 1100):
        engine = make_engine(tok)
        r = request(tok, f"p{n}", n, 2)
        engine.add(r)
        run(engine)
        times.append(r.ground_truth()["prefill_ms"])
    assert times[1] - times[0] == pytest.approx(0.1 * 1000, abs=1e-6)


def test_chunked_prefill_splits_long_prompts_by_token_budget(tok: QwenTokenizer) -> None:
    engine = make_engine(tok, max_num_batched_tokens=256)
    r = request(tok, "long", 1000, 2)
    engine.add(r)
    steps = []
    now = 0.0
    while engine.has_work:
        plan = engine.schedule(now)
        assert plan is not None
        assert plan.num_tokens <= 256
        steps.append(plan.num_tokens)
        now = plan.end
        engine.complete(plan, now)
    assert steps == [256, 256, 256, 232, 1]
    assert r.first_token is not None
    assert r.completion_tokens == 2


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget(tok: QwenTokenizer) -> None:
    engine = make_engine(tok, max_num_batched_tokens=300, enable_chunked_prefill=False)
    a, b = request(tok, "a", 200, 2), request(tok, "b", 200, 2)
    engine.add(a)
    engine.add(b)
    plan = engine.schedule(0.0)
    assert plan is not None
    assert [r.request_id for r, _ in plan.scheduled] == ["a"]  # b does not fit beside a


def test_kv_blocks_run_out_and_preemption_recomputes(tok: QwenTokenizer) -> None:
    # 8 blocks of 16 tokens = 128 tokens for everyone; three requests that each grow to 80 tokens.
    engine = make_engine(tok, num_gpu_blocks=8, block_size=16, enable_prefix_caching=False)
    reqs = [request(tok, f"k{i}", 30, 50) for i in range(3)]
    for r in reqs:
        engine.add(r)
    peak = 0.0
    now = 0.0
    while engine.has_work:
        plan = engine.schedule(now)
        assert plan is not None
        peak = max(peak, engine.kv.usage)
        now = plan.end
        engine.complete(plan, now)
    assert engine.num_preemptions > 0
    assert peak == 1.0
    assert sum(r.num_preemptions for r in reqs) == engine.num_preemptions
    # Recompute keeps what was generated: every request still ends with exactly max_tokens tokens.
    assert all(r.completion_tokens == 50 and r.finish_reason == "length" for r in reqs)
    assert engine.kv.num_free == 8
    # A preempted request recomputed its prompt (and outputs so far) as prefill.
    preempted = [r for r in reqs if r.num_preemptions]
    assert all(r.num_prefill_computed > 30 for r in preempted)


def test_prefix_caching_reuses_full_prompt_blocks(tok: QwenTokenizer) -> None:
    engine = make_engine(tok, block_size=16)
    shared = [7] * 64 + [8] * 10
    first = Request("first", list(shared), max_tokens=1, plan_cycle=[5], eos_token_id=tok.eos_token_id)
    engine.add(first)
    run(engine)
    second = Request("second", list(shared), max_tokens=1, plan_cycle=[5], eos_token_id=tok.eos_token_id)
    engine.add(second)
    plan = engine.schedule(1.0)
    assert plan is not None
    assert second.num_cached_tokens == 64  # four full blocks; the 10-token tail is computed
    assert plan.num_prefill_tokens == 10
    assert engine.prefix_hits == 64
    assert engine.prefix_queries == 2 * 74


def test_no_prefix_caching_means_no_hits(tok: QwenTokenizer) -> None:
    engine = make_engine(tok, enable_prefix_caching=False)
    for rid in ("x", "y"):
        engine.add(Request(rid, [7] * 64, max_tokens=1, plan_cycle=[5], eos_token_id=tok.eos_token_id))
        run(engine)
    assert engine.prefix_hits == 0


def test_abort_frees_slot_and_blocks(tok: QwenTokenizer) -> None:
    engine = make_engine(tok, max_num_seqs=1)
    a, b = request(tok, "a", 40, 1000), request(tok, "b", 40, 2)
    engine.add(a)
    engine.add(b)
    plan = engine.schedule(0.0)
    assert plan is not None
    engine.complete(plan, plan.end)
    assert engine.kv.usage > 0
    assert len(engine.waiting) == 1
    engine.abort("a")
    assert a.finish_reason == "abort"
    assert not engine.running
    run(engine, plan.end)
    assert b.finish_reason == "length"
    assert engine.kv.num_free == engine.kv.num_blocks


def test_stop_string_across_token_boundaries_is_cut(tok: QwenTokenizer) -> None:
    engine = make_engine(tok)
    text = "Count: one two three four five"
    r = request(tok, "s", 10, 100, text=text, stop=["ee fo"])
    r.ignore_eos = False
    engine.add(r)
    run(engine)
    assert r.finish_reason == "stop"
    assert r.stop_reason == "ee fo"
    assert r.text == "Count: one two thr"


def test_streamed_deltas_hold_back_a_possible_stop_prefix(tok: QwenTokenizer) -> None:
    engine = make_engine(tok)
    r = request(tok, "d", 10, 100, text="one two three four five", stop=["four"])
    engine.add(r)
    now = 0.0
    streamed = ""
    while engine.has_work:
        plan = engine.schedule(now)
        assert plan is not None
        now = plan.end
        engine.complete(plan, now)
        delta, _ = r.take_delta()
        streamed += delta
        assert "fou" not in streamed  # never sent text that later turned out to be the stop string
    assert streamed == "one two three "


def test_eos_and_min_tokens(tok: QwenTokenizer) -> None:
    engine = make_engine(tok)
    r = Request("e", [1, 2, 3], max_tokens=100, plan_cycle=[5], eos_at=4, eos_token_id=tok.eos_token_id)
    m = Request(
        "m", [1, 2, 4], max_tokens=100, plan_cycle=[5], eos_at=4, min_tokens=9, eos_token_id=tok.eos_token_id
    )
    engine.add(r)
    engine.add(m)
    run(engine)
    assert (r.finish_reason, r.stop_reason, r.completion_tokens) == ("stop", None, 5)  # EOS is counted
    assert r.output_ids[-1] == tok.eos_token_id
    assert m.completion_tokens == 10


def test_stop_token_ids(tok: QwenTokenizer) -> None:
    engine = make_engine(tok)
    cycle = tok.encode("a b c ")
    r = Request("t", [1], max_tokens=50, plan_cycle=cycle, stop_token_ids=[cycle[2]], eos_token_id=0)
    engine.add(r)
    run(engine)
    assert (r.finish_reason, r.stop_reason, r.completion_tokens) == ("stop", cycle[2], 3)
    assert r.text == tok.decode(cycle[:2])


def test_max_model_len_ends_with_length(tok: QwenTokenizer) -> None:
    engine = make_engine(tok)
    r = request(tok, "L", 4090, 10_000)
    engine.add(r)
    run(engine)
    assert r.finish_reason == "length"
    assert len(r.prompt_ids) + r.completion_tokens == 4096


def test_step_time_model_and_seeded_noise(tok: QwenTokenizer) -> None:
    plans = []
    for _ in range(2):
        engine = make_engine(tok, noise=0.2, seed=7)
        for i in range(3):
            engine.add(request(tok, f"n{i}", 50, 2))
        plan = engine.schedule(0.0)
        assert plan is not None
        plans.append(plan.duration)
    assert plans[0] == plans[1]  # same seed, same step times
    quiet = make_engine(tok)
    for i in range(3):
        quiet.add(request(tok, f"n{i}", 50, 2))
    plan = quiet.schedule(0.0)
    assert plan is not None
    assert plan.duration == pytest.approx((5.0 + 0.1 * 150 + 0.5 * 3) / 1000)


def test_eos_point_is_deterministic_and_after_one_pass() -> None:
    a = eos_point([1, 2, 3], one_pass=10, mean_output_tokens=100, seed=0)
    assert a == eos_point([1, 2, 3], one_pass=10, mean_output_tokens=100, seed=0)
    assert 50 <= a <= 150
    assert eos_point([1, 2, 3], one_pass=400, mean_output_tokens=100, seed=0) == 400


async def test_a_stop_that_lands_as_a_kick_wakes_the_idle_loop_still_stops_it(tok: QwenTokenizer) -> None:
    """The idle loop waits for a kick with a timeout. Python 3.11's asyncio.wait_for there returned the
    kick to a task cancelled in that same turn, and the loop went back to waiting: stop() never ended."""
    loop = EngineLoop(make_engine(tok))
    loop.start()
    await asyncio.sleep(0.05)  # idle: waiting for its wake-up
    loop.kick()
    await asyncio.sleep(0)  # the wait completes; the cancel below comes before the loop resumes
    stopping = asyncio.ensure_future(loop.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5.0)
    assert stopping in done, "EngineLoop.stop() did not end: the cancel was lost"
