"""Pure: the metadata every child of a ServedModel carries — its name and namespace, the standard labels
(api/names.py) and the controller owner reference, so that deleting the ServedModel garbage-collects it."""

from __future__ import annotations

from servedmodel.api import API_GROUP_VERSION, KIND, ServedModel, names
from servedmodel.api.base import Obj


def child_metadata(cr: ServedModel, name: str, annotations: dict[str, str] | None = None) -> Obj:
    """metadata of the child `name` (no owner reference while the ServedModel has no uid: dry renders)."""
    meta: Obj = {"name": name}
    if cr.metadata.namespace:
        meta["namespace"] = cr.metadata.namespace
    meta["labels"] = names.standard_labels(cr.name, cr.spec.engine.kind)
    if annotations:
        meta["annotations"] = annotations
    if cr.metadata.uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": API_GROUP_VERSION,
                "kind": KIND,
                "name": cr.name,
                "uid": cr.metadata.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta
