"""Pure: the request path of one probe as a waterfall (door -> queue -> prefill -> decode -> stop),
client side from the stream's timestamps, server side from the metrics window."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from servedmodel.api.probe import ProbeStatus

from .client import ProbeOutcome
from .report import handoff_ms, publishable_figures


@dataclass(frozen=True)
class Row:
    phase: str
    client_ms: float | None
    server_ms: float | None
    what: str


def waterfall(out: ProbeOutcome) -> list[Row]:
    t = out.timing
    f = publishable_figures(out)
    ph = out.window.phases_ms if out.window is not None and not out.window.reset else {}
    ms = 1e-6

    def span(a: int | None, b: int | None) -> float | None:
        return (b - a) * ms if a is not None and b is not None else None

    headers = span(t.sent_ns, t.headers_ns) if t else None
    to_first = span(t.headers_ns, t.first_token_ns) if t else None
    decode = span(t.first_token_ns, t.last_token_ns) if t else None
    stop = span(t.last_token_ns, t.done_ns) if t else None
    return [
        Row("door", headers, None, "request sent -> response headers (validate, template, tokenize, admit)"),
        Row("handoff", None, handoff_ms(ph), "API server -> engine (server TTFT - queue - prefill)"),
        Row("queue", None, ph.get("queue"), "arrival -> scheduled (server); client sees it inside prefill"),
        Row(
            "prefill",
            to_first,
            ph.get("prefill"),
            "client: headers -> first token; server: scheduled -> first",
        ),
        Row("decode", decode, ph.get("decode"), "first -> last token"),
        Row("stop", stop, None, "last token -> [DONE]"),
        Row("TTFT", f.ttft_ms if f else None, ph.get("ttft"), "request sent -> first content token"),
        Row("TPOT", f.tpot_ms if f else None, ph.get("tpot"), "(e2e - TTFT)/(tokens - 1), vLLM's definition"),
        Row("ITL p50", f.itl_p50_ms if f else None, None, "median gap between streamed tokens"),
        Row("ITL p95", f.itl_p95_ms if f else None, None, "95th percentile gap between streamed tokens"),
        Row("e2e", f.e2e_ms if f else None, ph.get("e2e"), "request sent -> [DONE]"),
    ]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render_table(out: ProbeOutcome, status: ProbeStatus) -> str:
    lines: list[str] = []
    lines.append(f"endpoint  {out.endpoint}")
    lines.append(f"model     {out.model or '-'}   max_model_len {out.max_model_len or '-'}")
    lines.append(f"result    {status.result} ({status.reason})")
    if status.message:
        lines.append(f"message   {status.message}")
    lines.append("")
    lines.append(f"{'phase':<9} {'client ms':>10} {'server ms':>10}  what")
    for r in waterfall(out):
        lines.append(f"{r.phase:<9} {_fmt(r.client_ms):>10} {_fmt(r.server_ms):>10}  {r.what}")
    srv = status.server
    if srv is not None:
        iso = (
            "isolated (only the probe finished in the window)" if srv.isolated else "shared window (averages)"
        )
        lines.append(f"server figures: {srv.requests} request(s) finished in the window, {iso}")
    if status.usage is not None:
        u = status.usage
        lines.append(
            f"usage     prompt {u.prompt_tokens}  completion {u.completion_tokens}  total {u.total_tokens}"
            f"   finish_reason {status.finish_reason}"
            + (f"   cached prompt {u.cached_prompt_tokens}" if u.cached_prompt_tokens is not None else "")
        )
    if status.scheduler is not None:
        s = status.scheduler
        lines.append(f"scheduler running {s.running}  waiting {s.waiting}  KV cache usage {s.kv_cache_usage}")
    if status.checks is not None:
        lines.append("")
        lines.append(f"{'check':<10} {'result':<8} {'reason':<24} message")
        for name in ("template", "limits", "stop", "usage", "streaming"):
            c = getattr(status.checks, name)
            if c is not None:
                lines.append(f"{name:<10} {c.result:<8} {c.reason:<24} {c.message}")
    return "\n".join(lines)


def as_json(out: ProbeOutcome, status: ProbeStatus) -> dict[str, Any]:
    return {
        "status": status.model_dump(by_alias=True, exclude_none=True),
        "waterfall": [asdict(r) for r in waterfall(out)],
    }
