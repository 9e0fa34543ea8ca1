"""A new engine revision proves the request path before it takes traffic, and one that cannot is rolled
back: on the real control plane (the Deployment controller rolls, kwok runs the pods and honours the
readiness gate), the operator as a process, its probe mapped to three simulators on 127.0.0.1.

The revision is the pods' inference.servedmodel.io/revision label. hack/rollout_rig.py's mapper keeps
the per-pod endpoint override current: pods of the first revision go to the good simulators (no two
live pods to one: with maxSurge 0 at most two are live), pods of any later revision to one rendering a
Llama 3 chat template for a Qwen model (its chats complete, its template check fails), until the test
says the later revisions are good too. It also samples the Service's EndpointSlice: at least one ready
endpoint at every sample is the "old pods keep serving".
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cluster_support
import httpx
import pytest
from cluster_support import apply, condition, served_model
from prometheus_client.parser import text_string_to_metric_families

import controlplane
from rollout_rig import RevisionMapper
from servedmodel.api.names import REVISION_LABEL, ROLLED_BACK_FROM_ANNOTATION
from servedmodel.sim.process import SimulatorProcess

pytestmark = pytest.mark.cluster
WAIT_S = 180.0
SIM_ARGS = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]
DEADLINE_S = 15


def sm(cp: controlplane.ControlPlane, namespace: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cp.kubectl("get", "-n", namespace, "sm", "qwen", "-o", "json").stdout)
    return out


def rollout(cp: controlplane.ControlPlane, namespace: str) -> dict[str, Any]:
    return dict((sm(cp, namespace).get("status") or {}).get("rollout") or {})


@dataclass
class Rig:
    """One ServedModel of two replicas (gate on, a short deadline), its operators and the mapper."""

    cp: controlplane.ControlPlane
    namespace: str
    operators: list[Any]
    mapper: RevisionMapper
    spec: dict[str, Any]

    def log(self) -> str:
        return "\n".join(op.log() for op in self.operators if op.alive())

    def wait(self, what: str, check: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        """status.rollout once check(status.rollout) holds."""
        found: dict[str, Any] = cluster_support.wait_for(
            what,
            lambda: (r := rollout(self.cp, self.namespace)) and check(r) and r,
            WAIT_S,
            detail=lambda: f"status.rollout {rollout(self.cp, self.namespace)}\n{self.log()}",
        )
        return found

    def revision(self, value: str) -> dict[str, Any]:
        """Apply a spec change that makes a new revision (an engine env var); its engine spec."""
        engine = {"maxModelLen": 4096, "env": [{"name": "REVISION", "value": value}]}
        apply(self.cp, self.namespace, served_model("qwen", **self.spec, engine=engine))
        return engine

    def assert_rolled_back(
        self, rolled: dict[str, Any], good: str, bad: str, engine: dict[str, Any], why: str = "ChecksFailed"
    ) -> None:
        """The engine runs `good` again, `bad` is remembered (why), the spec is as written, and it says so."""
        assert (rolled["revision"], rolled["blockedRevision"], rolled["lastProvenRevision"]) == (
            good,
            bad,
            good,
        )
        assert "pod " in rolled["blockedMessage"]
        assert f": {why}: " in rolled["blockedMessage"], rolled["blockedMessage"]
        obj = sm(self.cp, self.namespace)
        assert obj["spec"]["engine"]["env"] == engine["env"]  # spec as the user wrote it
        degraded = condition(obj, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "RolledBack"), degraded
        assert f"revision {bad} did not pass the readiness gate" in degraded["message"]
        blocked = condition(obj, "RolloutBlocked")
        assert (blocked["status"], blocked["reason"]) == ("True", "RolledBack"), blocked
        assert obj["status"]["phase"] == "Degraded"
        dep = self.cp.get_json("deployment", "qwen", "-n", self.namespace)
        assert dep["spec"]["template"]["metadata"]["labels"][REVISION_LABEL] == good
        assert dep["metadata"]["annotations"][ROLLED_BACK_FROM_ANNOTATION] == bad


@contextlib.contextmanager
def rig(
    cp: controlplane.ControlPlane,
    namespace: str,
    start_operator: Any,
    tmp_path: Path,
    operators: int = 1,
    bad_args: list[str] = SIM_ARGS,
) -> Iterator[Rig]:
    """Three simulators (two good, one the later revisions' engine: `bad_args`, rendering Llama 3's
    template for Qwen), the operators, the mapper, the ServedModel applied and its first revision Proven
    on both pods; on the way out, the EndpointSlice must have had a ready endpoint at every sample since."""
    override = tmp_path / "endpoints"
    override.write_text("# filled by the mapper\n")
    with (
        SimulatorProcess(SIM_ARGS, ready_timeout=60) as good,
        SimulatorProcess(SIM_ARGS, ready_timeout=60) as good_too,
        SimulatorProcess(bad_args, ready_timeout=60) as bad,
    ):
        httpx.post(
            f"{bad.base_url}/admin/faults", json={"chat_template": "llama3"}, timeout=5
        ).raise_for_status()
        ops = [
            start_operator(namespaces=[namespace], endpoint_override=f"@{override}") for _ in range(operators)
        ]
        goods = [good.base_url, good_too.base_url]
        mapper = RevisionMapper(cp, namespace, "qwen", override, goods, [bad.base_url])
        mapper.start()
        try:
            spec = {
                "replicas": 2,
                "servedModelName": "qwen",
                "probe": {"interval": 5, "checkLimits": False},  # the readiness gate: on by default
                "rollout": {"progressDeadlineSeconds": DEADLINE_S},
            }
            apply(cp, namespace, served_model("qwen", **spec))
            r = Rig(cp, namespace, ops, mapper, spec)
            first = r.wait(
                "the first revision Proven on both pods",
                lambda x: x.get("state") == "Proven" and x.get("passed") == 2,
            )
            assert first["lastProvenRevision"] == first["revision"] == mapper.first_revision
            mapper.sampling = True
            yield r
        finally:
            mapper.stop()
    assert mapper.trouble() is None, mapper.trouble()  # the old pods served throughout
    cp.kubectl("delete", "servedmodel", "qwen", "-n", namespace, "--wait=true", "--timeout=60s")


def test_a_revision_with_a_broken_template_is_held_then_rolled_back_and_a_good_one_goes_through(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Any, tmp_path: Path
) -> None:
    with rig(control_plane, namespace, start_operator, tmp_path) as r:
        r0 = str(r.mapper.first_revision)
        # A spec change: a new revision, whose pods render the wrong template.
        engine = r.revision("two")
        proving = r.wait(
            "the new revision held by its gate (ChecksFailed)",
            lambda x: x.get("revision") != r0 and x.get("failingReason") == "ChecksFailed",
        )
        r1 = proving["revision"]
        assert proving["message"].startswith("template: RoleMarkersMissing"), proving
        assert proving["fingerprint"] != proving["lastProvenFingerprint"]  # Llama 3's rendering, not ChatML's
        rolled = r.wait(
            "Blocked past the deadline, then rolled back",
            lambda x: x.get("state") == "RolledBack" and x.get("passed") == 2,
        )
        r.assert_rolled_back(rolled, r0, r1, engine)
        events = r.cp.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=qwen")
        reasons = {e["reason"] for e in events["items"]}
        assert {"RolloutBlocked", "TemplateChanged"} <= reasons, reasons

        # A good edit goes through the gate: a third revision, whose pods serve the right template.
        r.mapper.later = r.mapper.first
        r.revision("three")
        done = r.wait(
            "the third revision Proven on both pods",
            lambda x: (
                x.get("revision") not in (r0, r1) and x.get("state") == "Proven" and x.get("passed") == 2
            ),
        )
        assert done["lastProvenRevision"] == done["revision"]
        assert "blockedRevision" not in done
        cluster_support.wait_for(
            "Degraded cleared, phase Ready",
            lambda: (
                (o := sm(r.cp, namespace))["status"].get("phase") == "Ready"
                and condition(o, "Degraded").get("status") == "False"
            ),
            WAIT_S,
            detail=lambda: f"status.rollout {rollout(r.cp, namespace)}\n{r.log()}",
        )
        dep = r.cp.get_json("deployment", "qwen", "-n", namespace)
        assert ROLLED_BACK_FROM_ANNOTATION not in (dep["metadata"].get("annotations") or {})


def test_a_revision_whose_engine_cannot_take_the_probe_prompt_is_rolled_back(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Any, tmp_path: Path
) -> None:
    """An engine flag that breaks generation: the new revision's engine runs with max_model_len 16, below
    the probe's prompt. Its pod's probe fails at the door (PromptTooLong, vLLM's 400), its gate never
    opens, and the revision is Blocked and rolled back."""
    flag = [*SIM_ARGS[:-1], "16"]  # --max-model-len 16
    with rig(control_plane, namespace, start_operator, tmp_path, bad_args=flag) as r:
        r0 = str(r.mapper.first_revision)
        engine = r.revision("two")
        held = r.wait(
            "the new revision held by its gate",
            lambda x: x.get("revision") != r0 and x.get("failingReason") == "PromptTooLong",
        )
        rolled = r.wait(
            "Blocked past the deadline, then rolled back",
            lambda x: x.get("state") == "RolledBack" and x.get("passed") == 2,
        )
        r.assert_rolled_back(rolled, r0, held["revision"], engine, why="PromptTooLong")


def test_the_leader_killed_mid_rollout_the_standby_rolls_the_same_revision_back(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Any, tmp_path: Path
) -> None:
    """Two operators (leader election on, by default); a bad revision Proving under the leader; the
    leader SIGKILLed: the standby takes the Lease, goes on from status.rollout (the same revision, the
    same `since`), blocks it at the deadline and rolls it back, while the old pods serve."""
    with rig(control_plane, namespace, start_operator, tmp_path, operators=2) as r:
        r0 = str(r.mapper.first_revision)
        engine = r.revision("two")
        proving = r.wait(
            "the new revision held by its gate",
            lambda x: x.get("revision") != r0 and x.get("failingReason") == "ChecksFailed",
        )
        assert proving["state"] == "Proving", proving  # not yet Blocked: the standby is the one to block it
        leader = next(op for op in r.operators if leader_of(op))
        standby = next(op for op in r.operators if op is not leader)
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait(10)
        cluster_support.wait_for(
            "the standby leads", lambda: leader_of(standby), WAIT_S, detail=lambda: standby.log()
        )
        rolled = r.wait(
            "the standby blocked and rolled back the same revision",
            lambda x: x.get("state") == "RolledBack" and x.get("passed") == 2,
        )
        r.assert_rolled_back(rolled, r0, proving["revision"], engine)
        assert standby.alive()


def leader_of(op: Any) -> bool:
    """The operator says it leads (servedmodel_leader 1 on its /metrics)."""
    try:
        text = op.metrics()
    except OSError:
        return False
    return any(
        s.name == "servedmodel_leader" and s.value == 1.0
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )
