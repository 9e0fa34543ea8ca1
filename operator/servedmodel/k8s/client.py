"""A small typed async Kubernetes client on httpx: the only code in the operator that calls the API server.

Objects are plain dicts (the API's JSON); resources are named by (apiVersion, plural). Every call has
explicit connect/read timeouts and a bounded retry with jittered exponential backoff on 429, 5xx and
connection errors; everything else becomes an `ApiError` carrying the server's status, reason and message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import httpx

from .credentials import Credentials, load_credentials

log = logging.getLogger(__name__)

Obj = dict[str, Any]
ObjList = list[dict[str, Any]]

RETRY_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
DISCOVERY_TTL_S: Final = 300.0


class ApiError(Exception):
    """The API server said no (or could not be reached: status 0)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class NotFoundError(ApiError):
    """404: the object (or its resource type) does not exist."""


class ConflictError(ApiError):
    """409: field-manager conflict, resourceVersion conflict or already exists."""


class UnreachableError(ApiError):
    """The API server could not be reached (after retries); status is 0."""


@dataclass(frozen=True)
class Resource:
    """Where a kind lives: /api(s)/<group_version>/[namespaces/<ns>/]<plural>."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


# Kinds the operator touches, so the hot path needs no discovery round trip. Anything else is discovered.
KNOWN_RESOURCES: Final = (
    Resource("v1", "Pod", "pods"),
    Resource("v1", "Service", "services"),
    Resource("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
    Resource("v1", "Secret", "secrets"),
    Resource("v1", "ConfigMap", "configmaps"),
    Resource("v1", "Event", "events"),
    Resource("v1", "Namespace", "namespaces", namespaced=False),
    Resource("apps/v1", "Deployment", "deployments"),
    Resource("apps/v1", "ReplicaSet", "replicasets"),
    Resource("discovery.k8s.io/v1", "EndpointSlice", "endpointslices"),
    Resource("route.openshift.io/v1", "Route", "routes"),
    Resource("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
    Resource("inference.servedmodel.io/v1alpha1", "ServedModel", "servedmodels"),
)


def _error_from_response(response: httpx.Response) -> ApiError:
    reason, message = response.reason_phrase or "Error", response.text[:500]
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        reason = str(body.get("reason") or reason)
        message = str(body.get("message") or message)
    cls = {404: NotFoundError, 409: ConflictError}.get(response.status_code, ApiError)
    return cls(response.status_code, reason, message)


class KubeClient:
    """Async client for one API server. Use `KubeClient.from_environment()`; close with `aclose()`.

    Safe to share between tasks (one httpx connection pool); keep one in kopf's memo.
    """

    def __init__(
        self,
        credentials: Credentials,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        attempts: int = 4,
        backoff_base_s: float = 0.25,
        backoff_max_s: float = 5.0,
        user_agent: str = "servedmodel-operator",
    ) -> None:
        self.credentials = credentials
        self.attempts = max(1, attempts)
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._http = httpx.AsyncClient(
            base_url=credentials.server,
            verify=credentials.ssl_context() or True,
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=10.0, pool=10.0),
            headers={"User-Agent": user_agent, "Accept": "application/json"},
            auth=httpx.BasicAuth(credentials.username, credentials.password or "")
            if credentials.username and not credentials.token and not credentials.token_file
            else None,
        )
        self._resources: dict[tuple[str, str], Resource] = {}
        for r in KNOWN_RESOURCES:
            self._resources[(r.api_version, r.kind)] = r
            self._resources[(r.api_version, r.plural)] = r
        self._discovery: dict[str, tuple[float, Obj | None]] = {}
        self.request_count = 0  # HTTP requests sent, retries included (the operator exports it)

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, **kwargs: Any) -> KubeClient:
        """Credentials from `kubeconfig`, $KUBECONFIG, the pod's service account or ~/.kube/config."""
        return cls(load_credentials(kubeconfig), **kwargs)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- transport -------------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Obj:
        """One API call with bounded retries; returns the decoded JSON body (empty dict if none)."""
        headers = {"Content-Type": content_type} if body is not None else {}
        token = self.credentials.bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        content = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
        last: ApiError | None = None
        retry_after: str | None = None
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self._delay(attempt, retry_after))
            self.request_count += 1
            try:
                response = await self._http.request(
                    method, path, params=dict(params or {}), content=content, headers=headers
                )
            except httpx.TransportError as e:
                last = UnreachableError(
                    0, type(e).__name__, f"{method} {path}: {e!s} ({self.credentials.server})"
                )
                log.debug("attempt %d: %s", attempt + 1, last)
                continue
            if response.status_code < 400:
                return response.json() if response.content else {}
            error = _error_from_response(response)
            if response.status_code not in RETRY_STATUSES:
                raise error
            last = error
            retry_after = response.headers.get("Retry-After")
            log.debug("attempt %d: %s", attempt + 1, error)
        assert last is not None
        raise last

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(float(retry_after), self.backoff_max_s)
            except ValueError:
                pass
        # Full jitter: spreads the retries of many reconciles hitting the same overloaded server.
        return random.uniform(0, min(self.backoff_max_s, self.backoff_base_s * 2**attempt))

    # ---- resource resolution and discovery -------------------------------------------------------

    async def _group_version(self, group_version: str) -> Obj | None:
        """The APIResourceList of a group/version, cached for DISCOVERY_TTL_S; None if not served."""
        cached = self._discovery.get(group_version)
        now = time.monotonic()
        if cached is not None and now - cached[0] < DISCOVERY_TTL_S:
            return cached[1]
        path = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        try:
            found: Obj | None = await self.request("GET", path)
        except NotFoundError:
            found = None
        self._discovery[group_version] = (now, found)
        return found

    async def discover(self, group_version: str) -> bool:
        """Does the server serve this group/version (e.g. route.openshift.io/v1, monitoring.coreos.com/v1)?"""
        return await self._group_version(group_version) is not None

    async def resource(self, api_version: str, kind_or_plural: str) -> Resource:
        """Resolve a kind ("Deployment") or plural ("deployments") to its Resource."""
        known = self._resources.get((api_version, kind_or_plural))
        if known is not None:
            return known
        listing = await self._group_version(api_version)
        for r in (listing or {}).get("resources", []):
            if "/" in r.get("name", ""):
                continue  # subresource
            if kind_or_plural in (r.get("kind"), r.get("name")):
                found = Resource(api_version, r["kind"], r["name"], bool(r.get("namespaced", True)))
                self._resources[(api_version, found.kind)] = found
                self._resources[(api_version, found.plural)] = found
                return found
        raise NotFoundError(404, "NotFound", f"the server does not serve {kind_or_plural} in {api_version}")

    # ---- reads -----------------------------------------------------------------------------------

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Obj | None:
        """The object, or None if it does not exist."""
        r = await self.resource(api_version, plural)
        try:
            return await self.request("GET", r.path(namespace, name))
        except NotFoundError:
            return None

    async def list(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
    ) -> ObjList:
        """All matching objects (pages followed); namespace None lists across namespaces."""
        r = await self.resource(api_version, plural)
        params: dict[str, str] = {"limit": str(page_size)}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        items: ObjList = []
        while True:
            page = await self.request("GET", r.path(namespace), params=params)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            params["continue"] = token

    async def list_endpoint_slices(self, namespace: str, service_name: str) -> ObjList:
        """EndpointSlices of a Service (label kubernetes.io/service-name), e.g. to find ready engine pods."""
        return await self.list(
            "discovery.k8s.io/v1",
            "endpointslices",
            namespace,
            label_selector=f"kubernetes.io/service-name={service_name}",
        )

    # ---- writes ----------------------------------------------------------------------------------

    async def apply(self, obj: Obj, field_manager: str, force: bool = True) -> Obj:
        """Server-side apply `obj` (needs apiVersion, kind, metadata.name[, namespace]); returns the result.

        The body is JSON, which is valid apply-patch YAML. With force=True this manager takes over fields
        another manager set (the operator is the authority on its children).
        """
        meta = obj.get("metadata") or {}
        r = await self.resource(obj["apiVersion"], obj["kind"])
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self.request(
            "PATCH",
            r.path(meta.get("namespace"), meta["name"]),
            params=params,
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def apply_status(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        status: Obj,
        field_manager: str,
        *,
        force: bool = True,
    ) -> Obj:
        """Server-side apply of `status` on the /status subresource, as `field_manager`.

        `status` holds only the fields this manager owns (e.g. the probe: {"probe": {...}, "conditions":
        [{"type": "Serving", ...}]}). Fields this manager applied before and now omits are removed;
        other managers' fields stay. status.conditions is a list-map keyed by `type`, so each manager's
        conditions survive the other's applies. Returns the whole object after the write.
        """
        r = await self.resource(api_version, plural)
        body: Obj = {
            "apiVersion": api_version,
            "kind": r.kind,
            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
            "status": status,
        }
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self.request(
            "PATCH",
            r.path(namespace, name, "status"),
            params=params,
            body=body,
            content_type="application/apply-patch+yaml",
        )

    async def delete(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        *,
        propagation: str = "Background",
    ) -> bool:
        """Delete the object; False if it was already gone."""
        r = await self.resource(api_version, plural)
        try:
            await self.request(
                "DELETE",
                r.path(namespace, name),
                body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation},
            )
        except NotFoundError:
            return False
        return True

    async def create_event(
        self,
        involved: Obj,
        *,
        type: str,
        reason: str,
        message: str,
        component: str = "servedmodel-operator",
    ) -> Obj:
        """Record a core/v1 Event about `involved` (an object dict with apiVersion, kind, metadata)."""
        meta = involved.get("metadata") or {}
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        namespace = meta.get("namespace") or "default"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'object')}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        return await self.request("POST", f"/api/v1/namespaces/{namespace}/events", body=event)
