"""The HPA path of spec.autoscaling for real, on loopback: Debian's Prometheus scraping simulators that
stand in for the ServedModel's (kwok) pods, prometheus-adapter (built from the Go module proxy) serving
custom.metrics.k8s.io through the API server's aggregation layer, and a load generator that makes the
engines' queues grow.

- `EnginePods`: simulators on 127.0.0.1, each labelled in Prometheus as one live engine pod of the
  ServedModel (file_sd targets with `namespace` and `pod` labels, rewritten as pods come and go), as a
  ServiceMonitor's relabelling would label the real pods.
- `Prometheus`: Debian's prometheus scraping those targets (and, optionally, the operator's /metrics with
  honor_labels, as manifests/monitoring/operator_service_monitor.yaml does).
- `Adapter`: prometheus-adapter with ADAPTER_RULES (the rules docs/operations.md gives), registered as the
  v1beta1/v1beta2 custom.metrics.k8s.io APIServices behind an ExternalName Service to localhost.
- `Load`: a separate process holding N streaming chats open against one engine; stopping it (by pid)
  closes the connections, and the engine aborts what it held.
Every process is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import yaml

import controlplane
import loopback
from loopback import LoopbackProcess, stop_process
from servedmodel.sim.ports import free_port
from servedmodel.sim.process import SimulatorProcess

ADAPTER_NAMESPACE = "kube-system"
ADAPTER_SERVICE = "servedmodel-test-prometheus-adapter"
API_VERSIONS = ("v1beta1", "v1beta2")

# The prometheus-adapter rules the HPA path needs (the same as docs/operations.md): vLLM's scheduler
# gauges per pod (`vllm:` renamed `vllm_`, custom-metric names are URL path segments) and the operator's
# probe TTFT p95 per ServedModel (an Object metric: its `name` label is the ServedModel).
ADAPTER_RULES = """\
rules:
  - seriesQuery: '{__name__=~"vllm:(num_requests_waiting|num_requests_running|kv_cache_usage_perc)",\
namespace!="",pod!=""}'
    resources:
      overrides:
        namespace: {resource: namespace}
        pod: {resource: pod}
    name:
      matches: "^vllm:(.*)$"
      as: "vllm_${1}"
    metricsQuery: 'sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)'
  - seriesQuery: 'servedmodel_probe_ttft_p95_seconds{namespace!="",name!=""}'
    resources:
      overrides:
        namespace: {resource: namespace}
        name: {group: inference.servedmodel.io, resource: servedmodels}
    metricsQuery: 'max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)'
"""

LOAD_SCRIPT = """\
import asyncio, sys, httpx
url, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = {"model": model, "messages": [{"role": "user", "content": "count to a million"}],
        "max_tokens": 4000, "stream": True, "ignore_eos": True}
async def one(client):
    while True:
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
        except httpx.HTTPError:
            await asyncio.sleep(0.2)
async def main():
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        await asyncio.gather(*(one(client) for _ in range(n)))
asyncio.run(main())
"""


def adapter_binary() -> Path:
    base = os.environ.get("SERVEDMODEL_CACHE") or str(Path.home() / ".cache" / "servedmodel")
    version = controlplane.versions()["PROMETHEUS_ADAPTER_VERSION"]
    return Path(base) / f"prometheus-adapter-{version}" / "bin" / "adapter"


def engine_metric(sim: SimulatorProcess, name: str) -> float:
    """Sum of one series in a simulator's /metrics (every label set)."""
    text = httpx.get(f"{sim.base_url}/metrics", timeout=5, trust_env=False).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


class EnginePods:
    """Simulators standing in for the ServedModel's pods: each live pod is given one simulator (the
    oldest pod the first), and Prometheus' file_sd targets say which; a thread follows the pods."""

    def __init__(
        self, cp: controlplane.ControlPlane, namespace: str, selector: str, sims: list[SimulatorProcess]
    ):
        self.cp, self.namespace, self.selector, self.sims = cp, namespace, selector, sims
        self.dir = Path(tempfile.mkdtemp(prefix="autoscaling-sd-"))
        self.targets_file = self.dir / "engines.json"
        self.assigned: dict[str, int] = {}
        self._write([])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="engine-pods", daemon=True)

    def start(self) -> EnginePods:
        self._thread.start()
        return self

    def live_pods(self) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={urllib.parse.quote(self.selector)}"
        pods = self.cp.request("GET", path).get("items") or []
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return sorted(live, key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]))

    def _write(self, groups: list[dict[str, Any]]) -> None:
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)  # atomic: Prometheus never reads half a file

    def sync(self) -> None:
        names = [p["metadata"]["name"] for p in self.live_pods()]
        for gone in set(self.assigned) - set(names):
            del self.assigned[gone]
        for pod in names:
            if pod not in self.assigned:
                free = [i for i in range(len(self.sims)) if i not in self.assigned.values()]
                if free:
                    self.assigned[pod] = free[0]
        groups = [
            {
                "targets": [f"127.0.0.1:{self.sims[i].port}"],
                "labels": {"namespace": self.namespace, "pod": pod},
            }
            for pod, i in sorted(self.assigned.items())
        ]
        self._write(groups)

    def _follow(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                self.sync()
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)


class Prometheus(loopback.Prometheus):
    """Debian's prometheus scraping the engine targets every second (and the operator, if given)."""

    def __init__(self, targets_file: Path, operator_metrics: str | None = None) -> None:
        jobs: list[dict[str, Any]] = [
            {
                "job_name": "engines",
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}],
            }
        ]
        if operator_metrics:
            # As the operator's ServiceMonitor: keep the series' own namespace/name (the ServedModel's).
            jobs.append(
                {
                    "job_name": "operator",
                    "honor_labels": True,
                    "static_configs": [{"targets": [operator_metrics]}],
                }
            )
        super().__init__(jobs, prefix="autoscaling-prom-")


class Adapter(LoopbackProcess):
    """prometheus-adapter on a free loopback port, registered with the API server's aggregation layer."""

    def __init__(self, cp: controlplane.ControlPlane, prometheus_url: str) -> None:
        super().__init__("autoscaling-adapter-", "adapter.log")
        self.cp = cp
        self.port = free_port()
        (self.dir / "rules.yaml").write_text(ADAPTER_RULES)
        kubeconfig = str(cp.kubeconfig)
        self.spawn(
            [
                str(adapter_binary()),
                f"--secure-port={self.port}",
                "--bind-address=127.0.0.1",
                f"--cert-dir={self.dir / 'certs'}",  # a self-signed serving certificate
                f"--lister-kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--prometheus-url={prometheus_url}/",
                "--metrics-relist-interval=2s",
                f"--config={self.dir / 'rules.yaml'}",
                "--v=2",
            ]
        )

    def register(self) -> None:
        """An ExternalName Service to localhost (the aggregator dials host:port of the APIService) and
        the two APIServices; the serving certificate is self-signed, so TLS is not verified here."""
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": ADAPTER_NAMESPACE},
            "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"port": self.port}]},
        }
        docs: list[dict[str, Any]] = [service]
        for i, version in enumerate(API_VERSIONS):
            docs.append(
                {
                    "apiVersion": "apiregistration.k8s.io/v1",
                    "kind": "APIService",
                    "metadata": {"name": f"{version}.custom.metrics.k8s.io"},
                    "spec": {
                        "service": {
                            "name": ADAPTER_SERVICE,
                            "namespace": ADAPTER_NAMESPACE,
                            "port": self.port,
                        },
                        "group": "custom.metrics.k8s.io",
                        "version": version,
                        "insecureSkipTLSVerify": True,
                        "groupPriorityMinimum": 100,
                        "versionPriority": 100 + 100 * i,
                    },
                }
            )
        self.cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))

    def available(self) -> bool:
        for version in API_VERSIONS:
            svc = self.cp.request(
                "GET", f"/apis/apiregistration.k8s.io/v1/apiservices/{version}.custom.metrics.k8s.io"
            )
            conds = (svc.get("status") or {}).get("conditions") or []
            if not any(c.get("type") == "Available" and c.get("status") == "True" for c in conds):
                return False
        return True

    def raw(self, path: str) -> Any:
        """GET a custom.metrics.k8s.io path through the API server (what the HPA controller does)."""
        res = self.cp.kubectl("get", "--raw", f"/apis/custom.metrics.k8s.io/v1beta2{path}", check=False)
        return json.loads(res.stdout) if res.returncode == 0 else {"error": res.stderr.strip()}

    def stop(self) -> None:
        # Unregister first: an unavailable APIService breaks discovery for everything after this test.
        for version in API_VERSIONS:
            self.cp.kubectl(
                "delete", "apiservice", f"{version}.custom.metrics.k8s.io", "--ignore-not-found", check=False
            )
        self.cp.kubectl(
            "delete", "service", ADAPTER_SERVICE, "-n", ADAPTER_NAMESPACE, "--ignore-not-found", check=False
        )
        super().stop()


class Load:
    """`concurrency` streaming chats held open against one engine, in their own process."""

    def __init__(self, base_url: str, model: str, concurrency: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LOAD_SCRIPT, base_url, model, str(concurrency)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        stop_process(self.proc)
