"""The operator end to end with real vLLM behind its probe.

A vLLM ServedModel on the local control plane (kwok's fake GPU node runs the Deployment's pod); the
operator is started with SERVEDMODEL_ENDPOINT_OVERRIDE pointing that ServedModel at the session's real
vLLM on 127.0.0.1, so the probe walks vLLM's own API server, engine and /metrics.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from cluster_support import ProbingOperator, apply, condition, served_model, wait_for

import controlplane
from vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.timeout(900)]
OperatorProcess = Any  # tests/cluster/conftest.py's (conftests are not importable)
CHECKS = ("template", "limits", "stop", "usage")


def sm(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cp.kubectl("get", "-n", namespace, "sm", name, "-o", "json").stdout)
    return out


def columns(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, str]:
    header, row = cp.kubectl("get", "sm", name, "-n", namespace).stdout.splitlines()[:2]
    return dict(zip(header.split(), row.split(), strict=False))


def test_servedmodel_probed_against_real_vllm_is_ready_and_serving(
    probing: ProbingOperator,
    vllm_qwen25: VLLMServer,
) -> None:
    cp, namespace = probing.cp, probing.namespace
    op = probing.start("qwen", vllm_qwen25.base_url)
    apply(cp, namespace, served_model("qwen", servedModelName="qwen", probe={"interval": 5}))

    def probed_twice() -> dict[str, Any] | None:
        # Two probes in the window, the last read on time: a probe whose own loop this busy machine held
        # up says so and publishes no client TTFT/TPOT for that cycle (by design), and the next one does.
        obj = sm(cp, namespace, "qwen")
        probe = (obj.get("status") or {}).get("probe") or {}
        window, client = probe.get("window") or {}, probe.get("client") or {}
        ready = condition(obj, "Ready").get("status") == "True"
        timed = "ttftMs" in client and "tpotMs" in client
        return obj if ready and window.get("samples", 0) >= 2 and timed else None

    obj = wait_for(
        "Ready and two successful probes of real vLLM", probed_twice, 300, detail=lambda: op.log(60)
    )
    probe = obj["status"]["probe"]
    assert (probe["result"], probe["reason"]) == ("Success", "Serving"), probe.get("message")
    assert probe["model"] == "qwen"
    assert probe["endpoint"] == vllm_qwen25.base_url
    assert {k: probe["checks"][k]["result"] for k in CHECKS} == dict.fromkeys(CHECKS, "Pass"), probe["checks"]
    assert probe["checks"]["template"]["reason"] == "PromptTokensMatch"
    assert "maximum context length is 4096" in probe["checks"]["limits"]["message"]
    # vLLM's own histograms, over a window where only the probe finished a request
    server = probe["server"]
    assert server["isolated"] is True
    assert server["requests"] == 1
    for field in ("ttftMs", "queueMs", "prefillMs", "decodeMs", "e2eMs"):
        assert server[field] >= 0, field
    assert server["ttftMs"] > 0
    assert probe["client"]["ttftMs"] > 0
    assert probe["usage"]["promptTokens"] > 0
    assert probe["counters"]["generationTokensTotal"] >= probe["usage"]["completionTokens"]
    assert probe["scheduler"]["running"] == 0
    for type_ in ("Serving", "TemplateOK", "Ready"):
        assert condition(obj, type_)["status"] == "True", (type_, condition(obj, type_))
    assert obj["status"]["phase"] == "Ready"

    cols = columns(cp, namespace, "qwen")
    for col in ("TTFT", "TPOT", "RUNNING", "WAITING"):
        assert cols.get(col) not in (None, "<none>"), cols
    assert float(cols["TTFT"]) > 0
    wide = cp.kubectl("get", "sm", "qwen", "-n", namespace, "-o", "wide").stdout
    assert "Ready" in wide


def test_cpu_only_servedmodel_renders_vllms_cpu_image_and_serves(
    probing: ProbingOperator,
    vllm_qwen25: VLLMServer,
) -> None:
    """resources.gpus: 0 on a cluster without GPUs in use: vLLM's CPU image, the KV cache from the spec,
    no GPU request; the pod is scheduled by the real scheduler and the probe reaches the real engine."""
    cp, namespace = probing.cp, probing.namespace
    op = probing.start("cpu", vllm_qwen25.base_url)
    manifest = served_model(
        "cpu",
        servedModelName="qwen",
        engine={"maxModelLen": 4096, "cpuKVCacheSpaceGiB": 1},
        resources={"gpus": 0},
        probe={"interval": 5},
    )
    apply(cp, namespace, manifest)

    def serving() -> dict[str, Any] | None:
        obj = sm(cp, namespace, "cpu")
        ok = (
            condition(obj, "Ready").get("status") == "True"
            and condition(obj, "Serving").get("status") == "True"
        )
        return obj if ok else None

    obj = wait_for("the CPU ServedModel Ready and Serving", serving, 300, detail=lambda: op.log(60))
    assert obj["status"]["probe"]["checks"]["template"]["result"] == "Pass"
    deployment = json.loads(cp.kubectl("get", "deployment", "cpu", "-n", namespace, "-o", "json").stdout)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].startswith("public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    resources = container["resources"]
    assert "nvidia.com/gpu" not in json.dumps(resources)
    assert resources["requests"] == {"cpu": "2", "memory": "7Gi"}  # defaults: never BestEffort
    pods = json.loads(cp.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    assert pods
    assert all(p["status"]["phase"] == "Running" for p in pods)
