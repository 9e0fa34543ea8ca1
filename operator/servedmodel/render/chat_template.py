"""Pure: the chat template a ServedModel names (spec.engine.chatTemplate, a ConfigMap key) → the digest
its pod template carries, so editing the template rolls the pods.

A ConfigMap mounted as a volume is refreshed in a running pod by the kubelet, but vLLM reads
--chat-template once at start: without a new pod nothing changes. The reconciler reads the ConfigMap
(from the watch-fed cache, or the API server), `template_digest` hashes the referenced key, and render
puts the digest into the pod template's annotations (CHAT_TEMPLATE_DIGEST_ANNOTATION): a new template is
a new pod template hash, and the Deployment rolls.

A missing ConfigMap or key is not a crash but a `TemplateMissing` (reason and message for the Degraded
condition). Meanwhile the pods keep the digest they have (`running_digest`): a deleted ConfigMap must
not roll healthy pods into ones that cannot mount it.

Only ConfigMaps labelled CHAT_TEMPLATE_LABEL are watched (a server-side label selector: the operator
never streams every ConfigMap of the cluster), so an edit of one of those rolls the pods at once; an
unlabelled one is still read on every reconcile of its ServedModel and rolls them at the next one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from servedmodel.api import ConfigMapKeyRef

CHAT_TEMPLATE_DIGEST_ANNOTATION: Final = "inference.servedmodel.io/chat-template-digest"
# Label a chat template ConfigMap with this (any value) so the operator watches it.
CHAT_TEMPLATE_LABEL: Final = "inference.servedmodel.io/chat-template"
TEMPLATE_NOT_FOUND: Final = "ChatTemplateNotFound"
TEMPLATE_KEY_NOT_FOUND: Final = "ChatTemplateKeyNotFound"
TEMPLATE_UNREADABLE: Final = "ChatTemplateUnreadable"  # the API server refused the read (RBAC)


@dataclass(frozen=True)
class TemplateMissing:
    """Why the named chat template cannot be read: the reason and message of Degraded."""

    reason: str
    message: str


def template_digest(configmap: Mapping[str, Any] | None, ref: ConfigMapKeyRef) -> str | TemplateMissing:
    """`sha256:<hex>` of the referenced key's content (data or binaryData), or why there is none."""
    where = f"spec.engine.chatTemplate: ConfigMap {ref.name}"
    if configmap is None:
        return TemplateMissing(TEMPLATE_NOT_FOUND, f"{where} not found in the ServedModel's namespace")
    data, binary = configmap.get("data") or {}, configmap.get("binaryData") or {}
    if isinstance(data.get(ref.key), str):
        content = str(data[ref.key]).encode()
    elif isinstance(binary.get(ref.key), str):
        try:
            content = base64.b64decode(str(binary[ref.key]), validate=True)
        except (binascii.Error, ValueError):
            return TemplateMissing(TEMPLATE_KEY_NOT_FOUND, f"{where}: binaryData {ref.key} is not base64")
    else:
        keys = sorted([*data, *binary])
        return TemplateMissing(
            TEMPLATE_KEY_NOT_FOUND, f"{where} has no key {ref.key} (keys: {', '.join(keys) or 'none'})"
        )
    return "sha256:" + hashlib.sha256(content).hexdigest()


def running_digest(deployment: Mapping[str, Any] | None) -> str | None:
    """The digest the engine Deployment's pod template carries now (None: none, or no Deployment)."""
    template = ((deployment or {}).get("spec") or {}).get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(CHAT_TEMPLATE_DIGEST_ANNOTATION)
    return str(value) if value else None


def referencing(servedmodels: Iterable[Mapping[str, Any]], namespace: str, configmap: str) -> list[str]:
    """Names of the ServedModels in `namespace` whose spec.engine.chatTemplate names `configmap`."""
    out = []
    for sm in servedmodels:
        meta = sm.get("metadata") or {}
        ref = ((sm.get("spec") or {}).get("engine") or {}).get("chatTemplate") or {}
        if meta.get("namespace") == namespace and ref.get("name") == configmap:
            out.append(str(meta.get("name")))
    return sorted(out)
