"""`servedmodel probe URL`: a one-shot probe of any OpenAI-compatible vLLM endpoint.

Prints the waterfall door -> queue -> prefill -> decode -> stop with client and server times and the
request-path checks, as a table or as JSON. Exit code: 0 serving and every check passed or skipped,
1 the probe failed, 2 serving but a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from servedmodel.api.probe import ProbeMessage, ProbeSpec

from .client import MetricsReader, PodMetrics, probe_client, run_probe
from .endpoints import normalise_base_url, resolve_external
from .prometheus import PrometheusMetrics
from .report import build_status
from .waterfall import as_json, render_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url", help="base URL of the engine, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)"
    )
    parser.add_argument(
        "--model", help="served model name to probe (default: the first listed by /v1/models)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--api-key-env", metavar="VAR", help="environment variable holding the API key (never printed)"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="overall limit, seconds (default 30)")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="connect limit, seconds")
    parser.add_argument("--first-byte-timeout", type=float, default=20.0, help="first-byte limit, seconds")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_completion_tokens (default 16)")
    parser.add_argument("--message", help="user message of the probe (default: words that hit the stop)")
    parser.add_argument("--stop", action="append", help="stop string (repeatable; default 'five')")
    parser.add_argument("--no-check-limits", action="store_true", help="skip the oversized-prompt check")
    parser.add_argument("--no-metrics", action="store_true", help="do not read /metrics")
    parser.add_argument(
        "--metrics-url",
        action="append",
        help="engine base URL to scrape (repeatable; default the URL itself)",
    )
    parser.add_argument("--prometheus-url", help="read engine figures from this Prometheus instead")
    parser.add_argument("--namespace", help="namespace label to filter Prometheus series by")
    parser.add_argument(
        "--bearer-token-env", metavar="VAR", help="environment variable with Prometheus' token"
    )


def spec_from_args(args: argparse.Namespace) -> ProbeSpec:
    fields: dict[str, object] = {
        "timeout": args.timeout,
        "connect_timeout": args.connect_timeout,
        "first_byte_timeout": args.first_byte_timeout,
        "max_tokens": args.max_tokens,
        "check_limits": not args.no_check_limits,
    }
    if args.message:
        fields["messages"] = [ProbeMessage(role="user", content=args.message)]
    if args.stop is not None:
        fields["stop"] = [s for s in args.stop if s]
    return ProbeSpec.model_validate(fields)


async def probe_once(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    target = resolve_external(args.url)
    async with probe_client(spec) as client:
        metrics: MetricsReader | None = None
        if args.prometheus_url:
            token = os.environ.get(args.bearer_token_env) if args.bearer_token_env else None
            metrics = PrometheusMetrics(
                client,
                args.prometheus_url,
                model=args.model,
                namespace=args.namespace,
                bearer_token=token,
                settle_timeout_s=spec.timeout,
            )
        elif not args.no_metrics:
            urls = [normalise_base_url(u) for u in (args.metrics_url or [target.base_url])]
            metrics = PodMetrics(client, urls, args.model)
        out = await run_probe(client, target, spec, model=args.model, api_key=api_key, metrics=metrics)
    status = build_status(out, spec, None)
    if args.json:
        print(json.dumps(as_json(out, status), indent=2))
    else:
        print(render_table(out, status))
    if not out.ok:
        return 1
    failed = any(c.result == "Fail" for c in out.checks.values())
    return 2 if failed else 0


def main(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(probe_once(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
