"""OLM's own tools for checking the bundle, from the Go module proxy (nothing is vendored).

- `operator_verify()`: operator-framework/api's `operator-verify` (the validators `operator-sdk bundle
  validate` runs), built once with the machine's Go into the cache beside the control plane.
- `keda_crd(plural)`: KEDA's CRDs (keda.sh: ScaledObject, TriggerAuthentication) from its Go module.
- `http_add_on_crd()`: KEDA HTTP add-on's HTTPScaledObject CRD (http.keda.sh) from its Go module at
  hack/versions.env's KEDA_HTTP_ADD_ON_VERSION.
- `gie_crd(plural)`: the Gateway API Inference Extension's CRDs (InferencePool, InferenceObjective) from its
  Go module at hack/versions.env's GIE_VERSION, copied once into the cache (gie-<version>/).
- `olm_crd(name)`: one of OLM's CRDs (e.g. the ClusterServiceVersion's, with its full schema) from the
  same module, so the API server can validate our CSV against it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

OLM_API_MODULE = "github.com/operator-framework/api"
OLM_API_VERSION = "v0.30.0"
# The Prometheus Operator's CRDs (ServiceMonitor, PrometheusRule, PodMonitor), for server-side dry-runs.
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator"
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
# KEDA's CRDs (ScaledObject, TriggerAuthentication), for the autoscaling tests' server-side applies.
KEDA = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.21.0"
# KEDA's HTTP add-on (autoscaling.scaleToZero's wake-up); its version is pinned in hack/versions.env.
HTTP_ADD_ON = "github.com/kedacore/http-add-on"
# The Gateway API Inference Extension (spec.inferencePool); its version is pinned in hack/versions.env.
GIE = "sigs.k8s.io/gateway-api-inference-extension"
GIE_CRD_FILES = {
    "inferencepools": "inference.networking.k8s.io_inferencepools.yaml",
    "inferenceobjectives": "inference.networking.x-k8s.io_inferenceobjectives.yaml",
}
BUILD_TIMEOUT_S = 1800.0  # cold on 2 cores: about 4 minutes of CPU, 8 with a busy machine


class ToolUnavailable(RuntimeError):
    """No Go toolchain (or no module proxy): the caller skips."""


def _go() -> str:
    go = shutil.which("go") or (
        "/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None
    )
    if go is None:
        raise ToolUnavailable("no Go toolchain on PATH")
    return go


def _cache_root() -> Path:
    return Path(os.environ.get("SERVEDMODEL_CACHE") or str(Path.home() / ".cache" / "servedmodel"))


def cache_dir() -> Path:
    return _cache_root() / f"olm-api-{OLM_API_VERSION}"


def _pin(name: str) -> str:
    """A version pinned in hack/versions.env (the one place the pins are set)."""
    for line in (Path(__file__).resolve().parent / "versions.env").read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key == name:
            return value.strip()
    raise ToolUnavailable(f"{name} is not in hack/versions.env")


def gie_version() -> str:
    """GIE_VERSION from hack/versions.env."""
    return _pin("GIE_VERSION")


def _env() -> dict[str, str]:
    return {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}


def operator_verify() -> Path:
    """Path of operator-verify, built on first use."""
    exe = cache_dir() / "bin" / "operator-verify"
    if os.access(exe, os.X_OK):
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        [_go(), "install", f"{OLM_API_MODULE}/cmd/operator-verify@{OLM_API_VERSION}"],
        env={**_env(), "GOBIN": str(exe.parent)},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if res.returncode != 0:
        raise ToolUnavailable(f"go install operator-verify failed: {res.stderr[-2000:]}")
    return exe


def module_dir(module: str = OLM_API_MODULE, version: str = OLM_API_VERSION) -> Path:
    """A Go module's files in the module cache (downloaded when missing), e.g. for the CRD YAML it ships."""
    res = subprocess.run(
        [_go(), "mod", "download", "-json", f"{module}@{version}"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if res.returncode != 0:
        raise ToolUnavailable(f"go mod download {module}@{version} failed: {res.stderr[-2000:]}")
    return Path(json.loads(res.stdout)["Dir"])


def olm_crd(plural: str) -> Path:
    """OLM's CRD file for a resource, e.g. olm_crd("clusterserviceversions")."""
    path = module_dir() / "crds" / f"operators.coreos.com_{plural}.yaml"
    if not path.is_file():
        raise ToolUnavailable(f"{path} not in the module")
    return path


def prometheus_operator_crd(plural: str) -> Path:
    """The Prometheus Operator's CRD file for a resource, e.g. prometheus_operator_crd("servicemonitors")."""
    module = module_dir(PROMETHEUS_OPERATOR, PROMETHEUS_OPERATOR_VERSION)
    path = module / "example" / "prometheus-operator-crd" / f"monitoring.coreos.com_{plural}.yaml"
    if not path.is_file():
        raise ToolUnavailable(f"{path} not in the module")
    return path


def keda_crd(plural: str) -> Path:
    """KEDA's CRD file for a resource (config/crd/bases of the module), e.g. keda_crd("scaledobjects")."""
    path = module_dir(KEDA, KEDA_VERSION) / "config" / "crd" / "bases" / f"keda.sh_{plural}.yaml"
    if not path.is_file():
        raise ToolUnavailable(f"{path} not in the module")
    return path


def http_add_on_crd() -> Path:
    """The HTTP add-on's HTTPScaledObject CRD (config/crd/bases of its module)."""
    version = _pin("KEDA_HTTP_ADD_ON_VERSION")
    bases = module_dir(HTTP_ADD_ON, version) / "config" / "crd" / "bases"
    path = bases / "http.keda.sh_httpscaledobjects.yaml"
    if not path.is_file():
        raise ToolUnavailable(f"{path} not in the module")
    return path


def gie_crd(plural: str) -> Path:
    """The Gateway API Inference Extension's CRD file for a resource ("inferencepools",
    "inferenceobjectives"), from the cache; the first call copies them out of the Go module."""
    version = gie_version()
    cached = _cache_root() / f"gie-{version}" / GIE_CRD_FILES[plural]
    if cached.is_file():
        return cached
    bases = module_dir(GIE, version) / "config" / "crd" / "bases"
    cached.parent.mkdir(parents=True, exist_ok=True)
    for name in GIE_CRD_FILES.values():
        if not (bases / name).is_file():
            raise ToolUnavailable(f"{bases / name} not in the module")
        tmp = cached.parent / f".{name}.tmp"
        tmp.write_bytes((bases / name).read_bytes())
        tmp.replace(cached.parent / name)
    return cached


if __name__ == "__main__":
    # `make test` runs this before pytest: a cold build takes minutes, longer than one test may run.
    print(operator_verify())
    print(olm_crd("clusterserviceversions"))
    print(prometheus_operator_crd("servicemonitors"))
    print(keda_crd("scaledobjects"))
    print(http_add_on_crd())
    print(gie_crd("inferencepools"))
