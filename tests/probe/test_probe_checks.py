"""The request-path checks, each passing and failing (pure)."""

from __future__ import annotations

import pytest

from servedmodel.api import families
from servedmodel.probe import checks
from servedmodel.probe.checks import LearnedStop
from servedmodel.probe.metrics import WindowDelta
from servedmodel.probe.sse import Delivery

# token_strs of Qwen2.5's ChatML rendering (byte-level BPE: Ċ is a newline), as /tokenize returns them
SYSTEM_TURN = ["<|im_start|>", "system", "Ċ", "You", "Ġare", "Ġhelpful", "<|im_end|>", "Ċ"]
USER_TURN = ["<|im_start|>", "user", "Ċ", "Count", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
CHATML = "".join([*SYSTEM_TURN, *USER_TURN])
LLAMA3 = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>ĊĊCount<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>ĊĊ"
)


# The same system + user conversation as other families' templates render it (token_strs joined).
BAR = "\uff5c"  # DeepSeek's full-width bar
RENDERED = {
    "mistral": "<s>[INST]▁You▁are▁helpful<0x0A><0x0A>Count[/INST]",  # system folded into the user turn
    "deepseek": f"<{BAR}begin▁of▁sentence{BAR}>You▁are▁helpful<{BAR}User{BAR}>Count<{BAR}Assistant{BAR}>",
    "gemma": "<bos><start_of_turn>user\nYou▁are▁helpful\n\nCount<end_of_turn>\n<start_of_turn>model\n",
    "chatml": CHATML,
}
BY_NAME = {f.name: f for f in families.FAMILIES}
CHATML_FAMILY = BY_NAME["chatml"]


@pytest.mark.parametrize(
    ("names", "family"),
    [
        (("qwen", "Qwen/Qwen2.5-7B-Instruct"), "chatml"),
        (("my-model", "/models/Qwen3-8B"), "chatml"),
        (("meta-llama/Llama-3.1-8B-Instruct", None), "llama3"),
        (("ibm-granite/granite-3.3-8b-instruct", None), "granite"),
        (("r1", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"), "deepseek"),  # DeepSeek's template, not Qwen's
        (("mistralai/Mistral-7B-Instruct-v0.3", None), "mistral"),
        (("google/gemma-3-4b-it", None), "gemma"),
        (("mystery", None), None),
    ],
)
def test_family_from_name_or_root(names: tuple[str, str | None], family: str | None) -> None:
    found = families.family_of(*names)
    assert (found.name if found is not None else None) == family


@pytest.mark.parametrize("family", sorted(RENDERED))
def test_each_familys_own_rendering_passes_and_the_others_fail(family: str) -> None:
    """Every family's markers are found in its own template's rendering of a system + user conversation
    (roles without a marker of their own, like Mistral's and Gemma's system, are not asked for), and
    in no other family's."""
    own = checks.check_template(BY_NAME[family], RENDERED[family], ["system", "user"], 9, 9)
    assert (own.result, own.reason) == ("Pass", "PromptTokensMatch"), own.message
    for other, text in RENDERED.items():
        if other != family:
            c = checks.check_template(BY_NAME[family], text, ["system", "user"], 9, 9)
            assert (c.result, c.reason) == ("Fail", "RoleMarkersMissing"), (family, other)


def test_template_passes_with_markers_and_matching_count() -> None:
    c = checks.check_template(CHATML_FAMILY, CHATML, ["user"], 19, 19)
    assert (c.result, c.reason) == ("Pass", "PromptTokensMatch")


def test_template_fails_when_another_familys_template_renders() -> None:
    c = checks.check_template(CHATML_FAMILY, LLAMA3, ["user"], 12, 12)
    assert (c.result, c.reason) == ("Fail", "RoleMarkersMissing")
    assert "<|im_start|>user" in c.message


def test_template_fails_on_count_mismatch() -> None:
    c = checks.check_template(CHATML_FAMILY, CHATML, ["user"], 19, 23)
    assert (c.result, c.reason) == ("Fail", "PromptTokensMismatch")


def test_template_fails_when_tokenize_fails() -> None:
    c = checks.check_template(
        CHATML_FAMILY, None, ["user"], None, 19, tokenize_error="POST /tokenize: HTTP 500"
    )
    assert (c.result, c.reason) == ("Fail", "TokenizeFailed")


def test_template_unknown_family_still_compares_counts() -> None:
    c = checks.check_template(None, LLAMA3, ["user"], 12, 12)
    assert c.result == "Pass"
    assert "unknown" in c.message


@pytest.mark.parametrize(
    ("enabled", "mml", "status", "error", "want"),
    [
        (True, 4096, 400, None, ("Pass", "OversizedPromptRejected")),
        (True, 4096, 200, None, ("Fail", "LimitNotEnforced")),
        (True, 4096, 500, None, ("Fail", "UnexpectedStatus")),
        (True, 4096, None, "connection refused", ("Fail", "LimitRequestFailed")),
        (True, None, None, None, ("Skipped", "MaxModelLenUnknown")),
        (False, 4096, None, None, ("Skipped", "Disabled")),
    ],
)
def test_limits(
    enabled: bool, mml: int | None, status: int | None, error: str | None, want: tuple[str, str]
) -> None:
    c = checks.check_limits(enabled, mml, status, "maximum context length is 4096 tokens", error)
    assert (c.result, c.reason) == want


@pytest.mark.parametrize(
    ("content", "finish", "stop_reason", "want"),
    [
        ("one two three four ", "stop", "five", ("Pass", "StoppedAtStop")),
        ("one two", "stop", None, ("Pass", "StoppedAtStop")),  # EOS first: still a clean stop
        ("one two three four five six", "length", None, ("Fail", "StopIgnored")),
        ("one two three four five", "stop", None, ("Fail", "StopIgnored")),
        ("one two three", "length", None, ("Fail", "StopNotReached")),
    ],
)
def test_stop(content: str, finish: str, stop_reason: str | None, want: tuple[str, str]) -> None:
    c = checks.check_stop(["five"], content, finish, stop_reason)
    assert (c.result, c.reason) == want


def test_stop_skipped_without_stop_strings() -> None:
    assert checks.check_stop([], "x", "length", None).result == "Skipped"


@pytest.mark.parametrize(
    "content",
    ["eg  Rout tokenizer 随机 glyph salad zq", "aaaa aaaa aaaa bbbb", "x y", "[probe 12345678] Repeat"],
)
def test_picked_stop_string_first_occurs_where_picked(content: str) -> None:
    picked = checks.pick_stop_string(content)
    assert picked is not None
    stop, offset = picked
    assert offset > 0
    assert content.find(stop) == offset
    assert stop == stop.strip()


def test_nothing_to_learn_from_a_tiny_or_blank_answer() -> None:
    assert checks.pick_stop_string("a") is None
    assert checks.pick_stop_string("   ") is None
    assert checks.pick_stop_string("\ufffd\ufffd\ufffd") is None


def test_picked_stop_avoids_the_probes_own_stop_strings() -> None:
    picked = checks.pick_stop_string("one two three four", avoid=["four", "three"])
    assert picked is not None
    assert "four" not in picked[0]
    assert "three" not in picked[0]


FIRST = "ab cd ef gh ij"


@pytest.mark.parametrize(
    ("learned", "want"),
    [
        (LearnedStop("ef", 6, FIRST, "ab cd ", "stop", "ef", 3, 5), ("Pass", "StoppedAtLearnedStop")),
        (LearnedStop("ef", 6, FIRST, FIRST, "length", None, 5, 5), ("Fail", "StopIgnored")),
        (LearnedStop("ef", 6, FIRST, "ab cd ", "stop", None, 3, 5), ("Fail", "StopNotHonoured")),
        (LearnedStop("ef", 6, FIRST, "zz yy", "length", None, 3, 5), ("Skipped", "OutputNotRepeatable")),
        (LearnedStop(None, first="a"), ("Skipped", "OutputTooShort")),
        (LearnedStop("ef", 6, FIRST, error="HTTP 500: boom"), ("Fail", "StopRequestFailed")),
    ],
)
def test_learned_stop(learned: LearnedStop, want: tuple[str, str]) -> None:
    """The model never says the probe's stop string (dummy weights): the verdict rests on the stop
    string learned from its own answer."""
    c = checks.check_stop(["five"], FIRST, "length", None, learned)
    assert (c.result, c.reason) == want


def test_own_stop_reached_needs_no_learning() -> None:
    learned = LearnedStop("ef", 6, FIRST, FIRST, "length", None)
    c = checks.check_stop(["five"], "one two ", "stop", "five", learned)
    assert (c.result, c.reason) == ("Pass", "StoppedAtStop")


def test_streaming_check() -> None:
    live = Delivery(False, 16, 16, 16, 90.0, 90.2, 6.0)
    assert checks.check_streaming(live).result == "Pass"
    shared = checks.check_streaming(Delivery(False, 16, 8, 8, 90.0, None, None))
    assert (shared.result, shared.reason) == ("Pass", "TokensStreamed")
    assert "8 token(s) shared a chunk" in shared.message
    lump = checks.check_streaming(Delivery(True, 16, 16, 1, 0.1, 90.0, 6.0))
    assert (lump.result, lump.reason) == ("Fail", "CoalescedStream")
    assert "server decode 90.00 ms" in lump.message
    assert checks.check_streaming(Delivery(False, 1, 1, 1, None, None, None)).result == "Skipped"


def window(prompt: float, gen: float, done: float = 1) -> WindowDelta:
    return WindowDelta(
        counters={"request_success": done, "prompt_tokens": prompt, "generation_tokens": gen},
        phases_ms={},
        reset=False,
    )


USAGE = {"prompt_tokens": 31, "completion_tokens": 4, "total_tokens": 35}


@pytest.mark.parametrize(
    ("usage", "chunks", "win", "isolated", "want"),
    [
        (USAGE, 4, window(31, 4), True, ("Pass", "CountersMatch")),
        (USAGE, 4, window(30, 4), True, ("Fail", "CountersMismatch")),
        (USAGE, 4, window(131, 54, 3), False, ("Pass", "UsageConsistent")),
        (USAGE, 4, window(20, 54, 3), False, ("Fail", "CountersMismatch")),
        (USAGE, 4, None, None, ("Pass", "UsageConsistent")),
        (None, 4, None, None, ("Fail", "UsageMissing")),
        (
            {"prompt_tokens": 31, "completion_tokens": 4, "total_tokens": 36},
            4,
            None,
            None,
            ("Fail", "UsageInconsistent"),
        ),
        (USAGE, 6, None, None, ("Fail", "UsageInconsistent")),
        ({"prompt_tokens": 31}, 4, None, None, ("Fail", "UsageIncomplete")),
    ],
)
def test_usage(
    usage: dict[str, int] | None,
    chunks: int,
    win: WindowDelta | None,
    isolated: bool | None,
    want: tuple[str, str],
) -> None:
    c = checks.check_usage(usage, chunks, 1, win, isolated)
    assert (c.result, c.reason) == want


def test_usage_in_a_window_another_request_was_still_in_flight_at_its_end() -> None:
    """No other request finished in the window (isolated by the success counter), but one still ran at
    its end and had already been prefilled: counters above usage are that request's, not a mismatch
    (two pods' probes on one engine in tests/cluster/test_rollout_gate.py failed here); below usage, or
    above it with nothing in flight, still is one."""
    c = checks.check_usage(USAGE, 4, 1, window(62, 5), True, in_flight=True)
    assert (c.result, c.reason) == ("Pass", "UsageConsistent")
    c = checks.check_usage(USAGE, 4, 1, window(62, 5), True)
    assert (c.result, c.reason) == ("Fail", "CountersMismatch")
    c = checks.check_usage(USAGE, 4, 1, window(30, 4), True, in_flight=True)
    assert (c.result, c.reason) == ("Fail", "CountersMismatch")
