"""A watch-fed, in-memory store of Kubernetes objects: what the control loop reads instead of the API server.

Pure (no I/O, no kopf, no clock): the informers (k8s/informer.py) feed it every list and watch event
of the ServedModels, the operator's children and the chat-template ConfigMaps, and the writers (the
reconciler, the probe) may write their own responses through (`upsert`) so the next pass does not act
on a stale copy.

Objects are the API's JSON dicts, stored by kind → namespace → name. `metadata.managedFields` and the
`kubectl.kubernetes.io/last-applied-configuration` annotation are dropped on the way in: they are large
and nobody reads them, and the cache holds thousands of Pods. A Pod keeps only its metadata, its status
and the few spec fields the operator reads (`POD_SPEC_FIELDS`, containers' names and ports): its
containers' args, env, probes and volumes are the Deployment's, and a Pod is the most numerous object
held. Stored dicts are shared: treat what the read API returns as read-only (copy before changing it).

Index: objects are also kept by their ``app.kubernetes.io/instance`` label (the ServedModel they belong
to), so a ``list`` whose labels name the instance reads that ServedModel's objects only, not every
object of the kind: the probe scheduler and the reconciler list a model's Pods on every pass, and with
a thousand models a scan of every Pod made that quadratic.

Read API (what the reconciler, the probe scheduler and autoscaling use):

- ``cache.get(kind, namespace, name) -> Obj | None``
- ``cache.list(kind, namespace=None, *, labels=None) -> list[Obj]``: every object of `kind` (one
  namespace, or all when None) whose labels include every ``labels`` pair (a value of ``None`` only
  requires the key); sorted by name.
- ``cache.owner_key(obj) -> (namespace, name) | None``: the ServedModel an object belongs to (its
  controller ownerReference of kind ServedModel, else the ``app.kubernetes.io/instance`` label).
- ``cache.keys(kind) -> list[(namespace, name)]``; ``cache.tracks(kind)``: whether anything feeds it;
  ``len(cache)``; ``cache.count(kind)``.

Kinds are named by their `kind` ("ServedModel", "Deployment", "Pod", "Service", "PersistentVolumeClaim",
"ConfigMap", "HorizontalPodAutoscaler", "ScaledObject", ...): the operator never watches two kinds
of the same name from different groups.

Ordering: a watch delivers one kind's events in order, but a written-through response can be newer
than an event still in flight. An event or upsert whose `metadata.resourceVersion` is older than the
stored one (compared as integers, which etcd-backed API servers hand out) is ignored; when either is not
an integer the newer arrival wins, as in client-go's informers. So a write's answer that also carries
another writer's change (our status write answered with the user's new spec) hides that change's watch
event; ``on_written(kind, before, now)`` is told of every answer stored, for the operator to route it
as the event would have been (watches.on_written).

Deletes, as client-go's informers keep them (what k8s/informer.py relies on):

- ``replace(kind, objects, resource_version, namespace=None)``: a relist's answer replaces what the
  cache holds of that kind (in that namespace): what the list lacks is deleted, unless it is newer than
  the list (a write-through that landed after the list's snapshot). It returns the changes as
  `Delta`s, so the informer can enqueue the owners of what went away.
- a DELETED event removes the object only if the uid matches (a delete + recreate of one name can
  deliver the new object's write-through before the old one's DELETED);
- deleted uids are remembered (a bounded set of tombstones): a write-through that lands after the
  DELETED event never re-inserts the object;
- ``evict(kind, obj)``: a write for `obj` answered 404 drops that object as its DELETED event would
  (by uid: a newer one of the same name stays) and tombstones its uid.
"""

from __future__ import annotations

import builtins
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from servedmodel.api.base import Key, Obj

EventType = Literal["ADDED", "MODIFIED", "DELETED"] | str | None

SERVED_MODEL: Final = "ServedModel"
EVENT: Final = "Event"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"
LAST_APPLIED: Final = "kubectl.kubernetes.io/last-applied-configuration"
INTERN_MAX_CHARS: Final = 64  # names, label values, enum-like fields; not messages or templates
# Deleted uids remembered against late write-throughs; a write lands within seconds of its DELETED
# event, so this bounds memory (~100 bytes each) far above any burst of deletes.
TOMBSTONES_MAX: Final = 20_000


@dataclass(frozen=True)
class Delta:
    """One change a relist made: ADDED (`old` None), MODIFIED or DELETED (`new` None)."""

    type: Literal["ADDED", "MODIFIED", "DELETED"]
    old: Obj | None
    new: Obj | None

    @property
    def obj(self) -> Obj:
        found = self.new if self.new is not None else self.old
        assert found is not None
        return found


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _uid(obj: Mapping[str, Any]) -> str:
    return str(_meta(obj).get("uid") or "")


def _rv(obj: Mapping[str, Any]) -> int | None:
    try:
        return int(str(_meta(obj).get("resourceVersion")))
    except ValueError:
        return None


# What the operator reads of a Pod's spec (probe/endpoints.pod_base_url: the engine's port; the rest for
# describing a replica); a container keeps its name, image and ports.
POD_SPEC_FIELDS: Final = ("nodeName", "readinessGates", "restartPolicy")
CONTAINER_FIELDS: Final = ("name", "image", "ports")


def _pod_spec(spec: Mapping[str, Any]) -> Obj:
    out: Obj = {k: spec[k] for k in POD_SPEC_FIELDS if k in spec}
    for key in ("initContainers", "containers"):
        if key in spec:
            out[key] = [{k: c[k] for k in CONTAINER_FIELDS if k in c} for c in spec[key] or []]
    return out


def _interned(value: Any) -> Any:
    """`value` with its dicts' keys (and short strings) interned: every decoded object has its own copy
    of "metadata", "apiVersion", label keys and values..., about a quarter of a cached object's memory."""
    if isinstance(value, Mapping):
        return {sys.intern(k) if isinstance(k, str) else k: _interned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interned(v) for v in value]
    if isinstance(value, str) and len(value) <= INTERN_MAX_CHARS:
        return sys.intern(value)
    return value


def slim(obj: Mapping[str, Any], kind: str | None = None) -> Obj:
    """A copy without managedFields and kubectl's last-applied annotation (nothing here reads them),
    its keys and short strings interned; a Pod's spec cut to what the operator reads."""
    out = dict(obj)
    meta = dict(_meta(obj))
    meta.pop("managedFields", None)
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping) and LAST_APPLIED in annotations:
        meta["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
    out["metadata"] = meta
    if kind == "Pod" and isinstance(out.get("spec"), Mapping):
        out["spec"] = _pod_spec(out["spec"])
    interned: Obj = _interned(out)
    return interned


def _instance(obj: Mapping[str, Any]) -> str | None:
    value = (_meta(obj).get("labels") or {}).get(INSTANCE_LABEL)
    return str(value) if value else None


def _involved(obj: Mapping[str, Any]) -> str | None:
    uid = (obj.get("involvedObject") or {}).get("uid")
    return str(uid) if uid else None


def labels_match(obj: Mapping[str, Any], labels: Mapping[str, str | None]) -> bool:
    """Equality-based selector: every key present, with the value unless the value is None."""
    have = _meta(obj).get("labels") or {}
    return all(k in have and (v is None or have[k] == v) for k, v in labels.items())


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in _meta(obj).get("ownerReferences") or [])


class Cache:
    """kind → namespace → name → object. Single-threaded (the operator's event loop); no locks needed."""

    def __init__(self) -> None:
        self._store: dict[str, dict[str, dict[str, Obj]]] = {}
        # kind → (namespace, instance label) → name → object: the same objects, by ServedModel.
        self._by_instance: dict[str, dict[Key, dict[str, Obj]]] = {}
        # involvedObject.uid → (namespace, name) → Event: an object's Events without a scan of them all.
        self._by_involved: dict[str, dict[Key, Obj]] = {}
        self._fed: set[str] = set()
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        # Told (kind, stored before, stored now) of every write's answer stored. The answer may carry
        # another writer's change (a user's new spec under our status write): its watch event then
        # arrives older than, or equal to, what is stored and is routed as no change, so the operator
        # routes the answer here instead (watches.on_written).
        self.on_written: Callable[[str, Obj | None, Obj], None] | None = None
        # Kinds whose written answers on_written routes as their events would be: a watch event of the
        # state stored already is neither stored nor routed again (upsert).
        self.routed_on_write: set[str] = set()

    # ---- writes (watch events, write-through) ----------------------------------------------------

    def track(self, kind: str) -> None:
        """Declare that a watch feeds `kind` (so `tracks(kind)` is True before its first event)."""
        self._fed.add(kind)
        self._store.setdefault(kind, {})

    def apply_event(self, kind: str, event_type: EventType, obj: Mapping[str, Any]) -> bool:
        """One watch event (kopf's `type`: None for the initial listing, ADDED, MODIFIED, DELETED).

        Returns True when the store changed (a stale event changes nothing; see upsert for an equal one)."""
        self.track(kind)
        if event_type == "DELETED":
            return self._remove_object(kind, obj)
        return self.upsert(kind, obj, written=False)

    def upsert(self, kind: str, obj: Mapping[str, Any], *, written: bool = True) -> bool:
        """Store `obj` unless the stored copy is newer; True when stored. `written`: a write's answer
        (the default for callers), refused when its uid was deleted already."""
        meta = _meta(obj)
        name = meta.get("name")
        if not name:
            return False
        if written and _uid(obj) in self._tombstones:
            return False
        namespace = str(meta.get("namespace") or "")
        bucket = self._store.setdefault(kind, {}).setdefault(namespace, {})
        old = bucket.get(str(name))
        if old is not None:
            old_rv, new_rv = _rv(old), _rv(obj)
            if old_rv is not None and new_rv is not None:
                if new_rv < old_rv:
                    return False  # stale
                # The state stored already: a write's answer that changed nothing, or the watch event of
                # our own write of a kind whose answers on_written routes in full (the probe's status
                # write every cycle: slimmed and routed once, not twice). Other kinds' events are routed
                # even then: their route enqueues the owner for what a write's answer carried in.
                if new_rv == old_rv and (written or kind in self.routed_on_write):
                    return False
            self._unindex(kind, namespace, str(name), old)
        stored = bucket[str(name)] = slim(obj, kind)
        instance = _instance(stored)
        if instance is not None:
            self._by_instance.setdefault(kind, {}).setdefault((namespace, instance), {})[str(name)] = stored
        about = _involved(stored) if kind == EVENT else None
        if about is not None:
            self._by_involved.setdefault(about, {})[(namespace, str(name))] = stored
        if written and self.on_written is not None:
            self.on_written(kind, old, stored)
        return True

    def remove(self, kind: str, namespace: str, name: str, *, uid: str = "") -> bool:
        """Drop the stored object (only if its uid is `uid`, when given) and tombstone its uid."""
        if uid:
            self._tombstone(uid)
        bucket = self._store.get(kind, {}).get(namespace)
        if bucket is None or name not in bucket:
            return False
        if uid and _uid(bucket[name]) not in ("", uid):
            return False  # the name holds a newer object already
        old = bucket.pop(name)
        self._tombstone(_uid(old))
        self._unindex(kind, namespace, name, old)
        if not bucket:
            del self._store[kind][namespace]
        return True

    def evict(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """A write for `obj` was answered 404: that object is gone, whatever the watch has said so far,
        and leaves as its DELETED event would (by uid: a delete + recreate of one name can have the new
        object's ADDED event in the cache before the old one's write comes back 404)."""
        return self._remove_object(kind, obj)

    def _remove_object(self, kind: str, obj: Mapping[str, Any]) -> bool:
        meta = _meta(obj)
        return self.remove(kind, str(meta.get("namespace") or ""), str(meta.get("name")), uid=_uid(obj))

    def _tombstone(self, uid: str) -> None:
        if not uid:
            return
        self._tombstones[uid] = None
        self._tombstones.move_to_end(uid)
        while len(self._tombstones) > TOMBSTONES_MAX:
            self._tombstones.popitem(last=False)

    def replace(
        self,
        kind: str,
        objects: Iterable[Mapping[str, Any]],
        resource_version: str,
        namespace: str | None = None,
    ) -> builtins.list[Delta]:
        """A full list of `kind` (in `namespace`, or all) at `resource_version` replaces what is stored:
        returns what it added, changed and deleted. An object the list lacks but whose resourceVersion
        is newer than the list's (written through after the list's snapshot) is kept."""
        self.track(kind)
        list_rv = _rv({"metadata": {"resourceVersion": resource_version}})
        deltas: builtins.list[Delta] = []
        seen: set[Key] = set()
        for obj in objects:
            meta = _meta(obj)
            key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
            seen.add(key)
            old = self.get(kind, *key)
            if old is not None and _uid(old) and _uid(old) != _uid(obj):
                self.remove(kind, *key)
                deltas.append(Delta("DELETED", old, None))
                old = None
            if old is not None and _meta(old).get("resourceVersion") == meta.get("resourceVersion"):
                continue
            if self.upsert(kind, obj, written=False):
                deltas.append(Delta("ADDED" if old is None else "MODIFIED", old, self.get(kind, *key)))
        by_ns = self._store.get(kind, {})
        scopes = [namespace] if namespace is not None else builtins.list(by_ns)
        for ns in scopes:
            for name, old in builtins.list(by_ns.get(ns, {}).items()):
                if (ns, name) in seen:
                    continue
                old_rv = _rv(old)
                if list_rv is not None and old_rv is not None and old_rv > list_rv:
                    continue
                self.remove(kind, ns, name)
                deltas.append(Delta("DELETED", old, None))
        return deltas

    def _unindex(self, kind: str, namespace: str, name: str, obj: Obj) -> None:
        about = _involved(obj) if kind == EVENT else None
        events = self._by_involved.get(about) if about is not None else None
        if events is not None:
            events.pop((namespace, name), None)
            if not events:
                del self._by_involved[str(about)]
        instance = _instance(obj)
        if instance is None:
            return
        by_key = self._by_instance.get(kind, {})
        group = by_key.get((namespace, instance))
        if group is None:
            return
        group.pop(name, None)
        if not group:
            del by_key[(namespace, instance)]

    # ---- reads -----------------------------------------------------------------------------------

    def tracks(self, kind: str) -> bool:
        """Whether a watch feeds `kind` (an untracked kind's absence says nothing)."""
        return kind in self._fed

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self._store.get(kind, {}).get(namespace, {}).get(name)

    def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        labels: Mapping[str, str | None] | None = None,
    ) -> list[Obj]:
        by_ns = self._store.get(kind, {})
        instance = (labels or {}).get(INSTANCE_LABEL)
        if namespace is not None and instance is not None:
            buckets = [self._by_instance.get(kind, {}).get((namespace, instance), {})]
        elif namespace is not None:
            buckets = [by_ns.get(namespace, {})]
        else:
            buckets = list(by_ns.values())
        out = [
            obj
            for bucket in buckets
            for obj in bucket.values()
            if labels is None or labels_match(obj, labels)
        ]
        out.sort(key=lambda o: (str(_meta(o).get("namespace") or ""), str(_meta(o).get("name"))))
        return out

    def events_about(self, uid: str) -> builtins.list[Obj]:
        """The cached Events (those the Events watch's field selector lets through) whose involvedObject
        is the object of `uid`, by namespace and name."""
        return [e for _, e in sorted(self._by_involved.get(uid, {}).items())]

    def keys(self, kind: str = SERVED_MODEL) -> builtins.list[Key]:
        return sorted((ns, name) for ns, bucket in self._store.get(kind, {}).items() for name in bucket)

    def kinds(self) -> builtins.list[str]:
        return sorted(self._fed)

    def count(self, kind: str) -> int:
        return sum(len(b) for b in self._store.get(kind, {}).values())

    def __len__(self) -> int:
        return sum(self.count(kind) for kind in self._store)

    def __iter__(self) -> Iterator[tuple[str, Obj]]:
        for kind, by_ns in self._store.items():
            for bucket in by_ns.values():
                for obj in bucket.values():
                    yield kind, obj

    @staticmethod
    def owner_key(obj: Mapping[str, Any]) -> Key | None:
        """The ServedModel `obj` belongs to: its controller ownerReference, else the instance label."""
        meta = _meta(obj)
        namespace = meta.get("namespace")
        if not namespace:
            return None
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") == SERVED_MODEL and ref.get("controller") and ref.get("name"):
                return str(namespace), str(ref["name"])
        instance = (meta.get("labels") or {}).get(INSTANCE_LABEL)
        return (str(namespace), str(instance)) if instance else None
