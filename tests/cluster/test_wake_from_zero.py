"""autoscaling.scaleToZero's wake from zero on the real control plane with KEDA's operator and its HTTP
add-on's interceptor and external scaler (built by hack/build-keda.sh and hack/build-keda-http-add-on.sh
into the cache), each started here out of cluster by its own pid and stopped after; KEDA's and the
add-on's CRDs (their modules' config/crd/bases) installed for the test and removed after. KEDA's
metrics-apiserver is not run: it serves 1 -> N, and the 0 -> 1 activation is the operator's own.

No cluster DNS here: hack/keda_rig.py runs the interceptor and the scaler each in a mount namespace of
its own with an /etc/hosts that maps the model's Service to 127.0.0.42, where the test's simulator
listens on the Service's port (the stand-in for cluster DNS, as the endpoint-override file stands in for
pod IPs), and the interceptor admin EndpointSlice's FQDN to 127.0.0.1.

The model at zero; a request through the interceptor's proxy port (Host: the model's Service) is held;
KEDA asks the scaler (external-push), scales the Deployment 0 -> 1; the kwok pod is mapped to the
simulator; the probe opens the readiness gate, the Service's endpoints become ready, the interceptor
forwards and the held request is answered; status.startup records the woken pod's start with KEDA's
activation between the request and its answer. Counted, not timed: bounded waits only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import cluster_support
import httpx
import pytest
from cluster_support import apply, crds_installed, served_model

import controlplane
import keda_rig
from loopback import Prometheus, prometheus_missing
from required import absent
from rollout_rig import write_override

pytestmark = pytest.mark.cluster
WAIT_S = 240.0


@pytest.fixture
def keda_crds(control_plane: controlplane.ControlPlane) -> Iterator[None]:
    for path in keda_rig.binaries().values():
        if not path.exists():
            absent(f"{path} not built; run `make keda`")
    with crds_installed(
        control_plane, keda_rig.crd_files, keda_rig.CRDS, "KEDA's and its HTTP add-on's CRDs"
    ):
        yield


def deployment_replicas(cp: controlplane.ControlPlane, namespace: str) -> int | None:
    dep = cluster_support.get(cp, namespace, "deployment", "qwen")
    return None if dep is None else int((dep.get("spec") or {}).get("replicas", 1))


def test_a_request_wakes_the_model_from_zero(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    start_operator: Any,
    tmp_path: Path,
    keda_crds: None,
) -> None:
    cp = control_plane
    if (missing := prometheus_missing()) is not None:
        absent(missing)
    hosts = keda_rig.service_hosts(namespace, "qwen-engine")
    with Prometheus([]) as prom, keda_rig.wake_rig(cp, namespace, "qwen-engine", WAIT_S) as rig:
        try:
            wakes(cp, namespace, start_operator, tmp_path, prom, rig, hosts)
        finally:
            keda_rig.release_scaled_objects(cp, namespace)


def wakes(
    cp: controlplane.ControlPlane,
    namespace: str,
    start_operator: Any,
    tmp_path: Path,
    prom: Prometheus,
    rig: keda_rig.WakeRig,
    hosts: list[str],
) -> None:
    assert rig.sim is not None
    sim, interceptor = rig.sim, rig.interceptor
    override = tmp_path / "endpoints"
    write_override(override, ["# filled once the pod exists"])
    op = start_operator(
        namespaces=[namespace],
        endpoint_override=f"@{override}",
        env=rig.operator_env(),
    )

    def detail() -> str:
        return f"{op.log(60)}\n{rig.logs()}"

    probe = {"interval": 5, "readinessGate": True, "failureThreshold": 1, "checkLimits": False}
    body = served_model(
        "qwen",
        engine={"kind": "simulator", "maxModelLen": 4096},
        resources={"gpus": 0},
        servedModelName="qwen",
        probe=probe,
        autoscaling={
            "minReplicas": 1,
            "maxReplicas": 1,
            "targets": {"waitingRequestsPerReplica": 4},
            "scaleToZero": True,
            "cooldownSeconds": 0,
            "pollingIntervalSeconds": 1,
            "prometheus": {"url": prom.base_url},
        },
    )
    apply(cp, namespace, body)
    httpso = cluster_support.wait_for(
        "the HTTPScaledObject",
        lambda: cluster_support.get(cp, namespace, "httpscaledobject", "qwen"),
        WAIT_S,
        detail=detail,
    )
    assert httpso["metadata"]["annotations"]["httpscaledobject.keda.sh/skip-scaledobject-creation"] == "true"
    so = cp.get_json("scaledobject", "qwen", "-n", namespace)
    assert [t["type"] for t in so["spec"]["triggers"]] == ["prometheus", "external-push"]
    # The model at zero: KEDA, every trigger idle (nothing queried, nothing held).
    cluster_support.wait_for(
        "the Deployment at 0 replicas",
        lambda: deployment_replicas(cp, namespace) == 0,
        WAIT_S,
        detail=detail,
    )
    cluster_support.wait_for(
        "no engine pod",
        lambda: not cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=qwen")["items"],
        WAIT_S,
        detail=detail,
    )

    # One request through the interceptor's proxy port, for the model's Service: held.
    answer: dict[str, Any] = {}

    def send() -> None:
        try:
            r = httpx.post(
                f"http://127.0.0.1:{interceptor.proxy}/v1/chat/completions",
                headers={"Host": hosts[1]},
                json={"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=WAIT_S,
            )
            answer["status"], answer["body"] = r.status_code, r.text
        except httpx.HTTPError as e:
            answer["error"] = repr(e)

    client = threading.Thread(target=send, daemon=True)
    sent = datetime.now(UTC)
    client.start()

    def pod_name() -> str | None:
        pods = cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=qwen")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return str(live[0]["metadata"]["name"]) if live else None

    pod = cluster_support.wait_for("KEDA scaled 0 -> 1: the engine pod", pod_name, WAIT_S, detail=detail)
    assert not answer, answer  # still held: no engine answers yet
    write_override(override, [f"{namespace}/qwen/{pod}={sim.base_url}"])
    cluster_support.wait_for(
        "the Service's endpoint ready (the probe opened the gate)",
        lambda: cp.endpoint_ready(namespace, "qwen-engine").get(pod) is True,
        WAIT_S,
        detail=detail,
    )
    client.join(WAIT_S)
    answered = datetime.now(UTC)
    assert answer.get("status") == 200, f"{answer}\n{detail()}"
    assert "choices" in answer["body"]

    # status.startup: the woken pod's start, with KEDA's activation between the held request and the
    # answer, and the wake inside the request's wait (the API server's clock is this machine's).
    def woken() -> dict[str, Any] | None:
        last = (cluster_support.get(cp, namespace, "servedmodel", "qwen") or {}).get("status", {})
        start = (last.get("startup") or {}).get("last") or {}
        return start if start.get("pod") == pod else None

    start = cluster_support.wait_for("status.startup of the woken pod", woken, WAIT_S, detail=detail)
    activated = datetime.fromisoformat(start["activated"].replace("Z", "+00:00"))
    assert sent - timedelta(seconds=1) <= activated <= answered, (sent, start, answered)
    assert 0 < start["wakeSeconds"] <= (answered - sent).total_seconds() + 1, (sent, start, answered)
