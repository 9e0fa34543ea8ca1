"""A real node beside kwok (issue 22): containerd + runc + the CNI bridge + a kubelet + kube-proxy
(iptables mode), registered with a running ControlPlane, started and stopped by pid like the control
plane's components.

The node is named REAL_NODE, labelled and tainted ``servedmodel.dev/real-node`` (NoSchedule) so the
kwok-based tests never land on it unless a pod tolerates the taint. Pods get addresses from POD_CIDR on
the bridge BRIDGE (no masquerade, no route beyond this machine). Everything the node writes (containerd's
root/state, the kubelet's root, pod logs, CNI's IPAM, network namespaces) lies under DIR/node and is
unmounted/removed by stop(), which also kills the containers' shims, deletes the bridge, removes the
cgroups the kubelet made and the HOST_PATHS it had to write outside DIR/node. Pods reach Services' ClusterIPs
(SERVICE_CIDR, routed to the bridge's gateway) through kube-proxy's rules; start_cluster() also starts the
control plane with kube-apiserver on GATEWAY, so pods reach it too, at GATEWAY and through the `kubernetes`
Service (in-cluster config). Binaries come from hack/build-node.sh; the pause image from
hack/pause_image.py.

One real node per machine at a time: the bridge, the pod CIDR, the ``kubepods`` cgroups and the HOST_PATHS
are the machine's, so start() takes an exclusive lock on LOCK (flock: released by stop() or when the
process dies) and waits for it while another run's node holds it (another checkout's `make test`, a CI run
beside it), up to SERVEDMODEL_REAL_NODE_LOCK_WAIT_S (default 1200 s).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import controlplane
from pause_image import PAUSE_IMAGE, ensure_archive

REAL_NODE = "servedmodel-real-node"
REAL_NODE_LABEL = "servedmodel.dev/real-node"
# A private range unused here (the host's is 192.0.2.0/24, kwok's pods 10.244.0.0/16, Services 10.0.0.0/16).
POD_CIDR = "10.233.0.0/24"
# The bridge's address on the host: the pods' gateway; made by start() before CNI's first ADD, so that
# kube-apiserver can listen on it (start_cluster).
GATEWAY = "10.233.0.1"
BRIDGE = "smbr0"
# The top-level cgroups the kubelet (cgroupsPerQOS) creates in each v1 hierarchy.
_KUBELET_CGROUPS = ("kubepods",)
# Paths outside DIR/node that the components write whatever their flags say: the kubelet's device-plugin
# socket (a constant), the shims' sockets (/run/containerd/s, a constant), libcni's result cache (go-cni's
# default, not configurable in containerd's CRI). stop() removes those that start() did not find.
HOST_PATHS = (Path("/var/lib/kubelet"), Path("/run/containerd"), Path("/var/lib/cni"))
CNI_RESULTS = Path("/var/lib/cni/results")
CNI_NETWORK = "servedmodel-real-node"
# The kubelet's filter chain (it drops non-local packets to 127.0.0.0/8), jumped to from INPUT and OUTPUT.
FIREWALL_CHAIN = "KUBE-FIREWALL"
LOCK = Path(os.environ.get("SERVEDMODEL_REAL_NODE_LOCK", "/run/lock/servedmodel-real-node.lock"))
LOCK_WAIT_S = float(os.environ.get("SERVEDMODEL_REAL_NODE_LOCK_WAIT_S", "1200"))


def node_bin_dir() -> Path:
    v = controlplane.versions()
    name = f"node-{v['K8S_VERSION']}-containerd-{v['CONTAINERD_VERSION']}-cni-{v['CNI_PLUGINS_VERSION']}"
    return controlplane.cache_root().parent / name / "bin"


def missing_node_binaries(bin_dir: Path | None = None) -> list[str]:
    bin_dir = bin_dir or node_bin_dir()
    names = ["kubelet", "containerd", "ctr", "containerd-shim-runc-v2"]
    names += [f"cni/{p}" for p in ("bridge", "host-local", "loopback")]
    missing = [n for n in names if not (bin_dir / n).is_file()]
    if shutil.which("runc") is None:
        missing.append("runc (apt-get install runc)")
    return missing


@dataclass
class RealNode:
    cp: controlplane.ControlPlane
    dir: Path
    bin_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # HOST_PATHS that did not exist before start(): removed by stop().
    made: list[Path] = field(default_factory=list)
    # The machine-wide LOCK, held from start() until stop() has removed everything.
    lock_fd: int | None = None
    # start_cluster(): stop() stops the control plane too (keeping its logs when keep_logs).
    own_cp: bool = False
    keep_logs: bool = False
    # The iptables binaries (iptables, ip6tables) in which the kubelet's KUBE-FIREWALL chain did not exist
    # before start(): stop() removes it there (kube-proxy --cleanup leaves it).
    firewall_made: list[str] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.dir / "containerd.sock"

    def ctr(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "ctr"), "--address", str(self.socket), "-n", "k8s.io", *args],
            check=check,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop kube-proxy (and remove its rules), the kubelet, every container, containerd and the shims;
        unmount and remove what the node made (mounts and network namespaces under DIR/node, the bridge,
        the kubelet's cgroups); the control plane start_cluster() started. Idempotent."""
        for name in ("kube-proxy", "kubelet"):
            proc = self.procs.get(name)
            if proc is not None:
                controlplane.kill_processes([(name, proc.pid, str(self.bin_dir / name))], timeout)
        if "kube-proxy" in self.procs:
            self._cleanup_proxy_rules()
        for binary in self.firewall_made:
            for chain in ("INPUT", "OUTPUT"):
                while _iptables(binary, "-D", chain, "-j", FIREWALL_CHAIN):
                    pass
            _iptables(binary, "-F", FIREWALL_CHAIN)
            _iptables(binary, "-X", FIREWALL_CHAIN)
        self.firewall_made = []
        if self.socket.exists() and "containerd" in self.procs and self.procs["containerd"].poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                for line in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                    self.ctr("tasks", "kill", "-s", "SIGKILL", line, check=False)
                for line in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                    self.ctr("tasks", "delete", "-f", line, check=False)
        containerd = self.procs.get("containerd")
        if containerd is not None:
            controlplane.kill_processes(
                [("containerd", containerd.pid, str(self.bin_dir / "containerd"))], timeout
            )
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1.0)
        self._kill_shims()
        self._unmount()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        self._remove_cgroups()
        self._remove_host_paths()
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "pids").unlink()
        # The node's logs go beside the control plane's (kept there when a test failed).
        with contextlib.suppress(OSError):
            shutil.rmtree(self.cp.log_dir / "node", ignore_errors=True)
            shutil.move(self.dir / "logs", self.cp.log_dir / "node")
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.own_cp:
            self.cp.stop(keep_logs=self.keep_logs)
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None

    def _cleanup_proxy_rules(self) -> None:
        # kube-proxy leaves its KUBE-* chains and rules behind when stopped; its --cleanup mode removes them.
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            log = self.dir / "logs" / "kube-proxy-cleanup.log"
            with log.open("ab") as out:
                subprocess.run(
                    [str(self.bin_dir / "kube-proxy"), "--cleanup", "--v=1"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=60,
                    check=False,
                )

    def _kill_shims(self) -> None:
        # The shims run in their own sessions and outlive containerd; each names our socket in its argv.
        needle = str(self.socket).encode()
        shims: list[tuple[str, int, str]] = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and needle in argv:
                shims.append(("shim", int(proc.name), argv[0].decode()))
        controlplane.kill_processes(shims, 5.0)

    def _unmount(self) -> None:
        prefix = str(self.dir) + "/"
        for _ in range(3):
            mounts = [
                line.split()[1]
                for line in Path("/proc/mounts").read_text().splitlines()
                if line.split()[1].startswith(prefix)
            ]
            if not mounts:
                return
            for m in sorted(mounts, key=len, reverse=True):
                subprocess.run(["umount", "-l", m], capture_output=True, check=False)

    def _remove_host_paths(self) -> None:
        for path in self.made:
            shutil.rmtree(path, ignore_errors=True)
        # Where /var/lib/cni was there before, only this network's cached results (a pod torn down by the
        # kubelet has none left; one killed with the node has).
        sandboxes = self.dir / "containerd" / "root" / "io.containerd.grpc.v1.cri" / "sandboxes"
        ids = {p.name for p in sandboxes.iterdir()} if sandboxes.is_dir() else set()
        results = list(CNI_RESULTS.glob(f"{CNI_NETWORK}-*")) if CNI_RESULTS.is_dir() else []
        results += [r for i in ids for r in CNI_RESULTS.glob(f"cni-loopback-{i}-*")]
        for result in results:
            with contextlib.suppress(OSError):
                result.unlink()

    @staticmethod
    def _remove_cgroups() -> None:
        root = Path("/sys/fs/cgroup")
        for hierarchy in root.iterdir() if root.is_dir() else []:
            for name in _KUBELET_CGROUPS:
                top = hierarchy / name
                if not top.is_dir() or top.is_symlink():
                    continue
                # Depth-first rmdir: a v1 cgroup directory is removed with rmdir once its children are.
                for d in sorted(
                    (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
                ):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                with contextlib.suppress(OSError):
                    top.rmdir()


def _containerd_config(d: Path, bin_dir: Path) -> str:
    # SERVEDMODEL_RUNC: another runc than the one on PATH.
    runc = os.environ.get("SERVEDMODEL_RUNC") or shutil.which("runc") or "runc"
    return f"""version = 3
root = "{d / "containerd" / "root"}"
state = "{d / "containerd" / "state"}"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{d / "containerd.sock"}"

[ttrpc]
  address = "{d / "containerd.sock.ttrpc"}"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{d / "containerd" / "opt"}"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

# restrict_oom_score_adj: the sandbox's spec asks for oomScoreAdj -998 (and Guaranteed pods' containers
# -997); lowering oom_score_adj needs CAP_SYS_RESOURCE, which this machine's root lacks (CapEff
# 0x1fffeffffff), so runc's nsexec failed ("failed to update /proc/self/oom_score_adj: Permission
# denied", reported as "can't get final child's PID from pipe: EOF"). Restricted, containerd raises any
# adjustment below its own to its own (0 here), as rootless containerd does.
[plugins."io.containerd.cri.v1.runtime"]
  enable_selinux = false
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{d / "runc"}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{bin_dir / "cni"}"]
    conf_dir = "{d / "cni" / "net.d"}"
    max_conf_num = 1

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
"""


def _cni_config(d: Path) -> dict[str, object]:
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                    # The pod network and the Services' ClusterIPs (kube-proxy's DNAT on the host): no
                    # default route, nothing beyond this machine.
                    "routes": [{"dst": POD_CIDR}, {"dst": controlplane.SERVICE_CIDR}],
                    "dataDir": str(d / "cni" / "ipam"),
                },
            }
        ],
    }


def _kubelet_config(d: Path, port: int, healthz: int) -> dict[str, object]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{d / 'containerd.sock'}",
        "podLogsDir": str(d / "pod-logs"),
        "podCIDR": POD_CIDR,
        "registerWithTaints": [{"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}],
        "makeIPTablesUtilChains": False,
        "serializeImagePulls": False,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "resolvConf": "/etc/resolv.conf",
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
        "protectKernelDefaults": False,
        "localStorageCapacityIsolation": False,
    }


def _iptables(binary: str, *args: str) -> bool:
    """One iptables/ip6tables command on the filter table; whether it succeeded (False without the binary)."""
    try:
        return subprocess.run([binary, "-w", "5", *args], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _kube_proxy_config(kubeconfig: Path, healthz: int, metrics: int) -> dict[str, object]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": REAL_NODE,
        "mode": "iptables",
        "bindAddress": "127.0.0.1",
        "healthzBindAddress": f"127.0.0.1:{healthz}",
        "metricsBindAddress": f"127.0.0.1:{metrics}",
        "clusterCIDR": POD_CIDR,
        "detectLocalMode": "ClusterCIDR",
        # NodePorts only on the bridge's address; none on loopback (that would set route_localnet for the
        # whole machine).
        "nodePortAddresses": [f"{GATEWAY}/32"],
        "iptables": {"localhostNodePorts": False, "masqueradeAll": False, "syncPeriod": "30s",
                     "minSyncPeriod": "0s"},
        # Leave the machine's conntrack sysctls alone (0: do not set) and its OOM score (root lacks
        # CAP_SYS_RESOURCE here, see restrict_oom_score_adj).
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        "oomScoreAdj": 0,
    }  # fmt: skip


def _make_bridge() -> None:
    """The bridge with GATEWAY, before CNI's first ADD (the bridge plugin takes it as it finds it)."""
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
    for cmd in (
        ["ip", "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", f"{GATEWAY}/{POD_CIDR.split('/')[1]}", "dev", BRIDGE],
        ["ip", "link", "set", BRIDGE, "up"],
    ):
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise controlplane.ControlPlaneError(f"{' '.join(cmd)}: {res.stderr.strip()}")


def _take_lock(wait_s: float, who: str) -> int:
    """The machine-wide LOCK (flock, exclusive), waiting up to `wait_s` while another node holds it."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "?"
            if time.monotonic() >= deadline:
                os.close(fd)
                raise controlplane.ControlPlaneError(
                    f"another real node still runs on this machine after {wait_s:.0f} s ({LOCK} held by "
                    f"{holder}); one node at a time (SERVEDMODEL_REAL_NODE_LOCK_WAIT_S)"
                ) from None
            if not said:
                sys.stderr.write(f"realnode: waiting for {LOCK} (held by {holder})\n")
                said = True
            time.sleep(1.0)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} {who}\n".encode(), 0)
        return fd


def start(
    cp: controlplane.ControlPlane,
    *,
    bin_dir: Path | None = None,
    timeout: float = 180.0,
    lock_wait: float | None = None,
    lock_fd: int | None = None,
) -> RealNode:
    """Take the machine's LOCK (waiting up to `lock_wait`, default LOCK_WAIT_S), start containerd (the pause
    image imported) and a kubelet registered as REAL_NODE with ``cp``; return once the Node is Ready. On
    failure everything started is stopped and the lock released. `lock_fd`: the lock already taken (and the
    bridge made) by start_cluster()."""
    bin_dir = bin_dir or node_bin_dir()
    missing = missing_node_binaries(bin_dir)
    if missing:
        raise controlplane.ControlPlaneError(
            f"missing in {bin_dir}: {', '.join(missing)}; build them with `make node` (hack/build-node.sh)"
        )
    if lock_fd is None:
        lock_fd = _take_lock(LOCK_WAIT_S if lock_wait is None else lock_wait, str(cp.dir))
        _make_bridge()
    d = cp.dir / "node"
    shutil.rmtree(d, ignore_errors=True)
    (d / "cni" / "net.d").mkdir(parents=True)
    launcher = controlplane._Launcher(d, bin_dir, detach=False)
    node = RealNode(cp=cp, dir=d, bin_dir=bin_dir, procs=launcher.procs, lock_fd=lock_fd)
    node.made = [p for p in HOST_PATHS if not p.exists()]
    node.firewall_made = [b for b in ("iptables", "ip6tables") if not _iptables(b, "-S", FIREWALL_CHAIN)]
    deadline = time.monotonic() + timeout
    try:
        (d / "containerd.toml").write_text(_containerd_config(d, bin_dir))
        (d / "cni" / "net.d" / "10-servedmodel.conflist").write_text(json.dumps(_cni_config(d), indent=2))
        # containerd finds containerd-shim-runc-v2 on PATH.
        os.environ["PATH"] = f"{bin_dir}:{os.environ.get('PATH', '')}"
        launcher.spawn("containerd", [f"--config={d / 'containerd.toml'}", "--log-level=info"])
        controlplane._wait(
            "containerd socket", launcher, deadline, lambda: node.ctr("version", check=False).returncode == 0
        )
        node.ctr("images", "import", "--all-platforms", str(ensure_archive()))
        port, healthz = controlplane.free_ports(2)
        (d / "kubelet.json").write_text(json.dumps(_kubelet_config(d, port, healthz), indent=2))
        launcher.spawn("kubelet", [
            f"--config={d / 'kubelet.json'}",
            f"--kubeconfig={cp.kubeconfig}",
            f"--root-dir={d / 'kubelet'}",
            f"--cert-dir={d / 'kubelet' / 'pki'}",
            f"--hostname-override={REAL_NODE}",
            f"--node-labels={REAL_NODE_LABEL}=true",
            "--v=2",
        ])  # fmt: skip

        def ready() -> bool:
            obj = cp.request("GET", f"/api/v1/nodes/{REAL_NODE}")
            conds = obj.get("status", {}).get("conditions") or []
            return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)

        controlplane._wait(f"node {REAL_NODE} Ready (kubelet)", launcher, deadline, ready)
        proxy_healthz, proxy_metrics = controlplane.free_ports(2)
        (d / "kube-proxy.json").write_text(
            json.dumps(_kube_proxy_config(cp.kubeconfig, proxy_healthz, proxy_metrics), indent=2)
        )
        launcher.spawn("kube-proxy", [f"--config={d / 'kube-proxy.json'}", "--v=2"])

        def proxy_synced() -> bool:
            # 200 once its rules are synced (503 before).
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{proxy_healthz}/healthz", timeout=2) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        controlplane._wait("kube-proxy /healthz (rules synced)", launcher, deadline, proxy_synced)
    except BaseException:
        node.stop()
        raise
    return node


def start_cluster(*, timeout: float = 180.0, lock_wait: float | None = None) -> RealNode:
    """A control plane of its own, kube-apiserver listening on GATEWAY (pods reach it, in-cluster config
    through the `kubernetes` Service), and the node on it; node.cp is that control plane, which
    node.stop() stops. The lock is taken and the bridge made before kube-apiserver binds GATEWAY."""
    lock_fd = _take_lock(LOCK_WAIT_S if lock_wait is None else lock_wait, "start_cluster")
    try:
        _make_bridge()
        cp = controlplane.start(address=GATEWAY)
    except BaseException:
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        os.close(lock_fd)
        raise
    try:
        node = start(cp, timeout=timeout, lock_fd=lock_fd)
    except BaseException:
        cp.stop(keep_logs=True)
        raise
    node.own_cp = True
    return node
