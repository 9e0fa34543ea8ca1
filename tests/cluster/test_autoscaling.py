"""spec.autoscaling against the real control plane: the operator's HPA / KEDA objects, replicas handed to
the autoscaler by server-side apply field ownership (no reset, no fight), `kubectl scale sm` refused while
autoscaled, the HPA path end to end (kube-controller-manager's HPA controller + prometheus-adapter +
Debian's Prometheus scraping simulators labelled as the ServedModel's pods), KEDA's real CRDs accepting
what the operator renders, and scale to zero without probe traffic.

Counted and ordered, not timed: the waits are bounded polls; what is asserted is the order of replica
counts and how many chats reached an engine.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cluster_support
import pytest
import yaml
from autoscaling_support import (
    Adapter,
    EnginePods,
    Load,
    Prometheus,
    adapter_binary,
    engine_metric,
)
from cluster_support import ProbingOperator, apply, condition, crds_installed, golden_dry_run, served_model

import controlplane
from loopback import prometheus_missing
from required import need
from servedmodel.api import names
from servedmodel.scaling import HANDOVER_MANAGER
from servedmodel.sim.process import SimulatorProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack"))
import olm_tools  # hack/: the KEDA CRDs from the Go module proxy

OperatorProcess = Any  # tests/cluster/conftest.py's
pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0
OPERATOR_MANAGER = "servedmodel-operator"
QUICK_ENGINE = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--sim-step-base-ms", "2"]
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 3, "targets": {"waitingRequestsPerReplica": 2}}


def wait_for(what: str, probe: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    return cluster_support.wait_for(what, probe, timeout, interval=0.3)


def get(cp: controlplane.ControlPlane, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
    res = cp.kubectl("get", "-n", namespace, kind, name, "-o", "json", "--show-managed-fields", check=False)
    return json.loads(res.stdout) if res.returncode == 0 else None


def replicas_owners(deployment: dict[str, Any]) -> set[str]:
    return {
        m["manager"]
        for m in deployment["metadata"].get("managedFields") or []
        if "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {})
    }


def generation_seen(cp: controlplane.ControlPlane, namespace: str, name: str) -> Callable[[], bool]:
    def seen() -> bool:
        obj = get(cp, namespace, "servedmodel", name) or {}
        return (obj.get("status") or {}).get("observedGeneration") == obj.get("metadata", {}).get(
            "generation"
        )

    return seen


def status_writes(op: OperatorProcess) -> float:
    lines = [x for x in op.metrics().splitlines() if x.startswith("servedmodel_status_writes_total ")]
    return float(lines[0].split()[1]) if lines else 0.0


@dataclass
class Watched:
    """One ServedModel's status, polled."""

    cp: controlplane.ControlPlane
    namespace: str
    name: str

    def autoscaling(self) -> dict[str, Any]:
        """status.autoscaling, {} when there is none (or no ServedModel)."""
        obj = get(self.cp, self.namespace, "servedmodel", self.name) or {}
        auto: dict[str, Any] = (obj.get("status") or {}).get("autoscaling") or {}
        return auto

    def wait_autoscaling(
        self, what: str, ok: Callable[[dict[str, Any]], bool], timeout: float = WAIT_S
    ) -> dict[str, Any]:
        """status.autoscaling once `ok` holds for it."""
        auto: dict[str, Any] = wait_for(what, lambda: a if ok(a := self.autoscaling()) else None, timeout)
        return auto

    def wait_serving(self, status: str) -> dict[str, Any]:
        """The ServedModel once its Serving condition has that status."""

        def check() -> dict[str, Any] | None:
            obj = get(self.cp, self.namespace, "servedmodel", self.name)
            return obj if condition(obj, "Serving").get("status") == status else None

        obj: dict[str, Any] = wait_for(f"Serving {status}", check)
        return obj


def delete_served_models(cp: controlplane.ControlPlane, namespace: str) -> None:
    cp.kubectl(
        "delete", "servedmodels", "--all", "-n", namespace, "--wait=true", "--timeout=30s", check=False
    )


def need_tools(*tools: str) -> None:
    """Skip (fail under SERVEDMODEL_REQUIRE_CLUSTER=1) unless each of these is here: "prometheus"
    (Debian's), "adapter" (prometheus-adapter)."""
    missing = {
        "prometheus": prometheus_missing(),
        "adapter": None
        if adapter_binary().is_file()
        else f"prometheus-adapter not built ({adapter_binary()}): run `make prometheus-adapter`",
    }
    for tool in tools:
        need(missing[tool])


def started_adapter(cp: controlplane.ControlPlane, prom: Prometheus) -> Adapter:
    """prometheus-adapter on `prom`, registered as custom.metrics.k8s.io and Available."""
    adapter = Adapter(cp, prom.base_url)
    adapter.register()
    wait_for("custom.metrics.k8s.io Available", adapter.available, timeout=180)
    return adapter


def test_server_side_apply_drops_a_field_its_only_owner_stops_applying(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """Why the operator hands spec.replicas over: without it, leaving the field out resets it to 1."""
    cp = bare_control_plane
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "plain", "namespace": namespace},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "plain"}},
            "template": {
                "metadata": {"labels": {"app": "plain"}},
                "spec": {"containers": [{"name": "c", "image": "example.invalid/none"}]},
            },
        },
    }
    manager = ["--server-side", "--field-manager=only-owner", "-f", "-"]
    cp.kubectl("apply", *manager, input=yaml.safe_dump(dep))
    del dep["spec"]["replicas"]
    cp.kubectl("apply", *manager, input=yaml.safe_dump(dep))
    obj = get(cp, namespace, "deployment", "plain")
    assert obj is not None
    assert obj["spec"]["replicas"] == 1


def test_replicas_belong_to_the_autoscaler(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    operator: OperatorProcess,
) -> None:
    cp = control_plane
    name = "scaled"
    watched = Watched(cp, namespace, name)
    base = served_model(name, replicas=3, probe={"enabled": False})
    apply(cp, namespace, base)
    wait_for(
        "Deployment at 3",
        lambda: ((get(cp, namespace, "deployment", name) or {}).get("spec") or {}).get("replicas") == 3,
    )

    apply(cp, namespace, {**base, "spec": {**base["spec"], "autoscaling": AUTOSCALING}})
    hpa = wait_for("the HPA", lambda: get(cp, namespace, "hpa", name))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    wait_for("the autoscaling generation reconciled", generation_seen(cp, namespace, name))
    dep = get(cp, namespace, "deployment", name)
    assert dep is not None
    # Not reset to 1 when the operator's apply dropped the field: the hand-over manager holds it.
    assert dep["spec"]["replicas"] == 3
    owners = replicas_owners(dep)
    assert OPERATOR_MANAGER not in owners
    assert HANDOVER_MANAGER in owners

    # The scale subresource is frozen while autoscaled, and says why.
    res = cp.kubectl("scale", "-n", namespace, "servedmodel", name, "--replicas=4", check=False)
    assert res.returncode != 0
    assert "spec.autoscaling.minReplicas" in res.stderr, res.stderr

    # What the HPA does (an update through /scale) stays: a later apply pass does not fight it.
    cp.kubectl("scale", "-n", namespace, "deployment", name, "--replicas=2")
    spec = {**base["spec"], "autoscaling": {**AUTOSCALING, "maxReplicas": 4}}
    apply(cp, namespace, {**base, "spec": spec})
    wait_for(
        "the HPA's new maxReplicas",
        lambda: (get(cp, namespace, "hpa", name) or {})["spec"]["maxReplicas"] == 4,
    )
    wait_for("that generation reconciled", generation_seen(cp, namespace, name))
    dep = get(cp, namespace, "deployment", name)
    assert dep is not None
    assert dep["spec"]["replicas"] == 2

    # status.autoscaling says what the HPA says (no adapter here: it cannot get the metric).
    auto = watched.wait_autoscaling(
        "status.autoscaling from the HPA",
        lambda a: a.get("reason") not in (None, "HorizontalPodAutoscalerMissing"),
    )
    assert auto["autoscaler"] == "HorizontalPodAutoscaler"
    assert auto["horizontalPodAutoscaler"] == name
    assert auto["reason"].startswith("Failed"), auto  # FailedGetPodsMetric: no custom.metrics.k8s.io
    # Written on change only: the HPA controller syncs every 2 s, the status stays as it is.
    writes = status_writes(operator)
    assert writes > 0
    time.sleep(5 * 2)  # an observation window of five HPA syncs, not a timing assertion
    assert status_writes(operator) == writes
    described = cp.kubectl("describe", "-n", namespace, "servedmodel", name).stdout
    assert "Autoscaling:" in described
    assert "Horizontal Pod Autoscaler:" in described

    # Autoscaling off: the HPA is pruned and spec.replicas is the operator's again.
    apply(cp, namespace, base)
    wait_for("the HPA pruned", lambda: get(cp, namespace, "hpa", name) is None)
    wait_for(
        "Deployment back at spec.replicas",
        lambda: (get(cp, namespace, "deployment", name) or {})["spec"]["replicas"] == 3,
    )
    dep = get(cp, namespace, "deployment", name)
    assert dep is not None
    assert OPERATOR_MANAGER in replicas_owners(dep)
    wait_for(
        "status.autoscaling gone",
        lambda: "autoscaling" not in ((get(cp, namespace, "servedmodel", name) or {}).get("status") or {}),
    )


def test_an_hpa_of_ones_own_on_the_served_models_scale_subresource(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    """Without spec.autoscaling the scale subresource is the ServedModel's: an HPA on it sets spec.replicas
    (here: raised to its minReplicas) and the operator carries that to the Deployment."""
    cp = control_plane
    name = "own-hpa"
    apply(cp, namespace, served_model(name, probe={"enabled": False}))
    wait_for("the Deployment", lambda: get(cp, namespace, "deployment", name))
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "mine", "namespace": namespace},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "inference.servedmodel.io/v1alpha1",
                "kind": "ServedModel",
                "name": name,
            },
            "minReplicas": 2,
            "maxReplicas": 3,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "vllm_num_requests_waiting"},
                        "target": {"type": "AverageValue", "averageValue": "2"},
                    },
                }
            ],
        },
    }
    cp.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(hpa))
    wait_for(
        "spec.replicas raised by the HPA",
        lambda: (get(cp, namespace, "servedmodel", name) or {})["spec"]["replicas"] == 2,
    )
    wait_for(
        "the Deployment following",
        lambda: (get(cp, namespace, "deployment", name) or {})["spec"]["replicas"] == 2,
    )
    sm = get(cp, namespace, "servedmodel", name) or {}
    assert sm["status"]["selector"] == names.selector_string(name)  # what the HPA selects pods by


@pytest.fixture
def engines() -> Iterator[list[SimulatorProcess]]:
    """Three simulators with a batch of one: a second concurrent request waits in the queue."""
    args = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--max-model-len", "8192"]
    args += ["--max-num-seqs", "1", "--sim-step-base-ms", "20"]
    sims = [SimulatorProcess(args, ready_timeout=60) for _ in range(3)]
    try:
        for s in sims:
            s.__enter__()
        yield sims
    finally:
        for s in sims:
            s.__exit__(None, None, None)


def test_hpa_scales_on_waiting_requests_end_to_end(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    operator: OperatorProcess,
    engines: list[SimulatorProcess],
) -> None:
    need_tools("prometheus", "adapter")
    cp = control_plane
    name = "qwen-hpa"
    watched = Watched(cp, namespace, name)
    pods = EnginePods(cp, namespace, names.selector_string(name), engines)
    prom = Prometheus(pods.targets_file)
    adapter: Adapter | None = None
    load: Load | None = None
    try:
        prom.wait_ready()
        adapter = started_adapter(cp, prom)
        spec = {
            "servedModelName": "qwen",
            "probe": {"enabled": False},
            "autoscaling": {**AUTOSCALING, "scaleDown": {"stabilizationWindowSeconds": 5}},
        }
        apply(cp, namespace, served_model(name, **spec))
        pods.start()

        def metric_served() -> Any:
            got = adapter.raw(f"/namespaces/{namespace}/pods/*/vllm_num_requests_waiting")  # type: ignore[union-attr]
            return got if got.get("items") else None

        wait_for("the adapter serving vllm_num_requests_waiting for the pod", metric_served, timeout=180)

        def hpa_active() -> Any:
            hpa = get(cp, namespace, "hpa", name) or {}
            c = condition(hpa, "ScalingActive")
            return hpa if c.get("status") == "True" else None

        wait_for("HPA ScalingActive (the metric reaches the HPA controller)", hpa_active)
        seen: list[int] = []

        def replicas() -> int:
            n = int(((get(cp, namespace, "deployment", name) or {}).get("spec") or {}).get("replicas", 0))
            if not seen or seen[-1] != n:
                seen.append(n)
            return n

        assert replicas() == 1
        # Eight streams against the first pod's engine (a batch of one): seven wait.
        first = pods.assigned[pods.live_pods()[0]["metadata"]["name"]]
        load = Load(engines[first].base_url, "qwen", 8)
        wait_for(
            "the queue on the loaded engine",
            lambda: engine_metric(engines[first], "vllm:num_requests_waiting") >= 4,
        )
        wait_for("the HPA scaled the Deployment up to maxReplicas", lambda: replicas() == 3, timeout=180)
        up = list(seen)
        status = watched.wait_autoscaling(
            "status.autoscaling says 3", lambda a: a.get("desiredReplicas") == 3
        )
        assert status["lastScale"]["toReplicas"] == 3
        # the console's column (priority 1: kubectl get -o wide)
        wide = cp.kubectl("get", "sm", name, "-n", namespace, "-o", "wide").stdout.splitlines()
        at = wide[0].index("DESIRED")  # kubectl's table is fixed-width: read the cell under the header
        assert wide[1][at:].split()[0] == "3", wide
        load.stop()
        load = None
        wait_for("the queue drained", lambda: engine_metric(engines[first], "vllm:num_requests_waiting") == 0)
        wait_for("the HPA scaled down after the stabilization window", lambda: replicas() == 1, timeout=180)
        # Ordered: 1 → (up) → 3 while loaded, then back to 1; never down before the load stopped.
        assert up[0] == 1, up
        assert up[-1] == 3, up
        assert up == sorted(up), up
        assert seen[len(up) - 1 :] == sorted(seen[len(up) - 1 :], reverse=True), seen
        final = watched.wait_autoscaling(
            "status.autoscaling's last scale: 3 → 1",
            lambda a: a.get("lastScale", {}).get("toReplicas") == 1,
        )
        # The queue drains over a few HPA syncs, so the way down may take a step (3 → 2 → 1).
        assert final["lastScale"].get("fromReplicas") in (2, 3), final
        print(f"\nDeployment replicas seen, in order: {seen} (scale-up part {up})")
        dep = get(cp, namespace, "deployment", name)
        assert dep is not None
        assert OPERATOR_MANAGER not in replicas_owners(dep)
    finally:
        if load is not None:
            load.stop()
        pods.stop()
        if adapter is not None:
            adapter.stop()
        prom.stop()


def test_probe_ttft_p95_reaches_the_hpa_as_an_object_metric(
    probing: ProbingOperator,
) -> None:
    """The probe TTFT target end to end: the operator's gauge → Prometheus (honor_labels, as the operator's
    ServiceMonitor) → prometheus-adapter's Object metric on the ServedModel → the HPA controller."""
    need_tools("prometheus", "adapter")
    cp, namespace = probing.cp, probing.namespace
    name = "qwen-ttft"
    watched = Watched(cp, namespace, name)
    with SimulatorProcess(QUICK_ENGINE, ready_timeout=60) as sim:
        op = probing.start(name, sim.base_url)
        pods = EnginePods(cp, namespace, names.selector_string(name), [sim])
        prom = Prometheus(pods.targets_file, operator_metrics=f"127.0.0.1:{op.metrics_port}")
        adapter: Adapter | None = None
        try:
            prom.wait_ready()
            adapter = started_adapter(cp, prom)
            # A target far above what the simulator's TTFT will be: the HPA keeps minReplicas.
            auto = {"minReplicas": 1, "maxReplicas": 2, "targets": {"probeTtftP95Ms": 60000}}
            apply(
                cp,
                namespace,
                served_model(name, servedModelName="qwen", probe={"interval": 5}, autoscaling=auto),
            )
            obj_path = f"/namespaces/{namespace}/servedmodels.inference.servedmodel.io/{name}"
            path = f"{obj_path}/servedmodel_probe_ttft_p95_seconds"

            def served() -> Any:
                got = adapter.raw(path)  # type: ignore[union-attr]
                items = got.get("items") or []  # the adapter answers a list, also for one named object
                return items[0] if items and items[0].get("value") else None

            def why() -> str:
                series = prom.query("servedmodel_probe_ttft_p95_seconds")
                gauge = [x for x in op.metrics().splitlines() if x.startswith("servedmodel_probe_ttft_p95")]
                return f"prometheus: {series}\noperator: {gauge}\nadapter: {adapter.raw(path)}"  # type: ignore[union-attr]

            metric = cluster_support.wait_for(
                "the adapter serving the probe's TTFT p95 for the ServedModel",
                served,
                180,
                interval=0.5,
                detail=why,
            )
            assert metric["describedObject"]["kind"] == "ServedModel"
            # The gauge and the status come from the same probe cycle but travel apart (the status is a
            # PATCH the probe's writer sends; the gauge is scraped): on a loaded machine the adapter can
            # answer before the status lands.
            window = cluster_support.wait_for(
                "the ServedModel's status.probe.window",
                lambda: (
                    ((get(cp, namespace, "servedmodel", name) or {}).get("status") or {}).get("probe") or {}
                ).get("window"),
                60,
                interval=0.5,
            )
            assert window["ttftP95Ms"] > 0

            auto_status = watched.wait_autoscaling(
                "the HPA computing replicas from the object metric",
                lambda a: a.get("reason") == "ValidMetricFound",
            )
            assert "servedmodel_probe_ttft_p95_seconds" in auto_status["message"]
            assert auto_status["desiredReplicas"] == 1
        finally:
            pods.stop()
            if adapter is not None:
                adapter.stop()
            prom.stop()
            delete_served_models(cp, namespace)


@pytest.fixture
def keda_crds(control_plane: controlplane.ControlPlane) -> Iterator[None]:
    """KEDA's ScaledObject and TriggerAuthentication CRDs (github.com/kedacore/keda/v2 config/crd), removed
    afterwards so the rest of the session discovers no keda.sh."""
    fetch = lambda: [olm_tools.keda_crd(p) for p in ("scaledobjects", "triggerauthentications")]  # noqa: E731
    names = ("scaledobjects.keda.sh", "triggerauthentications.keda.sh")
    with crds_installed(control_plane, fetch, names, "KEDA CRDs"):
        yield


def test_keda_crds_accept_the_rendered_golden_objects(
    control_plane: controlplane.ControlPlane, namespace: str, keda_crds: None
) -> None:
    docs, out = golden_dry_run(
        control_plane, namespace, "keda-openshift", lambda d: d["apiVersion"].startswith("keda.sh/")
    )
    assert {d["kind"] for d in docs} == {"ScaledObject", "TriggerAuthentication"}
    assert "serverside-applied (server dry run)" in out, out


def test_keda_scaled_object_and_scale_to_zero_without_probe_traffic(
    probing: ProbingOperator,
    keda_crds: None,
) -> None:
    cp, namespace = probing.cp, probing.namespace
    name = "qwen-keda"
    watched = Watched(cp, namespace, name)
    with SimulatorProcess(QUICK_ENGINE, ready_timeout=60) as sim:
        op = probing.start(name, sim.base_url)
        spec = {
            "servedModelName": "qwen",
            "probe": {"interval": 5},
            "autoscaling": {
                **AUTOSCALING,
                "scaleToZero": True,
                "cooldownSeconds": 60,
                "prometheus": {
                    "url": "https://thanos-querier.openshift-monitoring.svc:9092",
                    "bearerTokenSecretRef": {"name": "keda-token", "key": "token"},
                },
            },
        }
        try:
            # KEDA reads the token Secret on the operator's word: only with its owner's opt-in.
            cp.kubectl("create", "secret", "generic", "keda-token", "-n", namespace, "--from-literal=token=t")
            apply(cp, namespace, served_model(name, **spec))
            refused = wait_for(
                "InvalidSpec naming the Secret",
                lambda: condition(get(cp, namespace, "servedmodel", name), "InvalidSpec").get("message"),
            )
            assert "keda-token" in refused
            assert "inference.servedmodel.io/allowed-servedmodels" in refused
            assert get(cp, namespace, "triggerauthentication", f"{name}-prometheus") is None
            cp.kubectl(
                "annotate", "secret", "keda-token", "-n", namespace,
                f"inference.servedmodel.io/allowed-servedmodels={name}",
            )  # fmt: skip
            so = wait_for("the ScaledObject", lambda: get(cp, namespace, "scaledobject", name), timeout=90)
            assert so["spec"]["idleReplicaCount"] == 0
            assert so["spec"]["triggers"][0]["metadata"]["query"] == (
                f'sum(vllm:num_requests_waiting{{namespace="{namespace}",model_name="qwen"}})'
            )
            auth = get(cp, namespace, "triggerauthentication", f"{name}-prometheus")
            assert auth is not None
            assert auth["spec"]["secretTargetRef"] == [
                {"parameter": "bearerToken", "name": "keda-token", "key": "token"}
            ]
            assert get(cp, namespace, "hpa", name) is None  # KEDA makes its own HPA; the operator none
            watched.wait_serving("True")
            obj = get(cp, namespace, "servedmodel", name) or {}
            assert obj["status"]["autoscaling"]["reason"] == "HorizontalPodAutoscalerMissing"  # no KEDA here

            # The HPA KEDA's operator makes (controllers/keda/hpa.go): keda-hpa-<name>, KEDA's labels with
            # the ScaledObject's over them, owned by the ScaledObject, on an External metric. The real
            # HPA controller acts on it; the operator reads it and does not prune it.
            labels = {
                "app.kubernetes.io/name": f"keda-hpa-{name}",
                "app.kubernetes.io/managed-by": "keda-operator",
                **so["metadata"]["labels"],
            }
            keda_hpa = {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {
                    "name": f"keda-hpa-{name}",
                    "namespace": namespace,
                    "labels": labels,
                    "ownerReferences": [
                        {
                            "apiVersion": "keda.sh/v1alpha1",
                            "kind": "ScaledObject",
                            "name": name,
                            "uid": so["metadata"]["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                    "minReplicas": 1,
                    "maxReplicas": 3,
                    "metrics": [
                        {
                            "type": "External",
                            "external": {
                                "metric": {
                                    "name": "s0-prometheus",
                                    "selector": {"matchLabels": {"scaledobject.keda.sh/name": name}},
                                },
                                "target": {"type": "AverageValue", "averageValue": "2"},
                            },
                        }
                    ],
                },
            }
            cp.kubectl(
                "apply",
                "--server-side",
                "--field-manager=keda-operator",
                "-f",
                "-",
                input=json.dumps(keda_hpa),
            )

            auto = watched.wait_autoscaling(
                "status.autoscaling from KEDA's HPA (no external.metrics.k8s.io here)",
                lambda a: a.get("reason", "").startswith("Failed"),
            )
            assert auto["autoscaler"] == "KEDA"
            assert auto["horizontalPodAutoscaler"] == f"keda-hpa-{name}"
            assert auto["currentReplicas"] == 1
            # a new generation is applied and pruned: KEDA's HPA (owned by the ScaledObject) stays
            spec["probe"] = {"interval": 6}
            apply(cp, namespace, served_model(name, **spec))
            wait_for("that generation reconciled", generation_seen(cp, namespace, name))
            assert get(cp, namespace, "hpa", f"keda-hpa-{name}") is not None
            spec["probe"] = {"interval": 5}
            apply(cp, namespace, served_model(name, **spec))

            # KEDA's idle scale to zero, as KEDA does it: the Deployment's scale subresource to 0.
            cp.kubectl("scale", "-n", namespace, "deployment", name, "--replicas=0")
            obj = watched.wait_serving("Unknown")
            assert condition(obj, "Serving")["reason"] == "ScaledToZero"
            assert condition(obj, "Ready")["reason"] == "ScaledToZero"
            assert obj["status"]["autoscaling"]["reason"] == "ScaledToZero"
            chats_at_zero = engine_metric(sim, "vllm:request_success_total")
            # Three probe intervals at zero (an observation window, not a timing assertion): the
            # scheduler keeps coming back to the model and sends nothing.
            time.sleep(3 * 5)
            assert engine_metric(sim, "vllm:request_success_total") == chats_at_zero
            assert engine_metric(sim, "vllm:num_requests_running") == 0
            # No stale latency signal at zero (it would keep a KEDA trigger active).
            assert not [
                line
                for line in op.metrics().splitlines()
                if line.startswith("servedmodel_probe_ttft_p95_seconds{") and f'name="{name}"' in line
            ]

            # Scaled up again (KEDA's first active trigger): probing, and serving, resume.
            cp.kubectl("scale", "-n", namespace, "deployment", name, "--replicas=1")
            watched.wait_serving("True")
            assert engine_metric(sim, "vllm:request_success_total") > chats_at_zero
        finally:
            delete_served_models(cp, namespace)
