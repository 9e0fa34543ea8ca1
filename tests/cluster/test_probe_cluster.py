"""The probe daemon inside `servedmodel run` against the real control plane.

The engine pods are kwok's fakes (their addresses exist nowhere and are never contacted): the operator is
started with SERVEDMODEL_ENDPOINT_OVERRIDE pointing the ServedModel at a simulator on 127.0.0.1, or the
ServedModel is in external mode with a loopback endpoint. Status writes are counted from a watch on the
object: every change of the probe's fields must carry a new lastProbeTime (at most one write per cycle).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cluster_support
import pytest
from cluster_support import ProbingOperator, apply, condition, served_model
from prometheus_client.parser import text_string_to_metric_families

import controlplane
from servedmodel.access import ALLOW_ANNOTATION
from servedmodel.sim.process import SimulatorProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "probe"))
from probe_support import PrometheusServer  # tests/probe's helper (tests are not a package)

from loopback import prometheus_missing
from required import need

OperatorProcess = Any  # tests/cluster/conftest.py's (conftests are not importable)

pytestmark = pytest.mark.cluster
WAIT_S = 120.0
PROBE_CONDITIONS = ("Serving", "TemplateOK", "LatencySLOMet")


def wait_for(what: str, probe: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll `probe` until it returns something truthy; return it, or fail saying what was last seen."""
    return cluster_support.wait_for(what, probe, timeout, interval=0.3)


def sm(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    res = cp.kubectl("get", "-n", namespace, "servedmodel", name, "-o", "json", "--show-managed-fields")
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def metric(op: OperatorProcess, sample: str, **labels: str) -> float:
    for family in text_string_to_metric_families(op.metrics()):
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return float(s.value)
    return 0.0


class Watch:
    """`kubectl get sm NAME --watch -o json` in the background (its output read by a thread as it comes);
    stopped by its pid."""

    def __init__(self, cp: controlplane.ControlPlane, namespace: str, name: str) -> None:
        cmd = [str(cp.bin_dir / "kubectl"), f"--kubeconfig={cp.kubeconfig}", "get", "servedmodel", name]
        cmd += ["-n", namespace, "--watch", "-o", "json"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._out = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read1(65536):
            self._out += chunk

    def stop(self) -> list[dict[str, Any]]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
        return self.objects()

    def objects(self) -> list[dict[str, Any]]:
        """The objects the watch has printed so far (a half-written last one left out)."""
        text = bytes(self._out).decode(errors="replace")
        decoder = json.JSONDecoder()
        objs: list[dict[str, Any]] = []
        i = 0
        while i < len(text):
            while i < len(text) and text[i].isspace():
                i += 1
            if i >= len(text):
                break
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                break  # a half-written object at SIGTERM
            objs.append(obj)
        return objs


@contextlib.contextmanager
def watching(cp: controlplane.ControlPlane, namespace: str, name: str) -> Iterator[Watch]:
    w = Watch(cp, namespace, name)
    try:
        yield w
    finally:
        w.stop()


def probe_share(obj: dict[str, Any]) -> tuple[str, str]:
    """The fields the probe owns (status.probe and its conditions) and lastProbeTime."""
    status = obj.get("status") or {}
    conds = [c for c in status.get("conditions") or [] if c.get("type") in PROBE_CONDITIONS]
    share = json.dumps({"probe": status.get("probe"), "conditions": conds}, sort_keys=True)
    return share, str((status.get("probe") or {}).get("lastProbeTime"))


def count_probe_writes(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(writes that changed the probe's fields, of which repeated an already-seen lastProbeTime). The
    watch may start after the first probe write (a loaded machine): its first event then shows that write,
    so the count starts from an object the probe has not written."""
    writes = repeats = 0
    prev_share, _ = probe_share({})
    times: set[str] = set()
    for obj in events:
        share, t = probe_share(obj)
        if share != prev_share:
            writes += 1
            if t in times:
                repeats += 1
        times.add(t)
        prev_share = share
    return writes, repeats


def columns(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, str]:
    table = cp.kubectl("get", "sm", name, "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    return dict(zip(header.split(), row.split(), strict=False))


def test_probe_fills_status_conditions_and_columns(
    probing: ProbingOperator,
) -> None:
    cp, namespace = probing.cp, probing.namespace
    sim_args = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen-small", "--max-model-len", "4096"]
    with SimulatorProcess([*sim_args, "--sim-step-base-ms", "2"], ready_timeout=60) as sim:
        op = probing.start("qwen", sim.base_url)
        spec = {
            "servedModelName": "qwen-small",
            "probe": {"interval": 5, "slo": {"ttftMs": 10000, "tpotMs": 2000}},
        }
        apply(cp, namespace, served_model("qwen", **spec))
        with watching(cp, namespace, "qwen") as watch:  # (a watch of a name that does not exist yet ends)

            def three_probes() -> dict[str, Any] | None:
                obj = sm(cp, namespace, "qwen")
                probe = (obj.get("status") or {}).get("probe") or {}
                window = probe.get("window") or {}
                # A cycle whose stream a loaded machine read in one lump publishes no client TTFT/TPOT
                # (report.py's publishable_figures, by design): wait for one that does.
                client = probe.get("client") or {}
                timed = client.get("ttftMs") is not None and client.get("tpotMs") is not None
                return obj if window.get("samples", 0) >= 3 and timed else None

            obj = wait_for("three successful probes, the last timed", three_probes)
            # The watch delivers that write when it does (seconds late on a loaded API server): wait for it.
            version = obj["metadata"]["resourceVersion"]
            wait_for(
                "the watch to deliver the third probe write",
                lambda: any(e["metadata"]["resourceVersion"] == version for e in watch.objects()),
                30,
            )
        events = watch.objects()
        probe = obj["status"]["probe"]
        assert (probe["result"], probe["reason"]) == ("Success", "Serving")
        assert probe["model"] == "qwen-small"
        assert probe["endpoint"] == sim.base_url
        assert probe["client"]["ttftMs"] > 0
        assert probe["client"]["tpotMs"] > 0
        assert probe["server"]["isolated"] is True
        assert probe["usage"]["promptTokens"] > 0
        # The timed request ends on the probe's stop string or its token limit, depending on what the
        # model says (the per-cycle nonce changes the simulator's echo); the stop check below proves
        # the server honours a stop either way.
        assert probe["finishReason"] in ("stop", "length")
        assert {k: v["result"] for k, v in probe["checks"].items()} == {
            "template": "Pass",
            "limits": "Pass",
            "stop": "Pass",
            "usage": "Pass",
            "streaming": "Pass",
        }
        assert probe["scheduler"]["running"] == 0
        assert probe["counters"]["generationTokensTotal"] > 0
        assert condition(obj, "Serving")["status"] == "True"
        assert condition(obj, "TemplateOK")["status"] == "True"
        assert condition(obj, "LatencySLOMet")["status"] == "True"
        # the reconciler's conditions live beside the probe's (list-map keyed by type, two managers)
        assert condition(obj, "Ready")["status"] == "True"
        probe_fields = [
            m
            for m in obj["metadata"]["managedFields"]
            if m["manager"] == "servedmodel-probe" and m.get("subresource") == "status"
        ]
        assert len(probe_fields) == 1
        assert "f:probe" in probe_fields[0]["fieldsV1"]["f:status"]

        cols = columns(cp, namespace, "qwen")
        for col in ("TTFT", "TPOT", "RUNNING", "WAITING"):
            assert cols.get(col) not in (None, "<none>"), cols
        assert float(cols["TTFT"]) > 0

        writes, repeats = count_probe_writes(events)
        cycles = metric(op, "servedmodel_probe_total", namespace=namespace, name="qwen", result="success")
        counted = metric(op, "servedmodel_probe_status_writes_total", namespace=namespace, name="qwen")
        assert writes >= 3
        assert repeats == 0, "a probe cycle wrote status more than once"
        assert counted <= cycles


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_endpoint_is_data_not_a_crash(
    probing: ProbingOperator,
) -> None:
    cp, namespace = probing.cp, probing.namespace
    url = f"http://127.0.0.1:{closed_port()}"
    operator = probing.start("gone", url)
    manifest = served_model("gone", endpoint=url, probe={"interval": 5})
    del manifest["spec"]["engine"], manifest["spec"]["resources"]
    apply(cp, namespace, manifest)

    def failed_twice() -> dict[str, Any] | None:
        obj = sm(cp, namespace, "gone")
        probe = (obj.get("status") or {}).get("probe") or {}
        return obj if probe.get("consecutiveFailures", 0) >= 2 else None

    obj = wait_for("two failed probes", failed_twice)
    probe = obj["status"]["probe"]
    assert (probe["result"], probe["reason"]) == ("Failure", "ConnectionRefused")
    serving = condition(obj, "Serving")
    assert (serving["status"], serving["reason"]) == ("False", "ConnectionRefused")
    assert "client" not in probe
    assert operator.alive()
    assert operator.healthy()
    assert (
        metric(
            operator,
            "servedmodel_probe_failures_total",
            namespace=namespace,
            name="gone",
            reason="ConnectionRefused",
        )
        >= 2
    )


def test_api_key_from_secret_is_sent_never_written(
    probing: ProbingOperator,
) -> None:
    cp, namespace = probing.cp, probing.namespace
    key = "sk-cluster-probe-7f3a9c2e41"
    args = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--api-key", key]
    with SimulatorProcess(args, ready_timeout=60) as sim:
        operator = probing.start("keyed", sim.base_url)
        cp.kubectl("create", "secret", "generic", "engine-key", "-n", namespace, f"--from-literal=key={key}")
        cp.kubectl("annotate", "secret", "engine-key", "-n", namespace, f"{ALLOW_ANNOTATION}=keyed")
        manifest = served_model(
            "keyed",
            endpoint=sim.base_url,
            servedModelName="qwen",
            engine={"apiKeySecretRef": {"name": "engine-key", "key": "key"}},
            probe={"interval": 5},
        )
        del manifest["spec"]["resources"]
        apply(cp, namespace, manifest)

        def serving() -> dict[str, Any] | None:
            obj = sm(cp, namespace, "keyed")
            probe = (obj.get("status") or {}).get("probe") or {}
            return obj if probe.get("result") == "Success" else None

        obj = wait_for("a successful probe with the API key", serving)
    assert condition(obj, "Serving")["status"] == "True"
    assert key not in json.dumps(obj)
    events = cp.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    assert key not in events
    assert key not in operator.log()


@pytest.mark.prometheus
def test_prometheus_source_with_bearer_token(
    probing: ProbingOperator,
) -> None:
    """spec.probe.metricsSource prometheus: the daemon reads the token Secret and queries PromQL filtered
    by model_name and namespace (a real Prometheus on loopback scraping the simulator every second)."""
    need(prometheus_missing())
    cp, namespace = probing.cp, probing.namespace
    args = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--sim-step-base-ms", "2"]
    with SimulatorProcess(args, ready_timeout=60) as sim:
        prom = PrometheusServer([f"127.0.0.1:{sim.port}"], {"namespace": namespace})
        try:
            prom.wait_ready()
            probing.start("prom", sim.base_url)
            cp.kubectl("create", "secret", "generic", "thanos", "-n", namespace, "--from-literal=token=t0ken")
            cp.kubectl("annotate", "secret", "thanos", "-n", namespace, f"{ALLOW_ANNOTATION}=prom")
            source = {
                "type": "prometheus",
                "prometheus": {
                    "url": prom.base_url,
                    "bearerTokenSecretRef": {"name": "thanos", "key": "token"},
                },
            }
            manifest = served_model(
                "prom",
                endpoint=sim.base_url,
                servedModelName="qwen",
                probe={"interval": 5, "metricsSource": source},
            )
            del manifest["spec"]["resources"], manifest["spec"]["engine"]
            apply(cp, namespace, manifest)

            def isolated_server_figures() -> dict[str, Any] | None:
                probe = (sm(cp, namespace, "prom").get("status") or {}).get("probe") or {}
                server = probe.get("server") or {}
                return probe if server.get("isolated") is True and server.get("decodeMs") else None

            probe = wait_for("server figures from Prometheus", isolated_server_figures)
        finally:
            prom.stop()
    assert probe["result"] == "Success"
    assert probe["checks"]["usage"]["reason"] == "CountersMatch"
    assert probe["counters"]["generationTokensTotal"] > 0
    assert probe["scheduler"]["running"] == 0
    assert "t0ken" not in json.dumps(probe)
