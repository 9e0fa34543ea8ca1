"""The chat template ConfigMaps (spec.engine.chatTemplate): watched so that editing one rolls the pods.

Only ConfigMaps labelled `inference.servedmodel.io/chat-template` are watched, filtered by the API
server (a label selector on the watch): the operator never streams every ConfigMap of the cluster. An
event feeds the watch-fed cache and enqueues every ServedModel of that namespace naming the ConfigMap;
their reconcile computes the new digest (render.chat_template), the pod template changes, and the
Deployment rolls. RBAC: get, list and watch on configmaps, nothing else.
"""

from __future__ import annotations

from typing import Any, Final

import kopf

from servedmodel.render.chat_template import CHAT_TEMPLATE_LABEL, referencing

CONFIGMAP: Final = "ConfigMap"
SERVED_MODEL: Final = "ServedModel"


@kopf.on.startup()
async def watch_labelled_configmaps_only(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.watching.label_selectors["v1", "configmaps"] = CHAT_TEMPLATE_LABEL


@kopf.on.event("v1", "configmaps", labels={CHAT_TEMPLATE_LABEL: kopf.PRESENT}, id="chat-template-cache")
async def chat_template_configmap_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Cache the ConfigMap; enqueue the ServedModels whose chat template it is."""
    cache, controller = memo.cache, memo.controller
    cache.apply_event(CONFIGMAP, type, body)
    meta = body.get("metadata") or {}
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    for served_model in referencing(cache.list(SERVED_MODEL, namespace), namespace, name):
        controller.enqueue(namespace, served_model)
