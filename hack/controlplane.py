#!/usr/bin/env python3
"""Start and stop a real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok (fake nodes, one with 8 `nvidia.com/gpu`).

Binaries come from hack/build-control-plane.sh (cached outside the repository). Each launch gets a
fresh directory and free loopback ports, so parallel runs don't collide; every process it starts is
stopped by its pid (SIGTERM, then SIGKILL) from `stop()`, the context manager, atexit, or
`down --dir DIR` for a detached launch.

Python:  with controlplane.start() as cp: cp.kubectl("get", "nodes")
Shell:   python hack/controlplane.py up --dir DIR     # prints the kubeconfig, writes DIR/env
         python hack/controlplane.py down --dir DIR   # stops what DIR/pids records

Only the standard library: it runs before the project's virtualenv exists.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

HACK_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(HACK_DIR.parent / "operator"))  # servedmodel, where it is not installed
from servedmodel.sim.ports import free_ports as _free_ports  # noqa: E402  (standard library only)

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
BINARIES = (*COMPONENTS, "kubectl")
STAGE_FILES = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)
# kwok's pod-ready stage replaced by hack/kwok's, which honours readiness gates as a kubelet does, plus
# the two stages that flip Ready when a gate's condition changes (see the files).
REPO_STAGE_FILES = ("pod-ready.yaml", "pod-readiness-gates-ready.yaml", "pod-readiness-gates-unready.yaml")
GPU_NODE = "kwok-gpu-0"
GPU_RESOURCE = "nvidia.com/gpu"
# Shutdown order: the clients first, storage last.
STOP_ORDER = ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")
# One request's bound. Loopback answers in milliseconds, but a 2-core machine running the suite's four
# workers beside another job was seen to keep a GET of one CRD waiting over 5 s (a fresh-clone CI run
# at load 11): a harness call failing there says nothing about the code under test.
REQUEST_TIMEOUT_S = 30.0
# The HPA controller's sync period (upstream: 15s), short so an autoscaling test sees several decisions
# in a minute; it only matters where an HPA exists. SERVEDMODEL_CONTROLLER_MANAGER_FLAGS adds more.
HPA_SYNC_PERIOD = "2s"
# The aggregation layer's front proxy (kube-apiserver → aggregated API servers such as
# prometheus-adapter's custom.metrics.k8s.io): the client name its certificate carries.
FRONT_PROXY_CLIENT = "front-proxy-client"
# Room for the scale benchmark (3,000 ServedModels: a Service and a Pod each, and some to spare): a /16
# service range (65,534 ClusterIPs; the default /24 ran out at 253 Services) and a node that admits
# that many pods (simulator-engine pods request no GPU, so pods are what limits them).
SERVICE_CIDR = "10.0.0.0/16"
NODE_PODS = 5000
CONTROLLER_THROUGHPUT = (
    "--kube-api-qps=500",
    "--kube-api-burst=1000",
    "--concurrent-deployment-syncs=25",
    "--concurrent-replicaset-syncs=25",
    "--concurrent-service-endpoint-syncs=25",
    "--concurrent-gc-syncs=50",
)


class ControlPlaneError(RuntimeError):
    """The control plane could not be started; the message names the component and its log."""


def versions() -> dict[str, str]:
    """The pins from hack/versions.env (the one place they are set)."""
    out: dict[str, str] = {}
    for line in (HACK_DIR / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def cache_root() -> Path:
    base = os.environ.get("SERVEDMODEL_CACHE") or str(Path.home() / ".cache" / "servedmodel")
    return Path(base) / f"k8s-{versions()['K8S_VERSION']}"


def default_bin_dir() -> Path:
    return cache_root() / "bin"


def stages_dir(bin_dir: Path) -> Path:
    return bin_dir.parent / "kwok-stages"


def missing_binaries(bin_dir: Path | None = None) -> list[str]:
    """What hack/build-control-plane.sh still has to build (empty when the control plane can start)."""
    bin_dir = bin_dir or default_bin_dir()
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if not all((stages_dir(bin_dir) / f).is_file() for f in STAGE_FILES):
        missing.append("kwok-stages")
    return missing


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, below the kernel's ephemeral range (servedmodel.sim.ports: a port
    bind(0) hands out can be taken by any outgoing connection's source port before it is bound)."""
    return _free_ports(n)


# --- process bookkeeping -------------------------------------------------------------------------

# Every process any launch in this interpreter started: (component, pid, executable). The test suite
# checks at the end that none of them is still alive.
_STARTED: list[tuple[str, int, str]] = []
_LIVE: list[ControlPlane] = []
_LOCK = threading.Lock()


def _set_parent_death_signal() -> None:
    # Runs in the child between fork and exec: if the launching process dies without cleaning up
    # (SIGKILL, OOM), the kernel kills the component too instead of leaving it orphaned.
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def process_alive(pid: int, exe: str | None = None) -> bool:
    """True when pid runs (not a zombie) and, if exe is given, is that executable (guards pid reuse)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
        return False
    if exe is None:
        return True
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return argv0 == exe


def leftover_processes() -> list[tuple[str, int]]:
    """Components started by this interpreter that are still running (should be empty after stop)."""
    with _LOCK:
        started = list(_STARTED)
    return [(name, pid) for name, pid, exe in started if process_alive(pid, exe)]


def kill_leftovers(timeout: float = 5.0) -> list[tuple[str, int]]:
    """Stop whatever leftover_processes() lists; returns what it stopped."""
    with _LOCK:
        left = [(n, p, e) for n, p, e in _STARTED if process_alive(p, e)]
    kill_processes(left, timeout)
    return [(n, p) for n, p, _ in left]


def kill_processes(procs: Sequence[tuple[str, int, str]], timeout: float = 10.0) -> None:
    """SIGTERM each live (name, pid, exe) in order, wait up to timeout, then SIGKILL what is left."""
    for _, pid, exe in procs:
        if process_alive(pid, exe):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(process_alive(p, e) for _, p, e in procs):
        _reap()
        time.sleep(0.05)
    for _, pid, exe in procs:
        if process_alive(pid, exe):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(process_alive(p, e) for _, p, e in procs):
        _reap()
        time.sleep(0.05)


def _reap() -> None:
    with _LOCK:
        live = list(_LIVE)
    for cp in live:
        for proc in cp.procs.values():
            proc.poll()


# --- the control plane ---------------------------------------------------------------------------


@dataclass
class ControlPlane:
    """A running control plane. Attributes are what tests and `make dev` need to talk to it."""

    dir: Path
    bin_dir: Path
    server: str
    token: str
    ca_file: Path
    kubeconfig: Path
    ports: dict[str, int]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    remove_dir: bool = True
    startup_s: float = 0.0
    # Each component's command line, so a fault test can restart one as it was (restart()).
    args: dict[str, list[str]] = field(default_factory=dict)
    detach: bool = False

    @property
    def log_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def env(self) -> dict[str, str]:
        """os.environ with KUBECONFIG pointing here (for subprocesses: the operator, kubectl)."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this control plane; check=True raises with stderr in the message."""
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and res.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} exited {res.returncode}: {res.stderr.strip()}")
        return res

    def _call(self, method: str, path: str, body: Any, content_type: str) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S, context=ctx) as resp:
            raw: bytes = resp.read()
        return raw

    def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json"
    ) -> Any:
        """One JSON request to the API server as the admin token user; HTTPError propagates."""
        raw = self._call(method, path, body, content_type)
        return json.loads(raw) if raw else None

    def get_json(self, *args: str, timeout: float = 60.0) -> Any:
        """`kubectl get ARGS -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json", timeout=timeout).stdout)

    def endpoint_ready(self, namespace: str, service: str) -> dict[str, bool]:
        """pod name -> the `ready` of its endpoint in the Service's EndpointSlices."""
        slices = self.get_json(
            "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={service}"
        )
        out: dict[str, bool] = {}
        for sl in slices["items"]:
            for ep in sl.get("endpoints") or []:
                ref = ep.get("targetRef") or {}
                if ref.get("kind") == "Pod":
                    out[str(ref["name"])] = bool((ep.get("conditions") or {}).get("ready"))
        return out

    def get_text(self, path: str) -> str:
        """GET a plain-text endpoint (/readyz, /livez, /metrics)."""
        return self._call("GET", path, None, "").decode()

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Wait until the CRD named crd (plural.group) is Established. Polls: `kubectl wait` fails at once
        on a CRD whose status has no conditions yet (right after apply)."""
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                conds = self.request("GET", path).get("status", {}).get("conditions") or []
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
                conds = []
            except OSError:  # a timed-out read on a starved API server: asked again until the deadline
                conds = []
            if any(c.get("type") == "Established" and c.get("status") == "True" for c in conds):
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"CRD {crd} not Established after {timeout:.0f}s: {conds}")
            time.sleep(0.05)

    def log_tail(self, component: str, lines: int = 30) -> str:
        try:
            return "\n".join(
                (self.log_dir / f"{component}.log").read_text(errors="replace").splitlines()[-lines:]
            )
        except FileNotFoundError:
            return "(no log)"

    # ---- faults (tests/cluster/test_faults.py, bench/operator_faults.py) -----------------------------

    def kill(self, component: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one component (SIGKILL: it dies with no chance to clean up) and reap it."""
        proc = self.procs[component]
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10.0)

    def restart(self, component: str, timeout: float = 60.0) -> None:
        """Start `component` again with the command line it had (after `kill`); for the API server, wait
        for its /readyz."""
        if self.procs[component].poll() is None:
            raise ControlPlaneError(f"{component} is still running (pid {self.procs[component].pid})")
        launcher = _Launcher(self.dir, self.bin_dir, self.detach, procs=self.procs)
        launcher.spawn(component, self.args[component])
        if component == "kube-apiserver":
            _wait(
                "kube-apiserver /readyz",
                launcher,
                time.monotonic() + timeout,
                lambda: self.get_text("/readyz") == "ok",
            )

    def pause(self, component: str) -> None:
        """SIGSTOP: the process holds its sockets and answers nothing (a hung etcd, a frozen operator)."""
        os.kill(self.procs[component].pid, signal.SIGSTOP)

    def resume(self, component: str) -> None:
        os.kill(self.procs[component].pid, signal.SIGCONT)

    def stop(self, timeout: float = 10.0, *, keep_logs: bool = False) -> None:
        """Stop every component this launch started, by pid; idempotent."""
        for p in self.procs.values():  # a paused component would not hear SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
        procs = [(n, self.procs[n].pid, str(self.bin_dir / n)) for n in STOP_ORDER if n in self.procs]
        kill_processes(procs, timeout)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1.0)
        with _LOCK, contextlib.suppress(ValueError):
            _LIVE.remove(self)
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "pids").unlink()
        if self.remove_dir:
            if keep_logs:
                shutil.rmtree(self.dir / "etcd", ignore_errors=True)
            else:
                shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _stop_all_live() -> None:
    with _LOCK:
        live = list(_LIVE)
    for cp in live:
        cp.stop()


atexit.register(_stop_all_live)


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise ControlPlaneError("openssl is not on PATH: it makes the control plane's CA and keys")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def loopback_serving_cert(certs: Path, ca_name: str, *, server_auth: bool = False) -> None:
    """A CA of its own (`ca.crt`, `ca.key`) and a certificate it signs for 127.0.0.1 (`tls.crt`, `tls.key`)
    in `certs`, for a component the tests run out of cluster (KEDA's gRPC service, LWS's webhooks);
    `server_auth` adds extendedKeyUsage=serverAuth (the API server checks it on webhook servers)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", f"/CN={ca_name}", cwd=certs)  # fmt: skip
    _openssl("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1", cwd=certs)
    ext = "subjectAltName=IP:127.0.0.1\n" + ("extendedKeyUsage=serverAuth\n" if server_auth else "")
    (certs / "san.ext").write_text(ext)
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "tls.crt", "-days", "2", "-extfile", "san.ext", cwd=certs)  # fmt: skip


def _make_pki(pki: Path, address: str = "127.0.0.1") -> None:
    """A CA, a serving certificate for 127.0.0.1/localhost (and `address`), and the service-account signing
    key. EC P-256 keys: generated in milliseconds, accepted by every component."""
    pki.mkdir(parents=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=servedmodel-test-ca", cwd=pki)  # fmt: skip
    _openssl("req", *ec, "-keyout", "apiserver.key", "-out", "apiserver.csr", "-subj", "/CN=kube-apiserver",
             cwd=pki)  # fmt: skip
    extra = "" if address == "127.0.0.1" else f"IP:{address},"
    (pki / "san.ext").write_text(
        f"subjectAltName=IP:127.0.0.1,IP:10.0.0.1,{extra}DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "apiserver.crt", "-days", "3650", "-extfile", "san.ext", cwd=pki)  # fmt: skip
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", "sa.key", cwd=pki
    )
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    # The aggregation layer: a separate CA for the front proxy, as kubeadm makes, so an aggregated API
    # server trusts request headers (X-Remote-User) only from the kube-apiserver's proxy client.
    _openssl("req", "-x509", *ec, "-keyout", "front-proxy-ca.key", "-out", "front-proxy-ca.crt",
             "-days", "3650", "-subj", "/CN=servedmodel-front-proxy-ca", cwd=pki)  # fmt: skip
    _openssl("req", *ec, "-keyout", "front-proxy-client.key", "-out", "front-proxy-client.csr",
             "-subj", f"/CN={FRONT_PROXY_CLIENT}", cwd=pki)  # fmt: skip
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt",
             "-CAkey", "front-proxy-ca.key", "-CAcreateserial", "-out", "front-proxy-client.crt",
             "-days", "3650", "-extfile", "client.ext", cwd=pki)  # fmt: skip


def _kubeconfig(server: str, ca_file: Path, token: str) -> str:
    # JSON is valid YAML; every client (kubectl, kopf, the kubernetes client) reads it.
    name = "servedmodel-local"
    cluster = {"server": server, "certificate-authority": str(ca_file)}
    context = {"cluster": name, "user": "admin", "namespace": "default"}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": name, "context": context}],
        "current-context": name,
    }
    return json.dumps(config, indent=2)


def gpu_node(name: str = GPU_NODE, gpus: int = 8, pods: int = NODE_PODS) -> dict[str, Any]:
    """A fake GPU node kwok manages: capacity like an 8-GPU server, no taints (pods need no toleration),
    and room for `pods` pods (kwok runs none of them) instead of a kubelet's 110."""
    capacity = {
        "cpu": "32",
        "memory": "256Gi",
        "pods": str(pods),
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": str(gpus),
            },
        },
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def fake_volume(name: str, size: str = "10Ti") -> dict[str, Any]:
    """A PersistentVolume nothing mounts (kwok runs no containers): unclassed PVCs (the weight cache)
    bind to it, so Pods that claim one still schedule. Retain: each binds once per control plane."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": {"type": "kwok"}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": f"/nonexistent/{name}"},
        },
    }


class _Launcher:
    def __init__(
        self,
        directory: Path,
        bin_dir: Path,
        detach: bool,
        procs: dict[str, subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.dir = directory
        self.bin_dir = bin_dir
        self.detach = detach
        self.procs: dict[str, subprocess.Popen[bytes]] = {} if procs is None else procs
        self.args: dict[str, list[str]] = {}
        (directory / "logs").mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, args: Sequence[str]) -> None:
        self.args[name] = list(args)
        exe = str(self.bin_dir / name)
        with (self.dir / "logs" / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [exe, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                # Own session: a Ctrl-C in the terminal reaches the launcher, which stops components in order.
                start_new_session=True,
                preexec_fn=None if self.detach else _set_parent_death_signal,
            )
        self.procs[name] = proc
        with _LOCK:
            _STARTED.append((name, proc.pid, exe))
        with (self.dir / "pids").open("a") as f:
            f.write(f"{name} {proc.pid} {exe}\n")

    def check_running(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = self.dir / "logs" / f"{name}.log"
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
                raise ControlPlaneError(
                    f"{name} exited with {proc.returncode} during startup; {log}:\n{tail}"
                )


def _wait(what: str, launcher: _Launcher, deadline: float, probe: Callable[[], bool]) -> None:
    while True:
        launcher.check_running()
        try:
            if probe():
                return
        except (OSError, urllib.error.URLError, ValueError, ssl.SSLError):
            pass
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"timed out waiting for {what}; logs in {launcher.dir / 'logs'}")
        time.sleep(0.05)


def start(
    directory: Path | None = None,
    *,
    bin_dir: Path | None = None,
    timeout: float = 120.0,
    detach: bool = False,
    volumes: int = 32,
    apiserver_flags: Sequence[str] = (),
    etcd_flags: Sequence[str] = (),
    address: str = "127.0.0.1",
) -> ControlPlane:
    """Start etcd, kube-apiserver, controller-manager, scheduler and kwok; return once the API server is
    ready, the GPU node is Ready and the `default` ServiceAccount exists. On failure everything started
    is stopped and ControlPlaneError names the component and its log.

    directory: where data, certificates, logs, kubeconfig and pids go (default: a new temporary
    directory, removed by stop()). detach: the components outlive this process (for `up`).
    volumes: how many fake PersistentVolumes (storageClassName "") to pre-create for PVCs.
    apiserver_flags: more kube-apiserver flags (a fault test's `--watch-cache=false`, say).
    etcd_flags: more etcd flags, after the defaults (the last of a repeated flag wins: a bigger
    `--quota-backend-bytes` for a benchmark of thousands of objects).
    address: where kube-apiserver listens and what it advertises (the real node's bridge gateway, so that
    pods reach it, directly and through the `kubernetes` Service, whose endpoints it then keeps: the lease
    reconciler; on loopback there are none). Always an address of this machine."""
    attempts = 3
    for attempt in range(1, attempts + 1):
        try:
            return _start_once(
                directory,
                bin_dir=bin_dir,
                timeout=timeout,
                detach=detach,
                volumes=volumes,
                apiserver_flags=apiserver_flags,
                etcd_flags=etcd_flags,
                address=address,
            )
        except _PortTaken as e:
            # A free port found by binding 0 can be taken by another run before the component binds it.
            if attempt == attempts:
                raise ControlPlaneError(str(e)) from e
            if directory is None:
                shutil.rmtree(e.directory, ignore_errors=True)
    raise AssertionError("unreachable")


class _PortTaken(ControlPlaneError):
    def __init__(self, message: str, directory: Path) -> None:
        super().__init__(message)
        self.directory = directory


def _start_once(
    directory: Path | None,
    *,
    bin_dir: Path | None,
    timeout: float,
    detach: bool,
    volumes: int,
    apiserver_flags: Sequence[str] = (),
    etcd_flags: Sequence[str] = (),
    address: str = "127.0.0.1",
) -> ControlPlane:
    t0 = time.monotonic()
    bin_dir = bin_dir or default_bin_dir()
    missing = missing_binaries(bin_dir)
    if missing:
        raise ControlPlaneError(
            f"missing in {bin_dir}: {', '.join(missing)}; build them with `make control-plane` "
            "(hack/build-control-plane.sh)"
        )
    remove_dir = directory is None
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="servedmodel-cp-"))
    else:
        directory = directory.resolve()
        directory.mkdir(parents=True, exist_ok=True)
        if (directory / "pids").exists():
            raise ControlPlaneError(
                f"{directory} already holds a control plane (pids file); run `down` first"
            )
        # What a stopped launch left behind (data, keys, logs) is replaced: every start is fresh.
        for stale in ("etcd", "pki", "logs"):
            shutil.rmtree(directory / stale, ignore_errors=True)
    launcher = _Launcher(directory, bin_dir, detach)
    etcd_port, etcd_peer, api_port = free_ports(3)
    token = secrets.token_hex(16)
    server = f"https://{address}:{api_port}"
    pki = directory / "pki"
    kubeconfig = directory / "kubeconfig"
    cp = ControlPlane(
        dir=directory,
        bin_dir=bin_dir,
        server=server,
        token=token,
        ca_file=pki / "ca.crt",
        kubeconfig=kubeconfig,
        ports={"etcd": etcd_port, "etcd-peer": etcd_peer, "kube-apiserver": api_port},
        procs=launcher.procs,
        remove_dir=remove_dir,
        args=launcher.args,
        detach=detach,
    )
    if not detach:
        with _LOCK:
            _LIVE.append(cp)
    deadline = t0 + timeout
    try:
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        launcher.spawn("etcd", [
            f"--data-dir={directory / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=1073741824",
            *etcd_flags,
        ])  # fmt: skip
        _make_pki(pki, address)  # while etcd starts
        (pki / "tokens.csv").write_text(f"{token},admin,admin,system:masters\n")
        kubeconfig.write_text(_kubeconfig(server, cp.ca_file, token))
        kubeconfig.chmod(0o600)

        def etcd_healthy() -> bool:
            with urllib.request.urlopen(f"{etcd_url}/health", timeout=1.0) as r:
                return bool(json.loads(r.read()).get("health") == "true")

        _wait("etcd /health", launcher, deadline, etcd_healthy)
        launcher.spawn("kube-apiserver", [
            f"--etcd-servers={etcd_url}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--bind-address={address}", f"--advertise-address={address}", f"--secure-port={api_port}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--allow-privileged=true",
            # The `kubernetes` Service's endpoints: none on loopback (an endpoint may not be 127.0.0.0/8).
            f"--endpoint-reconciler-type={'none' if address == '127.0.0.1' else 'lease'}",
            # The aggregation layer (APIServices such as prometheus-adapter's custom.metrics.k8s.io).
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--v=1",
            # Extra flags for experiments/debugging, e.g. "--v=4 --feature-gates=...".
            *os.environ.get("SERVEDMODEL_APISERVER_FLAGS", "").split(),
            *apiserver_flags,
        ])  # fmt: skip

        def api_ready() -> bool:
            return cp.get_text("/readyz") == "ok"

        _wait("kube-apiserver /readyz", launcher, deadline, api_ready)
        t_api = time.monotonic() - t0
        launcher.spawn("kube-controller-manager", [
            f"--kubeconfig={kubeconfig}", "--leader-elect=false",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--bind-address=127.0.0.1", "--secure-port=0",
            "--use-service-account-credentials=false", "--v=1",
            f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}",
            # Client rate limits and workers sized for thousands of Deployments (defaults: 20 QPS, 5
            # workers), so the controllers, not the operator under test, are not the queue.
            *CONTROLLER_THROUGHPUT,
            *os.environ.get("SERVEDMODEL_CONTROLLER_MANAGER_FLAGS", "").split(),
        ])  # fmt: skip
        launcher.spawn("kube-scheduler", [
            f"--kubeconfig={kubeconfig}", "--leader-elect=false",
            "--bind-address=127.0.0.1", "--secure-port=0", "--v=1",
            "--kube-api-qps=500", "--kube-api-burst=1000",
        ])  # fmt: skip
        stages = stages_dir(bin_dir)
        launcher.spawn("kwok", [
            f"--kubeconfig={kubeconfig}", "--manage-all-nodes=false",
            # Only the fake nodes (gpu_node()): a real kubelet's node (hack/realnode.py) is left alone.
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--cidr=10.244.0.0/16", "--node-ip=10.240.0.2",
            # Leases renewed by kwok keep the node Ready past the node-lifecycle grace period.
            "--node-lease-duration-seconds=40",
            *[f"--config={stages / f}" for f in STAGE_FILES if f not in REPO_STAGE_FILES],
            *[f"--config={HACK_DIR / 'kwok' / f}" for f in REPO_STAGE_FILES],
        ])  # fmt: skip
        cp.request("POST", "/api/v1/nodes", gpu_node())
        for i in range(volumes):
            cp.request("POST", "/api/v1/persistentvolumes", fake_volume(f"kwok-pv-{i:02d}"))

        def node_ready() -> bool:
            node = cp.request("GET", f"/api/v1/nodes/{GPU_NODE}")
            conds = node.get("status", {}).get("conditions") or []
            return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)

        def default_sa() -> bool:
            try:
                cp.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return False
                raise
            return True

        _wait(f"node {GPU_NODE} Ready (kwok)", launcher, deadline, node_ready)
        _wait("ServiceAccount default/default (controller-manager)", launcher, deadline, default_sa)
    except ControlPlaneError as e:
        cp.stop(keep_logs=True)
        if "address already in use" in str(e):
            raise _PortTaken(str(e), directory) from e
        raise
    except BaseException:
        cp.stop(keep_logs=True)
        raise
    cp.startup_s = time.monotonic() - t0
    info = {
        "server": server,
        "kubeconfig": str(kubeconfig),
        "ca_file": str(cp.ca_file),
        "log_dir": str(cp.log_dir),
        "bin_dir": str(bin_dir),
        "ports": cp.ports,
        "pids": cp.pids(),
        "apiserver_ready_s": round(t_api, 2),
        "startup_s": round(cp.startup_s, 2),
    }
    (directory / "controlplane.json").write_text(json.dumps(info, indent=2) + "\n")
    (directory / "env").write_text(f"export KUBECONFIG={kubeconfig}\nexport PATH={bin_dir}:$PATH\n")
    return cp


def stop_dir(directory: Path, timeout: float = 10.0) -> list[tuple[str, int]]:
    """Stop the components a (detached) launch recorded in DIR/pids; returns what was running."""
    pid_file = directory / "pids"
    if not pid_file.exists():
        return []
    procs: list[tuple[str, int, str]] = []
    for line in pid_file.read_text().splitlines():
        name, pid, exe = line.split(" ", 2)
        procs.append((name, int(pid), exe))
    procs.sort(key=lambda p: STOP_ORDER.index(p[0]) if p[0] in STOP_ORDER else -1)
    running = [(n, p) for n, p, e in procs if process_alive(p, e)]
    kill_processes(procs, timeout)
    pid_file.unlink()
    shutil.rmtree(directory / "etcd", ignore_errors=True)
    return running


@contextlib.contextmanager
def running(directory: Path | None = None, **kwargs: Any) -> Iterator[ControlPlane]:
    cp = start(directory, **kwargs)
    try:
        yield cp
    finally:
        cp.stop()


def _bench(n: int) -> int:
    """Warm start/stop times (binaries built): what each test session pays once."""
    rows = []
    for _ in range(n):
        cp = start()
        api = json.loads((cp.dir / "controlplane.json").read_text())["apiserver_ready_s"]
        t0 = time.monotonic()
        cp.stop()
        rows.append((api, cp.startup_s, time.monotonic() - t0))
    print(f"{'run':>3}  {'apiserver /readyz':>17}  {'ready (node+SA)':>15}  {'stop':>6}")
    for i, (api, ready, stop) in enumerate(rows, 1):
        print(f"{i:>3}  {api:>16.1f}s  {ready:>14.1f}s  {stop:>5.1f}s")
    med = sorted(r[1] for r in rows)[len(rows) // 2]
    print(f"median ready: {med:.1f}s  (load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)")
    return 0


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="controlplane.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start detached; print the kubeconfig path; write DIR/env")
    up.add_argument("--dir", type=Path, required=True, help="state directory (kubeconfig, logs, pids, data)")
    up.add_argument("--bin-dir", type=Path, default=None, help="built binaries (default: the version cache)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness")
    up.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops everything")
    down = sub.add_parser("down", help="stop what DIR/pids records")
    down.add_argument("--dir", type=Path, required=True)
    sub.add_parser("missing", help="print binaries still to build; exit 1 if any")
    bench = sub.add_parser("bench", help="start and stop N times; print a table of the phase times")
    bench.add_argument("-n", type=int, default=3)
    args = parser.parse_args(argv)

    if args.cmd == "missing":
        missing = missing_binaries()
        print("\n".join(missing) if missing else f"all present in {default_bin_dir()}")
        return 1 if missing else 0
    if args.cmd == "bench":
        return _bench(args.n)
    if args.cmd == "down":
        stopped = stop_dir(args.dir)
        print(f"stopped {', '.join(f'{n} ({p})' for n, p in stopped) or 'nothing (none running)'}")
        return 0
    try:
        cp = start(args.dir, bin_dir=args.bin_dir, timeout=args.timeout, detach=not args.foreground)
    except (ControlPlaneError, OSError, subprocess.SubprocessError) as e:
        print(f"control plane failed: {e}", file=sys.stderr)
        return 1
    print(f"control plane ready in {cp.startup_s:.1f}s: {cp.server}")
    print(f"export KUBECONFIG={cp.kubeconfig}")
    print(f"logs: {cp.log_dir}   stop: python {Path(__file__).name} down --dir {args.dir}")
    if args.foreground:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            cp.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
