"""The rollout gate against real vLLM: a chat-template ConfigMap edit that drops the role markers makes a
new revision whose pod never opens its gate, is Blocked and rolled back, while the old pods serve.

kwok runs the pods; hack/rollout_rig.py's mapper sends the probe of each pod to the vLLM its revision
would run: the first revision's pods to the session's vLLM (Qwen2.5's own ChatML template, the one the
ConfigMap first holds), the edited revision's to a vLLM started with the edited template
(--chat-template, "user: …" lines without a ChatML marker). Both old pods share one engine, so the
operator probes one pod per cycle (two probes at once on one engine would each count the other's
tokens in the usage check).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_support import apply, condition, served_model, wait_for

import controlplane
from rollout_rig import RevisionMapper
from servedmodel.render.chat_template import CHAT_TEMPLATE_LABEL
from servedmodel.sim.templates import bundled_source
from vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.timeout(900)]
KEY = "template.jinja"
WAIT_S = 300.0


def configmap(cp: controlplane.ControlPlane, namespace: str, template: str) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "qwen-template", "labels": {CHAT_TEMPLATE_LABEL: "true"}},
        "data": {KEY: template},
    }
    cp.kubectl(
        "apply", "--server-side", "--force-conflicts", "-n", namespace, "-f", "-", input=yaml.safe_dump(body)
    )


def sm(cp: controlplane.ControlPlane, namespace: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cp.kubectl("get", "-n", namespace, "sm", "qwen", "-o", "json").stdout)
    return out


def test_a_template_configmap_edit_without_role_markers_is_held_then_rolled_back(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    start_operator: Any,
    tmp_path: Path,
    vllm_qwen25: VLLMServer,
    start_vllm: Callable[..., VLLMServer],
) -> None:
    cp = control_plane
    plain = tmp_path / "plain.jinja"
    plain.write_text(bundled_source("plain"))
    edited = start_vllm("qwen2.5", extra_args=["--chat-template", str(plain)])
    override = tmp_path / "endpoints"
    override.write_text("")
    op = start_operator(
        namespaces=[namespace],
        endpoint_override=f"@{override}",
        env={"SERVEDMODEL_PROBE_MAX_PODS_PER_CYCLE": "1"},
    )
    mapper = RevisionMapper(cp, namespace, "qwen", override, [vllm_qwen25.base_url], [edited.base_url])
    mapper.start()

    def rollout_when(what: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        def current() -> dict[str, Any] | None:
            r = dict((sm(cp, namespace).get("status") or {}).get("rollout") or {})
            return r if r and check(r) else None

        found: dict[str, Any] = wait_for(what, current, WAIT_S, interval=0.5, detail=lambda: op.log(80))
        return found

    try:
        configmap(cp, namespace, bundled_source("qwen2.5"))
        engine = {"maxModelLen": 4096, "chatTemplate": {"name": "qwen-template", "key": KEY}}
        spec = {
            "replicas": 2,
            "servedModelName": "qwen",
            "engine": engine,
            "probe": {"interval": 5},  # the readiness gate: on by default
            "rollout": {"progressDeadlineSeconds": 30},
        }
        apply(cp, namespace, served_model("qwen", **spec))
        first = rollout_when(
            "the first revision Proven on both pods", lambda r: r["state"] == "Proven" and r["passed"] == 2
        )
        mapper.sampling = True
        r0 = first["revision"]
        assert first["fingerprint"].startswith("sha256:")

        configmap(cp, namespace, bundled_source("plain"))  # the edit: no <|im_start|> anywhere
        held = rollout_when(
            "the edited revision held by its gate",
            lambda r: r["revision"] != r0 and r.get("failingReason") == "ChecksFailed",
        )
        r1 = held["revision"]
        assert held["message"].startswith("template: RoleMarkersMissing"), held
        assert "<|im_start|>" in held["message"]
        assert held["fingerprint"] != first["fingerprint"]
        rolled = rollout_when(
            "Blocked past the deadline, then rolled back",
            lambda r: r["state"] == "RolledBack" and r["passed"] == 2,
        )
        assert (rolled["revision"], rolled["blockedRevision"]) == (r0, r1)
        obj = sm(cp, namespace)
        degraded = condition(obj, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "RolledBack"), degraded
        events = cp.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=qwen")
        reasons = {e["reason"] for e in events["items"]}
        assert {"RolloutBlocked", "TemplateChanged"} <= reasons, reasons
    finally:
        mapper.stop()
    assert mapper.trouble() is None, mapper.trouble()  # the old pods served throughout
    cp.kubectl("delete", "servedmodel", "qwen", "-n", namespace, "--wait=true", "--timeout=60s")
