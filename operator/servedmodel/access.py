"""Pure: what a namespace user may make the operator do with a Secret, and where the operator may connect.

The operator is one process serving every namespace, with its own network position and (where a
namespace grants it) read access to that namespace's Secrets. Two rules keep a tenant from using it as
a deputy (docs/operations.md, "Security model"):

- **Secrets** — the operator uses a Secret's value for a ServedModel only if the Secret's annotation
  ``inference.servedmodel.io/allowed-servedmodels`` lists that ServedModel's name (comma-separated) or
  is ``*``. The annotation is set by whoever owns the Secret; a ServedModel's author merely naming the
  Secret is not consent. Applies to spec.engine.apiKeySecretRef and
  spec.probe.metricsSource.prometheus.bearerTokenSecretRef.
- **Outbound targets** — an external endpoint (spec.endpoint) and a Prometheus URL must be http(s),
  carry no credentials, query or fragment, and name a host the operator's allow-list admits
  (SERVEDMODEL_ALLOWED_TARGETS: exact hosts, ``*.suffix`` wildcards, CIDRs for IP literals; default the
  in-cluster Service names ``*.svc`` and ``*.svc.cluster.local``). An endpoint's path is its base: none,
  ``/`` or ``/v1`` (the probe adds the OpenAI routes itself). Host names are not resolved here: a CIDR
  admits only an IP literal, so a name cannot be pointed at an address the list did not admit.

Each refusal is a (reason, message) that names the Secret or the field and the rule, and never holds a
Secret's value.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

ALLOW_ANNOTATION: Final = "inference.servedmodel.io/allowed-servedmodels"
DEFAULT_ALLOWED_TARGETS: Final = "*.svc,*.svc.cluster.local"

# Reasons (status.probe.reason, the Serving condition).
SECRET_NOT_ALLOWED: Final = "SecretNotAllowed"
TARGET_NOT_ALLOWED: Final = "TargetNotAllowed"
INSECURE_TLS_NOT_ALLOWED: Final = "InsecureTLSNotAllowed"

# An external endpoint's base path: the probe appends /v1/models, /v1/chat/completions, /tokenize,
# /health and /metrics itself.
ENDPOINT_BASE_PATHS: Final = frozenset({"", "/", "/v1", "/v1/"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Refusal:
    """Why the operator will not do it: a CamelCase reason and a message naming what and which rule."""

    reason: str
    message: str


def allowed_servedmodels(annotations: Mapping[str, Any] | None) -> frozenset[str]:
    """The names in the Secret's opt-in annotation ('*' stays '*'); empty without it."""
    value = (annotations or {}).get(ALLOW_ANNOTATION)
    if not isinstance(value, str):
        return frozenset()
    return frozenset(n.strip() for n in value.split(",") if n.strip())


def secret_refusal(secret: Mapping[str, Any], servedmodel: str, field: str) -> Refusal | None:
    """None when the Secret's owner allowed `servedmodel` to use it; else a refusal naming the Secret."""
    meta = secret.get("metadata") or {}
    allowed = allowed_servedmodels(meta.get("annotations"))
    if "*" in allowed or servedmodel in allowed:
        return None
    name = meta.get("name") or "?"
    has = "whose list does not name it" if allowed else "lacks it"
    return Refusal(
        SECRET_NOT_ALLOWED,
        f"Secret {name} ({field}) is not allowed for ServedModel {servedmodel}: the Secret must carry the "
        f'annotation {ALLOW_ANNOTATION}: "{servedmodel}" (or "*"), and {has}',
    )


@dataclass(frozen=True)
class AllowList:
    """The operator's outbound allow-list: exact hosts, '*.suffix' wildcards and CIDRs."""

    hosts: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # '.svc' for '*.svc'
    networks: tuple[Network, ...] = ()
    text: str = ""

    @classmethod
    def parse(cls, entries: str | Iterable[str]) -> AllowList:
        """'*.svc, 10.0.0.0/8, prometheus.example.com, 127.0.0.1' (commas or an iterable); a bad entry
        raises ValueError naming it."""
        items = entries.split(",") if isinstance(entries, str) else list(entries)
        hosts: set[str] = set()
        suffixes: list[str] = []
        networks: list[Network] = []
        for raw in items:
            entry = raw.strip().lower().rstrip(".")
            if not entry:
                continue
            if entry == "*":
                raise ValueError("allowed targets: '*' would admit every host; list them")
            if entry.startswith("*."):
                suffixes.append(entry[1:])
                continue
            if "*" in entry:
                raise ValueError(f"allowed targets: {raw.strip()!r}: a wildcard only as '*.suffix'")
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if "/" in entry or ":" in entry:
                raise ValueError(f"allowed targets: {raw.strip()!r} is neither a host nor a CIDR")
            hosts.add(entry)
        text = ",".join(i.strip() for i in items if i.strip())
        return cls(frozenset(hosts), tuple(suffixes), tuple(networks), text)

    def admits(self, host: str) -> bool:
        h = host.strip().lower().rstrip(".").strip("[]")
        try:
            address = ipaddress.ip_address(h)
        except ValueError:
            return h in self.hosts or any(h.endswith(s) and len(h) > len(s) for s in self.suffixes)
        return any(address in n for n in self.networks) or h in self.hosts


def target_refusal(url: str, allow: AllowList, field: str, *, base_path_only: bool) -> Refusal | None:
    """None when the operator may connect to `url`; else a refusal naming the field and the rule.

    base_path_only: the URL is an OpenAI-compatible server's base (spec.endpoint), so its path may only
    be none, '/' or '/v1'; a Prometheus URL may have a path prefix (e.g. behind a proxy)."""

    def refuse(why: str) -> Refusal:
        return Refusal(TARGET_NOT_ALLOWED, f"{field} {_shown(url)}: {why}")

    try:
        parts = urlsplit(url.strip())
        host = parts.hostname
        _ = parts.port  # raises on a port that is not a number
    except ValueError:
        return refuse("not a URL")
    if parts.scheme not in ("http", "https"):
        return refuse("only http and https URLs are allowed")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return refuse("credentials in the URL are not allowed (use a Secret reference)")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return refuse("a query or fragment is not allowed: the operator chooses the routes it calls")
    if base_path_only and parts.path not in ENDPOINT_BASE_PATHS:
        return refuse(
            "the path must be empty, / or /v1: the probe calls the OpenAI routes (/v1/models, "
            "/v1/chat/completions, /tokenize, /health, /metrics) itself"
        )
    if not host:
        return refuse("no host")
    if not allow.admits(host):
        return refuse(
            f"host {host} is not in the operator's allow-list of targets (SERVEDMODEL_ALLOWED_TARGETS="
            f"{allow.text or '(empty)'}); a cluster admin can add it"
        )
    return None


def _shown(url: str, limit: int = 200) -> str:
    """The URL as a message shows it: bounded, and without any userinfo."""
    try:
        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            url = url.replace(parts.netloc, parts.netloc.rpartition("@")[2], 1)
    except ValueError:
        pass
    return url if len(url) <= limit else url[:limit] + "…"


def redact(text: str, secrets: Iterable[str], mark: str = "[redacted]") -> str:
    """`text` with every occurrence of each (non-empty) secret replaced by `mark`."""
    for s in secrets:
        if s and s in text:
            text = text.replace(s, mark)
    return text
