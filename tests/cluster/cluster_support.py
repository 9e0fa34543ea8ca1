"""Helpers shared by the cluster tests (test files are not a package; pytest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import controlplane
import olm_tools
from required import absent

T = TypeVar("T")


@contextmanager
def own_control_plane(fetch: Callable[[], T]) -> Iterator[tuple[controlplane.ControlPlane, T]]:
    """A control plane of a module's own (for cluster-wide objects the session's must not see), and what
    `fetch` gets for it (olm_tools' CRDs); the module is skipped (failed under
    SERVEDMODEL_REQUIRE_CLUSTER=1) when the control plane is not built or `fetch` cannot get it."""
    if missing := controlplane.missing_binaries():
        absent(f"control plane not built: {', '.join(missing)} missing; run `make control-plane`")
    try:
        fetched = fetch()
    except olm_tools.ToolUnavailable as exc:
        absent(f"OLM tools unavailable: {exc}")
    with controlplane.running() as cp:
        yield cp, fetched


@dataclass
class ProbingOperator:
    """conftest's `probing` fixture: the test's control plane and namespace, and `start(name, url)`, the
    operator on that namespace probing ServedModel `name` at `url` (returns conftest's OperatorProcess)."""

    cp: controlplane.ControlPlane
    namespace: str
    start: Callable[[str, str], Any]


def wait_for(
    what: str,
    probe: Callable[[], Any],
    timeout: float = 120.0,
    *,
    interval: float = 0.2,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Poll `probe` until it returns something truthy and return it; fail naming `what` and the last value.

    `detail` adds context to the failure (e.g. the operator's log). A bounded wait, never a timing assertion.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail else ""
            pytest.fail(f"gave up after {timeout:.0f}s waiting for {what}; last seen: {last!r}{extra}")
        time.sleep(interval)


async def until(check: Callable[[], Any], within: float, what: str = "the condition") -> float:
    """Await `check()` truthy, polling every 50 ms without blocking the loop (an informer or elector runs on
    it); the seconds it took. Fails naming `what` after `within` seconds. A bounded wait, not a timing."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within:
            raise AssertionError(f"gave up after {within:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def metric_sum(op: Any, sample: str, **labels: str) -> float:
    """The sum of one sample in the operator's /metrics (`op`: conftest's OperatorProcess) over every series
    whose labels include `labels`, read with prometheus_client's parser."""
    return sum(
        s.value
        for fam in text_string_to_metric_families(op.metrics())
        for s in fam.samples
        if s.name == sample and set(labels.items()) <= set(s.labels.items())
    )


def served_model(name: str, **spec: Any) -> dict[str, Any]:
    """A vLLM ServedModel for the fake GPU node; `spec` keys replace the defaults. Without a `probe` of
    the test's own, the readiness gate is off: kwok's pods have no engine behind them (the probe goes to
    a closed port), and with the gate (on by default) they would never be Ready."""
    body: dict[str, Any] = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "engine": {"maxModelLen": 4096},
        "resources": {"gpus": 1},
        "probe": {"readinessGate": False},
    }
    body.update(spec)
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": name},
        "spec": body,
    }


def apply(cp: controlplane.ControlPlane, namespace: str, manifest: dict[str, Any]) -> None:
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def get(cp: controlplane.ControlPlane, namespace: str, *what: str) -> dict[str, Any] | None:
    """`kubectl get -n namespace WHAT -o json` (managed fields included); None when it is NotFound."""
    res = cp.kubectl("get", "-n", namespace, *what, "-o", "json", "--show-managed-fields", check=False)
    if res.returncode != 0:
        if "NotFound" in res.stderr:
            return None
        raise AssertionError(res.stderr)
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def engine_pods(cp: controlplane.ControlPlane, namespace: str, name: str = "qwen") -> list[dict[str, Any]]:
    """ServedModel `name`'s engine pods that are not being deleted."""
    pods = cp.get_json("pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]


def ready_since(pod: dict[str, Any]) -> str | None:
    """When the pod's Ready condition last turned True (RFC 3339), None while it is not Ready."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "True":
            return str(c["lastTransitionTime"])
    return None


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """The condition of that type in obj's status, or {} when there is none (or no obj)."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


@contextmanager
def crds_installed(
    cp: controlplane.ControlPlane, fetch: Callable[[], list[Path]], names: Sequence[str], what: str
) -> Iterator[None]:
    """Third-party CRDs (`fetch` gives their files: hack/olm_tools.py) applied and established, removed
    afterwards so the rest of the session does not discover their API group; `what` names them when the
    fetch fails (absent: a skip locally, a failure in CI)."""
    try:
        paths = fetch()
    except olm_tools.ToolUnavailable as e:
        absent(f"{what} unavailable: {e}")
    args = [a for p in paths for a in ("-f", str(p))]
    cp.kubectl("apply", "--server-side", *args)
    for crd in names:
        cp.wait_established(crd)
    try:
        yield
    finally:
        cp.kubectl("delete", "--ignore-not-found", "--wait=true", *args, check=False)


def golden_dry_run(
    cp: controlplane.ControlPlane, namespace: str, case: str, keep: Callable[[dict[str, Any]], bool]
) -> tuple[list[dict[str, Any]], str]:
    """The objects of tests/golden/expected/<case>.yaml that `keep` picks, in `namespace` and without the
    owner reference (no ServedModel here), through a server-side dry-run apply: (them, kubectl's output)."""
    golden = Path(__file__).resolve().parents[1] / "golden" / "expected" / f"{case}.yaml"
    docs = [d for d in yaml.safe_load_all(golden.read_text()) if d and keep(d)]
    for d in docs:
        d["metadata"]["namespace"] = namespace
        d["metadata"].pop("ownerReferences")
    res = cp.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(docs))
    return docs, res.stdout
