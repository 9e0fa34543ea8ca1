"""autoscaling.scaleToZero's wake from zero on the real control plane with KEDA's operator and its HTTP
add-on's interceptor and external scaler (built by hack/build-keda.sh and hack/build-keda-http-add-on.sh
into the cache), each started here out of cluster by its own pid and stopped after; KEDA's and the
add-on's CRDs (their modules' config/crd/bases) installed for the test and removed after. KEDA's
metrics-apiserver is not run: it serves 1 -> N, and the 0 -> 1 activation is the operator's own.

No cluster DNS here: the interceptor forwards to `<service>.<namespace>:<port>` (the add-on's
interceptor/middleware/routing.go), so it runs in its own mount namespace with an /etc/hosts that maps
the model's Service to 127.0.0.42, where the test's simulator listens on the Service's port (the stand-in
for cluster DNS, as the endpoint-override file stands in for pod IPs). The binaries are static (netgo),
and Go's resolver reads /etc/hosts first. The scaler finds the interceptor's admin port through the
EndpointSlice of a selector-less Service made here (127.0.0.1).

The model at zero; a request through the interceptor's proxy port (Host: the model's Service) is held;
KEDA asks the scaler (external-push), scales the Deployment 0 -> 1; the kwok pod is mapped to the
simulator; the probe opens the readiness gate, the Service's endpoints become ready, the interceptor
forwards and the held request is answered. Counted, not timed: bounded waits only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cluster_support
import httpx
import pytest
import yaml
from cluster_support import apply, crds_installed, served_model

import controlplane
import olm_tools
from loopback import LoopbackProcess, Prometheus, prometheus_missing
from required import absent
from rollout_rig import write_override
from servedmodel.sim.ports import free_port, health_status, port_open

pytestmark = pytest.mark.cluster
WAIT_S = 240.0
SIM_HOST = "127.0.0.42"  # a loopback address of its own, so the simulator can listen on the Service's port
SIM_PORT = 8000  # names.ENGINE_PORT: the port the HTTPScaledObject routes to
INTERCEPTOR_ADMIN = "servedmodel-test-interceptor-admin"
ADMIN_HOST = "interceptor-admin.servedmodel.test"  # the admin EndpointSlice's FQDN (the scaler's /etc/hosts)
CRDS = ("scaledobjects.keda.sh", "triggerauthentications.keda.sh", "httpscaledobjects.http.keda.sh")


def _cache() -> Path:
    return Path(os.environ.get("SERVEDMODEL_CACHE") or str(Path.home() / ".cache" / "servedmodel"))


def binaries() -> dict[str, Path]:
    v = controlplane.versions()
    out = {
        "keda": _cache() / f"keda-{v['KEDA_VERSION']}" / "bin" / "keda",
        "interceptor": _cache() / f"keda-http-add-on-{v['KEDA_HTTP_ADD_ON_VERSION']}" / "bin" / "interceptor",
        "scaler": _cache() / f"keda-http-add-on-{v['KEDA_HTTP_ADD_ON_VERSION']}" / "bin" / "scaler",
    }
    for path in out.values():
        if not path.exists():
            absent(f"{path} not built; run `make keda`")
    return out


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


class Keda(LoopbackProcess):
    """KEDA's operator: no leader election, no cert rotation or webhook/APIService patching; its gRPC
    metrics service (for the metrics-apiserver, not run) on loopback with a certificate of a CA made here."""

    def __init__(self, cp: controlplane.ControlPlane, binary: Path, namespace: str) -> None:
        super().__init__("keda-", "keda.log")
        certs = self.dir / "certs"
        certs.mkdir()
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
                 "-subj", "/CN=servedmodel-test-keda-ca", cwd=certs)  # fmt: skip
        _openssl("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1", cwd=certs)
        (certs / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", "tls.crt", "-days", "2", "-extfile", "san.ext", cwd=certs)  # fmt: skip
        self.health = free_port()
        self.spawn(
            [
                str(binary),
                "--leader-elect=false",
                "--enable-cert-rotation=false",
                "--enable-webhook-patching=false",
                "--enable-apiservice-patching=false",
                f"--cert-dir={certs}",
                f"--ca-dir={certs}",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{self.health}",
                f"--metrics-service-bind-address=127.0.0.1:{free_port()}",
            ],
            env={
                **os.environ,
                "KUBECONFIG": str(cp.kubeconfig),
                "WATCH_NAMESPACE": namespace,
                "POD_NAMESPACE": namespace,
                "KEDA_CLUSTER_OBJECT_NAMESPACE": namespace,
            },
        )

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"KEDA's operator exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}")
        return health_status(self.health, 1.0) == 200


def with_hosts(folder: Path, hosts: dict[str, str], binary: Path) -> list[str]:
    """`binary` in its own mount namespace with an /etc/hosts of `hosts` (name -> address) bind-mounted
    over: what cluster DNS would answer. As root a mount namespace; otherwise a user namespace too."""
    hosts_file = folder / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in hosts.items()))
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    script = 'mount --bind "$0" /etc/hosts && exec "$1"'
    return ["unshare", *userns, "--mount", "sh", "-c", script, str(hosts_file), str(binary)]


class Interceptor(LoopbackProcess):
    """The add-on's interceptor in its own mount namespace, /etc/hosts bind-mounted over: `hosts` (name ->
    address) are what cluster DNS would answer."""

    def __init__(self, cp: controlplane.ControlPlane, binary: Path, namespace: str, hosts: list[str]) -> None:
        super().__init__("keda-interceptor-", "interceptor.log")
        self.proxy, self.admin = free_port(), free_port()
        self.spawn(
            with_hosts(self.dir, dict.fromkeys(hosts, SIM_HOST), binary),
            env={
                **os.environ,
                "KUBECONFIG": str(cp.kubeconfig),
                "KEDA_HTTP_CURRENT_NAMESPACE": namespace,
                "KEDA_HTTP_WATCH_NAMESPACE": namespace,
                "KEDA_HTTP_PROXY_PORT": str(self.proxy),
                "KEDA_HTTP_ADMIN_PORT": str(self.admin),
                "OTEL_PROM_EXPORTER_PORT": str(free_port()),
                # Generous: the held request waits for the wake (KEDA, the pod, the probe, the gate).
                "KEDA_CONDITION_WAIT_TIMEOUT": f"{int(WAIT_S)}s",
                "KEDA_RESPONSE_HEADER_TIMEOUT": "60s",
            },
        )

    def queue(self) -> Any:
        return httpx.get(f"http://127.0.0.1:{self.admin}/queue", timeout=2).json()

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"the interceptor exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}")
        try:
            self.queue()
            return True
        except (httpx.HTTPError, ValueError):
            return False


class Scaler(LoopbackProcess):
    """The add-on's external scaler (gRPC on loopback); it reads the interceptor's queue counts from the
    ready addresses of INTERCEPTOR_ADMIN's EndpointSlice: an FQDN (the API server refuses loopback IPs in
    an EndpointSlice) that its /etc/hosts maps to 127.0.0.1."""

    def __init__(self, cp: controlplane.ControlPlane, binary: Path, namespace: str, admin_port: int) -> None:
        super().__init__("keda-scaler-", "scaler.log")
        self.port = free_port()
        self.spawn(
            with_hosts(self.dir, {ADMIN_HOST: "127.0.0.1"}, binary),
            env={
                **os.environ,
                "KUBECONFIG": str(cp.kubeconfig),
                "KEDA_HTTP_SCALER_PORT": str(self.port),
                "KEDA_HTTP_SCALER_TARGET_ADMIN_NAMESPACE": namespace,
                "KEDA_HTTP_SCALER_TARGET_ADMIN_SERVICE": INTERCEPTOR_ADMIN,
                "KEDA_HTTP_SCALER_TARGET_ADMIN_DEPLOYMENT": INTERCEPTOR_ADMIN,
                "KEDA_HTTP_SCALER_TARGET_ADMIN_PORT": str(admin_port),
                "KEDA_HTTP_WATCH_NAMESPACE": namespace,
            },
        )

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"the scaler exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}")
        return port_open(self.port, 1.0)


def admin_endpoints(cp: controlplane.ControlPlane, namespace: str, port: int) -> None:
    """A selector-less Service and its EndpointSlice: the interceptor's admin port at ADMIN_HOST."""
    docs = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": INTERCEPTOR_ADMIN, "namespace": namespace},
            "spec": {"ports": [{"name": "admin", "port": port}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": INTERCEPTOR_ADMIN,
                "namespace": namespace,
                "labels": {"kubernetes.io/service-name": INTERCEPTOR_ADMIN},
            },
            "addressType": "FQDN",
            "endpoints": [{"addresses": [ADMIN_HOST], "conditions": {"ready": True}}],
            "ports": [{"name": "admin", "port": port}],
        },
    ]
    cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))


class SimOnServicePort(LoopbackProcess):
    """The simulator on SIM_HOST:SIM_PORT (what /etc/hosts makes of the model's Service)."""

    def __init__(self) -> None:
        super().__init__("wake-sim-", "sim.log")
        self.base_url = f"http://{SIM_HOST}:{SIM_PORT}"
        self.spawn(
            [
                sys.executable,
                "-m",
                "servedmodel.sim",
                "--host",
                SIM_HOST,
                "--port",
                str(SIM_PORT),
                "Qwen/Qwen2.5-0.5B-Instruct",
                "--served-model-name",
                "qwen",
                "--max-model-len",
                "4096",
            ]
        )

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture
def keda_crds(control_plane: controlplane.ControlPlane) -> Iterator[None]:
    fetch = lambda: [  # noqa: E731
        olm_tools.keda_crd("scaledobjects"),
        olm_tools.keda_crd("triggerauthentications"),
        olm_tools.http_add_on_crd(),
    ]
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
        interceptor = Interceptor(cp, bins["interceptor"], namespace, hosts)
        procs.append(interceptor)
        cluster_support.wait_for(
            "the interceptor's admin port", interceptor.ready, 60, detail=interceptor.log_text
        )
        admin_endpoints(cp, namespace, interceptor.admin)
        scaler = Scaler(cp, bins["scaler"], namespace, interceptor.admin)
        procs.append(scaler)
        keda = Keda(cp, bins["keda"], namespace)
        procs.append(keda)
        cluster_support.wait_for("KEDA's operator healthy", keda.ready, 120, detail=keda.log_text)
        cluster_support.wait_for("the simulator", sim.ready, 60, detail=sim.log_text)

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
        cp.kubectl(
            "delete", "servedmodels", "--all", "-n", namespace, "--wait=true", "--timeout=30s", check=False
        )
    finally:
        for proc in reversed(procs):
            proc.stop()
