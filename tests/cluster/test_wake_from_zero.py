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
forwards and the held request is answered. Counted, not timed: bounded waits only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cluster_support
import httpx
import pytest
from cluster_support import apply, crds_installed, served_model

import controlplane
import keda_rig
import olm_tools
from keda_rig import SIM_HOST, Interceptor, Keda, Scaler, SimOnServicePort, admin_endpoints
from loopback import LoopbackProcess, Prometheus, prometheus_missing
from required import absent
from rollout_rig import write_override

pytestmark = pytest.mark.cluster
WAIT_S = 240.0
# Every CRD of KEDA's (its operator waits for each kind it watches) and the add-on's HTTPScaledObject.
KEDA_KINDS = ("scaledobjects", "scaledjobs", "triggerauthentications", "clustertriggerauthentications")
EVENTING_KINDS = ("cloudeventsources", "clustercloudeventsources")
CRDS = (
    *(f"{k}.keda.sh" for k in KEDA_KINDS),
    *(f"{k}.eventing.keda.sh" for k in EVENTING_KINDS),
    "httpscaledobjects.http.keda.sh",
)


def binaries() -> dict[str, Path]:
    out = keda_rig.binaries()
    for path in out.values():
        if not path.exists():
            absent(f"{path} not built; run `make keda`")
    return out


def ready(proc: Any) -> Any:
    """proc.ready, a rig process that exited failing the test (with its log)."""

    def check() -> bool:
        try:
            return bool(proc.ready())
        except keda_rig.RigError as e:
            pytest.fail(str(e))

    return check


@pytest.fixture
def keda_crds(control_plane: controlplane.ControlPlane) -> Iterator[None]:
    def fetch() -> list[Path]:
        bases = olm_tools.keda_crd("scaledobjects").parent
        eventing = [bases / f"eventing.keda.sh_{k}.yaml" for k in EVENTING_KINDS]
        return [*(olm_tools.keda_crd(k) for k in KEDA_KINDS), *eventing, olm_tools.http_add_on_crd()]

    with crds_installed(control_plane, fetch, CRDS, "KEDA's and its HTTP add-on's CRDs"):
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
    bins = binaries()
    if (missing := prometheus_missing()) is not None:
        absent(missing)
    hosts = [f"qwen-engine.{namespace}", f"qwen-engine.{namespace}.svc"]
    # KEDA's Prometheus trigger needs a Prometheus; it scrapes nothing (vLLM's series are gone at zero).
    procs: list[LoopbackProcess] = []
    try:
        prom = Prometheus([])
        procs.append(prom)
        sim = SimOnServicePort()
        procs.append(sim)
        interceptor = Interceptor(cp, bins["interceptor"], namespace, hosts, WAIT_S)
        procs.append(interceptor)
        cluster_support.wait_for(
            "the interceptor's admin port", ready(interceptor), 60, detail=interceptor.log_text
        )
        admin_endpoints(cp, namespace, interceptor.admin)
        scaler = Scaler(cp, bins["scaler"], namespace, interceptor.admin)
        procs.append(scaler)
        keda = Keda(cp, bins["keda"], namespace)
        procs.append(keda)
        cluster_support.wait_for("KEDA's operator healthy", ready(keda), 120, detail=keda.log_text)
        cluster_support.wait_for("the simulator", ready(sim), 60, detail=sim.log_text)

        override = tmp_path / "endpoints"
        write_override(override, ["# filled once the pod exists"])
        op = start_operator(
            namespaces=[namespace],
            endpoint_override=f"@{override}",
            env={
                "SERVEDMODEL_KEDA_HTTP_SCALER_ADDRESS": f"127.0.0.1:{scaler.port}",
                "SERVEDMODEL_ALLOWED_TARGETS": f"*.svc,*.svc.cluster.local,127.0.0.1,{SIM_HOST}",
            },
        )

        def detail() -> str:
            return "\n".join(
                [
                    op.log(60),
                    "--- keda ---",
                    keda.log_text()[-3000:],
                    "--- interceptor ---",
                    interceptor.log_text()[-2000:],
                    "--- scaler ---",
                    scaler.log_text()[-2000:],
                ]
            )

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
        assert (
            httpso["metadata"]["annotations"]["httpscaledobject.keda.sh/skip-scaledobject-creation"] == "true"
        )
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
            lambda: (
                not cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=qwen")["items"]
            ),
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
        assert answer.get("status") == 200, f"{answer}\n{detail()}"
        assert "choices" in answer["body"]
    finally:
        release_scaled_objects(cp, namespace)
        for proc in reversed(procs):
            proc.stop()


def release_scaled_objects(cp: controlplane.ControlPlane, namespace: str) -> None:
    """KEDA puts its finalizer on every ScaledObject: delete them while its operator still runs (the
    ServedModel first, else the operator renders its ScaledObject again), and drop what is left's
    finalizers, or the CRDs' deletion after the test waits on them for ever."""
    for kind in ("servedmodels", "scaledobjects"):
        cp.kubectl("delete", kind, "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
    left = cp.get_json("scaledobjects", "-n", namespace)["items"]
    for so in left:
        patch = '{"metadata":{"finalizers":null}}'
        name = so["metadata"]["name"]
        cp.kubectl("patch", "scaledobject", name, "-n", namespace, "--type=merge", "-p", patch, check=False)
