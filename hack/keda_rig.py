"""KEDA's operator and its HTTP add-on's interceptor and external scaler on loopback, out of cluster, each
by its own pid (tests/cluster/test_wake_from_zero.py, bench/cold_start.py); built by hack/build-keda.sh
and hack/build-keda-http-add-on.sh into the cache. KEDA's metrics-apiserver is not run (1 -> N only).

No cluster DNS here: the interceptor forwards to `<service>.<namespace>:<port>` (the add-on's
interceptor/middleware/routing.go) and the scaler dials the addresses of the interceptor admin Service's
EndpointSlice, so both run in a mount namespace of their own with an /etc/hosts bind-mounted over (the
binaries are static: Go's own resolver, which reads /etc/hosts). The model's Service maps to SIM_HOST,
where a simulator listens on the Service's port. The admin EndpointSlice holds an FQDN (the API server
refuses loopback IPs there) that the scaler's /etc/hosts maps to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

import controlplane
import olm_tools
from loopback import LoopbackProcess
from servedmodel.sim.ports import free_port, port_open

SIM_HOST = "127.0.0.42"  # a loopback address of its own, so the simulator can listen on the Service's port
SIM_PORT = 8000  # names.ENGINE_PORT: the port the HTTPScaledObject routes to
INTERCEPTOR_ADMIN = "servedmodel-interceptor-admin"
ADMIN_HOST = "interceptor-admin.servedmodel.test"  # the admin EndpointSlice's FQDN (the scaler's /etc/hosts)


class RigError(RuntimeError):
    """A process of the rig exited; its log's tail is the message."""


def cache() -> Path:
    return Path(os.environ.get("SERVEDMODEL_CACHE") or str(Path.home() / ".cache" / "servedmodel"))


def binaries() -> dict[str, Path]:
    """Where the builds put them (they may not exist)."""
    v = controlplane.versions()
    addon = cache() / f"keda-http-add-on-{v['KEDA_HTTP_ADD_ON_VERSION']}" / "bin"
    return {
        "keda": cache() / f"keda-{v['KEDA_VERSION']}" / "bin" / "keda",
        "interceptor": addon / "interceptor",
        "scaler": addon / "scaler",
    }


def with_hosts(folder: Path, hosts: dict[str, str], binary: Path) -> list[str]:
    """`binary` in its own mount namespace with an /etc/hosts of `hosts` (name -> address) bind-mounted
    over: what cluster DNS would answer. As root a mount namespace; otherwise a user namespace too."""
    hosts_file = folder / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in hosts.items()))
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    script = 'mount --bind "$0" /etc/hosts && exec "$1"'
    return ["unshare", *userns, "--mount", "sh", "-c", script, str(hosts_file), str(binary)]


class _Checked(LoopbackProcess):
    what = "process"

    def alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RigError(f"{self.what} exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}")


class Keda(_Checked):
    """KEDA's operator: no leader election, no cert rotation or webhook/APIService patching; its gRPC
    metrics service (for the metrics-apiserver, not run) on loopback with a certificate of a CA made here
    (it loads ca.crt, tls.crt and tls.key from --cert-dir even when nothing calls it)."""

    what = "KEDA's operator"

    def __init__(self, cp: controlplane.ControlPlane, binary: Path, namespace: str) -> None:
        super().__init__("keda-", "keda.log")
        certs = self.dir / "certs"
        certs.mkdir()
        controlplane.loopback_serving_cert(certs, "servedmodel-test-keda-ca")
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
        # controller-runtime's health probe serves /healthz and /readyz (not the engines' /health)
        self.alive()
        conn = http.client.HTTPConnection("127.0.0.1", self.health, timeout=1.0)
        try:
            conn.request("GET", "/readyz")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()


class Interceptor(_Checked):
    """The add-on's interceptor; `hosts` (the model's Service names) map to SIM_HOST."""

    what = "the interceptor"

    def __init__(
        self, cp: controlplane.ControlPlane, binary: Path, namespace: str, hosts: list[str], wait_s: float
    ) -> None:
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
                # The held request waits for the wake (KEDA, the pod, the probe, the gate): 1.5 s by default.
                "KEDA_CONDITION_WAIT_TIMEOUT": f"{int(wait_s)}s",
                "KEDA_RESPONSE_HEADER_TIMEOUT": "60s",
            },
        )

    def queue(self) -> Any:
        """The admin /queue: `<namespace>/<HTTPScaledObject>` -> {Concurrency, RPS}."""
        return httpx.get(f"http://127.0.0.1:{self.admin}/queue", timeout=2).json()

    def ready(self) -> bool:
        self.alive()
        try:
            self.queue()
            return True
        except (httpx.HTTPError, ValueError):
            return False


class Scaler(_Checked):
    """The add-on's external scaler (gRPC on loopback)."""

    what = "the scaler"

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
        self.alive()
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


class SimOnServicePort(_Checked):
    """The simulator on SIM_HOST:SIM_PORT (what the /etc/hosts above makes of the model's Service)."""

    what = "the simulator"

    def __init__(self, model: str = "Qwen/Qwen2.5-0.5B-Instruct", served: str = "qwen") -> None:
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
                model,
                "--served-model-name",
                served,
                "--max-model-len",
                "4096",
            ]
        )

    def ready(self) -> bool:
        self.alive()
        try:
            return httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


# Every CRD of KEDA's (its operator waits for each kind it watches) and the add-on's HTTPScaledObject.
KEDA_KINDS = ("scaledobjects", "scaledjobs", "triggerauthentications", "clustertriggerauthentications")
EVENTING_KINDS = ("cloudeventsources", "clustercloudeventsources")
CRDS = (
    *(f"{k}.keda.sh" for k in KEDA_KINDS),
    *(f"{k}.eventing.keda.sh" for k in EVENTING_KINDS),
    "httpscaledobjects.http.keda.sh",
)


def crd_files() -> list[Path]:
    """KEDA's and the add-on's CRD files, from their Go modules (olm_tools)."""
    bases = olm_tools.keda_crd("scaledobjects").parent
    eventing = [bases / f"eventing.keda.sh_{k}.yaml" for k in EVENTING_KINDS]
    return [*(olm_tools.keda_crd(k) for k in KEDA_KINDS), *eventing, olm_tools.http_add_on_crd()]


def service_hosts(namespace: str, service: str) -> list[str]:
    """The names the interceptor may dial or route for a Service (render/wake.hosts' in-cluster ones)."""
    return [
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _wait(proc: _Checked, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not proc.ready():  # a process that exited raises RigError with its log
        if time.monotonic() > deadline:
            raise RigError(f"{proc.what} not ready within {timeout:.0f} s:\n{proc.log_text()[-3000:]}")
        time.sleep(0.2)


@dataclass
class WakeRig:
    """The wake-from-zero stack on loopback: the interceptor, the scaler, KEDA's operator, and optionally
    the simulator on the Service's address. Its processes stop in reverse order."""

    interceptor: Interceptor
    scaler: Scaler
    keda: Keda
    sim: SimOnServicePort | None
    procs: list[_Checked] = field(default_factory=list)

    def logs(self) -> str:
        return "\n".join(f"--- {p.what} ---\n{p.log_text()[-2000:]}" for p in self.procs)

    def operator_env(self) -> dict[str, str]:
        """What the operator needs to render the wake trigger (SERVEDMODEL_KEDA_HTTP_SCALER_ADDRESS) and
        probe the loopback addresses that stand for the model's Service and pods."""
        return {
            "SERVEDMODEL_KEDA_HTTP_SCALER_ADDRESS": f"127.0.0.1:{self.scaler.port}",
            "SERVEDMODEL_ALLOWED_TARGETS": f"*.svc,*.svc.cluster.local,127.0.0.1,{SIM_HOST}",
        }


@contextlib.contextmanager
def wake_rig(
    cp: controlplane.ControlPlane,
    namespace: str,
    service: str,
    wait_s: float,
    *,
    simulator: bool = True,
    ready_timeout: float = 120.0,
) -> Iterator[WakeRig]:
    """Start the stack for the model's Service `service` (its CRDs installed, KEDA's and the add-on's)
    and stop every process it started, by pid, on the way out. `wait_s`: how long the interceptor holds
    a request (KEDA_CONDITION_WAIT_TIMEOUT)."""
    bins = binaries()
    procs: list[_Checked] = []
    try:
        sim = None
        if simulator:
            sim = SimOnServicePort()
            procs.append(sim)
        interceptor = Interceptor(
            cp, bins["interceptor"], namespace, service_hosts(namespace, service), wait_s
        )
        procs.append(interceptor)
        _wait(interceptor, ready_timeout)
        admin_endpoints(cp, namespace, interceptor.admin)
        scaler = Scaler(cp, bins["scaler"], namespace, interceptor.admin)
        procs.append(scaler)
        keda = Keda(cp, bins["keda"], namespace)
        procs.append(keda)
        for proc in (scaler, keda, *([sim] if sim is not None else [])):
            _wait(proc, ready_timeout)
        yield WakeRig(interceptor, scaler, keda, sim, procs)
    finally:
        for proc in reversed(procs):
            proc.stop()


def release_scaled_objects(cp: controlplane.ControlPlane, namespace: str) -> None:
    """KEDA puts its finalizer on every ScaledObject: delete them while its operator still runs (the
    ServedModel first, else the operator renders its ScaledObject again), and drop what is left's
    finalizers, or the CRDs' deletion after waits on them for ever."""
    for kind in ("servedmodels", "scaledobjects"):
        cp.kubectl("delete", kind, "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
    for so in cp.get_json("scaledobjects", "-n", namespace)["items"]:
        patch = '{"metadata":{"finalizers":null}}'
        name = so["metadata"]["name"]
        cp.kubectl("patch", "scaledobject", name, "-n", namespace, "--type=merge", "-p", patch, check=False)
