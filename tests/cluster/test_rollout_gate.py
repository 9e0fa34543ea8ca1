"""A new engine revision proves the request path before it takes traffic, and one that cannot is rolled
back: on the real control plane (the Deployment controller rolls, kwok runs the pods and honours the
readiness gate), the operator as a process, its probe mapped to three simulators on 127.0.0.1.

The revision is the pods' inference.servedmodel.io/revision label. A mapper thread keeps the per-pod
endpoint override current: pods of the first revision go to the good simulators (no two live pods to
one: with maxSurge 0 at most two are live), pods of any later revision to one rendering a Llama 3 chat
template for a Qwen model (its chats complete, its template check fails), until the test says the
later revisions are good too. The same thread samples the
Service's EndpointSlice: at least one ready endpoint at every sample is the "old pods keep serving".
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import cluster_support
import httpx
import pytest
from cluster_support import apply, condition, served_model

import controlplane
from servedmodel.api.names import REVISION_LABEL, ROLLED_BACK_FROM_ANNOTATION
from servedmodel.sim.process import SimulatorProcess

pytestmark = pytest.mark.cluster
WAIT_S = 180.0
SIM_ARGS = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]
DEADLINE_S = 15


class Mapper(threading.Thread):
    """Every 0.3 s: engine pods → the override file (by revision), and the EndpointSlice's ready count."""

    def __init__(
        self, cp: controlplane.ControlPlane, namespace: str, path: Path, good: str, bad: str
    ) -> None:
        super().__init__(name="override-mapper", daemon=True)
        self.cp, self.namespace, self.path, self.good, self.bad = cp, namespace, path, good, bad
        self.first_revision: str | None = None
        self.all_good = False
        self.ready_counts: list[int] = []
        self.sampling = False  # from the first revision's Proven on
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.wait(0.3):
                self.step()
        except BaseException as e:  # reported by the test, not lost in a thread
            self.error = e

    def step(self) -> None:
        selector = "app.kubernetes.io/instance=qwen,app.kubernetes.io/component=engine"
        pods = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}")
        lines = []
        serving = 0  # good pods mapped so far: each its own good engine, as each pod has its own
        for p in sorted(pods["items"], key=lambda p: p["metadata"].get("creationTimestamp", "")):
            revision = (p["metadata"].get("labels") or {}).get(REVISION_LABEL)
            if revision is None or p["metadata"].get("deletionTimestamp"):
                continue
            self.first_revision = self.first_revision or revision
            if self.all_good or revision == self.first_revision:
                url, serving = self.good[serving % len(self.good)], serving + 1
            else:
                url = self.bad
            lines.append(f"{self.namespace}/qwen/{p['metadata']['name']}={url}")
        self.path.write_text("\n".join(lines) + "\n")
        if self.sampling:
            eps = self.cp.endpoint_ready(self.namespace, "qwen-engine")
            self.ready_counts.append(sum(eps.values()))


def sm(cp: controlplane.ControlPlane, namespace: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cp.kubectl("get", "-n", namespace, "sm", "qwen", "-o", "json").stdout)
    return out


def rollout(cp: controlplane.ControlPlane, namespace: str) -> dict[str, Any]:
    return dict((sm(cp, namespace).get("status") or {}).get("rollout") or {})


def test_a_revision_with_a_broken_template_is_held_then_rolled_back_and_a_good_one_goes_through(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Any, tmp_path: Path
) -> None:
    cp = control_plane
    override = tmp_path / "endpoints"
    override.write_text("# filled by the mapper\n")
    with (
        SimulatorProcess(SIM_ARGS, ready_timeout=60) as good,
        SimulatorProcess(SIM_ARGS, ready_timeout=60) as good_too,
        SimulatorProcess(SIM_ARGS, ready_timeout=60) as bad,
    ):
        httpx.post(
            f"{bad.base_url}/admin/faults", json={"chat_template": "llama3"}, timeout=5
        ).raise_for_status()
        op = start_operator(namespaces=[namespace], endpoint_override=f"@{override}")
        mapper = Mapper(cp, namespace, override, [good.base_url, good_too.base_url], bad.base_url)
        mapper.start()
        try:
            probe = {"interval": 5, "checkLimits": False}  # the readiness gate: on by default
            spec = {"replicas": 2, "servedModelName": "qwen", "probe": probe}
            rollout_spec = {"progressDeadlineSeconds": DEADLINE_S}
            apply(cp, namespace, served_model("qwen", **spec, rollout=rollout_spec))

            def revision(value: str) -> dict[str, Any]:
                """Apply a spec change that makes a new revision (an engine env var); its engine spec."""
                engine = {"maxModelLen": 4096, "env": [{"name": "REVISION", "value": value}]}
                apply(cp, namespace, served_model("qwen", **spec, engine=engine, rollout=rollout_spec))
                return engine

            first = cluster_support.wait_for(
                "the first revision Proven on both pods",
                lambda: (r := rollout(cp, namespace)).get("state") == "Proven" and r.get("passed") == 2 and r,
                WAIT_S,
                detail=lambda: f"status.rollout {rollout(cp, namespace)}\n{op.log()}",
            )
            mapper.sampling = True
            r0 = first["revision"]
            assert first["lastProvenRevision"] == r0
            assert mapper.first_revision == r0

            # A spec change: a new revision, whose pods render the wrong template.
            engine = revision("two")
            proving = cluster_support.wait_for(
                "the new revision held by its gate (ChecksFailed)",
                lambda: (
                    (r := rollout(cp, namespace)).get("revision") != r0
                    and r.get("failingReason") == "ChecksFailed"
                    and r
                ),
                WAIT_S,
                detail=lambda: f"status.rollout {rollout(cp, namespace)}\n{op.log()}",
            )
            r1 = proving["revision"]
            assert proving["message"].startswith("template: RoleMarkersMissing"), proving
            rolled = cluster_support.wait_for(
                "Blocked past the deadline, then rolled back",
                lambda: (
                    (r := rollout(cp, namespace)).get("state") == "RolledBack" and r.get("passed") == 2 and r
                ),
                WAIT_S,
                detail=lambda: f"status.rollout {rollout(cp, namespace)}\n{op.log()}",
            )
            assert (rolled["revision"], rolled["blockedRevision"], rolled["lastProvenRevision"]) == (
                r0,
                r1,
                r0,
            )
            assert "pod " in rolled["blockedMessage"]
            assert "ChecksFailed" in rolled["blockedMessage"]
            obj = sm(cp, namespace)
            assert obj["spec"]["engine"]["env"] == engine["env"]  # spec as the user wrote it
            degraded = condition(obj, "Degraded")
            assert (degraded["status"], degraded["reason"]) == ("True", "RolledBack"), degraded
            assert f"revision {r1} did not pass the readiness gate" in degraded["message"]
            blocked = condition(obj, "RolloutBlocked")
            assert (blocked["status"], blocked["reason"]) == ("True", "RolledBack"), blocked
            assert obj["status"]["phase"] == "Degraded"
            dep = cp.get_json("deployment", "qwen", "-n", namespace)
            assert dep["spec"]["template"]["metadata"]["labels"][REVISION_LABEL] == r0
            assert dep["metadata"]["annotations"][ROLLED_BACK_FROM_ANNOTATION] == r1
            events = cp.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=qwen")
            assert "RolloutBlocked" in {e["reason"] for e in events["items"]}

            # A good edit goes through the gate: a third revision, whose pods serve the right template.
            mapper.all_good = True
            revision("three")
            done = cluster_support.wait_for(
                "the third revision Proven on both pods",
                lambda: (
                    (r := rollout(cp, namespace)).get("revision") not in (r0, r1)
                    and r.get("state") == "Proven"
                    and r.get("passed") == 2
                    and r
                ),
                WAIT_S,
                detail=lambda: f"status.rollout {rollout(cp, namespace)}\n{op.log()}",
            )
            assert done["lastProvenRevision"] == done["revision"]
            assert "blockedRevision" not in done
            cluster_support.wait_for(
                "Degraded cleared, phase Ready",
                lambda: (
                    (o := sm(cp, namespace))["status"].get("phase") == "Ready"
                    and condition(o, "Degraded").get("status") == "False"
                ),
                WAIT_S,
                detail=lambda: f"status.rollout {rollout(cp, namespace)}\n{op.log()}",
            )
            dep = cp.get_json("deployment", "qwen", "-n", namespace)
            assert ROLLED_BACK_FROM_ANNOTATION not in (dep["metadata"].get("annotations") or {})
        finally:
            mapper.halt.set()
            mapper.join(10)
        assert mapper.error is None, mapper.error
        assert mapper.ready_counts, "the EndpointSlice was never sampled"
        assert min(mapper.ready_counts) >= 1, mapper.ready_counts  # the old pods served throughout
        cp.kubectl("delete", "servedmodel", "qwen", "-n", namespace, "--wait=true", "--timeout=60s")
