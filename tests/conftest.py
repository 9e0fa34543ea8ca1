"""Suite-wide fixtures: the real Kubernetes control plane (hack/controlplane.py) for `cluster` tests.

One control plane per test session (started on first use), the CRDs from crds/ installed, a fresh
namespace per test. Binaries are built by `make control-plane`, never here: when they are missing,
every test marked `cluster` is skipped with the reason, or fails with it under
SERVEDMODEL_REQUIRE_CLUSTER=1 (tests/required.py; .ci/run sets it), where no test may skip at all. At
the end the suite checks that no component it started is still running and fails loudly if one is.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "hack"))
sys.path.insert(0, str(ROOT / "tests"))

import controlplane  # noqa: E402  (hack/ is tooling, not a package)
import summary  # noqa: E402  (tests/ is not a package either)
from required import REQUIRE_CLUSTER, need, required  # noqa: E402
from servedmodel.probe.loop import freeze_heap  # noqa: E402

CRD_DIR = ROOT / "crds"


def pytest_configure(config: pytest.Config) -> None:
    # A SIGTERM (CI timeout, `kill`) becomes KeyboardInterrupt so fixture teardown stops the components.
    def _on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, _on_sigterm)


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection built (~170,000 objects) out of every later full collection, as the operator does
    # once its caches synced (probe/loop.freeze_heap): unfrozen, one took ~110 ms on an idle 2-core machine,
    # twice that under the suite's load, and a probe run in this process read the tokens that arrived
    # meanwhile as one lump (CoalescedStream in a CI run of tests/vllm/test_probe_vllm.py).
    freeze_heap()


def control_plane_missing() -> str | None:
    missing = controlplane.missing_binaries()
    if not missing:
        return None
    return (
        f"control plane not built ({', '.join(missing)} missing in {controlplane.default_bin_dir()}); "
        "run `make control-plane` (hack/build-control-plane.sh), see docs/control-plane.md"
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under pytest-xdist (`make test`), the real-vLLM tests run in two workers: the ones on the session's
    # engines in the `vllm` group, the ones that start engines of their own (`own_engines`) in another.
    # Each group is about half of their time (a vLLM start is 60-70 s in a suite) and at most two engines
    # run at once: more would make each slower than the tests allow.
    # The `e2e` tests share one real node (tests/e2e/conftest.py), one per machine: all in one worker.
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if item.get_closest_marker("vllm"):
            own = item.get_closest_marker("own_engines") is not None
            item.add_marker(pytest.mark.xdist_group("vllm-own-engines" if own else "vllm"))
        elif item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.xdist_group("e2e"))
    # Locally, skip at collection (no session fixture starts for a test that cannot run). Required, mark
    # nothing: `_cluster_build` fails each `cluster` test with the reason.
    reason = control_plane_missing()
    if reason is None or required():
        return
    for item in items:
        if item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _cluster_build(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("cluster"):
        need(control_plane_missing())


def _skip_forbidden(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under SERVEDMODEL_REQUIRE_CLUSTER=1 a skip of any kind is a failure: the backstop for a skip that
    does not come through `need` (a fixture of another folder, a new test)."""
    if not (report.skipped and required(REQUIRE_CLUSTER)) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2].removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = f"{REQUIRE_CLUSTER}=1: no test may skip (every tier is required), but: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _skip_forbidden(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _skip_forbidden(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)  # inside pytest-xdist's, which sends workeroutput after it
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    # After the wrapped hooks: pytest's runner tears down session fixtures there (and tests/vllm/conftest.py
    # has stopped its engines), so by now every component must be gone, in success, failure and
    # interruption alike.
    yield
    left = controlplane.kill_leftovers()
    if left:
        names = ", ".join(f"{n} (pid {p})" for n, p in left)
        summary.LEAKS.append(f"control-plane components still running after the suite (now killed): {names}")
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller prints, and fails the run
        workeroutput["summary_lines"] = list(summary.LINES)
        workeroutput["summary_leaks"] = list(summary.LEAKS)
    elif summary.LEAKS:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    out = getattr(node, "workeroutput", None) or {}
    summary.LINES.extend(out.get("summary_lines", []))
    summary.LEAKS.extend(out.get("summary_leaks", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in summary.LINES:
        terminalreporter.write_line(line)
    for line in summary.LEAKS:
        terminalreporter.write_line(f"ERROR: {line}", red=True, bold=True)


@pytest.fixture(scope="session")
def bare_control_plane(request: pytest.FixtureRequest) -> Iterator[controlplane.ControlPlane]:
    """The session's control plane without the project's CRDs (tests of the control plane itself)."""
    need(control_plane_missing())
    cp = controlplane.start()
    failed_before = request.session.testsfailed
    mp = pytest.MonkeyPatch()
    # In-process clients (kopf's KopfRunner) read KUBECONFIG: never fall back to a real cluster.
    mp.setenv("KUBECONFIG", str(cp.kubeconfig))
    try:
        yield cp
    finally:
        mp.undo()
        keep = request.session.testsfailed > failed_before
        cp.stop(keep_logs=keep)
        if keep:
            sys.stderr.write(f"\ncontrol-plane logs kept in {cp.log_dir}\n")


@pytest.fixture(scope="session")
def control_plane(bare_control_plane: controlplane.ControlPlane) -> controlplane.ControlPlane:
    """The session's control plane with every crds/*.yaml installed and Established."""
    cp = bare_control_plane
    crds = sorted(p for p in CRD_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    if crds:
        args = [a for p in crds for a in ("-f", str(p))]
        cp.kubectl("apply", "--server-side", "--force-conflicts", *args)
        for path in crds:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    cp.wait_established(doc["metadata"]["name"])
    return cp


def _namespace_name(nodeid: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", nodeid.rsplit("::", 1)[-1].lower()).strip("-")
    suffix = secrets.token_hex(3)
    return f"{base[: 62 - len(suffix) - 1].rstrip('-')}-{suffix}"


@pytest.fixture
def namespace(bare_control_plane: controlplane.ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test (its `default` ServiceAccount exists, so Pods are admitted);
    deleted afterwards without waiting for finalization. Needs no CRD (use `control_plane` too for those)."""
    name = _namespace_name(request.node.nodeid)
    bare_control_plane.request(
        "POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": {"test": "true"}}}
    )
    # The controller-manager's ServiceAccount controller makes `default`, but a loaded machine (a CI run
    # saw more than 30 s, right after a fault test restarted the control plane) can leave it late: make
    # it here, as that controller would (409 when it was first).
    try:
        bare_control_plane.request(
            "POST", f"/api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}}
        )
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise
    deadline = time.monotonic() + 30.0
    while True:
        try:
            bare_control_plane.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
            break
        except urllib.error.HTTPError as e:
            if e.code != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield name
    if os.environ.get("SERVEDMODEL_KEEP_NAMESPACES") != "1":
        bare_control_plane.kubectl(
            "delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False
        )
