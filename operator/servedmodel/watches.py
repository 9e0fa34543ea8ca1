"""What the operator watches, and which ServedModel each event enqueues.

Every watch is filtered by the API server (a label or field selector): ServedModels (all of them), the
operator's children — Deployments, Pods, Services, PVCs, HPAs, labelled
``app.kubernetes.io/managed-by=servedmodel-operator`` (KEDA's keda-hpa-<name> carries the ScaledObject's
labels, so the filter finds it too) —, the chat-template ConfigMaps, labelled
``inference.servedmodel.io/chat-template``, and pods' Pulled Events (routed nowhere: the prober reads
them). k8s/informer.py lists and watches each into the cache and calls `route` with every change;
`route` only decides what to enqueue:

- a ServedModel: when something the reconciler reads changed (generation, labels, annotations,
  deletion, finalizers, the reconciler's own status fields, the probe's Serving verdict and its rollout
  verdict, status.rollout's blocked and last proven revisions): the probe's
  other status writes — latencies every cycle, and Serving's message while it is True — reconcile
  nothing;
- a child: its owner (controller ownerReference, else the instance label), when that owner is cached:
  a child event never brings back a ServedModel the cache no longer has;
- a ConfigMap: every ServedModel of its namespace whose spec.engine.chatTemplate names it.

A write's answer written through into the cache (`on_written`) is routed the same way, where it carries
another writer's change: its watch event would otherwise arrive as no change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from .api import API_GROUP_VERSION, PLURAL, conditions, names
from .api.base import Key
from .api.probe import rollout_verdict
from .controller import Controller
from .k8s import Cache
from .k8s.cache import EVENT
from .k8s.informer import Handler, Watched
from .render.chat_template import CHAT_TEMPLATE_LABEL, referencing
from .status import RECONCILER_FIELDS

SERVED_MODEL: Final = "ServedModel"
CONFIGMAP: Final = "ConfigMap"
CHILDREN_SELECTOR: Final = f"app.kubernetes.io/managed-by={names.MANAGED_BY}"
PULLED_SELECTOR: Final = "involvedObject.kind=Pod,reason=Pulled"

WATCHES: Final = (
    Watched(API_GROUP_VERSION, PLURAL, SERVED_MODEL),
    Watched("apps/v1", "deployments", "Deployment", CHILDREN_SELECTOR),
    Watched("v1", "pods", "Pod", CHILDREN_SELECTOR),
    Watched("v1", "services", "Service", CHILDREN_SELECTOR),
    Watched("v1", "persistentvolumeclaims", "PersistentVolumeClaim", CHILDREN_SELECTOR),
    Watched("autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", CHILDREN_SELECTOR),
    Watched("v1", "configmaps", CONFIGMAP, CHAT_TEMPLATE_LABEL),
    # A pod's image pulled, for status.startup (prober/cycle.py): watched, not listed once per pod start.
    # The API server keeps no watch cache of Events, so each such list read every Event of the namespace
    # from etcd (~12 µs of API server and etcd CPU per Event there: 60 ms a list at 4,300 Events, once per
    # engine pod started, quadratic in the fleet); this watch's list is once per (re)list.
    Watched("v1", "events", EVENT, field_selector=PULLED_SELECTOR),
)


def metadata_inputs(obj: Mapping[str, Any]) -> Any:
    """What a reconcile reads of a ServedModel's metadata: its users change it, our status writes never."""
    meta = obj.get("metadata") or {}
    return (
        meta.get("generation"),
        meta.get("labels"),
        meta.get("annotations"),
        meta.get("deletionTimestamp"),
        meta.get("finalizers"),
    )


def reconciler_inputs(obj: Mapping[str, Any] | None) -> Any:
    """What a reconcile of this ServedModel depends on, besides its children."""
    if obj is None:
        return None
    status = obj.get("status") or {}
    serving = conditions.find(status.get("conditions"), conditions.SERVING) or {}
    # Serving's message reaches the reconciler's status only when it degrades the phase (status.py's
    # _degraded_by_probe): while Serving is True it carries the cycle's TTFT and changes every cycle.
    message_read = serving.get("status") == "False" or serving.get("reason") == conditions.REPLICAS_FAILING
    return (
        *metadata_inputs(obj),
        {k: status.get(k) for k in RECONCILER_FIELDS},
        [c for c in status.get("conditions") or [] if c.get("type") in conditions.RECONCILER_CONDITIONS],
        (serving.get("status"), serving.get("reason"), serving.get("message") if message_read else None),
        # the probe's rollout verdict: the reconciler rolls a Blocked revision back (reconcile.rollback)
        rollout_verdict(status.get("rollout")),
    )


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def route(kind: str, cache: Cache, controller: Controller) -> Handler:
    """The informer handler of `kind`: (type, cached before, cached after) → enqueue."""
    if kind == SERVED_MODEL:

        def served_model(type_: str, old: Any, new: Any) -> None:
            if new is None:
                controller.forget(*_key(old))
            elif old is None or reconciler_inputs(old) != reconciler_inputs(new):
                controller.enqueue(*_key(new))

        return served_model
    if kind == CONFIGMAP:

        def configmap(type_: str, old: Any, new: Any) -> None:
            namespace, name = _key(new if new is not None else old)
            for served_model in referencing(cache.list(SERVED_MODEL, namespace), namespace, name):
                controller.enqueue(namespace, served_model)

        return configmap
    if kind == EVENT:
        # Read by the prober when a pod's start ends (Cache.events_about); nothing to reconcile.
        return lambda type_, old, new: None

    def child(type_: str, old: Any, new: Any) -> None:
        owner = Cache.owner_key(new if new is not None else old)
        if owner is not None and cache.get(SERVED_MODEL, *owner) is not None:
            controller.enqueue(*owner)

    return child


def on_written(controller: Controller) -> Callable[[str, Any, Any], None]:
    """Cache.on_written: a ServedModel write's answer stored in the cache, routed as the watch event it
    hides would be.

    The answer is the object as it is now, other writers' changes included: the reconciler's or the
    probe's status write answered with the spec a user applied since the pass read it. That change's
    watch event then arrives older than the answer (ignored), and the answer's own event equal to it (no
    change): a new generation landing under a status write was never reconciled (a fresh-clone CI run:
    autoscaling applied while the first pass wrote Ready, no HPA in 120 s). Only the metadata is compared:
    the status is what the writer wrote. Routed here, the ServedModel's own event of that state is not
    routed again (Cache.routed_on_write). A child needs nothing of this: its route enqueues the owner on
    every event, the one of a state its write's answer stored included."""

    def written(kind: str, old: Any, new: Any) -> None:
        # nothing cached before (rare: passes start from the cache): its ADDED event would find this copy
        if kind == SERVED_MODEL and (old is None or metadata_inputs(old) != metadata_inputs(new)):
            controller.enqueue(*_key(new))

    return written


def handlers(cache: Cache, controller: Controller) -> dict[str, Callable[[str, Any, Any], None]]:
    """The informers' handler of every watched kind; and the cache's write-through router (on_written)."""
    cache.on_written = on_written(controller)
    cache.routed_on_write = {SERVED_MODEL}
    return {w.kind: route(w.kind, cache, controller) for w in WATCHES}


def leader_keys(cache: Cache) -> list[Key]:
    """Every cached ServedModel's key, for a replica that starts leading to look at once: the unsettled
    first (a generation not yet observed, or a phase other than Ready). The queue is FIFO, so models
    mid-creation when the Lease changed hands would otherwise wait behind a no-op pass over every settled
    one; on a starved machine, a leader that kept losing and retaking its Lease never reached them."""

    def settled(key: Key) -> bool:
        obj = cache.get(SERVED_MODEL, *key) or {}
        status = obj.get("status") or {}
        observed = status.get("observedGeneration") == (obj.get("metadata") or {}).get("generation")
        return observed and status.get("phase") == conditions.READY

    return sorted(cache.keys(SERVED_MODEL), key=settled)  # stable: False (unsettled) first
