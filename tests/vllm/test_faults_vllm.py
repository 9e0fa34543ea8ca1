"""Faults that real vLLM produces, seen by the operator's probe: each gives Serving=False (or, for the
template, TemplateOK=False) with its own reason, and Serving=True again once the fault clears.

The operator runs against the local control plane with SERVEDMODEL_ENDPOINT_OVERRIDE pointing the
ServedModel at a real vLLM on 127.0.0.1. Faults that need flags of their own (--api-key, a chat template
without ChatML markers) share one module server, restarted when a test needs other flags; the others
use the session's plain server and leave it as they found it. Every fault's row (status seen, seconds to
it, what cleared it, seconds to Serving=True again) is printed at the end of the run (conftest.py):
`.venv/bin/pytest -q tests/vllm/test_faults_vllm.py` prints the table of docs/vllm.md.

Waits are bounded (one probe interval + one probe timeout + slack for this shared machine), never
timing assertions.
"""

from __future__ import annotations

import base64
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster_support import apply, condition, served_model, wait_for

import controlplane
from servedmodel.sim.templates import bundled_source
from vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.timeout(1500)]
OperatorProcess = Any
FaultTable = list[tuple[str, str, float, str, float | None]]

KEY = "sk-probe-fault-test-5e0c1d"  # a test value, not a secret anyone uses
INTERVAL_S = 5
PROBE = {"interval": INTERVAL_S, "timeout": 20, "firstByteTimeout": 5}
# A fault must show within one interval + one probe timeout; the slack covers backoff after failures
# (at most 4 intervals) and a machine shared by several test runs.
DETECT_WAIT_S = INTERVAL_S + 20 + 60
RECOVER_WAIT_S = 4 * INTERVAL_S + 20 + 60


def sm(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cp.kubectl("get", "-n", namespace, "sm", name, "-o", "json").stdout)
    return out


def wait_condition(
    cp: controlplane.ControlPlane,
    namespace: str,
    name: str,
    type_: str,
    status: str,
    timeout: float,
    op: OperatorProcess,
) -> tuple[dict[str, Any], float]:
    """The first condition of that type with that status; and the seconds it took to appear."""
    t0 = time.monotonic()

    def seen() -> dict[str, Any] | None:
        c = condition(sm(cp, namespace, name), type_)
        return c if c.get("status") == status else None

    found: dict[str, Any] = wait_for(
        f"{type_}={status} on {namespace}/{name}", seen, timeout, interval=0.3, detail=lambda: op.log(40)
    )
    return found, time.monotonic() - t0


def external(name: str, url: str, **spec: Any) -> dict[str, Any]:
    """An external-mode ServedModel (nothing deployed: the probe only) on `url`."""
    fields: dict[str, Any] = {"servedModelName": "qwen", "probe": dict(PROBE), **spec}
    manifest = served_model(name, endpoint=url, **fields)
    del manifest["spec"]["resources"]
    if "engine" in spec:
        manifest["spec"]["engine"] = spec["engine"]
    else:
        del manifest["spec"]["engine"]
    return manifest


def set_secret(cp: controlplane.ControlPlane, namespace: str, value: str) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "engine-key", "namespace": namespace},
        "data": {"key": base64.b64encode(value.encode()).decode()},
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(secret))


def running(server: VLLMServer) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def no_chatml_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "plain.jinja"
    path.write_text(bundled_source("plain"))  # "user: ...\nassistant: " - no <|im_start|> markers
    return path


@pytest.fixture(scope="module")
def fault_server(start_vllm: Callable[..., VLLMServer], no_chatml_template: Path) -> VLLMServer:
    """Keyed tiny Qwen2.5 whose --chat-template has no ChatML markers (tests restart it as they need)."""
    return start_vllm("qwen2.5", extra_args=["--api-key", KEY, "--chat-template", str(no_chatml_template)])


def with_flags(server: VLLMServer, args: list[str]) -> VLLMServer:
    if server.extra_args != args or not server.alive():
        server.restart(args)
    return server


@pytest.fixture
def op_for(
    start_operator: Callable[..., OperatorProcess], namespace: str
) -> Callable[[str, VLLMServer], OperatorProcess]:
    def start(name: str, server: VLLMServer) -> OperatorProcess:
        return start_operator(
            namespaces=[namespace], endpoint_override=f"{namespace}/{name}={server.base_url}"
        )

    return start


def test_wrong_or_missing_api_key_is_unauthorized_until_the_right_key(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    op_for: Callable[[str, VLLMServer], OperatorProcess],
    fault_server: VLLMServer,
    no_chatml_template: Path,
    fault_table: FaultTable,
) -> None:
    cp = control_plane
    server = with_flags(fault_server, ["--api-key", KEY, "--chat-template", str(no_chatml_template)])
    op = op_for("keyed", server)
    set_secret(cp, namespace, KEY)
    keyed = {"apiKeySecretRef": {"name": "engine-key", "key": "key"}}
    apply(cp, namespace, external("keyed", server.base_url, engine=keyed))
    wait_condition(cp, namespace, "keyed", "Serving", "True", DETECT_WAIT_S, op)

    set_secret(cp, namespace, "sk-wrong")
    bad, detect = wait_condition(cp, namespace, "keyed", "Serving", "False", DETECT_WAIT_S, op)
    assert bad["reason"] == "Unauthorized", bad
    assert "401" in bad["message"]
    assert "sk-wrong" not in json.dumps(sm(cp, namespace, "keyed"))
    set_secret(cp, namespace, KEY)
    _, recover = wait_condition(cp, namespace, "keyed", "Serving", "True", RECOVER_WAIT_S, op)
    fault_table.append(
        (
            "wrong API key (--api-key)",
            "Serving=False Unauthorized",
            detect,
            "right key in the Secret",
            recover,
        )
    )

    apply(cp, namespace, external("keyed", server.base_url))  # no apiKeySecretRef: the key is missing
    bad, detect = wait_condition(cp, namespace, "keyed", "Serving", "False", DETECT_WAIT_S, op)
    assert bad["reason"] == "Unauthorized", bad
    apply(cp, namespace, external("keyed", server.base_url, engine=keyed))
    _, recover = wait_condition(cp, namespace, "keyed", "Serving", "True", RECOVER_WAIT_S, op)
    fault_table.append(
        ("missing API key", "Serving=False Unauthorized", detect, "apiKeySecretRef set", recover)
    )
    assert KEY not in json.dumps(sm(cp, namespace, "keyed"))
    assert KEY not in op.log()


def test_chat_template_without_chatml_markers_fails_template_ok(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    op_for: Callable[[str, VLLMServer], OperatorProcess],
    fault_server: VLLMServer,
    no_chatml_template: Path,
    fault_table: FaultTable,
) -> None:
    cp = control_plane
    server = with_flags(fault_server, ["--api-key", KEY, "--chat-template", str(no_chatml_template)])
    op = op_for("tmpl", server)
    set_secret(cp, namespace, KEY)
    t0 = time.monotonic()
    apply(
        cp,
        namespace,
        external("tmpl", server.base_url, engine={"apiKeySecretRef": {"name": "engine-key", "key": "key"}}),
    )
    bad, _ = wait_condition(cp, namespace, "tmpl", "TemplateOK", "False", DETECT_WAIT_S, op)
    detect = time.monotonic() - t0
    assert bad["reason"] == "RoleMarkersMissing", bad
    assert "<|im_start|>" in bad["message"]
    obj = sm(cp, namespace, "tmpl")
    assert condition(obj, "Serving")["status"] == "True"  # the model answers; the check says what is wrong
    assert obj["status"]["probe"]["checks"]["template"]["result"] == "Fail"

    # The fault clears when vLLM serves the model's own template again (a restart without the flag).
    server.restart(["--api-key", KEY])
    t1 = time.monotonic()
    good, _ = wait_condition(cp, namespace, "tmpl", "TemplateOK", "True", RECOVER_WAIT_S, op)
    assert good["reason"] == "PromptTokensMatch", good
    fault_table.append(
        (
            "chat template without ChatML markers (--chat-template)",
            "TemplateOK=False RoleMarkersMissing (Serving stays True)",
            detect,
            "vLLM restarted with the model's template",
            time.monotonic() - t1,
        )
    )


def test_engine_killed_mid_stream_then_restarted(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    op_for: Callable[[str, VLLMServer], OperatorProcess],
    fault_server: VLLMServer,
    fault_table: FaultTable,
) -> None:
    cp = control_plane
    server = with_flags(fault_server, ["--api-key", KEY])
    op = op_for("killed", server)
    set_secret(cp, namespace, KEY)
    # Long answers, so the engine is killed while the probe's stream is in flight.
    manifest = external(
        "killed", server.base_url, engine={"apiKeySecretRef": {"name": "engine-key", "key": "key"}}
    )
    manifest["spec"]["probe"].update({"maxTokens": 400, "timeout": 60, "firstByteTimeout": 10})
    apply(cp, namespace, manifest)
    wait_condition(cp, namespace, "killed", "Serving", "True", DETECT_WAIT_S, op)
    wait_for("the probe's stream in flight", lambda: running(server) >= 1, 120, interval=0.05)
    time.sleep(0.3)  # some tokens out
    server.signal_engine(signal.SIGKILL)
    bad, detect = wait_condition(cp, namespace, "killed", "Serving", "False", DETECT_WAIT_S, op)
    # vLLM ends the stream with an error event ("EngineCore encountered an issue"), then answers
    # /health 503 and exits: the cycle in flight says so.
    assert bad["reason"] == "MalformedStream", bad
    assert "EngineCore" in bad["message"], bad
    later, _ = wait_condition_reason(cp, namespace, "killed", ("ConnectionRefused", "EngineUnhealthy"), op)

    server.restart(["--api-key", KEY])  # what the Deployment's restart does for a pod
    t1 = time.monotonic()
    _, _ = wait_condition(cp, namespace, "killed", "Serving", "True", RECOVER_WAIT_S, op)
    fault_table.append(
        (
            "engine killed mid-stream (SIGKILL EngineCore + Worker)",
            f"Serving=False MalformedStream (error event), then {later}",
            detect,
            "vLLM restarted",
            time.monotonic() - t1,
        )
    )


def wait_condition_reason(
    cp: controlplane.ControlPlane, namespace: str, name: str, reasons: tuple[str, ...], op: OperatorProcess
) -> tuple[str, float]:
    t0 = time.monotonic()

    def seen() -> str | None:
        c = condition(sm(cp, namespace, name), "Serving")
        return str(c["reason"]) if c.get("status") == "False" and c.get("reason") in reasons else None

    reason: str = wait_for(
        f"Serving=False {reasons}", seen, RECOVER_WAIT_S, interval=0.3, detail=lambda: op.log(40)
    )
    return reason, time.monotonic() - t0


def test_engine_frozen_stalls_the_stream_until_thawed(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    op_for: Callable[[str, VLLMServer], OperatorProcess],
    vllm_qwen25: VLLMServer,
    fault_table: FaultTable,
) -> None:
    cp = control_plane
    op = op_for("frozen", vllm_qwen25)
    apply(cp, namespace, external("frozen", vllm_qwen25.base_url))
    wait_condition(cp, namespace, "frozen", "Serving", "True", DETECT_WAIT_S, op)
    vllm_qwen25.signal_engine(signal.SIGSTOP)
    try:
        bad, detect = wait_condition(cp, namespace, "frozen", "Serving", "False", DETECT_WAIT_S, op)
    finally:
        vllm_qwen25.signal_engine(signal.SIGCONT)
    t1 = time.monotonic()
    # /health, /v1/models and /tokenize live in the API server and still answer: the stream stalls.
    assert bad["reason"] == "StreamStalled", bad
    _, _ = wait_condition(cp, namespace, "frozen", "Serving", "True", RECOVER_WAIT_S, op)
    fault_table.append(
        (
            "engine frozen (SIGSTOP EngineCore + Worker)",
            "Serving=False StreamStalled",
            detect,
            "SIGCONT",
            time.monotonic() - t1,
        )
    )


def test_model_name_not_served(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    op_for: Callable[[str, VLLMServer], OperatorProcess],
    vllm_qwen25: VLLMServer,
    fault_table: FaultTable,
) -> None:
    cp = control_plane
    op = op_for("named", vllm_qwen25)
    t0 = time.monotonic()
    apply(cp, namespace, external("named", vllm_qwen25.base_url, servedModelName="qwen-72b"))
    bad, _ = wait_condition(cp, namespace, "named", "Serving", "False", DETECT_WAIT_S, op)
    detect = time.monotonic() - t0
    assert bad["reason"] == "ModelNotServed", bad
    assert "qwen-72b" in bad["message"]
    assert "served: qwen" in bad["message"]
    apply(cp, namespace, external("named", vllm_qwen25.base_url))
    _, recover = wait_condition(cp, namespace, "named", "Serving", "True", RECOVER_WAIT_S, op)
    fault_table.append(
        (
            "model name the server does not serve",
            "Serving=False ModelNotServed",
            detect,
            "servedModelName fixed",
            recover,
        )
    )


def test_probe_prompt_over_the_context(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    op_for: Callable[[str, VLLMServer], OperatorProcess],
    vllm_qwen25: VLLMServer,
    fault_table: FaultTable,
) -> None:
    cp = control_plane
    op = op_for("long", vllm_qwen25)
    # 4 messages of ~1,365 tokens each: over max_model_len 4096 (each message is at most 8,192 characters).
    long_messages = [{"role": "user", "content": (" hello" * 1365)[1:]} for _ in range(4)]
    manifest = external("long", vllm_qwen25.base_url)
    manifest["spec"]["probe"]["messages"] = long_messages
    t0 = time.monotonic()
    apply(cp, namespace, manifest)
    bad, _ = wait_condition(cp, namespace, "long", "Serving", "False", DETECT_WAIT_S, op)
    detect = time.monotonic() - t0
    assert bad["reason"] == "PromptTooLong", bad
    assert "maximum context length is 4096 tokens" in bad["message"]
    apply(cp, namespace, external("long", vllm_qwen25.base_url))
    _, recover = wait_condition(cp, namespace, "long", "Serving", "True", RECOVER_WAIT_S, op)
    probe = sm(cp, namespace, "long")["status"]["probe"]
    # The limits check is the same refusal, asked for on purpose: Pass with vLLM's own words.
    assert probe["checks"]["limits"]["result"] == "Pass"
    assert "maximum context length is 4096 tokens" in probe["checks"]["limits"]["message"]
    fault_table.append(
        (
            "probe prompt over the context (max_model_len 4096)",
            "Serving=False PromptTooLong",
            detect,
            "spec.probe.messages fixed",
            recover,
        )
    )
