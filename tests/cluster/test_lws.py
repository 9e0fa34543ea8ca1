"""spec.workers on the real control plane with the real LeaderWorkerSet controller (sigs.k8s.io/lws, built
by hack/build-lws.sh into the cache): its CRD (the module's config/crd/bases) installed for the test and
removed after; its controller manager started by this test, out of cluster, by its own pid, with its
webhooks (the pod webhook labels a group's pods and gives them LWS_* env) served on loopback with a
self-signed certificate that the webhook configurations registered here trust; stopped after.

A ServedModel (simulator engine) with workers.size 2: the operator renders a LeaderWorkerSet, the LWS
controller accepts and reconciles it, the StatefulSets make the leader and the worker pod (kwok's). Their
readiness gates hold the group until the probe passes on the leader and the worker's checks pass (both
pods mapped to simulators on 127.0.0.1 through the endpoint-override file). Then the worker's simulator
stalls with a request running on it: EngineStalled names the worker, and the group's gates close.
Bounded waits, no timing assertions; every process stopped by its pid.
"""

from __future__ import annotations

import base64
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cluster_support
import pytest
import yaml
from autoscaling_support import Load, engine_metric
from cluster_support import apply, condition, crds_installed, served_model

import controlplane
from loopback import LoopbackProcess
from required import absent
from rollout_rig import write_override
from servedmodel.api.names import LWS_WORKER_INDEX_LABEL
from servedmodel.api.probe import READINESS_GATE_CONDITION
from servedmodel.sim.ports import free_port
from servedmodel.sim.process import SimulatorProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "probe"))
from probe_support import set_faults  # tests/probe's helper (tests are not a package)

pytestmark = pytest.mark.cluster
WAIT_S = 180.0
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
LWS_SET_LABEL = "leaderworkerset.sigs.k8s.io/name"
WEBHOOKS = "servedmodel-test-lws"  # the names of the two webhook configurations registered here
SIM_ARGS = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]


def lws_root() -> Path:
    base = os.environ.get("SERVEDMODEL_CACHE") or str(Path.home() / ".cache" / "servedmodel")
    return Path(base) / f"lws-{controlplane.versions()['LWS_VERSION']}"


def lws_built() -> Path:
    root = lws_root()
    if not (root / "bin" / "lws-controller").exists() or not list((root / "crd").glob("*.yaml")):
        absent(f"LeaderWorkerSet not built in {root}; run `make lws`")
    return root


class LwsController(LoopbackProcess):
    """The LWS controller manager on the test's control plane: no leader election, no internal cert
    management (it would write its certificate into a Secret for an in-cluster Service), its webhook
    server on 127.0.0.1 with a certificate of a CA made here."""

    def __init__(self, cp: controlplane.ControlPlane, root: Path) -> None:
        super().__init__("lws-controller-", "lws.log")
        self.cp = cp
        self.port, self.health = free_port(), free_port()
        certs = self.dir / "certs"
        certs.mkdir()
        controlplane.loopback_serving_cert(certs, "servedmodel-test-lws-ca", server_auth=True)
        self.ca_bundle = base64.b64encode((certs / "ca.crt").read_bytes()).decode()
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": self.port, "host": "127.0.0.1", "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health}"},
        }
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config))
        self.spawn(
            [str(root / "bin" / "lws-controller"), f"--config={self.dir / 'config.yaml'}"],
            env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)},
        )

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"the LWS controller exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health}/readyz", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def register(self) -> None:
        """LWS's webhook configurations (config/webhook/manifests.yaml) pointed at 127.0.0.1; the pod
        webhooks only for LeaderWorkerSet pods (the rest of the session's pods never call them)."""
        docs = list(yaml.safe_load_all((lws_root() / "webhook" / "manifests.yaml").read_text()))
        for doc in docs:
            doc["metadata"]["name"] = f"{WEBHOOKS}-{doc['kind'].lower()}"
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {
                    "url": f"https://127.0.0.1:{self.port}{path}",
                    "caBundle": self.ca_bundle,
                }
                if any("pods" in rule["resources"] for rule in hook["rules"]):
                    hook["objectSelector"] = {
                        "matchExpressions": [{"key": LWS_SET_LABEL, "operator": "Exists"}]
                    }
        self.cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))

    def stop(self) -> None:
        # Unregister first: a webhook with failurePolicy Fail and no server refuses what it matches.
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            self.cp.kubectl("delete", kind, f"{WEBHOOKS}-{kind}", "--ignore-not-found", check=False)
        super().stop()


@pytest.fixture
def lws(control_plane: controlplane.ControlPlane) -> Iterator[LwsController]:
    root = lws_built()
    fetch = lambda: sorted((root / "crd").glob("*.yaml"))  # noqa: E731
    with crds_installed(control_plane, fetch, (LWS_CRD,), "LeaderWorkerSet CRD"):
        controller = LwsController(control_plane, root)
        try:
            cluster_support.wait_for(
                "the LWS controller ready", controller.ready, 60, detail=controller.log_text
            )
            controller.register()
            yield controller
        finally:
            controller.stop()


def group_pods(cp: controlplane.ControlPlane, namespace: str) -> dict[str, dict[str, Any]]:
    """The group's live pods by their worker index ("0": the leader)."""
    pods = cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=qwen")
    return {
        p["metadata"]["labels"].get(LWS_WORKER_INDEX_LABEL, "?"): p
        for p in pods["items"]
        if not p["metadata"].get("deletionTimestamp")
    }


def pod_condition(pod: dict[str, Any], type_: str) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return str(c.get("status"))
    return None


def test_without_the_lws_api_a_condition_says_so(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Any
) -> None:
    """No LeaderWorkerSet CRD in the cluster: nothing runs the engine (no Deployment in its place) and
    Degraded says why, naming the API."""
    cp = control_plane
    op = start_operator(namespaces=[namespace])
    body = served_model("qwen", engine={"kind": "simulator"}, resources={"gpus": 0}, workers={"size": 2})
    apply(cp, namespace, body)

    def degraded() -> dict[str, Any] | None:
        cond = condition(cluster_support.get(cp, namespace, "servedmodel", "qwen"), "Degraded")
        return cond if cond.get("reason") == "LeaderWorkerSetMissing" else None

    cond = cluster_support.wait_for(
        "Degraded: LeaderWorkerSetMissing", degraded, WAIT_S, detail=lambda: op.log(40)
    )
    assert "leaderworkerset.x-k8s.io/v1" in cond["message"]
    assert cp.kubectl("get", "deployment", "qwen", "-n", namespace, check=False).returncode != 0
    cp.kubectl(
        "delete", "servedmodels", "--all", "-n", namespace, "--wait=true", "--timeout=30s", check=False
    )


def test_a_two_pod_group_is_gated_whole_and_a_stalled_worker_named(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    start_operator: Any,
    tmp_path: Path,
    lws: LwsController,
) -> None:
    cp = control_plane
    override = tmp_path / "endpoints"
    write_override(override, ["# filled once the pods exist"])
    op = start_operator(namespaces=[namespace], endpoint_override=f"@{override}")

    def detail() -> str:
        return f"{op.log(60)}\n--- lws controller ---\n{lws.log_text()[-3000:]}"

    probe = {
        "interval": 5,
        "readinessGate": True,
        "failureThreshold": 1,
        "firstByteTimeout": 2,
        "timeout": 10,
        "checkLimits": False,
    }
    body = served_model(
        "qwen",
        engine={"kind": "simulator", "maxModelLen": 4096},
        resources={"gpus": 0},
        servedModelName="qwen",
        workers={"size": 2},
        probe=probe,
    )
    apply(cp, namespace, body)

    # Accepted (the API server, LWS's webhooks) and reconciled by the real LWS controller: the group's
    # leader and worker pod, labelled and given LWS's env by its pod webhook.
    def both() -> dict[str, dict[str, Any]] | None:
        now = group_pods(cp, namespace)
        return now if set(now) == {"0", "1"} else None

    pods = cluster_support.wait_for("the group's leader and worker pod", both, WAIT_S, detail=detail)
    leader, worker = pods["0"]["metadata"]["name"], pods["1"]["metadata"]["name"]
    lws_obj = cp.get_json("leaderworkerset", "qwen", "-n", namespace)
    assert lws_obj["metadata"]["ownerReferences"][0]["kind"] == "ServedModel"
    assert lws_obj["spec"]["leaderWorkerTemplate"]["size"] == 2
    env = {e["name"] for e in pods["1"]["spec"]["containers"][0].get("env") or []}
    assert {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"} <= env
    svc = cp.get_json("service", "qwen-engine", "-n", namespace)
    assert svc["spec"]["selector"][LWS_WORKER_INDEX_LABEL] == "0"
    # Nothing is mapped yet: no engine answers, the gates hold both pods (not Ready).
    for pod in pods.values():
        assert READINESS_GATE_CONDITION in [g["conditionType"] for g in pod["spec"]["readinessGates"]]
        assert pod_condition(pod, "Ready") != "True"

    with (
        SimulatorProcess(SIM_ARGS, ready_timeout=60) as lead_sim,
        SimulatorProcess([*SIM_ARGS, "--sim-step-base-ms", "20"], ready_timeout=60) as work_sim,
    ):
        write_override(
            override,
            [
                f"{namespace}/qwen/{leader}={lead_sim.base_url}",
                f"{namespace}/qwen/{worker}={work_sim.base_url}",
            ],
        )

        def group_ready() -> bool:
            now = group_pods(cp, namespace)
            return set(now) == {"0", "1"} and all(pod_condition(p, "Ready") == "True" for p in now.values())

        cluster_support.wait_for("both pods Ready (the gates opened)", group_ready, WAIT_S, detail=detail)
        cluster_support.wait_for(
            "the LeaderWorkerSet's status: one ready group",
            lambda: (
                (cp.get_json("leaderworkerset", "qwen", "-n", namespace).get("status") or {}).get(
                    "readyReplicas"
                )
                == 1
            ),
            WAIT_S,
            detail=detail,
        )

        # The worker hangs with a request running on it; the leader still answers /health.
        load = Load(work_sim.base_url, "qwen", 1)
        try:
            cluster_support.wait_for(
                "a request running on the worker",
                lambda: engine_metric(work_sim, "vllm:num_requests_running") >= 1,
                60,
            )
            set_faults(work_sim, engine_stalled=True)

            def stalled() -> dict[str, Any] | None:
                cond = condition(cluster_support.get(cp, namespace, "servedmodel", "qwen"), "EngineStalled")
                return cond if cond.get("status") == "True" else None

            cond = cluster_support.wait_for("EngineStalled", stalled, WAIT_S, detail=detail)
            assert f"worker pod {worker}" in cond["message"]

            def gates_closed() -> bool:
                now = group_pods(cp, namespace)
                return set(now) == {"0", "1"} and all(
                    pod_condition(p, READINESS_GATE_CONDITION) == "False"
                    and pod_condition(p, "Ready") != "True"
                    for p in now.values()
                )

            cluster_support.wait_for("the group's gates closed", gates_closed, WAIT_S, detail=detail)
        finally:
            load.stop()
            cp.kubectl(
                "delete",
                "servedmodels",
                "--all",
                "-n",
                namespace,
                "--wait=true",
                "--timeout=30s",
                check=False,
            )
