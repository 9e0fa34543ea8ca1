"""spec.engine.chatTemplate on the real control plane: editing the ConfigMap rolls the pods (a new
pod-template-hash), a missing ConfigMap or key is Degraded with a reason (never a crash), and while it is
missing the running pods are left alone.

The operator watches only ConfigMaps labelled inference.servedmodel.io/chat-template; the ConfigMaps
here carry that label. Waits are bounded polls; nothing here asserts on elapsed time.
"""

from __future__ import annotations

import hashlib
from typing import Any

import cluster_support
import pytest
import yaml
from cluster_support import apply, condition, get, wait_for

import controlplane
from servedmodel.render.chat_template import CHAT_TEMPLATE_DIGEST_ANNOTATION, CHAT_TEMPLATE_LABEL

OperatorProcess = Any
pytestmark = pytest.mark.cluster
WAIT_S = 90.0
KEY = "template.jinja"
QWEN_LIKE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
EDITED = QWEN_LIKE + "<|im_start|>assistant\n"


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def configmap(cp: controlplane.ControlPlane, namespace: str, name: str, data: dict[str, str]) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {CHAT_TEMPLATE_LABEL: "true"}},
        "data": data,
    }
    cp.kubectl(
        "apply", "--server-side", "--force-conflicts", "-n", namespace, "-f", "-", input=yaml.safe_dump(body)
    )


def served_model(name: str, template: str) -> dict[str, Any]:
    engine = {"maxModelLen": 4096, "chatTemplate": {"name": template, "key": KEY}}
    return cluster_support.served_model(name, engine=engine, probe={"enabled": False})


def template_digest(cp: controlplane.ControlPlane, namespace: str, name: str) -> str | None:
    dep = get(cp, namespace, "deployment", name) or {}
    annotations = ((dep.get("spec") or {}).get("template") or {}).get("metadata", {}).get("annotations") or {}
    return annotations.get(CHAT_TEMPLATE_DIGEST_ANNOTATION)


def pod_template_hashes(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, str]:
    """pod-template-hash → the chat template digest of each ReplicaSet of the engine Deployment."""
    sets = get(cp, namespace, "replicasets", "-l", f"app.kubernetes.io/instance={name}") or {"items": []}
    out = {}
    for rs in sets["items"]:
        labels = rs["metadata"].get("labels") or {}
        annotations = rs["spec"]["template"]["metadata"].get("annotations") or {}
        out[labels["pod-template-hash"]] = annotations.get(CHAT_TEMPLATE_DIGEST_ANNOTATION, "")
    return out


def sm(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    obj = get(cp, namespace, "servedmodel", name)
    assert obj is not None
    return obj


def test_configmap_edit_rolls_the_pods(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    configmap(cp, namespace, "qwen-template", {KEY: QWEN_LIKE, "notes": "unrelated"})
    apply(cp, namespace, served_model("qwen", "qwen-template"))

    first = wait_for(
        "a ReplicaSet with the template's digest",
        lambda: [h for h, d in pod_template_hashes(cp, namespace, "qwen").items() if d == digest(QWEN_LIKE)],
        WAIT_S,
    )
    wait_for(
        "phase Ready", lambda: sm(cp, namespace, "qwen").get("status", {}).get("phase") == "Ready", WAIT_S
    )

    configmap(cp, namespace, "qwen-template", {KEY: EDITED, "notes": "unrelated"})
    second = wait_for(
        "a new ReplicaSet with the edited template's digest",
        lambda: [h for h, d in pod_template_hashes(cp, namespace, "qwen").items() if d == digest(EDITED)],
        WAIT_S,
    )
    assert set(second).isdisjoint(first)  # a new pod template hash: the Deployment rolls
    assert template_digest(cp, namespace, "qwen") == digest(EDITED)
    wait_for(
        "the rollout to finish and the model Ready",
        lambda: sm(cp, namespace, "qwen").get("status", {}).get("phase") == "Ready",
        WAIT_S,
    )
    assert operator.alive()


def test_missing_configmap_or_key_is_a_reason_and_keeps_the_pods(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    apply(cp, namespace, served_model("late", "late-template"))

    def degraded_because(reason: str) -> Any:
        obj = sm(cp, namespace, "late")
        return obj if condition(obj, "Degraded").get("reason") == reason else None

    obj = wait_for("Degraded ChatTemplateNotFound", lambda: degraded_because("ChatTemplateNotFound"), WAIT_S)
    assert obj["status"]["phase"] == "Degraded"
    assert "late-template" in condition(obj, "Degraded")["message"]
    assert template_digest(cp, namespace, "late") is None  # the Deployment exists, without a digest

    # The ConfigMap appears (its watch event brings the ServedModel back): the digest, then Ready.
    configmap(cp, namespace, "late-template", {KEY: QWEN_LIKE})
    wait_for(
        "the digest in the pod template",
        lambda: template_digest(cp, namespace, "late") == digest(QWEN_LIKE),
        WAIT_S,
    )
    wait_for(
        "phase Ready", lambda: sm(cp, namespace, "late").get("status", {}).get("phase") == "Ready", WAIT_S
    )
    hashes = pod_template_hashes(cp, namespace, "late")

    # The key goes away: Degraded says so, and the running pods keep their template (no roll).
    configmap(cp, namespace, "late-template", {"other.jinja": QWEN_LIKE})
    obj = wait_for(
        "Degraded ChatTemplateKeyNotFound", lambda: degraded_because("ChatTemplateKeyNotFound"), WAIT_S
    )
    assert f"has no key {KEY}" in condition(obj, "Degraded")["message"]
    assert template_digest(cp, namespace, "late") == digest(QWEN_LIKE)
    assert pod_template_hashes(cp, namespace, "late") == hashes
    assert operator.alive()


def test_unlabelled_configmap_rolls_at_the_next_reconcile(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    """An unlabelled ConfigMap is not watched, but read on every reconcile: its edit alone rolls
    nothing; the ServedModel's next reconcile (here: an annotation, a ServedModel event) rolls the pods."""
    cp = control_plane
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "plain"}, "data": {KEY: QWEN_LIKE}}
    cp.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
    apply(cp, namespace, served_model("plain", "plain"))
    wait_for(
        "phase Ready", lambda: sm(cp, namespace, "plain").get("status", {}).get("phase") == "Ready", WAIT_S
    )
    assert template_digest(cp, namespace, "plain") == digest(QWEN_LIKE)

    body["data"] = {KEY: EDITED}
    cp.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
    # Nothing watches it: a ServedModel event (an annotation changes what the reconciler reads) brings
    # the reconcile that reads the new content.
    cp.kubectl("annotate", "servedmodel", "plain", "-n", namespace, "example.com/touched=1")
    wait_for("the edited digest", lambda: template_digest(cp, namespace, "plain") == digest(EDITED), WAIT_S)
    assert operator.alive()
