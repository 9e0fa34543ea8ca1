"""The operator outside the cluster with a kubeconfig whose user is an exec plugin (as EKS, GKE, AKS and
kubelogin write them): a real script prints an ExecCredential with a token the local API server accepts.

Both halves use it: kopf's watches (through the operator's login handler) and the operator's own
client (the status writes), so a Ready ServedModel proves the one identity works end to end.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cluster_support import apply, served_model, wait_for

import controlplane

# The `operator` fixture's OperatorProcess (tests/cluster/conftest.py; conftests are not importable).
OperatorProcess = Any

pytestmark = pytest.mark.cluster


def exec_kubeconfig(cp: controlplane.ControlPlane, tmp_path: Path) -> tuple[Path, Path]:
    runs = tmp_path / "plugin-runs"
    plugin = tmp_path / "credential-plugin.py"
    plugin.write_text(
        "import json, os, pathlib, sys\n"
        f"runs = pathlib.Path({str(runs)!r})\n"
        "with runs.open('a') as f:\n"
        "    f.write(os.environ.get('KUBERNETES_EXEC_INFO', '') + '\\n')\n"
        "token = pathlib.Path(sys.argv[1]).read_text().strip()\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',\n"
        "                  'status': {'token': token, 'expirationTimestamp': '2999-01-01T00:00:00Z'}}))\n"
    )
    token_file = tmp_path / "plugin-token"  # only the plugin reads it: the kubeconfig holds no secret
    token_file.write_text(cp.token)
    user: dict[str, Any] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(plugin), str(token_file)],
            "interactiveMode": "Never",
        }
    }
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": cp.server, "certificate-authority": str(cp.ca_file)}}
        ],
        "users": [{"name": "exec-user", "user": user}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "exec-user"}}],
        "current-context": "local",
    }
    path = tmp_path / "exec-kubeconfig"
    path.write_text(json.dumps(config))
    return path, runs


def test_operator_runs_on_an_exec_plugin_kubeconfig(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    cp = control_plane
    kubeconfig, runs = exec_kubeconfig(cp, tmp_path)
    op = start_operator(namespaces=[namespace], env={"KUBECONFIG": str(kubeconfig)})
    apply(cp, namespace, served_model("qwen", probe={"enabled": False}))

    def ready() -> Any:
        out = cp.kubectl("get", "sm", "qwen", "-n", namespace, "-o", "json", check=False).stdout
        obj = json.loads(out) if out else {}
        return obj if (obj.get("status") or {}).get("phase") == "Ready" else None

    wait_for("phase Ready through the exec-plugin identity", ready, detail=lambda: op.log(40))
    calls = [json.loads(line) for line in runs.read_text().splitlines() if line]
    # The token does not expire: one run serves kopf's login and every request of the client.
    assert len(calls) == 1, calls
    assert calls[0]["spec"]["interactive"] is False
    assert "exec-kubeconfig" in op.log()  # the start-up line names where the identity came from
    assert cp.token not in op.log()
