"""render/: table tests for args, kubelet health probes, securityContext, labels, env, images, determinism."""

from __future__ import annotations

import argparse
import base64
import json
from typing import Any

import pytest

from servedmodel.api import ConfigMapKeyRef, ServedModel, names
from servedmodel.config import OperatorConfig
from servedmodel.render import (
    RenderContext,
    RenderError,
    deployment,
    engine_args,
    engine_env,
    kubelet_probes,
    render,
    to_yaml,
)
from servedmodel.render.chat_template import (
    CHAT_TEMPLATE_DIGEST_ANNOTATION,
    TEMPLATE_KEY_NOT_FOUND,
    TEMPLATE_NOT_FOUND,
    TemplateMissing,
    referencing,
    running_digest,
    template_digest,
)
from servedmodel.sim import cli as sim_cli

CTX = RenderContext()
OCP = RenderContext(has_route_api=True, has_service_monitor_api=True)


def cr(spec: dict[str, Any] | None = None, name: str = "qwen", **meta: Any) -> ServedModel:
    body = {
        "metadata": {"name": name, "namespace": "ai", "uid": "uid-1", **meta},
        "spec": {"model": "Qwen/Qwen2.5-7B-Instruct", **(spec or {})},
    }
    return ServedModel.model_validate(body)


def container(obj: ServedModel, ctx: RenderContext = CTX) -> dict[str, Any]:
    c: dict[str, Any] = deployment(obj, ctx)["spec"]["template"]["spec"]["containers"][0]
    return c


def pod_spec(obj: ServedModel, ctx: RenderContext = CTX) -> dict[str, Any]:
    p: dict[str, Any] = deployment(obj, ctx)["spec"]["template"]["spec"]
    return p


BASE_ARGS = ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "Qwen/Qwen2.5-7B-Instruct", "--port", "8000"]


@pytest.mark.parametrize(
    ("spec", "tail"),
    [
        ({}, ["--tensor-parallel-size", "1"]),
        ({"engine": {"maxModelLen": 8192}}, ["--max-model-len", "8192", "--tensor-parallel-size", "1"]),
        ({"engine": {"maxNumSeqs": 64}}, ["--max-num-seqs", "64", "--tensor-parallel-size", "1"]),
        (
            {"engine": {"maxNumBatchedTokens": 4096}},
            ["--max-num-batched-tokens", "4096", "--tensor-parallel-size", "1"],
        ),
        (
            {"engine": {"gpuMemoryUtilization": 0.85}},
            ["--gpu-memory-utilization", "0.85", "--tensor-parallel-size", "1"],
        ),
        ({"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}}, ["--tensor-parallel-size", "2"]),
        (
            {"engine": {"enablePrefixCaching": False}},
            ["--tensor-parallel-size", "1", "--no-enable-prefix-caching"],
        ),
        (
            {"engine": {"enablePrefixCaching": True}},
            ["--tensor-parallel-size", "1", "--enable-prefix-caching"],
        ),
        (
            {"engine": {"enableChunkedPrefill": False}},
            ["--tensor-parallel-size", "1", "--no-enable-chunked-prefill"],
        ),
        ({"engine": {"dtype": "bfloat16"}}, ["--tensor-parallel-size", "1", "--dtype", "bfloat16"]),
        (
            {"engine": {"chatTemplate": {"name": "t", "key": "k.jinja"}}},
            [
                "--tensor-parallel-size",
                "1",
                "--chat-template",
                "/etc/servedmodel/chat-template/template.jinja",
            ],
        ),
        (
            {"engine": {"extraArgs": ["--enable-log-requests", "--block-size=32"]}},
            ["--tensor-parallel-size", "1", "--enable-log-requests", "--block-size=32"],
        ),
    ],
)
def test_engine_args(spec: dict[str, Any], tail: list[str]) -> None:
    assert engine_args(cr(spec).spec) == BASE_ARGS + tail


def test_revision_and_served_name() -> None:
    args = engine_args(cr({"revision": "v1.0", "servedModelName": "qwen"}).spec)
    assert args[:7] == [
        "Qwen/Qwen2.5-7B-Instruct",
        "--served-model-name",
        "qwen",
        "--port",
        "8000",
        "--revision",
        "v1.0",
    ]


def test_pvc_model_is_mounted_read_only_and_offline() -> None:
    obj = cr({"model": "pvc://store/qwen/7b"})
    c = container(obj)
    assert c["args"][0] == "/mnt/models/qwen/7b"
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in c["volumeMounts"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]
    vol = next(v for v in pod_spec(obj)["volumes"] if v["name"] == "model")
    assert vol["persistentVolumeClaim"] == {"claimName": "store", "readOnly": True}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"engine": {"extraArgs": ["--max-model-len=4096"]}}, "spec.engine.extraArgs"),
        ({"engine": {"extraArgs": ["--tensor_parallel_size", "2"]}}, "spec.engine.extraArgs"),
        ({"engine": {"extraArgs": ["--served-model-name", "x"]}}, "spec.engine.extraArgs"),
        ({"model": "pvc://store/../etc"}, "spec.model"),
    ],
)
def test_render_error_names_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(RenderError) as info:
        render(cr(spec), CTX)
    assert info.value.field == field
    assert str(info.value).startswith(field)


@pytest.mark.parametrize(("timeout", "threshold"), [(None, 180), (3600, 360), (65, 7)])
def test_startup_budget(timeout: int | None, threshold: int) -> None:
    spec = {"engine": {"startupTimeoutSeconds": timeout}} if timeout else {}
    p = kubelet_probes(cr(spec))
    startup = p["startupProbe"]
    assert startup["failureThreshold"] == threshold
    assert startup["failureThreshold"] * startup["periodSeconds"] >= (timeout or 1800)
    assert all(probe["httpGet"]["path"] == "/health" for probe in p.values())
    assert all(probe["httpGet"]["port"] == "http" for probe in p.values())
    assert p["livenessProbe"]["failureThreshold"] * p["livenessProbe"]["periodSeconds"] >= 120


def test_default_startup_budget_is_at_least_30_minutes() -> None:
    startup = container(cr())["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 30 * 60
    assert deployment(cr(), CTX)["spec"]["progressDeadlineSeconds"] > 30 * 60


@pytest.mark.parametrize("kind", ["vllm", "simulator"])
def test_restricted_v2_security_context(kind: str) -> None:
    obj = cr({"engine": {"kind": kind}, "resources": {"gpus": 0 if kind == "simulator" else 1}})
    c = container(obj)
    ctx = c["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["runAsNonRoot"] is True
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "runAsUser" not in ctx
    assert "privileged" not in ctx
    pod = pod_spec(obj)
    assert "runAsUser" not in pod["securityContext"]
    assert "fsGroup" not in pod["securityContext"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] in mounts
    assert env["HF_HOME"].startswith("/cache")
    assert "/cache" in mounts


def test_run_as_user_when_asked() -> None:
    assert container(cr({"engine": {"runAsUser": 1001}}))["securityContext"]["runAsUser"] == 1001


def test_vllm_pod_shape() -> None:
    obj = cr({"engine": {"shmSize": "2Gi"}, "resources": {"gpus": 1, "gpuResourceName": "amd.com/gpu"}})
    c = container(obj)
    assert c["image"] == "vllm/vllm-openai:v0.33.0"
    assert c["command"] == ["vllm", "serve"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["resources"]["limits"] == {"amd.com/gpu": "1"}
    shm = next(v for v in pod_spec(obj)["volumes"] if v["name"] == "shm")
    assert shm == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert pod_spec(obj)["enableServiceLinks"] is False


def test_simulator_pod_shape() -> None:
    ctx = RenderContext.from_config(OperatorConfig(simulator_image="example.com/sim:dev"))
    obj = cr({"engine": {"kind": "simulator", "maxModelLen": 2048}, "resources": {"gpus": 0}})
    c = container(obj, ctx)
    assert c["image"] == "example.com/sim:dev"
    assert c["command"] == ["servedmodel", "sim"]
    assert c["args"] == engine_args(obj.spec)
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert all(v["name"] != "shm" for v in pod_spec(obj, ctx)["volumes"])


def test_image_override() -> None:
    assert (
        container(cr({"engine": {"image": "registry.local/vllm:custom"}}))["image"]
        == "registry.local/vllm:custom"
    )


def test_secrets_only_by_reference() -> None:
    obj = cr(
        {
            "hfTokenSecretRef": {"name": "hf", "key": "token"},
            "engine": {"apiKeySecretRef": {"name": "api", "key": "key"}},
        }
    )
    env = {e["name"]: e for e in engine_env(obj)}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
    }
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "api", "key": "key"}
    assert "value" not in env["HF_TOKEN"]
    assert "value" not in env["VLLM_API_KEY"]
    assert not any(a.startswith("--api-key") for a in container(obj)["args"])


def test_env_sorted_and_user_env_overrides_by_name() -> None:
    obj = cr(
        {"engine": {"env": [{"name": "HF_HOME", "value": "/cache/hf"}, {"name": "A_FIRST", "value": "1"}]}}
    )
    env = engine_env(obj)
    variables = [e["name"] for e in env]
    assert variables == sorted(variables)
    assert len(variables) == len(set(variables))
    assert {"name": "HF_HOME", "value": "/cache/hf"} in env


@pytest.mark.parametrize("name", ["qwen", "vllm"])
def test_labels_selectors_and_names(name: str) -> None:
    objects = render(cr({"cache": {"size": "10Gi"}}, name=name), OCP)
    assert [o["kind"] for o in objects] == [
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "Route",
        "ServiceMonitor",
    ]
    selector = names.selector_labels(name)
    for obj in objects:
        labels = obj["metadata"]["labels"]
        for key in ("name", "instance", "component", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels
        assert labels["app.kubernetes.io/instance"] == name
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["controller"] is True
        assert owner["blockOwnerDeletion"] is True
        assert owner["uid"] == "uid-1"
        assert obj["metadata"]["namespace"] == "ai"
    dep, svc = objects[1], objects[2]
    assert dep["spec"]["selector"]["matchLabels"] == selector
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == selector
    assert svc["metadata"]["name"] == f"{name}-engine" != "vllm"
    assert objects[4]["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def test_selector_stable_across_engine_kind() -> None:
    a = deployment(cr(), CTX)["spec"]["selector"]
    b = deployment(cr({"engine": {"kind": "simulator"}, "resources": {"gpus": 0}}), CTX)["spec"]["selector"]
    assert a == b


@pytest.mark.parametrize(
    ("ctx", "spec", "kinds"),
    [
        (CTX, {}, ["Deployment", "Service"]),
        (OCP, {}, ["Deployment", "Service", "Route", "ServiceMonitor"]),
        (
            OCP,
            {"expose": {"route": False}, "monitoring": {"serviceMonitor": False}},
            ["Deployment", "Service"],
        ),
        (RenderContext(has_route_api=True), {}, ["Deployment", "Service", "Route"]),
        (CTX, {"cache": {"existingClaim": "hf"}}, ["Deployment", "Service"]),
        (CTX, {"cache": {"size": "1Gi"}}, ["PersistentVolumeClaim", "Deployment", "Service"]),
        (OCP, {"endpoint": "http://qwen.ai.svc:8000"}, []),
    ],
)
def test_which_children(ctx: RenderContext, spec: dict[str, Any], kinds: list[str]) -> None:
    assert [o["kind"] for o in render(cr(spec), ctx)] == kinds


def test_route_edge_tls_and_long_timeout() -> None:
    route = render(cr({"expose": {"host": "q.apps.example.com"}}), OCP)[2]
    assert route["spec"]["tls"] == {"termination": "edge", "insecureEdgeTerminationPolicy": "Redirect"}
    assert route["spec"]["host"] == "q.apps.example.com"
    assert route["spec"]["to"]["name"] == "qwen-engine"
    assert route["metadata"]["annotations"]["haproxy.router.openshift.io/timeout"] == "600s"
    plain = render(cr({"expose": {"tls": False}}), OCP)[2]
    assert "tls" not in plain["spec"]


def test_cache_claim_shape() -> None:
    (pvc,) = [
        o
        for o in render(cr({"cache": {"size": "100Gi", "storageClassName": "fast"}}), CTX)
        if o["kind"] == "PersistentVolumeClaim"
    ]
    assert pvc["metadata"]["name"] == "qwen-cache"
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "100Gi"}},
        "volumeMode": "Filesystem",
        "storageClassName": "fast",
    }


def test_deterministic() -> None:
    spec = {
        "engine": {"env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}], "maxModelLen": 4096},
        "nodeSelector": {"z": "1", "a": "2"},
        "cache": {"size": "1Gi"},
    }
    first = to_yaml(render(cr(spec), OCP))
    reordered = {
        "cache": {"size": "1Gi"},
        "nodeSelector": {"a": "2", "z": "1"},
        "engine": dict(reversed(list(spec["engine"].items()))),
    }
    assert to_yaml(render(cr(spec), OCP)) == first
    assert to_yaml(render(cr(reordered), OCP)) == first


def test_replicas_follow_spec() -> None:
    assert deployment(cr({"replicas": 3}), CTX)["spec"]["replicas"] == 3
    assert deployment(cr({"replicas": 0}), CTX)["spec"]["replicas"] == 0


def test_no_owner_reference_without_uid() -> None:
    obj = ServedModel.model_validate({"metadata": {"name": "q"}, "spec": {"model": "m"}})
    assert all("ownerReferences" not in o["metadata"] for o in render(obj, CTX))


def test_simulator_accepts_every_rendered_flag() -> None:
    # The simulator image runs `servedmodel sim` + the vLLM args: its parser must take all of them.
    obj = cr(
        {
            "revision": "main",
            "servedModelName": "qwen",
            "engine": {
                "kind": "simulator",
                "maxModelLen": 4096,
                "maxNumSeqs": 8,
                "maxNumBatchedTokens": 4096,
                "gpuMemoryUtilization": 0.5,
                "enablePrefixCaching": False,
                "enableChunkedPrefill": False,
                "dtype": "bfloat16",
                "chatTemplate": {"name": "t", "key": "k"},
            },
            "resources": {"gpus": 0},
        }
    )
    c = container(obj)
    assert c["command"][1] == "sim"
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    args = parser.parse_args(c["args"])
    assert args.served_model_name == ["qwen"]
    assert args.port == 8000
    assert args.max_model_len == 4096
    assert args.enable_prefix_caching is False


def _configmap(**data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "t", "namespace": "ml"},
        "data": data,
    }


def _pod_template_for(configmap: dict[str, Any] | None) -> dict[str, Any]:
    """The pod template the reconciler renders for a ServedModel whose chat template is ConfigMap t, key k."""
    sm = cr({"engine": {"chatTemplate": {"name": "t", "key": "k"}}})
    assert sm.spec.engine.chat_template is not None
    digest = template_digest(configmap, sm.spec.engine.chat_template)
    ctx = RenderContext(chat_template_digest=digest if isinstance(digest, str) else None)
    template: dict[str, Any] = deployment(sm, ctx)["spec"]["template"]
    return template


def test_chat_template_digest_rolls_pods() -> None:
    """Editing the referenced key changes the pod template (a new pod-template-hash: the pods roll);
    editing another key of the ConfigMap, or nothing, changes nothing."""
    first = _pod_template_for(_configmap(k="{{ messages }}", other="x"))
    assert first["metadata"]["annotations"][CHAT_TEMPLATE_DIGEST_ANNOTATION].startswith("sha256:")
    assert _pod_template_for(_configmap(k="{{ messages }}", other="x")) == first
    assert _pod_template_for(_configmap(k="{{ messages }}", other="changed")) == first
    edited = _pod_template_for(_configmap(k="{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert edited != first
    assert edited["spec"] == first["spec"]  # only the digest differs
    # binaryData counts as the same content as data.
    as_binary = {**_configmap(), "binaryData": {"k": base64.b64encode(b"{{ messages }}").decode()}}
    assert _pod_template_for(as_binary) == first


def test_no_digest_without_a_chat_template() -> None:
    meta = deployment(cr({}), RenderContext(chat_template_digest="sha256:abc"))["spec"]["template"][
        "metadata"
    ]
    assert CHAT_TEMPLATE_DIGEST_ANNOTATION not in meta.get("annotations", {})


@pytest.mark.parametrize(
    ("configmap", "reason", "says"),
    [
        (None, TEMPLATE_NOT_FOUND, "ConfigMap t not found"),
        (_configmap(other="x"), TEMPLATE_KEY_NOT_FOUND, "has no key k (keys: other)"),
        ({**_configmap(), "binaryData": {"k": "not base64!"}}, TEMPLATE_KEY_NOT_FOUND, "not base64"),
    ],
    ids=["no-configmap", "no-key", "bad-binary"],
)
def test_missing_chat_template_is_a_reason(configmap: dict[str, Any] | None, reason: str, says: str) -> None:
    got = template_digest(configmap, ConfigMapKeyRef(name="t", key="k"))
    assert isinstance(got, TemplateMissing)
    assert got.reason == reason
    assert says in got.message
    assert got.message.startswith("spec.engine.chatTemplate: ")


def test_running_digest_and_referencing() -> None:
    template = _pod_template_for(_configmap(k="x"))
    digest = template["metadata"]["annotations"][CHAT_TEMPLATE_DIGEST_ANNOTATION]
    assert running_digest({"spec": {"template": template}}) == digest
    assert running_digest(None) is None
    assert running_digest({"spec": {"template": {"metadata": {}}}}) is None
    sms = [
        {
            "metadata": {"namespace": "ml", "name": n},
            "spec": {"engine": {"chatTemplate": {"name": c, "key": "k"}}},
        }
        for n, c in (("b", "t"), ("a", "t"), ("c", "other"))
    ] + [{"metadata": {"namespace": "ml", "name": "d"}, "spec": {}}]
    assert referencing(sms, "ml", "t") == ["a", "b"]
    assert referencing(sms, "elsewhere", "t") == []
