"""The operator's Kubernetes client: a thin facade over lightkube's AsyncClient (the only code in the
operator that calls the API server; kopf's watches are the other half, with the same identity).

Objects in and out are plain dicts (the API's JSON); resources are named by (apiVersion, plural) or,
for applies, by the object's (apiVersion, kind). lightkube builds the URLs and bodies of reads, lists,
deletes, merge patches and reviews and decodes their errors. The hot requests, writes whose answer is
the object (server-side apply, also on /status; create; replace), Events and watches, go as plain
requests over the operator's own HTTP/1.1 client (wire/http11.py) instead: httpx's stack under them was
most of a probe cycle's status write and of a reconcile's applies at 1,000 ServedModels (issue 21's
profiles). This module adds what an operator needs on top:

- one identity (k8s/identity.py) whose token goes into each request's Authorization header, refreshed
  once on a 401 (rotated service-account tokens, expired exec-plugin tokens);
- a cap on requests in flight (``max_inflight``, an asyncio semaphore around each HTTP exchange), so a
  burst of reconciles queues here instead of starving the connection pool;
- explicit timeouts (connect 5 s, read ``read_timeout_s``, pool 30 s) and a bounded retry with jittered
  backoff on 429, 5xx and connection errors; every other error becomes an `ApiError` with the server's
  status, reason and message;
- counts of the HTTP requests sent, by verb and status code (``requests``), which the operator exports.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import secrets
import time
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol, TypeVar

import httpx2 as httpx
import lightkube
from lightkube.core import resource as lk_resource
from lightkube.generic_resource import (
    GenericGlobalResource,
    GenericGlobalStatus,
    GenericNamespacedResource,
    GenericNamespacedStatus,
    create_api_info,
)
from lightkube.types import CascadeType, PatchType

from servedmodel.api.base import Obj
from servedmodel.wire.http11 import LeanResponse, LeanTransport, WireError, encode_head

from .identity import Identity

log = logging.getLogger(__name__)

ObjList = list[Obj]
T = TypeVar("T")

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


class GoneError(ApiError):
    """410: the resourceVersion a watch (or a list's continue token) started from is compacted away;
    only a new list can say what exists now."""


@dataclass(frozen=True)
class Resource:
    """A kind the operator touches: where it lives and lightkube's class for it."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


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
    Resource("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    Resource("route.openshift.io/v1", "Route", "routes"),
    Resource("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
    Resource("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
    Resource("keda.sh/v1alpha1", "TriggerAuthentication", "triggerauthentications"),
    Resource("http.keda.sh/v1alpha1", "HTTPScaledObject", "httpscaledobjects"),
    Resource("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
    Resource("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective", "inferenceobjectives"),
    Resource("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"),
    Resource("inference.servedmodel.io/v1alpha1", "ServedModel", "servedmodels"),
    Resource("coordination.k8s.io/v1", "Lease", "leases"),
)


# Reviews the operator asks of the API server (its /metrics: TokenReview, then SubjectAccessReview).
REVIEW_RESOURCES: Final = {
    "TokenReview": Resource("authentication.k8s.io/v1", "TokenReview", "tokenreviews", namespaced=False),
    "SubjectAccessReview": Resource(
        "authorization.k8s.io/v1", "SubjectAccessReview", "subjectaccessreviews", namespaced=False
    ),
}


@functools.cache
def _lightkube_class(r: Resource) -> Any:
    """lightkube's generic (dict-backed) resource class for `r`: objects stay the API's JSON, decoded
    without per-field validation, for built-in kinds too (the typed models would reject a partial
    object and drop fields newer than the models)."""
    info = create_api_info(r.group, r.version, r.kind, r.plural)
    status_info = lk_resource.ApiInfo(
        resource=info.resource,
        parent=info.resource,
        plural=r.plural,
        verbs=["get", "patch", "put"],
        action="status",
    )
    main, status = (
        (GenericNamespacedResource, GenericNamespacedStatus)
        if r.namespaced
        else (GenericGlobalResource, GenericGlobalStatus)
    )
    status_cls = type(f"{r.kind}Status", (status,), {"_api_info": status_info})
    return type(r.kind, (main,), {"_api_info": info, "Status": status_cls})


def parse_label_selector(selector: str) -> dict[str, str | None]:
    """'a=b,c' → {'a': 'b', 'c': None} (equality and existence: all the operator uses)."""
    out: dict[str, str | None] = {}
    for part in filter(None, (p.strip() for p in selector.split(","))):
        key, eq, value = part.partition("=")
        out[key.rstrip("=").strip()] = value.lstrip("=").strip() if eq else None
    return out


def _to_dict(obj: Any) -> Obj:
    if obj is None:
        return {}
    if isinstance(obj, dict) and not hasattr(obj, "to_dict"):
        return obj
    result: Obj = obj.to_dict()
    return result


def _error(e: Exception) -> ApiError:
    if isinstance(e, lightkube.ApiError):
        status = e.status
        code = int(status.code or e.response.status_code)
        reason, message = str(status.reason or e.response.reason_phrase), str(status.message or "")
    elif isinstance(e, httpx.HTTPStatusError):
        # lightkube decodes a Status only under exactly `application/json`; take it from any JSON body.
        code, reason = e.response.status_code, e.response.reason_phrase or "Error"
        message = e.response.text[:500]
        try:
            body = e.response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("kind") == "Status":
            reason, message = str(body.get("reason") or reason), str(body.get("message") or message)
    else:
        return UnreachableError(0, type(e).__name__, str(e) or type(e).__name__)
    return _status_error(code, reason, message)


def _status_error(code: int, reason: str, message: str) -> ApiError:
    cls = {404: NotFoundError, 409: ConflictError, 410: GoneError}.get(code, ApiError)
    return cls(code, reason, message)


def _watch_event(line: bytes) -> tuple[str, Obj]:
    """One line of a watch's stream as (type, object); an ERROR event raises its status's ApiError."""
    event = json.loads(line)
    type_, obj = str(event.get("type") or ""), event.get("object") or {}
    if type_ == "ERROR":
        code = int(obj.get("code") or 0)
        raise _status_error(code, str(obj.get("reason") or "Error"), str(obj.get("message") or ""))
    return type_, obj


_APPLY_PATCH: Final = "application/apply-patch+yaml"


def _status_identity(api_version: str, r: Resource, namespace: str | None, name: str) -> Obj:
    return {
        "apiVersion": api_version,
        "kind": r.kind,
        "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
    }


def _status_body(api_version: str, r: Resource, namespace: str | None, name: str, status: Obj) -> Obj:
    """A /status apply's body: the object's identity and the fields its manager owns."""
    return {**_status_identity(api_version, r, namespace, name), "status": status}


def _status_json(api_version: str, r: Resource, namespace: str | None, name: str, status: bytes) -> bytes:
    """_status_body as JSON around a status that is JSON already."""
    identity = json.dumps(_status_identity(api_version, r, namespace, name), separators=(",", ":"))
    return identity[:-1].encode() + b',"status":' + status + b"}"  # [:-1]: the object's closing brace


def _response_error(response: httpx.Response | LeanResponse, body: bytes) -> ApiError:
    """An error answer (its Status object when the body is one) as an ApiError."""
    reason, message = response.reason_phrase or "Error", body[:500].decode("utf-8", "replace")
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "Status":
        reason, message = str(doc.get("reason") or reason), str(doc.get("message") or message)
    return _status_error(response.status_code, reason, message)


class _Answer(Protocol):
    """What the cap needs of an answer, httpx's or the lean client's."""

    @property
    def status_code(self) -> int: ...

    async def aclose(self) -> None: ...


_A = TypeVar("_A", bound=_Answer)


class _AuthTransport(httpx.AsyncBaseTransport):
    """Every request of our client passes here, httpx's (`handle_async_request`) and the lean client's
    (`lean`): the in-flight cap, the identity's Authorization header (one retry with a refreshed
    credential on 401), and the request count."""

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        lean: LeanTransport,
        identity: Identity,
        max_inflight: int,
        user_agent: str,
    ) -> None:
        self._inner = inner
        self._lean = lean
        server = urllib.parse.urlsplit(identity.server)
        self._host, self._netloc = server.hostname or "", server.netloc
        self._port = server.port or (443 if server.scheme == "https" else 80)
        self._prefix = server.path.rstrip("/")  # a server URL with a path (an API proxy's)
        self._user_agent = user_agent
        self._identity = identity
        self._slots = asyncio.Semaphore(max_inflight)
        self.max_inflight = max_inflight
        self.requests: Counter[tuple[str, int]] = Counter()
        # Seconds by method: waiting for one of the max_inflight slots, and from the slot to the
        # response's headers (what the API server took, plus this event loop's own delays): beside the
        # server's apiserver_request_duration_seconds they say where a slow request waited.
        self.slot_wait_s: defaultdict[str, float] = defaultdict(float)
        self.response_s: defaultdict[str, float] = defaultdict(float)
        self.in_flight = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._capped(request.method, lambda refresh: self._send(request, refresh=refresh))

    async def lean(
        self,
        method: str,
        path: str,
        params: Mapping[str, str | int] | None,
        body: bytes | None,
        headers: Mapping[str, str],
        timeouts: dict[str, float | None],
    ) -> LeanResponse:
        """`method` on `path` (with `params`) over the lean client; its answer once its head is here
        (the caller reads or closes it)."""
        target = urllib.parse.quote(self._prefix + path, safe="/:@!$&'()*+,;=-._~")
        if params:
            target += "?" + urllib.parse.urlencode(params)

        async def send(refresh: bool) -> LeanResponse:
            header = (await self._identity.credential(refresh=refresh)).header()
            fields = {"Accept": "application/json", "User-Agent": self._user_agent, **headers}
            if header:
                fields["Authorization"] = header
            wire = _wire_request(method, target, self._netloc, fields, body)
            try:
                response = await self._lean.send(
                    self._host, self._port, wire, method.encode("ascii"), timeouts
                )
            except Exception:
                self.requests[(method, 0)] += 1
                raise
            self.requests[(method, response.status_code)] += 1
            return response

        return await self._capped(method, send)

    async def _capped(self, method: str, send: Callable[[bool], Awaitable[_A]]) -> _A:
        """`send` (its argument: refresh the credential) within a slot, again refreshed on a 401."""
        queued = time.monotonic()
        async with self._slots:
            self.in_flight += 1
            started = time.monotonic()
            self.slot_wait_s[method] += started - queued
            try:
                response = await send(False)
                if response.status_code == 401 and self._identity.tokens is not None:
                    await response.aclose()
                    response = await send(True)
                return response
            finally:
                self.in_flight -= 1
                self.response_s[method] += time.monotonic() - started

    async def _send(self, request: httpx.Request, *, refresh: bool) -> httpx.Response:
        header = (await self._identity.credential(refresh=refresh)).header()
        if header:
            request.headers["Authorization"] = header
        request.headers["User-Agent"] = self._user_agent
        try:
            response = await self._inner.handle_async_request(request)
        except Exception:
            self.requests[(request.method, 0)] += 1
            raise
        self.requests[(request.method, response.status_code)] += 1
        return response

    async def aclose(self) -> None:
        await self._lean.aclose()
        await self._inner.aclose()


def _wire_request(
    method: str, target: str, netloc: str, headers: Mapping[str, str], body: bytes | None
) -> bytes:
    """The request as sent: its line, Host, `headers` (and Content-Length of a body), then the body."""
    fields = [(b"Host", netloc.encode("latin-1"))]
    fields += [(name.encode("ascii"), value.encode("latin-1")) for name, value in headers.items()]
    if body is not None:
        fields.append((b"Content-Length", b"%d" % len(body)))
    return b"".join(encode_head(method, target.encode("latin-1"), fields) + ([body] if body else []))


class KubeClient:
    """Async client for one API server: `KubeClient(load_identity(kubeconfig))`; close with `aclose()`.

    Safe to share between tasks (one connection pool); the operator keeps one in kopf's memo.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        max_inflight: int = 32,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        attempts: int = 3,
        backoff_base_s: float = 0.25,
        backoff_max_s: float = 5.0,
        user_agent: str = "servedmodel-operator",
    ) -> None:
        self.identity = identity
        self.attempts = max(1, attempts)
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        inner = httpx.AsyncHTTPTransport(
            verify=identity.ssl_context() or True,
            limits=httpx.Limits(max_connections=max_inflight, max_keepalive_connections=max_inflight),
            trust_env=False,
        )
        # The writes' and watches' client: TLS with the identity's context (CA, client certificate), kept
        # alive up to the in-flight cap, 30 s idle (a new TLS session costs more than the idle socket).
        lean = LeanTransport(tls=identity.ssl_context(), idle_per_host=max_inflight, keepalive_expiry_s=30.0)
        self.timeouts: dict[str, float | None] = {
            "connect": connect_timeout_s,
            "read": read_timeout_s,
            "write": 10.0,
        }
        self._transport = _AuthTransport(inner, lean, identity, max_inflight, user_agent)
        self._lk = lightkube.AsyncClient(
            config=identity.tls_config(),
            namespace=identity.namespace,
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=10.0, pool=30.0),
            trust_env=False,
            transport=self._transport,
        )
        # Plain HTTP on the same transport (identity, in-flight cap, counts) for what lightkube does not
        # give: a list's resourceVersion, watches from one, create and replace of plain dicts.
        self._http = httpx.AsyncClient(
            base_url=identity.server,
            transport=self._transport,
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=10.0, pool=30.0),
            trust_env=False,
        )
        self._by_kind: dict[tuple[str, str], Resource] = {}
        self._by_plural: dict[tuple[str, str], Resource] = {}
        for r in KNOWN_RESOURCES:
            self.register(r)
        self._discovery: dict[str, tuple[float, bool]] = {}
        self._discovering: dict[str, asyncio.Future[bool]] = {}

    @property
    def server(self) -> str:
        return self.identity.server

    @property
    def requests(self) -> Counter[tuple[str, int]]:
        """HTTP requests sent by (method, status code; 0 = no answer), retries included."""
        return self._transport.requests

    @property
    def request_seconds(self) -> tuple[dict[str, float], dict[str, float]]:
        """(seconds waiting for an in-flight slot, seconds from the slot to the response) by method."""
        return self._transport.slot_wait_s, self._transport.response_s

    @property
    def request_count(self) -> int:
        return sum(self._transport.requests.values())

    @property
    def in_flight(self) -> int:
        return self._transport.in_flight

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._lk.aclose()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- resources -------------------------------------------------------------------------------

    def register(self, r: Resource) -> None:
        """Make a kind known (e.g. another custom resource); built-in and operator kinds are known."""
        self._by_kind[(r.api_version, r.kind)] = r
        self._by_plural[(r.api_version, r.plural)] = r

    def resource(self, api_version: str, kind_or_plural: str) -> Resource:
        found = self._by_plural.get((api_version, kind_or_plural)) or self._by_kind.get(
            (api_version, kind_or_plural)
        )
        if found is None:
            # A programming error, not a 404: a caller must never read "not registered" as "deleted".
            raise LookupError(
                f"{kind_or_plural} in {api_version} is not a kind this client knows (register it)"
            )
        return found

    def _res(self, api_version: str, kind_or_plural: str) -> tuple[Resource, Any]:
        r = self.resource(api_version, kind_or_plural)
        return r, _lightkube_class(r)

    # ---- transport -------------------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One API call with bounded retries on 429/5xx/connection errors; other errors raise at once."""
        last: ApiError | None = None
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(
                    random.uniform(0, min(self.backoff_max_s, self.backoff_base_s * 2**attempt))
                )
            try:
                return await fn()
            except (lightkube.ApiError, httpx.HTTPError, WireError) as e:
                error = _error(e)
            except ApiError as e:  # the plain requests' answers (list_at, create, replace)
                error = e
            if error.status and error.status not in RETRY_STATUSES:
                raise error
            last = error
            log.debug("%s, attempt %d: %s", what, attempt + 1, error)
        assert last is not None
        if isinstance(last, UnreachableError):
            raise UnreachableError(0, last.reason, f"{what}: {last.message} ({self.server})")
        raise last

    # ---- discovery -------------------------------------------------------------------------------

    async def discover(self, group_version: str) -> bool:
        """Does the server serve this group/version (route.openshift.io/v1, monitoring.coreos.com/v1)?

        Asked by listing one object of the first known kind of that group/version (a 404 means not
        served, a 403 that the operator may not use it), cached for DISCOVERY_TTL_S; callers that ask
        while it is being asked share that one request (a mass create's reconciles all ask at once)."""
        cached = self._discovery.get(group_version)
        now = asyncio.get_running_loop().time()
        if cached is not None and now - cached[0] < DISCOVERY_TTL_S:
            return cached[1]
        asking = self._discovering.get(group_version)
        if asking is None:
            asking = self._discovering[group_version] = asyncio.ensure_future(self._discover(group_version))
            asking.add_done_callback(lambda _: self._discovering.pop(group_version, None))
        return await asyncio.shield(asking)  # one caller cancelled does not cancel the others' answer

    async def _discover(self, group_version: str) -> bool:
        now = asyncio.get_running_loop().time()
        kinds = [r for r in self._by_kind.values() if r.api_version == group_version]
        if not kinds:
            raise NotFoundError(404, "NotFound", f"no known kind in {group_version}")
        r, cls = kinds[0], _lightkube_class(kinds[0])

        async def probe() -> None:
            namespace = self.identity.namespace if r.namespaced else None
            async for _ in self._lk.list(cls, namespace=namespace, chunk_size=1):
                break

        try:
            await self._call(f"discover {group_version}", probe)
            served = True
        except NotFoundError:
            served = False
        except ApiError as e:
            if e.status != 403:
                raise
            # RBAC is checked before the API's existence: whether or not it is served, the operator may
            # not use it (its ClusterRole lacks the kind), so it must not render objects of it.
            log.warning(
                "discovery of %s: forbidden (%s); treating it as not served", group_version, e.message
            )
            served = False
        self._discovery[group_version] = (now, served)
        return served

    # ---- reads -----------------------------------------------------------------------------------

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Obj | None:
        """The object, or None if it does not exist."""
        r, cls = self._res(api_version, plural)

        async def call() -> Any:
            if r.namespaced:
                return await self._lk.get(cls, name, namespace=namespace)
            return await self._lk.get(cls, name)

        try:
            return _to_dict(await self._call(f"GET {r.kind} {namespace}/{name}", call))
        except NotFoundError:
            return None

    async def list(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        label_selector: str | Mapping[str, str | None] | None = None,
        field_selector: str | Mapping[str, str | None] | None = None,
        page_size: int = 500,
    ) -> ObjList:
        """All matching objects (pages followed); namespace None lists across namespaces."""
        r, cls = self._res(api_version, plural)
        labels = parse_label_selector(label_selector) if isinstance(label_selector, str) else label_selector
        fields = parse_label_selector(field_selector) if isinstance(field_selector, str) else field_selector

        async def call() -> ObjList:
            ns = (namespace or lightkube.ALL_NS) if r.namespaced else None
            kwargs: dict[str, Any] = {
                "chunk_size": page_size,
                "labels": labels or None,
                "fields": fields or None,
            }
            if r.namespaced:
                kwargs["namespace"] = ns
            return [_to_dict(o) async for o in self._lk.list(cls, **kwargs)]

        return await self._call(f"LIST {r.kind} {namespace or '*'}", call)

    @staticmethod
    def path(r: Resource, namespace: str | None) -> str:
        """The collection's URL path: /api/v1[/namespaces/NS]/PLURAL or /apis/GROUP/VERSION/…."""
        base = f"/api/{r.version}" if not r.group else f"/apis/{r.group}/{r.version}"
        if r.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        return f"{base}/{r.plural}"

    async def list_at(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
        each: Callable[[Obj], Obj] | None = None,
    ) -> tuple[ObjList, str]:
        """All matching objects (pages followed) and the list's resourceVersion, to watch from.

        `each`: applied to every item as its page arrives, what is kept instead (the informers' slim
        copies: a whole list of 10,000 ServedModels with their managedFields, held until the last page,
        was a few hundred MB of the operator's peak memory)."""
        r = self.resource(api_version, plural)
        url = self.path(r, namespace)

        async def call() -> tuple[ObjList, str]:
            items: ObjList = []
            cont: str | None = None
            rv = ""
            while True:
                params: dict[str, str | int] = {"limit": page_size}
                if label_selector:
                    params["labelSelector"] = label_selector
                if field_selector:
                    params["fieldSelector"] = field_selector
                if cont:
                    params["continue"] = cont
                response = await self._http.get(url, params=params)
                if response.status_code != 200:
                    raise _response_error(response, await response.aread())
                doc = response.json()
                meta = doc.get("metadata") or {}
                kind = r.kind
                for item in doc.get("items") or []:
                    item.setdefault("apiVersion", r.api_version)
                    item.setdefault("kind", kind)
                    items.append(item if each is None else each(item))
                del doc
                rv = str(meta.get("resourceVersion") or rv)
                cont = meta.get("continue")
                if not cont:
                    return items, rv

        what = f"LIST {r.kind} {namespace or '*'}"
        try:
            return await self._call(what, call)
        except GoneError:  # the continue token expired between two pages: list again from the first
            return await self._call(what, call)

    async def watch(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        resource_version: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_s: float = 300.0,
    ) -> AsyncIterator[tuple[str, Obj]]:
        """(type, object) of each watch event from `resource_version` until the server ends the watch
        (timeoutSeconds); a 410 (answer or ERROR event) raises GoneError, other refusals ApiError."""
        r = self.resource(api_version, plural)
        params: dict[str, str | int] = {
            "watch": 1,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": max(1, int(timeout_s)),
        }
        if resource_version:
            params["resourceVersion"] = resource_version
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        timeouts: dict[str, float | None] = {"connect": 5.0, "read": timeout_s + 30.0, "write": 10.0}
        try:
            response = await self._transport.lean("GET", self.path(r, namespace), params, None, {}, timeouts)
        except WireError as e:
            raise _error(e) from None
        try:
            if response.status_code != 200:
                raise _response_error(response, await response.aread())
            rest = b""  # an event's first bytes, its line not ended yet
            async for data in response.aiter_raw():
                *lines, rest = (rest + data).split(b"\n") if rest else data.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _watch_event(line)
            if rest.strip():
                yield _watch_event(rest)
        except WireError as e:
            raise _error(e) from None
        finally:
            await response.aclose()

    # ---- writes ----------------------------------------------------------------------------------

    async def create(self, obj: Obj) -> Obj:
        """POST `obj` (a 409 ConflictError when it exists)."""
        return await self._write("POST", obj, named=False)

    async def replace(self, obj: Obj) -> Obj:
        """PUT `obj`; its metadata.resourceVersion makes it conditional (409 ConflictError when the
        object changed since)."""
        return await self._write("PUT", obj, named=True)

    async def _write(self, method: str, obj: Obj, *, named: bool) -> Obj:
        """POST to the collection or PUT to the object's own URL (`named`): the answer's object."""
        meta = obj.get("metadata") or {}
        r = self.resource(obj["apiVersion"], obj["kind"])
        url = self.path(r, meta.get("namespace"))
        if named:
            url = f"{url}/{meta['name']}"

        what = f"{method} {r.kind} {meta.get('namespace')}/{meta.get('name')}"
        body = json.dumps(obj, separators=(",", ":")).encode()
        return await self._call(what, lambda: self._exchange(method, url, body))

    async def _exchange(
        self,
        method: str,
        path: str,
        body: bytes,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Obj:
        """One plain request over the lean client: the object its 200 or 201 answer holds (what it
        wrote), else the answer's ApiError. Callers retry it through _call."""
        written: Obj = json.loads(await self._exchange_raw(method, path, body, content_type, params))
        return written

    async def _exchange_raw(
        self,
        method: str,
        path: str,
        body: bytes,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> bytes:
        """_exchange's answer as the bytes of a 200 or 201, not decoded."""
        headers = {"Content-Type": content_type}
        response = await self._transport.lean(method, path, params, body, headers, self.timeouts)
        try:
            data = await response.aread()
        finally:
            await response.aclose()
        if response.status_code not in (200, 201):
            raise _response_error(response, data)
        return data

    async def create_review(self, review: Obj) -> Obj:
        """POST a TokenReview or a SubjectAccessReview (create-only, cluster-scoped: nothing is stored)
        and return the API server's answer, its `status` filled in. The caller keeps tokens out of logs."""
        r = REVIEW_RESOURCES[review["kind"]]
        obj = _lightkube_class(r)(review)

        async def call() -> Any:
            return await self._lk.create(obj)

        return _to_dict(await self._call(f"POST {r.kind}", call))

    # ---- writes (server-side apply) ----------------------------------------------------------------

    async def apply(self, obj: Obj, field_manager: str, force: bool = True) -> Obj:
        """Server-side apply `obj` (apiVersion, kind, metadata.name[, namespace]); returns the result.

        With force=True this manager takes over fields another manager set (the operator is the
        authority on its children)."""
        meta = obj.get("metadata") or {}
        r = self.resource(obj["apiVersion"], obj["kind"])
        name, namespace = meta["name"], meta.get("namespace")
        return await self._apply(r, namespace, name, "", obj, field_manager, force)

    async def _apply(
        self,
        r: Resource,
        namespace: str | None,
        name: str,
        subresource: str,
        body: Obj,
        field_manager: str,
        force: bool,
    ) -> Obj:
        """PATCH application/apply-patch+yaml (JSON is YAML) on the object's URL, or its `subresource`'s;
        the answer's object. A plain request, as create and replace: lightkube's patch built a request
        object and decoded the answer into a resource object and back, a third of a probe cycle's status
        write on the main loop (issue 21's profile at 1,000 ServedModels)."""
        what, url, content, params = self._apply_request(
            r, namespace, name, subresource, body, field_manager, force
        )
        return await self._call(what, lambda: self._exchange("PATCH", url, content, _APPLY_PATCH, params))

    def _apply_request(
        self,
        r: Resource,
        namespace: str | None,
        name: str,
        subresource: str,
        body: Obj | bytes,
        field_manager: str,
        force: bool,
    ) -> tuple[str, str, bytes, dict[str, str]]:
        """(what, URL path, body bytes, query) of a server-side apply (`body` as JSON already, or not)."""
        url = f"{self.path(r, namespace)}/{name}{subresource}"
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        content = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        return f"APPLY {r.kind}{subresource} {namespace}/{name}", url, content, params

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
        other managers' fields stay (status.conditions is a list-map keyed by `type`; so are a Pod's
        conditions, which makes this the way to set a readiness-gate condition too). Returns the whole
        object after the write."""
        r = self.resource(api_version, plural)
        body = _status_body(api_version, r, namespace, name, status)
        return await self._apply(r, namespace, name, "/status", body, field_manager, force)

    async def apply_status_unread(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        status: Obj,
        field_manager: str,
        *,
        force: bool = True,
        encoded: bytes | None = None,
    ) -> None:
        """apply_status for a writer whose cache a watch of the object feeds: the answer is read off the
        connection and dropped, not decoded, since the object comes back as its watch event (decoding
        both was ~4 % of the operator's samples probing 1,000 ServedModels every 60 s; issue 21).
        `encoded`: `status` as JSON, where the writer holds it already (the probe's last patch): sent as
        it is, not encoded again."""
        r = self.resource(api_version, plural)
        body: Obj | bytes = (
            _status_body(api_version, r, namespace, name, status)
            if encoded is None
            else _status_json(api_version, r, namespace, name, encoded)
        )
        what, url, content, params = self._apply_request(
            r, namespace, name, "/status", body, field_manager, force
        )
        await self._call(what, lambda: self._exchange_raw("PATCH", url, content, _APPLY_PATCH, params))

    async def patch(self, api_version: str, plural: str, namespace: str | None, name: str, patch: Obj) -> Obj:
        """A JSON merge patch of the object (metadata.resourceVersion in it makes it conditional)."""
        r, cls = self._res(api_version, plural)

        async def call() -> Any:
            kwargs: dict[str, Any] = {"namespace": namespace} if r.namespaced else {}
            return await self._lk.patch(cls, name, patch, patch_type=PatchType.MERGE, **kwargs)

        return _to_dict(await self._call(f"PATCH {r.kind} {namespace}/{name}", call))

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
        r, cls = self._res(api_version, plural)

        async def call() -> None:
            kwargs: dict[str, Any] = {"namespace": namespace} if r.namespaced else {}
            await self._lk.delete(cls, name, cascade=CascadeType(propagation), **kwargs)

        try:
            await self._call(f"DELETE {r.kind} {namespace}/{name}", call)
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
        event: Obj = {
            "apiVersion": "v1",
            "kind": "Event",
            # A name of its own, chosen once (not generateName): a POST the client retries after a
            # lost answer (the API server died mid-request) is refused 409 instead of posted twice.
            "metadata": {
                "name": f"{str(meta.get('name', 'object'))[:200]}.{secrets.token_hex(8)}",
                "namespace": namespace,
            },
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
        path = self.path(self.resource("v1", "Event"), namespace)
        body = json.dumps(event, separators=(",", ":")).encode()
        attempts = 0

        async def once() -> Obj:
            nonlocal attempts
            attempts += 1
            try:
                return await self._exchange("POST", path, body)
            except ConflictError:
                if attempts > 1:
                    return event  # an earlier attempt of this very request created it
                raise

        return await self._call(f"POST Event {namespace}", once)
