"""SSE decoding and stream timing on recorded-shaped vLLM 0.33 streams (pure)."""

from __future__ import annotations

import json

import pytest

from servedmodel.probe.bounds import too_deep
from servedmodel.probe.errors import (
    INVALID_ENCODING,
    MALFORMED_STREAM,
    RESPONSE_TOO_DEEP,
    RESPONSE_TOO_LARGE,
    ProbeFailure,
)
from servedmodel.probe.sse import (
    ClientFigures,
    SSEDecoder,
    StreamTiming,
    client_figures,
    delivery,
    percentile,
)


def chunk(delta: dict[str, object], finish: str | None = None, stop_reason: object = None) -> str:
    choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    doc = {
        "id": "chatcmpl-probe-1",
        "object": "chat.completion.chunk",
        "created": 1764441600,
        "model": "qwen",
        "choices": [choice],
    }
    return "data: " + json.dumps(doc) + "\n\n"


USAGE = (
    'data: {"id":"chatcmpl-probe-1","object":"chat.completion.chunk","created":1764441600,"model":"qwen",'
    '"choices":[],"usage":{"prompt_tokens":31,"total_tokens":35,"completion_tokens":4}}\n\n'
)
# The shape vLLM 0.33 streams with stream_options.include_usage: role chunk, content chunks, a finish
# chunk (with stop_reason), the usage chunk, [DONE].
RECORDED = (
    chunk({"role": "assistant", "content": ""})
    + chunk({"content": "one"})
    + chunk({"content": " two"})
    + chunk({"content": " three"})
    + chunk({"content": " four"})
    + chunk({"content": " "}, finish="stop", stop_reason="five")
    + USAGE
    + "data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 3, 7, 64, len(RECORDED)])
def test_decoder_reassembles_events_split_anywhere(size: int) -> None:
    dec = SSEDecoder()
    raw = RECORDED.encode()
    events: list[str] = []
    for i in range(0, len(raw), size):
        events.extend(dec.feed(raw[i : i + size]))
    events.extend(dec.close())
    assert len(events) == 8
    assert events[-1] == "[DONE]"
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "one"


def test_decoder_crlf_comments_and_multiline_data() -> None:
    dec = SSEDecoder()
    text = ': keep-alive\r\n\r\nevent: message\r\ndata: {"a":\r\ndata: 1}\r\n\r\n: ping\n\ndata: [DONE]'
    events = dec.feed(text.encode()) + dec.close()
    assert events == ['{"a":\n1}', "[DONE]"]


def timed(gaps_ms: list[float]) -> StreamTiming:
    """Feed RECORDED's events at sent=0, headers=2 ms, then the given gaps between events."""
    t = StreamTiming(sent_ns=0, headers_ns=2_000_000)
    dec = SSEDecoder()
    events = dec.feed(RECORDED.encode())
    now = 2_000_000
    for data, gap in zip(events, gaps_ms, strict=True):
        now += int(gap * 1e6)
        t.on_event(data, now)
    return t


def test_timing_ttft_tpot_itl_e2e() -> None:
    # role chunk at 12 ms, content at 12, 17, 22, 27 ms, finish chunk 32 ms, usage 32.5, [DONE] 33 ms
    t = timed([10, 0, 5, 5, 5, 5, 0.5, 0.5])
    f = client_figures(t)
    assert t.done
    assert t.content == "one two three four "
    assert t.finish_reason == "stop"
    assert t.stop_reason == "five"
    assert t.usage == {"prompt_tokens": 31, "total_tokens": 35, "completion_tokens": 4}
    assert f.headers_ms == pytest.approx(2.0)
    assert f.ttft_ms == pytest.approx(12.0)
    # five content chunks (the finish chunk carries " "): gaps 5, 5, 5, 5
    assert f.itl_ms == pytest.approx([5.0, 5.0, 5.0, 5.0])
    assert f.itl_p50_ms == pytest.approx(5.0)
    # vLLM TPOT: (last token - first token) / (completion_tokens - 1) = 20 / 3
    assert f.tpot_ms == pytest.approx(20.0 / 3)
    assert f.e2e_ms == pytest.approx(33.0)


def test_tpot_falls_back_to_chunk_count_without_usage() -> None:
    t = StreamTiming(sent_ns=0)
    for i, text in enumerate(["a", "b", "c"]):
        t.on_event(json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}), (i + 1) * 1_000_000)
    t.on_event("[DONE]", 5_000_000)
    f = client_figures(t)
    assert f.completion_tokens == 3
    assert f.tpot_ms == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ('{"choices": [{"delta": {"content": "x"', "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"id": "x"}', "no choices"),
        ('{"error": {"message": "engine died", "type": "InternalServerError"}}', "engine died"),
        ('{"choices": ["x"]}', "choice is not an object"),
    ],
)
def test_malformed_chunks_are_malformed_stream(data: str, fragment: str) -> None:
    t = StreamTiming(sent_ns=0)
    with pytest.raises(ProbeFailure) as exc:
        t.on_event(data, 1)
    assert exc.value.reason == MALFORMED_STREAM
    assert fragment in exc.value.message


def test_data_after_done_is_malformed() -> None:
    t = StreamTiming(sent_ns=0)
    t.on_event("[DONE]", 1)
    with pytest.raises(ProbeFailure):
        t.on_event('{"choices": []}', 2)


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [([], 50, None), ([3.0], 95, 3.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.5), ([*range(1, 101)], 95, 95.05)],
)
def test_percentile_matches_linear_interpolation(values: list[float], q: float, want: float | None) -> None:
    got = percentile([float(v) for v in values], q)
    assert got == (pytest.approx(want) if want is not None else None)


def feed(t: StreamTiming, events: list[tuple[float, str]]) -> StreamTiming:
    for at_ms, data in events:
        t.on_event(data, int(at_ms * 1e6))
    return t


def cont(delta: dict[str, object], completion: int, finish: str | None = None) -> str:
    """A chunk with continuous usage stats (every chunk says how many tokens so far)."""
    choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    usage = {"prompt_tokens": 31, "total_tokens": 31 + completion, "completion_tokens": completion}
    return json.dumps({"choices": [choice], "usage": usage})


def test_held_back_tokens_are_tokens() -> None:
    """vLLM with a stop string holds back its possible start: the chunk of such a token has empty text.
    It is still a token: TTFT is its chunk, not the first one with text."""
    t = feed(
        StreamTiming(sent_ns=0),
        [
            (10, json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
            (10, json.dumps({"choices": [{"index": 0, "delta": {"content": ""}}]})),  # 'one' held back
            (15, json.dumps({"choices": [{"index": 0, "delta": {"content": "one "}}]})),
            (20, json.dumps({"choices": [{"index": 0, "delta": {"content": "two "}}]})),
            (
                25,
                json.dumps(
                    {"choices": [{"index": 0, "delta": {"content": "th"}, "finish_reason": "length"}]}
                ),
            ),
            (26, "[DONE]"),
        ],
    )
    f = client_figures(t)
    assert t.token_ns == [10_000_000, 15_000_000, 20_000_000, 25_000_000]
    assert f.ttft_ms == pytest.approx(10.0)
    assert f.tpot_ms == pytest.approx(5.0)
    assert t.content == "one two th"


def test_finish_chunk_without_a_token_is_not_one() -> None:
    t = feed(
        StreamTiming(sent_ns=0),
        [
            (10, json.dumps({"choices": [{"index": 0, "delta": {"content": "a"}}]})),
            (20, json.dumps({"choices": [{"index": 0, "delta": {"content": "b"}}]})),
            (21, json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})),
        ],
    )
    assert len(t.token_ns) == 2


def test_continuous_usage_counts_tokens_per_chunk() -> None:
    """Two tokens a chunk: ITL gives one sample per token (gap / 2), TPOT spans the tokens after the first
    chunk, and the role chunk (0 tokens) is no token."""
    t = feed(
        StreamTiming(sent_ns=0),
        [
            (8, cont({"role": "assistant", "content": ""}, 0)),
            (8, cont({"content": "a b"}, 2)),
            (18, cont({"content": " c d"}, 4)),
            (28, cont({"content": " e f"}, 6, finish="length")),
            (
                28,
                json.dumps(
                    {
                        "choices": [],
                        "usage": {"prompt_tokens": 31, "total_tokens": 37, "completion_tokens": 6},
                    }
                ),
            ),
            (29, "[DONE]"),
        ],
    )
    f = client_figures(t)
    assert t.chunk_tokens == [2, 2, 2]
    assert f.completion_tokens == 6
    assert f.itl_ms == pytest.approx([5.0, 5.0, 5.0, 5.0])
    assert f.tpot_ms == pytest.approx(20.0 / 4)
    assert f.ttft_ms == pytest.approx(8.0)


def test_cached_tokens_from_prompt_tokens_details() -> None:
    t = StreamTiming(sent_ns=0)
    usage = {
        "prompt_tokens": 46,
        "total_tokens": 50,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    t.on_event(json.dumps({"choices": [], "usage": usage}), 1)
    assert t.usage is not None
    assert t.usage["cached_tokens"] == 32
    assert client_figures(t).cached_tokens == 32


def lumped(gaps_ms: list[float]) -> ClientFigures:
    t = StreamTiming(sent_ns=0)
    now = 20.0
    for i, gap in enumerate([0.0, *gaps_ms]):
        now += gap
        t.on_event(json.dumps({"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}), int(now * 1e6))
    t.on_event("[DONE]", int(now * 1e6))
    return client_figures(t)


def test_delivery_flags_a_lump_and_passes_a_live_stream() -> None:
    one_lump = delivery(lumped([0.01] * 15))
    assert one_lump.coalesced
    assert one_lump.bursts == 1
    # first token alone, then the rest at once: still lumps
    assert delivery(lumped([30.0, *[0.01] * 14])).coalesced
    live = delivery(lumped([6.0] * 15))
    assert not live.coalesced
    assert live.bursts == 16
    # the server's own decode time exposes a stream whose client span is far too short
    assert delivery(lumped([0.5] * 15), server_decode_ms=90.0, server_tpot_ms=6.0).coalesced
    assert not delivery(lumped([6.0] * 15), server_decode_ms=90.0, server_tpot_ms=6.0).coalesced
    assert "16 tokens in 16 chunks" in live.describe()


def feed_in_pieces(d: SSEDecoder, data: bytes, piece: int) -> None:
    for i in range(0, len(data), piece):
        d.feed(data[i : i + piece])


def test_decoder_refuses_a_line_over_its_cap_however_it_is_split() -> None:
    """A line without end is refused once it passes the cap (not after the whole stream), whether it
    comes in one read or a byte at a time; short lines around it decode as before."""
    for piece in (70_000, 4096, 1):
        d = SSEDecoder(max_line=64 * 1024)
        assert d.feed(b'data: {"a":1}\n\n') == ['{"a":1}']
        line = b"data: " + b"x" * 70_000
        with pytest.raises(ProbeFailure) as refused:
            feed_in_pieces(d, line, piece)
        assert refused.value.reason == RESPONSE_TOO_LARGE
        assert len(d._buf) <= 64 * 1024 + piece  # never held more than the cap and one read


def test_decoder_scans_each_byte_once() -> None:
    """Linear: a 60 KiB line fed a byte at a time is searched for a newline from where the last search
    ended, not from its start each time (the old decoder rescanned, quadratic without newlines)."""
    d = SSEDecoder()
    scanned = 0
    for _ in range(60_000):
        d.feed(b"x")
        scanned = max(scanned, d._scanned)
    assert scanned == 60_000  # the search offset advanced with the buffer
    assert d.feed(b"\n") == []  # a field without a name: nothing, and the buffer is empty again
    assert len(d._buf) == 0


def test_events_not_utf8_or_nested_too_deep_have_reasons_of_their_own() -> None:
    d = SSEDecoder()
    with pytest.raises(ProbeFailure) as bad:
        d.feed(b'data: {"choices":[{"delta":{"content":"\xff\xfe"}}]}\n\n')
    assert bad.value.reason == INVALID_ENCODING
    t = StreamTiming(sent_ns=0)
    with pytest.raises(ProbeFailure) as deep:
        t.on_event("[" * 100_000 + "]" * 100_000, 1)
    assert deep.value.reason == RESPONSE_TOO_DEEP


@pytest.mark.parametrize(
    ("body", "deep"),
    [
        (b"[" * 64 + b"]" * 64, False),
        (b"[" * 65 + b"]" * 65, True),
        (b'{"a":"' + b"[" * 500 + b'"}', False),  # brackets inside a string do not nest
        (b'{"a":[' + b"{}," * 1000 + b"{}]}", False),  # many, shallow
        (b"[" * 100_000, False),  # unbalanced: left to the decoder (MalformedResponse)
        (b"[" * 100_000 + b"]" * 100_000, True),
    ],
)
def test_json_depth_scan(body: bytes, deep: bool) -> None:
    assert too_deep(body) is deep
