"""The reconcile sequence: validate → discover → render → apply → prune → observe → status → events.

No kopf here: handlers/ call `reconcile()` and turn its `Outcome` into Events, retries and metrics.

- validate: `ServedModel` (pydantic) on the body; a spec the CRD schema let through but the model or
  render rejects becomes the InvalidSpec condition and a permanent outcome (no retry until it changes).
- apply: server-side apply of every rendered child as `config.field_manager`, force=True; render puts
  the controller owner reference on each, so deleting the ServedModel garbage-collects them.
- prune: children of this ServedModel (by owner uid) that the spec no longer renders (a Route after
  expose.route=false, everything after a switch to external mode) are deleted.
- status: `status.compute_status` from the observed Deployment, Pods and Route, written with one
  server-side apply on /status, and only when it differs from what is there (ignoring times).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import pydantic

from . import scaling
from .access import SECRET_NOT_ALLOWED, secret_refusal
from .api import API_GROUP_VERSION, PLURAL, ServedModel, conditions, names
from .config import OperatorConfig
from .k8s import ApiError, Cache, ConflictError, KubeClient
from .k8s.cache import owned_by
from .k8s.reader import Reader
from .render import RenderContext, RenderError, render
from .render.autoscaling import HPA_API, KEDA_API, hpa_name, keda_hpa_name, wakes
from .render.chat_template import TEMPLATE_UNREADABLE, TemplateMissing, running_digest, template_digest
from .render.inference_pool import INFERENCE_OBJECTIVE_API, INFERENCE_POOL_API
from .render.wake import HTTP_ADD_ON_API
from .render.workers import LWS_API
from .status import (
    ApplyFailed,
    External,
    InvalidSpec,
    Managed,
    Mode,
    Observed,
    Problem,
    Subject,
    Transition,
    compute_status,
    group_as_deployment,
    ready_groups,
    status_changed,
    transitions,
)

log = logging.getLogger(__name__)

ROUTE_API: Final = "route.openshift.io/v1"
APPLY_FAILED: Final = "ApplyFailed"
# A Blocked revision to roll back, and no ReplicaSet of the last proven one left (revisionHistoryLimit).
ROLLBACK_UNAVAILABLE: Final = "RollbackUnavailable"
MONITORING_API: Final = "monitoring.coreos.com/v1"
# (apiVersion, plural, kind) of every kind of child the operator may have made; optional APIs last.
CHILD_KINDS: Final = (
    ("apps/v1", "deployments", "Deployment"),
    ("v1", "services", "Service"),
    ("v1", "persistentvolumeclaims", "PersistentVolumeClaim"),
    (ROUTE_API, "routes", "Route"),
    (MONITORING_API, "servicemonitors", "ServiceMonitor"),
    (HPA_API, "horizontalpodautoscalers", "HorizontalPodAutoscaler"),
    (KEDA_API, "scaledobjects", "ScaledObject"),
    (KEDA_API, "triggerauthentications", "TriggerAuthentication"),
    (HTTP_ADD_ON_API, "httpscaledobjects", "HTTPScaledObject"),
    (INFERENCE_POOL_API, "inferencepools", "InferencePool"),
    (INFERENCE_OBJECTIVE_API, "inferenceobjectives", "InferenceObjective"),
    (LWS_API, "leaderworkersets", "LeaderWorkerSet"),
)
# spec.workers without the LeaderWorkerSet API in the cluster: nothing runs the engine.
LWS_MISSING: Final = "LeaderWorkerSetMissing"
# The LeaderWorkerSet's status says fewer (or more) ready groups than its pods do: its controller has not
# caught up, and no watch brings its status update (LeaderWorkerSets are not watched: the API is optional).
GROUP_RECHECK_S: Final = 2.0


@dataclass
class Outcome:
    """What one reconcile did. `status` is the reconciler's fragment as computed (written or not)."""

    status: dict[str, Any]
    written: bool
    transitions: list[Transition] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # "Kind/name"
    pruned: list[str] = field(default_factory=list)
    invalid_spec: str | None = None  # permanent: retrying cannot help until the spec changes
    apply_error: str | None = None  # temporary: retry later
    apply_reason: str | None = None  # why the children were applied (None: they were not)
    deferred: bool = False  # nothing written: the Deployment controller is behind (its event follows)
    recheck_after: float | None = None  # look again in this many seconds (a LeaderWorkerSet's lagging status)


def utc_now() -> str:
    """RFC 3339 with second precision, as Kubernetes writes metav1.Time."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def validation_message(error: pydantic.ValidationError, limit: int = 3) -> str:
    """A short human message: the first few field errors as `spec.path: message`."""
    parts = []
    for e in error.errors()[:limit]:
        loc = ".".join(str(x) for x in e["loc"] if not isinstance(x, int)) or "spec"
        parts.append(f"{loc}: {e['msg']}")
    more = error.error_count() - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse(body: Mapping[str, Any]) -> ServedModel:
    """The CR as a model; status is left out (the probe's fields there are not ours to validate)."""
    return ServedModel.from_body({k: v for k, v in body.items() if k != "status"})


async def observe(
    reader: Reader, name: str, namespace: str, *, with_route: bool, group: bool = False
) -> Observed:
    """The engine Deployment, its Pods and the Route, through the Reader: from the watch-fed cache (no
    request), from the API server only for a kind no watch feeds (the Route on OpenShift; the
    LeaderWorkerSet, read with `group` in the Deployment's place, status.group_as_deployment).

    Nothing is polled: a Deployment whose controller has not yet seen its newest generation is
    reported as it is (see `deployment_lagging`), and its next status update is a watch event that
    enqueues this ServedModel again.
    """
    if group:
        lws = await reader.get(LWS_API, "leaderworkersets", namespace, names.leader_worker_set_name(name))
        deployment = group_as_deployment(lws)
    else:
        deployment = await reader.get("apps/v1", "deployments", namespace, names.deployment_name(name))
    pods = await reader.list("v1", "pods", namespace, names.selector_labels(name))
    route = await reader.get(ROUTE_API, "routes", namespace, names.route_name(name)) if with_route else None
    return Observed(deployment=deployment, pods=pods, route=route)


async def chat_template(
    reader: Reader, namespace: str, cr: ServedModel
) -> tuple[str | None, TemplateMissing | None]:
    """(the digest the pod template carries, why the named template is missing) for
    spec.engine.chatTemplate: the ConfigMap key's digest, the ConfigMap from the cache (labelled ones are
    watched) or else the API server. While it is missing (or unreadable), the digest the running pods
    already carry is kept: a deleted ConfigMap must not roll healthy pods into ones that cannot start."""
    ref = cr.spec.engine.chat_template
    if ref is None:
        return None, None
    try:
        found = template_digest(await reader.get("v1", "configmaps", namespace, ref.name), ref)
    except ApiError as e:
        if e.status == 0:
            raise  # unreachable: the caller backs off
        found = TemplateMissing(
            TEMPLATE_UNREADABLE, f"spec.engine.chatTemplate: ConfigMap {ref.name}: {e.status} {e.reason}"
        )
    if isinstance(found, str):
        return found, None
    deployment = await reader.get("apps/v1", "deployments", namespace, names.deployment_name(cr.name))
    return running_digest(deployment), found


def secrets_handed_on(
    cr: ServedModel, config: OperatorConfig, objects: list[dict[str, Any]]
) -> list[tuple[str, str]]:
    """(field, Secret name) of each Secret the rendered children hand to code that is not the operator's
    to vouch for: KEDA reads the TriggerAuthentication's (bearer token, CA), and an engine image the
    admin did not configure gets the Secrets of its env (API key, HF token). Those need their owner's
    opt-in as the probe's own Secrets do (servedmodel.access); the admin's engine images do not."""
    out: list[tuple[str, str]] = []
    auto = cr.spec.autoscaling
    if (
        auto is not None
        and auto.prometheus is not None
        and any(o["kind"] == "TriggerAuthentication" for o in objects)
    ):
        if auto.prometheus.bearer_token_secret_ref is not None:
            out.append(
                (
                    "spec.autoscaling.prometheus.bearerTokenSecretRef",
                    auto.prometheus.bearer_token_secret_ref.name,
                )
            )
        if auto.prometheus.ca_secret_ref is not None:
            out.append(("spec.autoscaling.prometheus.caSecretRef", auto.prometheus.ca_secret_ref.name))
    image = cr.spec.engine.image
    if image is not None and image not in {config.vllm_image, config.vllm_cpu_image, config.simulator_image}:
        if cr.spec.engine.api_key_secret_ref is not None:
            out.append(("spec.engine.apiKeySecretRef", cr.spec.engine.api_key_secret_ref.name))
        if cr.spec.hf_token_secret_ref is not None:
            out.append(("spec.hfTokenSecretRef", cr.spec.hf_token_secret_ref.name))
    return out


async def secrets_refused(
    client: KubeClient, namespace: str, servedmodel: str, refs: list[tuple[str, str]]
) -> str | None:
    """Why the first of `refs` may not be handed on (its owner's opt-in missing, or unreadable), or None.
    Read at every pass: annotating the Secret takes effect at the ServedModel's next pass."""
    for spec_field, secret_name in refs:
        try:
            secret = await client.get("v1", "secrets", namespace, secret_name)
        except ApiError as e:
            if e.status == 0:
                raise  # unreachable: the caller backs off
            return (
                f"{SECRET_NOT_ALLOWED}: {spec_field}: the operator cannot read Secret {secret_name} to check "
                f"its owner's opt-in ({e.status} {e.reason}); bind servedmodel-operator-secret-reader in "
                f"{namespace}"
            )
        if secret is None:
            return f"{SECRET_NOT_ALLOWED}: {spec_field}: Secret {secret_name} not found"
        refusal = secret_refusal(secret, servedmodel, spec_field)
        if refusal is not None:
            return f"{refusal.reason}: {refusal.message}"
    return None


def deployment_lagging(observed: Observed) -> bool:
    """The Deployment controller has not yet observed the Deployment's newest generation: its status
    describes the previous template (an annotation bumps the generation too, without a rollout)."""
    return observed.deployment is not None and _unobserved(observed.deployment)


def differs(desired: Any, actual: Any) -> bool:
    """Does `actual` (a live object) lack something `desired` (what render makes) sets? Maps compare
    key by key (the server adds defaults, which are not a difference), lists item by item, scalars by
    value. A false "differs" costs one no-op apply; a missed one, a drift that stays."""
    if isinstance(desired, Mapping):
        if not isinstance(actual, Mapping):
            return True
        return any(differs(v, actual.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return True
        return any(differs(d, a) for d, a in zip(desired, actual, strict=True))
    if isinstance(desired, bool) or isinstance(actual, bool):
        return desired is not actual
    if isinstance(desired, int | float) and isinstance(actual, int | float):
        return float(desired) != float(actual)
    return bool(desired != actual)


def why_apply(body: Mapping[str, Any], objects: list[dict[str, Any]], cache: Cache) -> str | None:
    """Why this pass must apply the children (None: they are as rendered), as controller-runtime
    decides: a generation the status has not observed, the last apply failed, or a child missing or
    changed in the cache (kinds no watch feeds are checked only with the generation)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    if int(status.get("observedGeneration") or 0) != int(meta.get("generation") or 0):
        return "new generation"
    degraded = conditions.find(status.get("conditions"), "Degraded") or {}
    if degraded.get("reason") == APPLY_FAILED:
        return "the last apply failed"
    namespace = str(meta.get("namespace") or "default")
    for obj in objects:
        kind, child = obj["kind"], obj["metadata"]["name"]
        if not cache.tracks(kind):
            continue
        live = cache.get(kind, namespace, child)
        if live is None:
            return f"{kind}/{child} missing"
        if differs(obj, live):
            return f"{kind}/{child} changed"
    return None


def _unobserved(deployment: Mapping[str, Any]) -> bool:
    seen = int((deployment.get("status") or {}).get("observedGeneration") or 0)
    return seen < int((deployment.get("metadata") or {}).get("generation") or 0)


async def prune(
    reader: Reader,
    name: str,
    namespace: str,
    uid: str,
    keep: set[tuple[str, str]],
    optional: dict[str, bool],
) -> list[str]:
    """Delete this ServedModel's children (owner uid) whose (kind, name) is not in `keep`.

    Child names are fixed per ServedModel (api.names), so a kind that is still rendered has nothing
    to prune: only the kinds missing from `keep` are looked at, in the cache when a watch feeds that
    kind, else listed (one request each).
    """
    labels = {"app.kubernetes.io/instance": name, "app.kubernetes.io/managed-by": names.MANAGED_BY}
    kept_kinds = {kind for kind, _ in keep}
    pruned = []
    for api_version, plural, kind in CHILD_KINDS:
        if kind in kept_kinds or not optional.get(api_version, True):
            continue
        for obj in await reader.list(api_version, plural, namespace, labels):
            child = (obj.get("metadata") or {}).get("name", "")
            if (kind, child) not in keep and owned_by(obj, uid):
                await reader.client.delete(api_version, plural, namespace, child)
                pruned.append(f"{kind}/{child}")
    return pruned


async def hand_over_replicas(client: KubeClient, namespace: str, name: str, field_manager: str) -> None:
    """Before an apply without spec.replicas: keep the live value owned (see servedmodel.scaling), so
    server-side apply does not reset the Deployment to 1 replica under the autoscaler."""
    for _attempt in range(3):  # a rescale between the read and the write: read the new count again
        live = await client.get("apps/v1", "deployments", namespace, names.deployment_name(name))
        if live is None or not scaling.needs_handover(live, field_manager):
            return
        try:
            await client.apply(scaling.handover_object(live), scaling.HANDOVER_MANAGER, force=True)
            return
        except ConflictError:
            continue
    # Still rescaling: applying without spec.replicas now could reset it to 1; this pass fails and retries.
    raise ConflictError(409, "Conflict", "Deployment rescaled during the replicas handover three times")


async def observe_autoscaler(
    reader: Reader,
    cr: ServedModel,
    observed: Observed,
    previous: Mapping[str, Any] | None,
    *,
    keda: bool,
    wakes: bool = True,
) -> dict[str, Any] | None:
    """status.autoscaling from the HPA that scales the Deployment (ours, or the one KEDA makes): from
    the watch-fed cache where HPAs are watched (their status changes enqueue the ServedModel)."""
    if cr.spec.autoscaling is None:
        return None
    namespace = cr.metadata.namespace or "default"
    hpa = keda_hpa_name(cr.name) if keda else hpa_name(cr.name)
    found = await reader.get(HPA_API, "horizontalpodautoscalers", namespace, hpa)
    before = (previous or {}).get("autoscaling")
    return scaling.autoscaling_status(
        cr.spec,
        autoscaler="KEDA" if keda else "HorizontalPodAutoscaler",
        hpa_name=hpa,
        hpa=found,
        deployment=observed.deployment,
        previous=before if isinstance(before, dict) else None,
        wakes=wakes,
    )


PostEvents = Callable[[Mapping[str, Any], list[Transition]], Awaitable[None]]


async def rollback(
    client: KubeClient, reader: Reader, cr: ServedModel, objects: list[dict[str, Any]], previous: Any
) -> Problem | None:
    """Put the last proven revision's pod template into the rendered Deployment when the probe says the
    revision this spec renders is Blocked (status.rollout, probe/replicas.rollout_status) and
    spec.rollout.automaticRollback allows it: the template comes from that revision's ReplicaSet, as
    `kubectl rollout undo` takes it; spec stays as the user wrote it. Degraded says so (RolledBack), or
    why it cannot (RollbackUnavailable: no ReplicaSet of that revision left). None: nothing to do."""
    spec = cr.spec
    rollout = (previous or {}).get("rollout") if isinstance(previous, Mapping) else None
    if not isinstance(rollout, Mapping) or not (
        spec.rollout.automatic_rollback and spec.probe.readiness_gate
    ):
        return None
    deployment = next((o for o in objects if o["kind"] == "Deployment"), None)
    if deployment is None:
        return None
    rendered = deployment["spec"]["template"]["metadata"]["labels"].get(names.REVISION_LABEL)
    blocked, good = rollout.get("blockedRevision"), rollout.get("lastProvenRevision")
    if not blocked or blocked != rendered or not good or good == rendered:
        return None
    why = f"revision {blocked} did not pass the readiness gate ({rollout.get('blockedMessage') or 'blocked'})"
    namespace = str(cr.namespace or "default")
    selector = {**names.selector_labels(cr.name), names.REVISION_LABEL: str(good)}
    sets = await client.list("apps/v1", "replicasets", namespace, label_selector=selector)
    live = await reader.get("apps/v1", "deployments", namespace, str(deployment["metadata"]["name"]))
    uid = str(((live or {}).get("metadata") or {}).get("uid") or "")
    owned = [rs for rs in sets if uid and owned_by(rs, uid)]
    if not owned:
        return Problem(
            ROLLBACK_UNAVAILABLE, f"{why}; no ReplicaSet of revision {good} is left to roll back to"
        )
    newest = max(owned, key=lambda rs: str((rs.get("metadata") or {}).get("creationTimestamp") or ""))
    template = dict((newest.get("spec") or {}).get("template") or {})
    meta = dict(template.get("metadata") or {})
    meta.pop("creationTimestamp", None)
    meta["labels"] = {k: v for k, v in (meta.get("labels") or {}).items() if k != "pod-template-hash"}
    deployment["spec"]["template"] = {**template, "metadata": meta}
    annotations = deployment["metadata"].setdefault("annotations", {})
    annotations[names.ROLLED_BACK_FROM_ANNOTATION] = str(blocked)
    return Problem(
        conditions.ROLLED_BACK,
        f"{why}: the engine runs revision {good} again; spec unchanged until you fix it and apply again",
    )


async def finish(
    client: KubeClient,
    cache: Cache,
    config: OperatorConfig,
    body: Mapping[str, Any],
    desired: dict[str, Any],
    post_events: PostEvents | None,
) -> tuple[bool, list[Transition]]:
    """Write the status fragment if it changes something, posting its transitions' Events first: an
    operator that dies between the two posts them again on the next pass instead of never. The
    written object goes into the cache, so the next pass compares against it."""
    if not status_changed(body.get("status"), desired):
        return False, []
    changes = transitions(body.get("status"), desired)
    if post_events is not None and changes:
        await post_events(body, changes)
    meta = body["metadata"]
    written = await client.apply_status(
        API_GROUP_VERSION, PLURAL, meta.get("namespace"), meta["name"], desired, config.field_manager
    )
    cache.upsert("ServedModel", written)
    return True, changes


async def reconcile(
    client: KubeClient,
    body: Mapping[str, Any],
    config: OperatorConfig,
    *,
    cache: Cache | None = None,
    apply: bool | None = None,
    post_events: PostEvents | None = None,
    now: Callable[[], str] = utc_now,
) -> Outcome:
    """One pass over a ServedModel `body` (from the cache, or as the API server gives it).

    apply=None decides from the body and the cache (`why_apply`); True/False force it. Reads come from
    `cache` for every kind a watch feeds it (an empty cache: everything from the API server). Any
    refused child apply (4xx, or a 5xx the client's retries did not get past) becomes Degraded with
    reason ApplyFailed and the server's message, and `Outcome.apply_error` (the caller backs off and
    retries). ApiError propagates only when the API server cannot be reached or refuses a read.
    """
    cache = cache if cache is not None else Cache()
    reader = Reader(client, cache)
    meta = body["metadata"]
    name, namespace = str(meta["name"]), str(meta.get("namespace") or "default")
    generation = int(meta.get("generation") or 0)
    uid = str(meta.get("uid") or "")
    previous = body.get("status")
    subject = Subject(name, namespace, generation, previous, now())

    invalid: str | None = None
    cr: ServedModel | None = None
    objects: list[dict[str, Any]] = []
    optional: dict[str, bool] = {}
    try:
        cr = parse(body)
    except pydantic.ValidationError as e:
        invalid = validation_message(e)
    if cr is not None:
        # Also in external mode: pruning what an earlier, managed spec made needs to know what exists.
        optional = {
            ROUTE_API: await client.discover(ROUTE_API),
            MONITORING_API: await client.discover(MONITORING_API),
            KEDA_API: await client.discover(KEDA_API),
            HTTP_ADD_ON_API: await client.discover(HTTP_ADD_ON_API),
            INFERENCE_POOL_API: await client.discover(INFERENCE_POOL_API),
            INFERENCE_OBJECTIVE_API: await client.discover(INFERENCE_OBJECTIVE_API),
            LWS_API: await client.discover(LWS_API),
        }
    template_missing: TemplateMissing | None = None
    rolled_back: Problem | None = None
    if cr is not None and not cr.spec.external:
        template_digest, template_missing = await chat_template(reader, namespace, cr)
        ctx = RenderContext.from_config(
            config,
            has_route_api=optional[ROUTE_API],
            has_service_monitor_api=optional[MONITORING_API],
            has_keda_api=optional[KEDA_API],
            has_http_add_on_api=optional[HTTP_ADD_ON_API],
            has_inference_pool_api=optional[INFERENCE_POOL_API],
            has_inference_objective_api=optional[INFERENCE_OBJECTIVE_API],
            has_lws_api=optional[LWS_API],
            chat_template_digest=template_digest,
        )
        try:
            objects = render(cr, ctx)
        except RenderError as e:
            invalid = str(e)
        if invalid is None:
            invalid = await secrets_refused(
                client, namespace, cr.name, secrets_handed_on(cr, config, objects)
            )
        if invalid is None:
            rolled_back = await rollback(client, reader, cr, objects, previous)

    if invalid is not None:
        # Children of the last good spec stay as they are (and may still serve); say what is wrong.
        observed = await observe(reader, name, namespace, with_route=False)
        desired = compute_status(subject, InvalidSpec(invalid, observed))
        written, changes = await finish(client, cache, config, body, desired, post_events)
        return Outcome(desired, written, changes, invalid_spec=invalid)
    assert cr is not None

    applied: list[str] = []
    pruned: list[str] = []
    apply_error: tuple[str, str] | None = None
    reason = why_apply(body, objects, cache) if apply is None else ("requested" if apply else None)
    if reason is not None:
        assert cr is not None
        autoscaled = cr.spec.autoscaling is not None

        async def apply_one(obj: dict[str, Any]) -> tuple[str, ApiError | None]:
            ref = f"{obj['kind']}/{obj['metadata']['name']}"
            try:
                if obj["kind"] == "Deployment" and autoscaled:
                    await hand_over_replicas(client, namespace, name, config.field_manager)
                cache.upsert(obj["kind"], await client.apply(obj, config.field_manager, force=True))
            except ApiError as e:
                if e.status == 0:
                    raise  # unreachable: nothing can be written either; the caller backs off
                log.warning("[%s/%s] apply %s failed: %s", namespace, name, ref, e)
                return ref, e
            return ref, None

        # The children do not depend on each other (a pod waits for its claim, garbage collection for
        # nothing): applied at once, one round trip per pass instead of one per child.
        for ref, error in await asyncio.gather(*(apply_one(obj) for obj in objects)):
            if error is None:
                applied.append(ref)
            elif apply_error is None:
                apply_error = (APPLY_FAILED, f"{ref}: {error.status} {error.reason}: {error.message}")
        if uid and apply_error is None:
            keep = {(o["kind"], o["metadata"]["name"]) for o in objects}
            pruned = await prune(reader, name, namespace, uid, keep, optional)

    # The probe's Serving condition (its field manager's): a Ready model whose chat requests fail is
    # Degraded. The probe's status write is a ServedModel event, so this pass follows it at once.
    serving = conditions.find((previous or {}).get("conditions"), conditions.SERVING)
    serving = serving if cr.spec.probe.enabled else None
    served_model_name = cr.spec.resolved_served_model_name
    mode: Mode
    if cr.spec.endpoint is not None:
        mode = External(cr.spec.endpoint, served_model_name, serving)
    else:
        with_route = any(o["kind"] == "Route" for o in objects)
        group = cr.spec.workers is not None
        observed = await observe(reader, name, namespace, with_route=with_route, group=group)
        if reason is None and deployment_lagging(observed):
            # The Deployment controller has not caught up with a change that was not ours (an
            # annotation bumps the generation without a rollout): its status update is a watch event
            # that brings this ServedModel back; writing now would flap Progressing and back.
            return Outcome(dict(previous or {}), False, deferred=True)
        if apply_error is not None:
            mode = ApplyFailed(observed, served_model_name, *apply_error)
        else:
            autoscaling = await observe_autoscaler(
                reader,
                cr,
                observed,
                previous,
                keda=optional.get(KEDA_API, False),
                wakes=wakes(
                    cr,
                    optional.get(KEDA_API, False),
                    optional.get(HTTP_ADD_ON_API, False),
                    config.keda_http_scaler_address,
                ),
            )
            missing = None
            if template_missing is not None:
                missing = Problem(template_missing.reason, template_missing.message)
            if group and not optional.get(LWS_API, False):
                missing = Problem(
                    LWS_MISSING,
                    f"spec.workers needs the LeaderWorkerSet API ({LWS_API}), which this cluster does not "
                    "serve: install LeaderWorkerSet (sigs.k8s.io/lws); nothing runs the engine until then",
                )
            mode = Managed(observed, served_model_name, serving, autoscaling, missing, rolled_back)
    desired = compute_status(subject, mode)
    written, changes = await finish(client, cache, config, body, desired, post_events)
    recheck = None
    if isinstance(mode, Managed) and mode.observed.deployment is not None and cr.spec.workers is not None:
        said = int((mode.observed.deployment.get("status") or {}).get("readyReplicas") or 0)
        if said != ready_groups(mode.observed.pods, names.LWS_GROUP_INDEX_LABEL):
            recheck = GROUP_RECHECK_S
    return Outcome(
        desired,
        written,
        changes,
        applied=applied,
        pruned=pruned,
        apply_error=apply_error[1] if apply_error else None,
        apply_reason=reason,
        recheck_after=recheck,
    )
