"""The request-path checks, each passing and failing (pure)."""

from __future__ import annotations

import pytest

from servedmodel.probe.checks import check_limits, check_stop, check_template, check_usage, family_of
from servedmodel.probe.metrics import WindowDelta

# token_strs of Qwen2.5's ChatML rendering (byte-level BPE: Ċ is a newline), as /tokenize returns them
SYSTEM_TURN = ["<|im_start|>", "system", "Ċ", "You", "Ġare", "Ġhelpful", "<|im_end|>", "Ċ"]
USER_TURN = ["<|im_start|>", "user", "Ċ", "Count", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
CHATML = "".join([*SYSTEM_TURN, *USER_TURN])
LLAMA3 = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>ĊĊCount<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>ĊĊ"
)


@pytest.mark.parametrize(
    ("names", "family"),
    [
        (("qwen", "Qwen/Qwen2.5-7B-Instruct"), "chatml"),
        (("my-model", "/models/Qwen3-8B"), "chatml"),
        (("meta-llama/Llama-3.1-8B-Instruct", None), "llama3"),
        (("ibm-granite/granite-3.3-8b-instruct", None), "granite"),
        (("mystery", None), None),
    ],
)
def test_family_from_name_or_root(names: tuple[str, str | None], family: str | None) -> None:
    assert family_of(*names) == family


def test_template_passes_with_markers_and_matching_count() -> None:
    c = check_template("chatml", CHATML, ["user"], 19, 19)
    assert (c.result, c.reason) == ("Pass", "PromptTokensMatch")


def test_template_fails_when_another_familys_template_renders() -> None:
    c = check_template("chatml", LLAMA3, ["user"], 12, 12)
    assert (c.result, c.reason) == ("Fail", "RoleMarkersMissing")
    assert "<|im_start|>user" in c.message


def test_template_fails_on_count_mismatch() -> None:
    c = check_template("chatml", CHATML, ["user"], 19, 23)
    assert (c.result, c.reason) == ("Fail", "PromptTokensMismatch")


def test_template_fails_when_tokenize_fails() -> None:
    c = check_template("chatml", None, ["user"], None, 19, tokenize_error="POST /tokenize: HTTP 500")
    assert (c.result, c.reason) == ("Fail", "TokenizeFailed")


def test_template_unknown_family_still_compares_counts() -> None:
    c = check_template(None, LLAMA3, ["user"], 12, 12)
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
    c = check_limits(enabled, mml, status, "maximum context length is 4096 tokens", error)
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
    c = check_stop(["five"], content, finish, stop_reason)
    assert (c.result, c.reason) == want


def test_stop_skipped_without_stop_strings() -> None:
    assert check_stop([], "x", "length", None).result == "Skipped"


def window(prompt: float, gen: float, done: float = 1) -> WindowDelta:
    return WindowDelta(
        counters={"request_success": done, "prompt_tokens": prompt, "generation_tokens": gen},
        phases_ms={},
        phase_counts={},
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
    c = check_usage(usage, chunks, 1, win, isolated)
    assert (c.result, c.reason) == want
