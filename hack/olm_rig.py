"""Operator Lifecycle Manager on loopback, out of cluster, each process by its own pid: `opm serve` of a
file-based catalog made from manifests/bundle by `opm render` (tests/cluster/test_olm_install.py), and OLM's
olm and catalog operators against a control plane; built by hack/build-olm.sh into the cache.

No bundle image and no unpack Job: `opm render` of a bundle directory leaves the catalog's bundle without
an `image` and carries its manifests inline (`olm.bundle.object` properties); `opm serve` then sends them
in the gRPC Bundle (operator-registry pkg/cache/cache.go SendBundles strips `object` and `csvJson` only
when bundlePath is set), the catalog operator keeps that Bundle when bundlePath is empty (OLM
pkg/controller/registry/resolver/source_registry.go newOperatorFromBundle) and its resolver makes the
InstallPlan's steps straight from it instead of a bundleLookup (resolver/step_resolver.go ResolveSteps).

Upstream listens where it listens: `opm serve` on ":<port>" (cmd/opm/serve/serve.go; the port is a free
one here, only 127.0.0.1 is dialled) and OLM's operators serve health and metrics on ":8080" (OLM
pkg/lib/server/server.go getAddress, not configurable). The second operator (or both, when something
else has 8080) logs the bind error and carries on: nothing here reads those endpoints.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

import controlplane
from loopback import LoopbackProcess
from servedmodel.sim.ports import free_port, port_open

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "manifests" / "bundle"
TOOL_TIMEOUT_S = 60.0


class RigError(RuntimeError):
    """A process of the rig exited, or an opm command failed; its output's tail is the message."""


def olm_root() -> Path:
    cache = os.environ.get("SERVEDMODEL_CACHE") or str(Path.home() / ".cache" / "servedmodel")
    return Path(cache) / f"olm-{controlplane.versions()['OLM_VERSION']}"


def binaries() -> dict[str, Path]:
    """Where hack/build-olm.sh puts them (they may not exist)."""
    bin_dir = olm_root() / "bin"
    return {name: bin_dir / name for name in ("olm", "catalog", "opm")}


def crd_files() -> list[Path]:
    """OLM's CRDs (its deploy/chart/crds, copied by the build)."""
    return sorted((olm_root() / "crds").glob("*.yaml"))


def missing() -> str | None:
    """Why OLM cannot run here (a skip reason), or None when it can."""
    absent = [name for name, path in binaries().items() if not os.access(path, os.X_OK)]
    if absent or not crd_files():
        what = ", ".join(absent) if absent else "its CRDs"
        return f"OLM not built ({what} missing in {olm_root()}); run `make olm` (hack/build-olm.sh)"
    return None


def _opm(*args: str) -> str:
    res = subprocess.run(
        [str(binaries()["opm"]), *args],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )
    if res.returncode != 0:
        raise RigError(f"opm {' '.join(args)} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return res.stdout


def render_catalog(folder: Path, bundle: Path = BUNDLE) -> dict[str, Any]:
    """A file-based catalog in `folder` (catalog.yaml) of the one bundle in `bundle`, by opm: the bundle
    as `opm render` makes it from the directory, the package as `opm init` makes it, and one channel per
    the bundle's channel annotations, holding the bundle. Checked with `opm validate`; returns the
    rendered olm.bundle."""
    annotations = yaml.safe_load((bundle / "metadata" / "annotations.yaml").read_text())["annotations"]
    package = annotations["operators.operatorframework.io.bundle.package.v1"]
    channels = annotations["operators.operatorframework.io.bundle.channels.v1"].split(",")
    default = annotations.get("operators.operatorframework.io.bundle.channel.default.v1", channels[0])
    rendered: dict[str, Any] = yaml.safe_load(_opm("render", str(bundle), "--output=yaml"))
    if rendered.get("image"):
        raise RigError(f"opm render gave the bundle an image ({rendered['image']}): OLM would unpack it")
    docs: list[dict[str, Any]] = [
        yaml.safe_load(_opm("init", package, f"--default-channel={default}", "--output=yaml")),
        *(
            {"schema": "olm.channel", "package": package, "name": c, "entries": [{"name": rendered["name"]}]}
            for c in channels
        ),
        rendered,
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "catalog.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
    _opm("validate", str(folder))
    return rendered


class _Checked(LoopbackProcess):
    what = "process"

    def alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RigError(f"{self.what} exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}")


class OpmServe(_Checked):
    """`opm serve` of the catalog in `catalog` (gRPC, the registry API) on a free port; `address` is what
    a CatalogSource's spec.address names."""

    what = "opm serve"

    def __init__(self, catalog: Path) -> None:
        super().__init__("opm-serve-", "opm.log")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.spawn(
            [
                str(binaries()["opm"]),
                "serve",
                str(catalog),
                f"--port={self.port}",
                f"--pprof-addr=127.0.0.1:{free_port()}",
                f"--termination-log={self.dir / 'termination.log'}",
                f"--cache-dir={self.dir / 'cache'}",  # in the rig's folder, built at start
                "--cache-enforce-integrity=false",
            ]
        )

    def ready(self) -> bool:
        self.alive()
        return port_open(self.port, 1.0)


class OlmOperator(_Checked):
    """OLM's olm operator (OperatorGroups, ClusterServiceVersions and their install strategies), all
    namespaces, no OpenShift ClusterOperator status."""

    what = "OLM's olm operator"

    def __init__(self, cp: controlplane.ControlPlane, namespace: str) -> None:
        super().__init__("olm-operator-", "olm.log")
        self.spawn(
            [
                str(binaries()["olm"]),
                f"--namespace={namespace}",
                "--writeStatusName=",
                "--writePackageServerStatusName=",
                "--interval=5m",
            ],
            env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)},
        )


class CatalogOperator(_Checked):
    """OLM's catalog operator (CatalogSources, Subscriptions, resolution, InstallPlans), `namespace` its
    global catalog namespace, no OpenShift ClusterOperator status."""

    what = "OLM's catalog operator"

    def __init__(self, cp: controlplane.ControlPlane, namespace: str) -> None:
        super().__init__("olm-catalog-", "catalog.log")
        self.spawn(
            [
                str(binaries()["catalog"]),
                f"--kubeconfig={cp.kubeconfig}",
                f"--namespace={namespace}",
                "--writeStatusName=",
                "--interval=5m",
            ],
            env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)},
        )
