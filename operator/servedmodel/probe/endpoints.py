"""Pure: where a ServedModel's probe connects.

Managed mode: every engine pod at its own address (pod IP, engine port), chat and /metrics alike (the
probe scheduler walks the pods, servedmodel.prober.cycle). External
mode: spec.endpoint for both. An operator-wide override (SERVEDMODEL_ENDPOINT_OVERRIDE) replaces the
resolution, per ServedModel or per pod; the local control plane's pods are fake and their addresses
must never be contacted.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from servedmodel.api.names import ENGINE_PORT, ENGINE_PORT_NAME


@dataclass(frozen=True)
class ProbeTarget:
    """Base URLs (no /v1 suffix): `base_url` takes the API requests, `metrics_urls` are scraped."""

    base_url: str
    metrics_urls: tuple[str, ...]
    mode: str  # managed | external | override


def normalise_base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000': /tokenize, /health and /metrics live at the root."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    return u


@dataclass(frozen=True)
class _Override:
    """SERVEDMODEL_ENDPOINT_OVERRIDE parsed: one URL for all, or per ServedModel, or per pod."""

    everyone: str | None
    models: dict[str, str]  # "ns/name" -> base URL
    pods: dict[str, dict[str, str]]  # "ns/name" -> pod -> base URL


@functools.lru_cache(maxsize=4)
def _parsed(value: str) -> _Override:
    """Parsed once per text (every cycle asks; a bench maps 1,000 ServedModels in one value)."""
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if len(entries) == 1 and "=" not in entries[0]:
        return _Override(normalise_base_url(entries[0]), {}, {})
    models: dict[str, str] = {}
    pods: dict[str, dict[str, str]] = {}
    for entry in entries:
        key, sep, url = entry.partition("=")
        if not sep:
            continue
        key = key.strip()
        parts = key.split("/")
        if len(parts) == 2:
            models.setdefault(key, normalise_base_url(url))
        elif len(parts) == 3 and all(parts):
            pods.setdefault(f"{parts[0]}/{parts[1]}", {})[parts[2]] = normalise_base_url(url)
    return _Override(None, models, pods)


def parse_override(value: str | None, namespace: str, name: str) -> str | None:
    """SERVEDMODEL_ENDPOINT_OVERRIDE: one URL for all, or 'ns/name=URL,ns2/name2=URL2'. None if no match."""
    if not value or not value.strip():
        return None
    override = _parsed(value)
    return override.everyone or override.models.get(f"{namespace}/{name}")


def parse_pod_overrides(value: str | None, namespace: str, name: str) -> dict[str, str]:
    """Per-pod entries of SERVEDMODEL_ENDPOINT_OVERRIDE: 'ns/name/pod=URL' -> {pod: base URL}.

    They let tests and `make dev` give each (fake) engine pod its own local engine; a ServedModel with
    per-pod entries has only those pods probed (the others' addresses exist nowhere)."""
    if not value:
        return {}
    return dict(_parsed(value).pods.get(f"{namespace}/{name}", {}))


def pod_base_url(pod: Mapping[str, Any], port: int = ENGINE_PORT) -> str | None:
    """http://<pod IP>:<engine port> of a pod (its container port named http), None without an IP."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip:
        return None
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == ENGINE_PORT_NAME and isinstance(p.get("containerPort"), int):
                port = p["containerPort"]
    return f"http://{_host(str(ip))}:{port}"


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def resolve_external(endpoint: str) -> ProbeTarget:
    base = normalise_base_url(endpoint)
    return ProbeTarget(base, (base,), "external")


def resolve_override(url: str) -> ProbeTarget:
    base = normalise_base_url(url)
    return ProbeTarget(base, (base,), "override")
