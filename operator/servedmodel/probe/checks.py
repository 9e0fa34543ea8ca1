"""Pure: the request-path checks (template, limits, stop, usage), each Pass/Fail/Skipped with a reason."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from servedmodel.api.families import ChatFamily
from servedmodel.api.probe import ProbeCheck

from .metrics import WindowDelta
from .sse import LUMP_MIN_TOKENS, Delivery


def pass_(reason: str, message: str = "") -> ProbeCheck:
    return ProbeCheck(result="Pass", reason=reason, message=message)


def fail(reason: str, message: str = "") -> ProbeCheck:
    return ProbeCheck(result="Fail", reason=reason, message=message)


def skipped(reason: str, message: str = "") -> ProbeCheck:
    return ProbeCheck(result="Skipped", reason=reason, message=message)


def check_template(
    family: ChatFamily | None,
    rendered: str | None,
    roles: Sequence[str],
    tokenize_count: int | None,
    usage_prompt_tokens: int | None,
    *,
    tokenize_error: str | None = None,
) -> ProbeCheck:
    """The rendered prompt carries the family's role markers for every message and the generation
    prompt, and /tokenize's count equals usage.prompt_tokens."""
    if tokenize_error is not None or tokenize_count is None:
        return fail("TokenizeFailed", tokenize_error or "/tokenize gave no count")
    notes: list[str] = []
    if family is None:
        notes.append("model family unknown: role markers not checked")
    elif rendered is None:
        notes.append("no token strings: role markers not checked")
    else:
        missing = [m for m in family.markers(roles) if m not in rendered]
        if missing:
            return fail(
                "RoleMarkersMissing",
                f"{family.name} template expected; rendered prompt lacks "
                + ", ".join(repr(m) for m in missing),
            )
        notes.append(f"{family.name} role markers present")
    if usage_prompt_tokens is None:
        return pass_("RoleMarkersPresent", "; ".join([*notes, "no usage to compare the token count with"]))
    if usage_prompt_tokens != tokenize_count:
        return fail(
            "PromptTokensMismatch",
            f"/tokenize counted {tokenize_count} tokens, usage.prompt_tokens is {usage_prompt_tokens}",
        )
    return pass_("PromptTokensMatch", "; ".join([*notes, f"{tokenize_count} prompt tokens on both"]))


def check_limits(
    enabled: bool, max_model_len: int | None, status: int | None, message: str, error: str | None = None
) -> ProbeCheck:
    """A prompt longer than max_model_len must get vLLM's 400 at the door."""
    if not enabled:
        return skipped("Disabled", "spec.probe.checkLimits is false")
    if max_model_len is None:
        return skipped("MaxModelLenUnknown", "/v1/models did not report max_model_len")
    if error is not None or status is None:
        return fail("LimitRequestFailed", error or "no answer")
    if status == 400:
        return pass_("OversizedPromptRejected", f"400: {message[:200]}")
    if 200 <= status < 300:
        return fail("LimitNotEnforced", f"a prompt over max_model_len={max_model_len} tokens got {status}")
    return fail("UnexpectedStatus", f"expected 400, got {status}: {message[:200]}")


def pick_stop_string(content: str, avoid: Sequence[str] = ()) -> tuple[str, int] | None:
    """A stop string learned from the model's own output: a short piece of `content` that first occurs
    at offset > 0 (so some text comes before it), without whitespace at its ends (detokenizers differ
    there) or U+FFFD (a token split inside a UTF-8 character). Preferably past the middle, so the
    second request ends clearly early. None when the output is too short to learn from."""
    n = len(content)
    starts = [*range(max(1, n // 2), n), *range(n // 2 - 1, 0, -1)]
    for size in (6, 4, 3, 2, 1):
        for i in starts:
            cand = content[i : i + size]
            if len(cand) != size or cand != cand.strip() or "\ufffd" in cand:
                continue
            if content.find(cand) != i or any(cand in a or a in cand for a in avoid if a):
                continue
            return cand, i
    return None


@dataclass(frozen=True)
class LearnedStop:
    """The model-agnostic stop test: the same request again (temperature 0, seeded) with a stop string
    taken from the first answer; the server must end there with finish_reason stop."""

    stop: str | None  # None: nothing to learn from (output too short)
    offset: int = 0  # where `stop` starts in the first answer
    first: str = ""  # the first answer
    content: str = ""  # the second answer
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    completion_tokens: int | None = None
    first_tokens: int | None = None
    error: str | None = None


def check_stop(
    stop: Sequence[str],
    content: str,
    finish_reason: str | None,
    stop_reason: str | int | None,
    learned: LearnedStop | None = None,
) -> ProbeCheck:
    """The server honours stop strings. Proof either way: the probe's own stop string ended the
    answer (stop_reason names it, the string is absent), or, when the model never says it (dummy
    weights, a base model), the learned stop did (see LearnedStop). A stop string present in the
    output fails."""
    if not stop:
        return skipped("NoStopString", "spec.probe.stop is empty")
    present = [s for s in stop if s in content]
    if present:
        return fail(
            "StopIgnored",
            f"stop string {present[0]!r} appears in the output; finish_reason {finish_reason!r}",
        )
    if finish_reason == "stop" and stop_reason in stop:
        return pass_("StoppedAtStop", f"finish_reason stop (stop_reason {stop_reason!r})")
    if learned is None:
        if finish_reason == "stop":
            how = f"stop_reason {stop_reason!r}" if stop_reason is not None else "end of sequence"
            return pass_("StoppedAtStop", f"finish_reason stop ({how})")
        return fail("StopNotReached", f"finish_reason {finish_reason!r} before any stop string was generated")
    return _check_learned(learned)


def _check_learned(ls: LearnedStop) -> ProbeCheck:
    if ls.error is not None:
        return fail("StopRequestFailed", f"request with the learned stop string: {ls.error}")
    if ls.stop is None:
        return skipped("OutputTooShort", f"no stop string to learn from the output {ls.first[:40]!r}")
    s = ls.stop
    said = f"learned stop {s!r} (offset {ls.offset} of the model's own answer at temperature 0)"
    if ls.finish_reason == "stop" and ls.stop_reason == s:
        tokens = ""
        if ls.completion_tokens is not None and ls.first_tokens is not None:
            tokens = f", {ls.completion_tokens} of {ls.first_tokens} tokens"
        return pass_("StoppedAtLearnedStop", f"{said}: finish_reason stop, stop_reason {s!r}{tokens}")
    if s in ls.content:
        return fail("StopIgnored", f"{said} appears in the answer; finish_reason {ls.finish_reason!r}")
    common = min(len(ls.content), ls.offset)
    if ls.content[:common] != ls.first[:common]:
        return skipped(
            "OutputNotRepeatable",
            f"{said}: the same request gave another answer ({ls.content[:40]!r}): stop not judged",
        )
    return fail(
        "StopNotHonoured",
        f"{said}: finish_reason {ls.finish_reason!r}, stop_reason {ls.stop_reason!r}",
    )


def check_streaming(d: Delivery) -> ProbeCheck:
    """Tokens arrived as they were generated, not in one lump (then TTFT and TPOT are not real)."""
    if d.tokens < LUMP_MIN_TOKENS:
        return skipped("TooFewTokens", d.describe())
    if d.coalesced:
        return fail(
            "CoalescedStream",
            f"stream arrived in lumps: {d.describe()}; client TTFT, TPOT and ITL not written",
        )
    several = f"; {d.tokens - d.chunks} token(s) shared a chunk" if d.chunks < d.tokens else ""
    return pass_("TokensStreamed", d.describe() + several)


def check_usage(
    usage: Mapping[str, int] | None,
    token_chunks: int,
    requests: int,
    window: WindowDelta | None,
    isolated: bool | None,
    in_flight: bool = False,
) -> ProbeCheck:
    """Usage present and adding up; the counters' deltas equal it when the window is isolated
    (ingredients in: prompt tokens; bites out: generated tokens), and cover it otherwise. `in_flight`:
    requests still ran or waited when the window closed: no other request finished in it, but one that
    had not yet finished may have moved the counters (tokens count as they are made), so more than
    usage is no mismatch then."""
    if usage is None:
        return fail("UsageMissing", "no usage chunk despite stream_options.include_usage")
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    if p is None or c is None or t is None:
        return fail("UsageIncomplete", f"usage lacks fields: {dict(usage)}")
    if p + c != t:
        return fail("UsageInconsistent", f"prompt_tokens {p} + completion_tokens {c} != total_tokens {t}")
    if c < token_chunks:
        return fail("UsageInconsistent", f"completion_tokens {c} < {token_chunks} token chunks received")
    if window is None or window.reset:
        return pass_("UsageConsistent", "usage adds up; counters not compared (no metrics window)")
    dp, dg = window.counters.get("prompt_tokens"), window.counters.get("generation_tokens")
    if dp is None or dg is None:
        return pass_("UsageConsistent", "usage adds up; token counters not exported")
    want_p, want_g = p * requests, c * requests
    if isolated and not (in_flight and dp >= want_p and dg >= want_g):
        if round(dp) != want_p or round(dg) != want_g:
            return fail(
                "CountersMismatch",
                f"isolated window: counters moved prompt +{dp:g} generation +{dg:g}, "
                f"usage says {want_p} and {want_g}",
            )
        return pass_("CountersMatch", f"counters moved prompt +{dp:g} generation +{dg:g}, as usage says")
    if dp < want_p or dg < want_g:
        return fail(
            "CountersMismatch",
            f"counters moved prompt +{dp:g} generation +{dg:g}, less than usage's {want_p} and {want_g}",
        )
    return pass_("UsageConsistent", "usage adds up; window shared with other traffic, counters cover it")
