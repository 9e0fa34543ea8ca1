"""Where one probe cycle sends its requests and what it may send: the engine's API key and a Prometheus
token read from their Secrets where the Secret's owner allowed it (servedmodel.access), an external
endpoint or a Prometheus URL only past the operator's allow-list, and every outcome scrubbed of the
Secret values its cycle sent before status, Events or the log see it."""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar, cast

import httpx
from pydantic import BaseModel

from servedmodel import access
from servedmodel.api.base import Key
from servedmodel.api.spec import ServedModelSpec
from servedmodel.config import OperatorConfig
from servedmodel.k8s import ApiError
from servedmodel.k8s.reader import Reader
from servedmodel.probe import errors
from servedmodel.probe.client import MetricsReader, PodMetrics, ProbeOutcome
from servedmodel.probe.endpoints import ProbeTarget, parse_override, resolve_external, resolve_override
from servedmodel.probe.errors import ProbeFailure
from servedmodel.probe.prometheus import PrometheusMetrics

API_KEY_FIELD: Final = "spec.engine.apiKeySecretRef"
ScrubT = TypeVar("ScrubT")


def _scrub(value: ScrubT, secrets: frozenset[str]) -> ScrubT:
    """`value` with every string inside it (dataclasses, pydantic models, lists, dicts, a ProbeFailure)
    redacted of `secrets` (servedmodel.access.redact); frozen dataclasses are copied, others changed."""
    out: Any
    if isinstance(value, str):
        out = access.redact(value, secrets)
    elif isinstance(value, ProbeFailure):
        out = ProbeFailure(value.reason, access.redact(value.message, secrets))
    elif isinstance(value, BaseModel):
        out = value.model_copy(
            update={k: _scrub(getattr(value, k), secrets) for k in type(value).model_fields}
        )
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _scrub(getattr(value, f.name), secrets) for f in dataclasses.fields(value)}
        if getattr(getattr(value, "__dataclass_params__", None), "frozen", False):
            init = {f.name for f in dataclasses.fields(value) if f.init}
            out = dataclasses.replace(value, **{k: v for k, v in changes.items() if k in init})
        else:
            for k, v in changes.items():
                setattr(value, k, v)
            out = value
    elif isinstance(value, list):
        out = [_scrub(v, secrets) for v in value]
    elif isinstance(value, tuple):
        out = tuple(_scrub(v, secrets) for v in value)
    elif isinstance(value, dict):
        out = {_scrub(k, secrets): _scrub(v, secrets) for k, v in value.items()}
    else:
        out = value
    return cast(ScrubT, out)


class _KeyRef(Protocol):
    """A Secret key reference (spec.engine.apiKeySecretRef, a Prometheus bearer token's)."""

    name: str
    key: str


@dataclass
class Sources:
    """A scheduler's Secrets, targets and metrics readers, and the Secret values each running cycle sent
    (per ServedModel, until `redacted` takes them)."""

    reader: Reader
    config: OperatorConfig
    _in_use: dict[Key, set[str]] = field(default_factory=dict, init=False)
    # Prometheus sources with insecureSkipVerify: one client for all of them, closed with the pool.
    _insecure_http: httpx.AsyncClient | None = field(default=None, init=False)

    async def secret(self, key: Key, ref: _KeyRef, field: str) -> str:
        """A Secret key's value for ServedModel `key`, only where the Secret's owner allowed that
        (servedmodel.access.secret_refusal: the inference.servedmodel.io/allowed-servedmodels annotation);
        a refusal is a ProbeFailure naming the Secret and `field`. No message ever holds the value. The
        value is scrubbed from this cycle's outcomes (`redacted`)."""
        namespace, name = key
        try:
            secret = await self.reader.get("v1", "secrets", namespace, ref.name)
        except ApiError as exc:
            raise ProbeFailure(
                errors.SECRET_UNAVAILABLE, f"Secret {ref.name} ({field}): {exc.status} {exc.reason}"
            ) from None
        if secret is None:
            raise ProbeFailure(errors.SECRET_UNAVAILABLE, f"Secret {ref.name} ({field}) not found")
        refusal = access.secret_refusal(secret, name, field)
        if refusal is not None:
            raise ProbeFailure(refusal.reason, refusal.message)
        data = secret.get("data") or {}
        if ref.key not in data:
            raise ProbeFailure(errors.SECRET_UNAVAILABLE, f"Secret {ref.name} has no key {ref.key}")
        try:
            value = base64.b64decode(data[ref.key]).decode("utf-8").strip()
        except (ValueError, UnicodeDecodeError):
            raise ProbeFailure(
                errors.SECRET_UNAVAILABLE, f"Secret {ref.name} key {ref.key} is not UTF-8 text"
            ) from None
        self._in_use.setdefault(key, set()).add(value)
        return value

    async def api_key(self, key: Key, spec: ServedModelSpec) -> str | None:
        """The engine's API key (spec.engine.apiKeySecretRef), or None when it has none."""
        ref = spec.engine.api_key_secret_ref
        return None if ref is None else await self.secret(key, ref, API_KEY_FIELD)

    def target(self, key: Key, spec: ServedModelSpec) -> ProbeTarget:
        """External mode's target (managed models are probed pod by pod). spec.endpoint must pass the
        operator's allow-list (servedmodel.access.target_refusal); the admin's override is trusted."""
        override = parse_override(self.config.endpoint_override, *key)
        if override is not None:
            return resolve_override(override)
        assert spec.endpoint is not None  # only external models come here
        refusal = access.target_refusal(
            spec.endpoint, self.config.target_allow_list, "spec.endpoint", base_path_only=True
        )
        if refusal is not None:
            raise ProbeFailure(refusal.reason, refusal.message)
        return resolve_external(spec.endpoint)

    async def metrics_reader(
        self, http: httpx.AsyncClient, key: Key, spec: ServedModelSpec, target: ProbeTarget
    ) -> MetricsReader:
        """Where the cycle reads the server's figures: the pod's /metrics, or the Prometheus source."""
        src = spec.probe.metrics_source
        model = spec.resolved_served_model_name
        if src.type != "prometheus" or src.prometheus is None:
            return PodMetrics(http, target.metrics_urls, model)
        prom = src.prometheus
        field = "spec.probe.metricsSource.prometheus"
        refusal = access.target_refusal(
            prom.url, self.config.target_allow_list, f"{field}.url", base_path_only=False
        )
        if refusal is not None:
            raise ProbeFailure(refusal.reason, refusal.message)
        if prom.insecure_skip_verify and not self.config.allow_insecure_tls:
            raise ProbeFailure(
                access.INSECURE_TLS_NOT_ALLOWED,
                f"{field}.insecureSkipVerify is true, but the operator verifies TLS for every "
                "ServedModel (a cluster admin may allow skipping it: SERVEDMODEL_ALLOW_INSECURE_TLS)",
            )
        token = None
        if prom.bearer_token_secret_ref is not None:
            token = await self.secret(key, prom.bearer_token_secret_ref, f"{field}.bearerTokenSecretRef")
        return PrometheusMetrics(
            self._prometheus_http(http, insecure=prom.insecure_skip_verify),
            prom.url,
            model=model,
            namespace=key[0],
            bearer_token=token,
            settle_timeout_s=spec.probe.timeout,
        )

    def _prometheus_http(self, http: httpx.AsyncClient, *, insecure: bool) -> httpx.AsyncClient:
        """The client a Prometheus source queries on: this cycle's (the shared pool), or for
        insecureSkipVerify the one client that does not verify TLS."""
        if not insecure:
            return http
        if self._insecure_http is None:
            self._insecure_http = httpx.AsyncClient(verify=False, trust_env=False)
        return self._insecure_http

    def redacted(self, key: Key, *outs: ProbeOutcome) -> list[ProbeOutcome]:
        """The outcomes without any Secret value this model's cycle sent (an engine may echo the API key
        in an error body, a model id or its content): status, Events and the log are all made from them.
        Called once per cycle, also when the cycle failed before it sent anything."""
        secrets = self._in_use.pop(key, set())
        if not secrets:
            return list(outs)
        return [_scrub(out, frozenset(secrets)) for out in outs]

    def closers(self) -> list[Any]:
        """What stop() closes on the probe loop (the insecure client holds its connections)."""
        http, self._insecure_http = self._insecure_http, None
        return [] if http is None else [http.aclose]
