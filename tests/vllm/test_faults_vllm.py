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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster_support import ProbingOperator, apply, condition, served_model, wait_for

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


@dataclass
class Watch:
    """One ServedModel under a fault, with its own operator: waits on its conditions and writes the fault's
    row (status seen, seconds to it, what cleared it, seconds to clear) into the table."""

    cp: controlplane.ControlPlane
    namespace: str
    name: str
    op: OperatorProcess
    table: FaultTable

    def sm(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(
            self.cp.kubectl("get", "-n", self.namespace, "sm", self.name, "-o", "json").stdout
        )
        return out

    def apply(self, manifest: dict[str, Any]) -> None:
        apply(self.cp, self.namespace, manifest)

    def wait(self, type_: str, status: str, timeout: float) -> tuple[dict[str, Any], float]:
        """The first condition of that type with that status; and the seconds it took to appear."""
        t0 = time.monotonic()

        def seen() -> dict[str, Any] | None:
            c = condition(self.sm(), type_)
            return c if c.get("status") == status else None

        found: dict[str, Any] = wait_for(
            f"{type_}={status} on {self.namespace}/{self.name}",
            seen,
            timeout,
            interval=0.3,
            detail=lambda: self.op.log(40),
        )
        return found, time.monotonic() - t0

    def serving(self) -> None:
        self.wait("Serving", "True", DETECT_WAIT_S)

    def fault(self, reason: str, type_: str = "Serving") -> tuple[dict[str, Any], float]:
        """The fault's condition (type_=False for `reason`) and the seconds it took to appear."""
        bad, detect = self.wait(type_, "False", DETECT_WAIT_S)
        assert bad["reason"] == reason, bad
        return bad, detect

    def spec_fault(
        self, manifest: dict[str, Any], reason: str, type_: str = "Serving"
    ) -> tuple[dict[str, Any], float]:
        """Applies a manifest whose spec is the fault: the fault's condition, and the seconds from the
        apply."""
        t0 = time.monotonic()
        self.apply(manifest)
        bad, _ = self.fault(reason, type_)
        return bad, time.monotonic() - t0

    def cleared(
        self,
        fault: str,
        seen: str,
        detect: float,
        cleared_by: str,
        fixed: dict[str, Any] | None = None,
        type_: str = "Serving",
    ) -> dict[str, Any]:
        """Waits for type_=True again once the fault is cleared (by applying `fixed` when given, else by
        what the test did just before) and writes the fault's row."""
        if fixed is not None:
            self.apply(fixed)
        good, recover = self.wait(type_, "True", RECOVER_WAIT_S)
        self.table.append((fault, seen, detect, cleared_by, recover))
        return good


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
        # The owner's opt-in (servedmodel.access): every ServedModel of this test namespace may use it.
        "metadata": {
            "name": "engine-key",
            "namespace": namespace,
            "annotations": {"inference.servedmodel.io/allowed-servedmodels": "*"},
        },
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


KEYED = {"apiKeySecretRef": {"name": "engine-key", "key": "key"}}


@pytest.fixture
def watch(probing: ProbingOperator, fault_table: FaultTable) -> Callable[[str, VLLMServer], Watch]:
    """`watch(name, server)`: an operator probing ServedModel `name` on `server`, and the Watch on it."""

    def start(name: str, server: VLLMServer) -> Watch:
        return Watch(probing.cp, probing.namespace, name, probing.start(name, server.base_url), fault_table)

    return start


def keyed(
    watch: Callable[[str, VLLMServer], Watch], fault_server: VLLMServer, name: str, *flags: str
) -> tuple[Watch, VLLMServer]:
    """A Watch on the module's keyed server, running with --api-key and `flags`; the key in the Secret."""
    server = with_flags(fault_server, ["--api-key", KEY, *flags])
    w = watch(name, server)
    set_secret(w.cp, w.namespace, KEY)
    return w, server


@pytest.mark.own_engines
def test_wrong_or_missing_api_key_is_unauthorized_until_the_right_key(
    watch: Callable[[str, VLLMServer], Watch], fault_server: VLLMServer, no_chatml_template: Path
) -> None:
    w, server = keyed(watch, fault_server, "keyed", "--chat-template", str(no_chatml_template))
    w.apply(external("keyed", server.base_url, engine=KEYED))
    w.serving()

    set_secret(w.cp, w.namespace, "sk-wrong")
    bad, detect = w.fault("Unauthorized")
    assert "401" in bad["message"]
    assert "sk-wrong" not in json.dumps(w.sm())
    set_secret(w.cp, w.namespace, KEY)
    w.cleared("wrong API key (--api-key)", "Serving=False Unauthorized", detect, "right key in the Secret")

    w.apply(external("keyed", server.base_url))  # no apiKeySecretRef: the key is missing
    _, detect = w.fault("Unauthorized")
    fixed = external("keyed", server.base_url, engine=KEYED)
    w.cleared("missing API key", "Serving=False Unauthorized", detect, "apiKeySecretRef set", fixed)
    assert KEY not in json.dumps(w.sm())
    assert KEY not in w.op.log()


@pytest.mark.own_engines
def test_chat_template_without_chatml_markers_fails_template_ok(
    watch: Callable[[str, VLLMServer], Watch], fault_server: VLLMServer, no_chatml_template: Path
) -> None:
    w, server = keyed(watch, fault_server, "tmpl", "--chat-template", str(no_chatml_template))
    bad, detect = w.spec_fault(
        external("tmpl", server.base_url, engine=KEYED), "RoleMarkersMissing", "TemplateOK"
    )
    assert "<|im_start|>" in bad["message"]
    obj = w.sm()
    assert condition(obj, "Serving")["status"] == "True"  # the model answers; the check says what is wrong
    assert obj["status"]["probe"]["checks"]["template"]["result"] == "Fail"

    # The fault clears when vLLM serves the model's own template again (a restart without the flag).
    server.restart(["--api-key", KEY])
    good = w.cleared(
        "chat template without ChatML markers (--chat-template)",
        "TemplateOK=False RoleMarkersMissing (Serving stays True)",
        detect,
        "vLLM restarted with the model's template",
        type_="TemplateOK",
    )
    assert good["reason"] == "PromptTokensMatch", good


@pytest.mark.own_engines
def test_engine_killed_mid_stream_then_restarted(
    watch: Callable[[str, VLLMServer], Watch], fault_server: VLLMServer
) -> None:
    w, server = keyed(watch, fault_server, "killed")
    # Long answers, so the engine is killed while the probe's stream is in flight.
    manifest = external("killed", server.base_url, engine=KEYED)
    manifest["spec"]["probe"].update({"maxTokens": 400, "timeout": 60, "firstByteTimeout": 10})
    w.apply(manifest)
    w.serving()
    wait_for("the probe's stream in flight", lambda: running(server) >= 1, 120, interval=0.05)
    time.sleep(0.3)  # some tokens out
    server.signal_engine(signal.SIGKILL)
    # vLLM ends the stream with an error event ("EngineCore encountered an issue"), then answers
    # /health 503 and exits: the cycle in flight says so.
    bad, detect = w.fault("MalformedStream")
    assert "EngineCore" in bad["message"], bad
    later = wait_serving_reason(w, ("ConnectionRefused", "EngineUnhealthy"))

    server.restart(["--api-key", KEY])  # what the Deployment's restart does for a pod
    w.cleared(
        "engine killed mid-stream (SIGKILL EngineCore + Worker)",
        f"Serving=False MalformedStream (error event), then {later}",
        detect,
        "vLLM restarted",
    )


def wait_serving_reason(w: Watch, reasons: tuple[str, ...]) -> str:
    """The first Serving=False reason among `reasons`."""

    def seen() -> str | None:
        c = condition(w.sm(), "Serving")
        return str(c["reason"]) if c.get("status") == "False" and c.get("reason") in reasons else None

    reason: str = wait_for(
        f"Serving=False {reasons}", seen, RECOVER_WAIT_S, interval=0.3, detail=lambda: w.op.log(40)
    )
    return reason


def test_engine_frozen_stalls_the_stream_until_thawed(
    watch: Callable[[str, VLLMServer], Watch], vllm_qwen25: VLLMServer
) -> None:
    w = watch("frozen", vllm_qwen25)
    w.apply(external("frozen", vllm_qwen25.base_url))
    w.serving()
    vllm_qwen25.signal_engine(signal.SIGSTOP)
    try:
        # /health, /v1/models and /tokenize live in the API server and still answer: the stream stalls.
        _, detect = w.fault("StreamStalled")
    finally:
        vllm_qwen25.signal_engine(signal.SIGCONT)
    w.cleared("engine frozen (SIGSTOP EngineCore + Worker)", "Serving=False StreamStalled", detect, "SIGCONT")


def test_model_name_not_served(watch: Callable[[str, VLLMServer], Watch], vllm_qwen25: VLLMServer) -> None:
    w = watch("named", vllm_qwen25)
    bad, detect = w.spec_fault(
        external("named", vllm_qwen25.base_url, servedModelName="qwen-72b"), "ModelNotServed"
    )
    assert "qwen-72b" in bad["message"]
    assert "served: qwen" in bad["message"]
    fixed = external("named", vllm_qwen25.base_url)
    w.cleared(
        "model name the server does not serve",
        "Serving=False ModelNotServed",
        detect,
        "servedModelName fixed",
        fixed,
    )


def test_probe_prompt_over_the_context(
    watch: Callable[[str, VLLMServer], Watch], vllm_qwen25: VLLMServer
) -> None:
    w = watch("long", vllm_qwen25)
    # 4 messages of ~1,365 tokens each: over max_model_len 4096 (each message is at most 8,192 characters).
    long_messages = [{"role": "user", "content": (" hello" * 1365)[1:]} for _ in range(4)]
    manifest = external("long", vllm_qwen25.base_url)
    manifest["spec"]["probe"]["messages"] = long_messages
    bad, detect = w.spec_fault(manifest, "PromptTooLong")
    assert "maximum context length is 4096 tokens" in bad["message"]
    fixed = external("long", vllm_qwen25.base_url)
    fault = "probe prompt over the context (max_model_len 4096)"
    w.cleared(fault, "Serving=False PromptTooLong", detect, "spec.probe.messages fixed", fixed)
    probe = w.sm()["status"]["probe"]
    # The limits check is the same refusal, asked for on purpose: Pass with vLLM's own words.
    assert probe["checks"]["limits"]["result"] == "Pass"
    assert "maximum context length is 4096 tokens" in probe["checks"]["limits"]["message"]
